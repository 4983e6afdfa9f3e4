"""Every private or version-dependent PyTorch API autopar uses (autopar.passes.torch_compat)
exists and behaves as autopar expects, each on a tiny example: a PyTorch release that changes
one fails here, by name, rather than somewhere deep in a plan or a training step."""

import torch
import torch.nn as nn

from autopar.passes import torch_compat
from tests import world_tasks


def test_the_installed_pytorch_is_one_autopar_supports():
    oldest, newest = torch_compat.SUPPORTED
    assert oldest <= torch_compat.TORCH_VERSION <= newest, (
        f"PyTorch {torch.__version__} is outside {oldest} to {newest}: check every name in "
        "autopar/passes/torch_compat.py against it, then widen SUPPORTED and pyproject.toml")


def test_pytrees_flatten_map_and_rebuild():
    tree = ((torch.zeros(1), 2), {"a": 3, "b": [4, 5]})
    leaves, spec = torch_compat.tree_flatten(tree)
    assert isinstance(spec, torch_compat.TreeSpec)
    assert len(leaves) == spec.num_leaves == 5 and not spec.is_leaf()
    assert torch_compat.tree_leaves(tree)[1:] == [2, 3, 4, 5]
    kwargs = torch_compat.spec_child(spec, 1)
    assert kwargs.type is dict and list(kwargs.context) == ["a", "b"]
    assert torch_compat.spec_child(torch_compat.spec_child(spec, 0), 1).is_leaf()
    doubled = torch_compat.tree_map(lambda x: x * 2, tree)
    assert doubled[1] == {"a": 6, "b": [8, 10]} and doubled[0][1] == 4
    rebuilt = torch_compat.tree_unflatten(leaves, spec)
    assert rebuilt[1] == tree[1] and rebuilt[0][0] is leaves[0]


class _Regions(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = x + 1
        with torch.autocast("cpu", enabled=False):
            z = x * 3
        return x * y + z


def test_grad_mode_regions_of_an_exported_graph():
    """torch.export wraps a no_grad block and an autocast block in higher-order ops: the
    wrapper finds the submodule each calls and the arguments it passes."""
    x = torch.randn(2, requires_grad=True)
    gm = torch.export.export(_Regions(), (x,), strict=False).graph_module
    regions = [(n, torch_compat.grad_mode_region(n)) for n in gm.graph.nodes]
    regions = [(n, r) for n, r in regions if r is not None]
    assert len(regions) == 2
    assert sorted((r.grad_enabled, r.autocast) for _, r in regions) == [(False, None),
                                                                         (True, None)]
    for node, region in regions:
        sub, args = region.submodule, region.args
        assert torch_compat.is_higher_order(node.target)
        assert sub.op == "get_attr" and isinstance(getattr(gm, sub.target), torch.fx.GraphModule)
        assert [a.name for a in args] == ["x"]
        sub_inputs = [n for n in getattr(gm, sub.target).graph.nodes if n.op == "placeholder"]
        assert len(sub_inputs) == len(args)
    plain = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target is torch.ops.aten.mul.Tensor]
    assert plain and all(torch_compat.grad_mode_region(n) is None
                         and not torch_compat.is_higher_order(n.target) for n in plain)


class _Nonzero(nn.Module):
    def forward(self, x):
        return x.nonzero() * 2


def test_unbacked_sizes_are_found():
    gm = torch.export.export(_Nonzero(), (torch.randn(4),), strict=False).graph_module
    shapes = {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
    assert torch_compat.free_unbacked_symbols(shapes["nonzero"])
    assert not torch_compat.free_unbacked_symbols((4, 1))


def test_assertion_ops_exist():
    assert len(torch_compat.ASSERTION_OPS) == 3
    assert all(op.name().startswith("aten::") for op in torch_compat.ASSERTION_OPS)


def test_persistent_buffers():
    m = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3))
    m[1].register_buffer("scratch", torch.zeros(1), persistent=False)
    assert torch_compat.persistent_buffers(m) == {
        "0.running_mean", "0.running_var", "0.num_batches_tracked"}
    assert torch_compat.persistent_buffers(m) == {
        k for k in m.state_dict() if k in dict(m.named_buffers())}


def test_collectives_and_the_default_store(world2):
    got = world2.run(world_tasks.torch_compat_collectives)
    for rank, r in enumerate(got):
        assert r["all_gather_single"] == [0.0, 10.0, 1.0, 11.0]
        # sum over ranks of arange(4) + rank = [1, 3, 5, 7]; rank r keeps block r
        assert r["reduce_scatter_single"] == [[1.0, 3.0], [5.0, 7.0]][rank]
        # rank r receives block r of every rank: [2r, 2r+1] and [100 + 2r, 100 + 2r + 1]
        assert r["all_to_all_single"] == [2.0 * rank, 2.0 * rank + 1, 100 + 2.0 * rank,
                                          101 + 2.0 * rank]
        assert r["all_reduce"] == [1.0]
        assert r["store"] == b"left by rank 0"


def test_outside_dispatch_modes_leaves_the_active_mode_and_restores_it():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.ones(2)
    with Record():
        x + 1
        with torch_compat.outside_dispatch_modes():
            x * 2
        x - 1
    assert seen == [torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor]


class _Lines(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def helper(self, x):
        return torch.tanh(x)  # made inside a method that is not `forward`

    def forward(self, x):
        h = self.fc(x) * 2
        return self.helper(h)


def test_innermost_stack_traces_record_the_frame_fx_would_keep():
    """Exported under `innermost_stack_traces`, each node's stack trace is the innermost frame
    outside PyTorch of those FX's own recording keeps (under torch.export: `forward` frames),
    line for line as FX records it, and torch.fx's recorder is back afterwards."""
    import inspect

    import torch.fx.proxy as proxy

    from autopar.passes.trace import source_line

    def lines():
        ep = torch.export.export(_Lines(), (torch.ones(2, 3),), strict=False)
        return {n.name: source_line(n) for n in ep.graph.nodes}

    recorder = proxy.CapturedTraceback
    whole = lines()
    with torch_compat.innermost_stack_traces():
        assert proxy.CapturedTraceback is not recorder
        inner = lines()
    assert proxy.CapturedTraceback is recorder
    assert inner == whole
    forward = inspect.getsourcelines(_Lines.forward)[1]
    assert f"line {forward + 1}, in forward: h = self.fc(x) * 2" in inner["linear"]
    assert inner["tanh"].endswith("in forward: return self.helper(h)")  # not in helper
    assert __file__.removesuffix("c") in inner["mul"]


def test_watch_backward_runs_sees_backward_and_grad_imported_by_name():
    """Both reach torch.autograd's private `_engine_run_backward`; a PyTorch without it
    would miss a `grad` imported before tracing."""
    from torch.autograd import grad

    assert callable(getattr(torch.autograd, "_engine_run_backward", None)), (
        "torch.autograd._engine_run_backward is gone: find the engine entry that backward() "
        "and autograd.grad share, and wrap it in torch_compat.watch_backward_runs")
    seen = []
    x = torch.ones(3, requires_grad=True)
    with torch_compat.watch_backward_runs(lambda: seen.append(1)):
        grad(x.sum(), x)
        (x * 2).sum().backward()
    assert seen == [1, 1]
    (x * 2).sum().backward()  # put back
    assert seen == [1, 1]
