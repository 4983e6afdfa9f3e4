"""Misuses the gloo ranks run for tests/test_bad_inputs.py: each kind is one thing a user gets
wrong, run on every rank; the rank returns the error it raised ("Type: message"), so the test
sees that every rank raised, what it said, and (through the world's timeout) that none hung."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests.models import ScaledLinear
from tests.rank_tasks import build, mesh_for


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


class _Routed(nn.Module):
    """Token-choice routing with split sizes from .tolist() (data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 8) for _ in range(2))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        order = choice.argsort()
        counts = torch.bincount(choice, minlength=2)
        pieces = torch.split(x[order], counts.tolist())
        return torch.cat([e(p) for e, p in zip(self.experts, pieces)])[order.argsort()]


class _ClampsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.1, 0.1)  # weight clipping in forward
        return self.fc(x)


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=self.training)


def _mlp():
    model, loss_fn, (x, y) = build("mlp")
    return model, loss_fn, x, y


def _mesh():
    return mesh_for((dist.get_world_size(),))


def attempt(kind: str) -> str:
    """Run misuse `kind` on this rank; return "Type: message" of what it raised."""
    rank = dist.get_rank()
    model, loss_fn, x, y = _mlp()
    try:
        if kind == "non_tensor_input":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn)
            pm.step(x, 3)
        elif kind == "shape_differs_across_ranks":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x[: 8 - 2 * rank], y[: 8 - 2 * rank])
        elif kind == "values_differ_across_ranks":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x + rank, y)
        elif kind == "per_rank_slices_without_the_option":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            n = dist.get_world_size()
            pm.step(x.chunk(n)[rank], y.chunk(n)[rank])
        elif kind == "new_shape_with_raise":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y),
                                     on_new_shape="raise")
            pm.step(x[:4], y[:4])
        elif kind == "input_on_another_device":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x.to("meta"), y)
        elif kind == "dtype_differs_across_ranks":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x.double() if rank else x, y)
        elif kind == "non_scalar_loss":
            autopar.parallelize(model, _mesh(), example_inputs=(x, y),
                                loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"))
        elif kind == "loss_returns_tuple":
            autopar.parallelize(model, _mesh(), example_inputs=(x, y),
                                loss_fn=lambda out, t: (F.cross_entropy(out, t), out.mean()))
        elif kind == "step_without_a_loss":
            pm = autopar.parallelize(model, _mesh())
            pm.step(x)
        elif kind == "unknown_option":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, microbatch=2)
        elif kind == "pipeline_option_without_pp":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, schedule="1f1b")
        elif kind == "microbatches_not_dividing_the_batch":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, microbatches=3)
            pm.step(x, y)
        elif kind == "force_dimension_out_of_range":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y),
                                force={5: "data"})
        elif kind == "force_unknown_style":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y),
                                force="zero9")
        elif kind == "per_rank_unknown_dimension":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y),
                                per_rank_inputs=("data",))
        elif kind == "per_rank_batch_indivisible":
            autopar.plan(model, autopar.MeshSpec((dist.get_world_size(),), names=("dp",),
                                                 hardware="cpu"), (x[:3], y[:3]),
                         loss_fn=loss_fn, per_rank_inputs=("dp",))
        elif kind == "meta_model_without_init":
            with torch.device("meta"):
                meta_model = ScaledLinear()
            autopar.parallelize(meta_model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
        elif kind == "side_effect_in_forward":
            autopar.parallelize(_Counting(), _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
        elif kind == "data_dependent_routing":
            autopar.parallelize(_Routed(), _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
        elif kind == "parameter_written_in_forward":
            autopar.parallelize(_ClampsWeight(), _mesh(), loss_fn=loss_fn,
                                example_inputs=(x, y))
        elif kind == "random_states_differ":
            torch.manual_seed(rank)
            pm = autopar.parallelize(_Dropout(), _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x, y)
        elif kind == "requires_grad_changed":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            next(pm.parameters()).requires_grad_(False)
            pm.step(x, y)
        elif kind == "input_requires_grad":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.step(x.clone().requires_grad_(), y)
        elif kind == "backward_hook_on_the_model":
            model.net[0].register_full_backward_hook(lambda m, gi, go: None)
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
        elif kind == "gradient_hook_on_a_parameter":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            next(pm.parameters()).register_hook(lambda g: g * 2)
            pm.step(x, y)
        elif kind == "hook_on_a_parallelized_module":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            next(m for name, m in pm.named_modules() if name).register_forward_hook(
                lambda m, i, o: o * 2)
            pm.step(x, y)
        elif kind == "step_under_no_grad":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            with torch.no_grad():
                pm.step(x, y)
        elif kind == "to_after_parallelize":
            pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y))
            pm.double()
        elif kind == "state_before_planning":
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn).state_dict()
        elif kind == "plan_for_other_batch":
            plan = autopar.plan(model, autopar.MeshSpec((dist.get_world_size(),),
                                                        hardware="cpu"), (x[:4], y[:4]),
                                loss_fn=loss_fn)
            autopar.parallelize(model, _mesh(), loss_fn=loss_fn, plan=plan,
                                example_inputs=(x, y))
        elif kind == "keyword_batch_to_pipeline":
            from tests.pipeline_tasks import mesh_for as pp_mesh
            g, lm, (gx, gy) = build("gpt")
            pm = autopar.parallelize(g, pp_mesh((dist.get_world_size(),), ("pp",)),
                                     loss_fn=lm, example_inputs=(gx, gy))
            pm.step(gx, target=gy)
        else:
            raise ValueError(f"unknown misuse {kind}")
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def fail_mid_step(bad_rank: int, die: bool) -> str:
    """Rank `bad_rank` fails inside a step, in the middle of the program (its first
    all-reduce): it raises (or, with `die`, its process exits). Every other rank must raise,
    naming it, rather than wait forever."""
    from autopar.runtime import collectives
    model, loss_fn, (x, y) = build("gpt")
    pm = autopar.parallelize(model, _mesh(), loss_fn=loss_fn, example_inputs=(x, y),
                             force="tensor")
    pm.step(x, y)
    if dist.get_rank() == bad_rank:
        def broken(*args, **kwargs):
            if die:
                os._exit(3)
            raise MemoryError("out of memory (injected)")
        collectives._reduce = broken
    try:
        pm.step(x, y)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"
