"""Bad input gets a clear error (or a correct fallback), never a hang or a wrong answer."""

import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.passes.trace import TraceError
from autopar.solver.ilp import NoFeasiblePlan
from tests import rank_tasks
from tests.models import MLP


def test_mesh_smaller_than_world(world4):
    msgs = world4.run(rank_tasks.expect_error, "mesh_smaller_than_world")
    for m in msgs:
        assert m.startswith("ValueError") and "2 devices" in m and "4 ranks" in m, m


def test_plan_for_other_mesh(world4):
    msgs = world4.run(rank_tasks.expect_error, "plan_for_other_mesh")
    assert all(m.startswith("ValueError") and "(4,)" in m and "(2, 2)" in m for m in msgs), msgs


def test_plans_differ_across_ranks_raises_everywhere(world2):
    """Rank 0 passes a data-parallel plan, rank 1 a tensor-parallel one: every rank raises
    before any collective of the model (no hang)."""
    msgs = world2.run(rank_tasks.expect_error, "plans_differ_across_ranks")
    assert all(m.startswith("PlanMismatchError") for m in msgs), msgs


def test_plan_for_other_model(world2):
    msgs = world2.run(rank_tasks.expect_error, "plan_for_other_model")
    assert all(m.startswith("ValueError") and "another model" in m for m in msgs), msgs


def test_parameters_before_planning(world2):
    msgs = world2.run(rank_tasks.expect_error, "parameters_before_planning")
    assert all("not planned yet" in m for m in msgs), msgs


@pytest.mark.parametrize("force", [None, "data", "tensor", "fsdp"])
def test_indivisible_shapes_are_planned_around(world2, force):
    """Batch 3 and widths 5/7 do not split over 2 ranks: the plan keeps those dimensions whole
    and the numbers stay right."""
    plan = world2.run(rank_tasks.train_equivalence, "odd", (2,), force)[0]
    for op in plan["ops"]:
        assert "S(0)" not in op["inputs"][:1] or not op["op"].startswith("linear"), op


def test_unsupported_op_runs_replicated(world2):
    plan = world2.run(rank_tasks.train_equivalence, "unsupported", (2,), None)[0]
    assert plan["unsupported_ops"] == ["aten.flip.default"]
    flip = next(o for o in plan["ops"] if o["op"] == "flip.default")
    assert flip["inputs"] == ["R"] and flip["output"] == "R"


def test_unsupported_op_warns_once_naming_it():
    model, loss_fn, example = rank_tasks.build("unsupported")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example, loss_fn=loss_fn)
    named = [w for w in caught if "aten.flip.default" in str(w.message)]
    assert len(named) == 1 and "replicated" in str(named[0].message)


def test_non_tensor_input():
    class TakesInt(nn.Module):
        def forward(self, x, n):
            return x * n

    with pytest.raises(TraceError, match="input 1 is a int"):
        autopar.plan(TakesInt(), autopar.MeshSpec((2,)), (torch.randn(2), 3))


def test_data_dependent_control_flow_names_the_line():
    class Branches(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # the line the error must name
                return x * 2
            return x

    with pytest.raises(TraceError) as info:
        autopar.plan(Branches(), autopar.MeshSpec((2,)), (torch.randn(4),))
    msg = str(info.value)
    assert "data-dependent control flow" in msg
    assert "test_errors.py" in msg and "if x.sum() > 0" in msg


def test_memory_budget_no_plan_fits():
    model = MLP([256, 256, 256])
    with pytest.raises(NoFeasiblePlan, match="memory"):
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"),
                     (torch.randn(8, 256), torch.randint(0, 256, (8,))),
                     loss_fn=nn.functional.cross_entropy, memory_budget=1000)


def test_unknown_style_and_dimension():
    model = MLP([8, 8])
    example = (torch.randn(4, 8), torch.randint(0, 8, (4,)))
    spec = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")
    with pytest.raises(ValueError, match="unknown style"):
        autopar.plan(model, spec, example, loss_fn=nn.functional.cross_entropy, force="zero9")
    with pytest.raises(ValueError, match="mesh dimension 'tp'"):
        autopar.plan(model, spec, example, loss_fn=nn.functional.cross_entropy,
                     force={"tp": "tensor"})
