"""Bad input gets a clear error (or a correct fallback), never a hang or a wrong answer."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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


# -- the mesh and force= ---------------------------------------------------------------------

def _mlp_example():
    return MLP([8, 8]), (torch.randn(4, 8), torch.randint(0, 8, (4,)))


def test_repeated_mesh_dimension_names():
    with pytest.raises(ValueError, match="name 'dp' is used for more than one dimension"):
        autopar.MeshSpec((2, 2), names=("dp", "dp"))
    # A DeviceMesh that reached MeshSpec with repeated names (init_device_mesh refuses them,
    # the DeviceMesh constructor does not): only the attributes from_device_mesh reads.
    mesh = SimpleNamespace(device_type="cpu", shape=(2, 2), ndim=2, mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="name 'dp' is used for more than one dimension"):
        autopar.MeshSpec.from_device_mesh(mesh)


def test_mesh_names_count_must_match_dimensions():
    with pytest.raises(ValueError, match=r"3 mesh dimension names .* for a 2-D mesh"):
        autopar.MeshSpec((2, 2), names=("dp", "tp", "pp"))
    with pytest.raises(ValueError, match=r"1 mesh dimension names \('dp',\) for a 2-D mesh"):
        autopar.MeshSpec((2, 2), names="dp")  # one string is one name, not two letters


@pytest.mark.parametrize("shape,names", [((2,), ("dp",)), ((2, 2), ("dp", "tp"))])
@pytest.mark.parametrize("key", [5, -1, 2.0])
def test_force_dimension_index_out_of_range(shape, names, key):
    model, example = _mlp_example()
    spec = autopar.MeshSpec(shape, names=names, hardware="cpu")
    with pytest.raises(ValueError) as info:
        autopar.plan(model, spec, example, loss_fn=F.cross_entropy, force={key: "data"})
    msg = str(info.value)
    assert f"index {key!r}" in msg and "0 ('dp', size 2)" in msg
    if len(shape) == 2:
        assert "1 ('tp', size 2)" in msg


def test_force_names_a_dimension_twice():
    model, example = _mlp_example()
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu")
    with pytest.raises(ValueError, match=r"dimension 1 \('tp'\) twice, as 'tp' and as 1"):
        autopar.plan(model, spec, example, loss_fn=F.cross_entropy,
                     force={"tp": "tensor", 1: "data"})


def test_force_on_a_pipelined_mesh_keys_the_whole_mesh():
    """Indices count the whole mesh's dimensions, "pp" included, which takes no style."""
    model, example = _mlp_example()
    spec = autopar.MeshSpec((2, 2), names=("pp", "dp"), hardware="cpu")
    with pytest.raises(ValueError, match="pipeline dimension 0 \\('pp'\\)"):
        autopar.plan(model, spec, example, loss_fn=F.cross_entropy, force={0: "data"})
    # ZeRO inside pipeline stages is planned (tests/test_pipeline.py trains it)
    plan = autopar.plan(model, spec, example, loss_fn=F.cross_entropy, force={"dp": "zero2"})
    assert plan.pipeline is not None and set(plan.zero.values()) == {2}


# -- the loss --------------------------------------------------------------------------------

def test_loss_that_is_not_a_scalar():
    """reduction="none" would leave every rank with its own piece of the loss."""
    model, example = _mlp_example()
    with pytest.raises(TraceError) as info:
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example,
                     loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"))
    msg = str(info.value)
    assert "shape (4,)" in msg and "not a scalar" in msg and "test_errors.py" in msg
    assert "mean or sum" in msg


def test_loss_that_returns_a_tuple():
    model, example = _mlp_example()
    with pytest.raises(TraceError) as info:
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example,
                     loss_fn=lambda out, y: (F.cross_entropy(out, y), out.abs().mean()))
    msg = str(info.value)
    assert "tuple of 2 values" in msg and "one scalar tensor" in msg


# -- autocast regions in forward ---------------------------------------------------------------

class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.fc(x).float()


def test_autocast_region_in_forward_is_refused():
    """Inlined, its ops would run without its casts (in float32, silently)."""
    with pytest.raises(TraceError, match=r"torch.autocast \(device cpu, dtype torch.bfloat16\)"
                       r".*test_errors.py.*Cast explicitly"):
        autopar.plan(_Autocast(), autopar.MeshSpec((2,), hardware="cpu"),
                     (torch.randn(4, 8), torch.randn(4, 8)), loss_fn=F.mse_loss)


# -- data-dependent shapes: mixture of experts -----------------------------------------------

class _TokenChoiceMoE(nn.Module):
    """Top-k token-choice routing as torchtitan and Hugging Face Mixtral write it: tokens
    sorted by expert and split by the routed counts ("split"), or gathered per expert with
    torch.where ("where") or a boolean mask ("mask")."""

    def __init__(self, routing: str, dim=8, experts=4, top_k=2):
        super().__init__()
        self.routing, self.top_k = routing, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        y = torch.zeros_like(x)
        if self.routing == "split":
            order = chosen.reshape(-1).argsort()
            counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts))
            routed = x.repeat_interleave(self.top_k, dim=0)[order]
            pieces = torch.split(routed, counts.tolist())  # split sizes from the router
            out = torch.cat([e(p) for e, p in zip(self.experts, pieces)])
            y = y.index_add(0, order // self.top_k, out * weights.reshape(-1, 1)[order])
        elif self.routing == "where":
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)  # the tokens routed to expert e
                y = y.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        else:
            for e, expert in enumerate(self.experts):
                mask = (chosen == e).any(-1)
                y[mask] = y[mask] + expert(x[mask])  # boolean-mask indexing
        return y.reshape(B, T, D)


@pytest.mark.parametrize("routing,line", [
    ("split", "torch.split(routed, counts.tolist())"),
    ("where", "token, slot = torch.where(chosen == e)"),
    ("mask", "y[mask] = y[mask] + expert(x[mask])"),
])
def test_data_dependent_routing_names_the_line(routing, line):
    with pytest.raises(TraceError) as info:
        autopar.plan(_TokenChoiceMoE(routing), autopar.MeshSpec((2,), hardware="cpu"),
                     (torch.randn(2, 4, 8), torch.randn(2, 4, 8)), loss_fn=F.mse_loss)
    msg = str(info.value)
    assert "data-dependent shape" in msg and "needs static shapes" in msg
    assert "test_errors.py" in msg and line in msg, msg
    assert "fixed capacity" in msg and "weight the outputs by the router" in msg


# -- Python side effects in forward ------------------------------------------------------------

class _Counting(nn.Module):
    """A layer that keeps Python state in forward: a counter and a history list."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self._seen = []

    def forward(self, x):
        self.calls += 1
        self._seen.append(x.shape[0])
        return self.fc(x)


def test_forward_that_changes_python_state():
    model = nn.Sequential(nn.Linear(8, 8), _Counting())
    with pytest.raises(TraceError) as info:
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "model.1.calls changed from 0 to 1" in msg
    assert "model.1._seen was modified in place (a list of 0 items before, 1 item after)" in msg
    assert "does not repeat Python side effects" in msg and "out of forward" in msg


class _ReadThenSet(nn.Module):
    """Reads a setting, then changes it for good: the first call computes with the old value,
    every later call with the new one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        y = self.fc(x) * self.scale
        self.scale = 2.0
        return y


def test_state_changed_for_good_is_traced_only_where_every_call_computes_alike():
    from autopar.passes.trace import trace
    from tests.models import ShiftedWindows
    x = torch.randn(4, 6, 6, 8)
    model = ShiftedWindows(window=8)  # one window covers 6 x 6: no shift
    program = trace(model, (x,))
    assert model.shift == 4  # the user's model is left as it was
    rolls = [n for n in program.graph.nodes if n.target == torch.ops.aten.roll.default]
    assert rolls and all(n.args[1] == [0, 0] for n in rolls)
    with pytest.raises(TraceError, match=r"model.0.scale changed from 1.0 to 2.0"):
        autopar.plan(nn.Sequential(_ReadThenSet()), autopar.MeshSpec((2,), hardware="cpu"),
                     (torch.randn(4, 8),))


class _ScaleFromShape(nn.Module):
    """Sets a scale from the input's width once for good, as Swin sets its shift."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        self.scale = x.shape[-1] ** -0.5
        return self.fc(x)


class _SwitchedMask(nn.Module):
    """Multiplies by a mask tensor, then rebinds the mask to another tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.masks = [torch.ones(4), torch.full((4,), 2.0)]
        self.mask = self.masks[0]

    def forward(self, x):
        y = self.fc(x) * self.mask
        self.mask = self.masks[1]
        return y


def test_state_set_for_good_that_the_loss_reads_or_a_constant_holds_is_refused():
    """A loss function reading the attribute forward sets reads the new value from the first
    call on (the trace read the old one), and a tensor rebound in forward is a constant the
    graph's code does not show: both refused, where they trained wrong silently."""
    mesh = autopar.MeshSpec((2,), hardware="cpu")
    model = _ScaleFromShape()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"model.scale changed from 1.0 to 0.35"):
        autopar.plan(model, mesh, (x, y),
                     loss_fn=lambda out, t: ((out - t) ** 2).mean() * model.scale)
    assert model.scale == 1.0  # the user's model is left as it was
    autopar.plan(model, mesh, (x, y), loss_fn=F.mse_loss)  # a loss that does not read it
    with pytest.raises(TraceError, match=r"model.mask changed from a tensor"):
        autopar.plan(_SwitchedMask(), mesh, (torch.randn(4, 4),))


def test_forward_that_sets_a_cache_attribute():
    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            self.last_input = x
            return self.fc(x)

    model, example = MLP([8, 8]), (torch.randn(4, 8), torch.randint(0, 8, (4,)))
    model.net.append(Caching())
    with pytest.raises(TraceError, match=r"model\.net\.1\.last_input was set to a tensor"):
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example,
                     loss_fn=F.cross_entropy)


def test_mesh_given_as_a_shape_tuple():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"mesh is a tuple; pass an autopar.MeshSpec"):
        autopar.plan(MLP([8, 16, 4]), (2,), (x,))


def test_legacy_weight_norm_names_the_module_and_the_replacement():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warning
        torch.nn.utils.weight_norm(model[0])
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(TraceError, match=r"module 0 \(Linear\) uses torch.nn.utils.weight_norm"
                                         r".*parametrizations.weight_norm"):
        autopar.plan(model, autopar.MeshSpec((2,)), (x, y), loss_fn=F.cross_entropy)
    torch.nn.utils.remove_weight_norm(model[0])
    torch.nn.utils.parametrizations.weight_norm(model[0])  # what the message says to do
    plan = autopar.plan(model, autopar.MeshSpec((2,)), (x, y), loss_fn=F.cross_entropy)
    assert "0.parametrizations.weight.original0" in plan.parameters


def test_no_plan_fits_when_fsdp_gathers_dominate():
    model = MLP([16, 64, 32])
    x, y = torch.randn(8, 16), torch.randint(0, 32, (8,))
    with pytest.raises(NoFeasiblePlan, match=r"dominated by gathered.*bucket_bytes"):
        autopar.plan(model, autopar.MeshSpec((2,)), (x, y), loss_fn=F.cross_entropy,
                     force="fsdp", memory_budget=20_000)
