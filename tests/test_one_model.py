"""The model passed to autopar.parallelize becomes the parallelized model, as FSDP2's
fully_shard and tensor parallel's parallelize_module work in place (issue #46): its calls,
parameters, state dict and gradient clipping are the trained ones, and a loss function that
reads it reads its live tensors (gradients through an L2 term included), under every kind of
plan, as on one device."""

import pytest
import torch
import torch.nn as nn

from autopar.passes.trace import meta_copy, trace
from tests import one_model_tasks

STYLES = ["data", "fsdp", "tensor"]


@pytest.mark.parametrize("force", STYLES)
def test_the_model_passed_in_is_the_trained_model(world2, tmp_path, force):
    world2.run(one_model_tasks.the_model_trains, (2,), force, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("force", STYLES)
def test_a_loss_reading_the_model_reads_its_live_tensors(world2, force):
    world2.run(one_model_tasks.loss_reading_the_model, (2,), force)


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_a_plan_for_a_loss_reading_the_model_runs_it(world2, force):
    """autopar.plan traces such a loss as parallelize does (was another graph: the plan was
    refused as made for another model)."""
    world2.run(one_model_tasks.given_plan, force)


def test_an_optimizer_built_before_parallelize_is_refused(world2):
    for error in world2.run(one_model_tasks.old_optimizer, (2,), "fsdp"):
        assert "SGD.step() would step parameter a.weight" in error, error
        assert "before the build" in error and "over model.parameters()" in error


@pytest.mark.parametrize("which", ["c.weight", "cw"])
def test_a_loss_capturing_a_tensor_of_the_model_is_refused(world2, which):
    for error in world2.run(one_model_tasks.captured_tensor, which):
        assert error.startswith("TraceError: the loss function captured " + which), error
        assert f"inside the loss function (model.{which})" in error, error


def test_a_model_is_parallelized_again_only_if_its_build_failed(world2):
    for error in world2.run(one_model_tasks.parallelized_twice):
        assert "this model was parallelized already" in error, error


def test_a_pipelined_model_holds_its_stages(world2):
    meta = world2.run(one_model_tasks.pipelined)
    assert meta[0] and meta[1] and not set(meta[0]) & set(meta[1])


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("layer", [0, 3])
def test_a_loss_reading_a_layer_of_a_stack_differentiates_it(layer):
    """A loss function reading a layer of a stack traced as two copies (passes/fold.py) is
    traced on every layer, its term on that layer's parameter."""
    model = _Stack()

    def loss_fn(out, y):
        return (out - y).pow(2).mean() + model.layers[layer].weight.pow(2).sum()

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    program = trace(meta_copy(model), (x,), loss_fn, y, source=model)
    weight = next(ph for ph, name in program.params.items()
                  if name == f"layers.{layer}.weight")
    node = next(n for n in program.graph.nodes if n.name == weight)
    assert len(node.users) == 2  # its layer's linear and the L2 term
    assert not program.constants
