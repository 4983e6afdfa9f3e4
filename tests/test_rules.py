"""Numerical check of every sharding rule, forward and backward, on simulated ranks.

For each sample call (tests/rule_samples.py), each mesh-dimension size n and each 1-D strategy
the rule returns (after the planner's own filters: even splits only, no pending sums of integers),
one process plays all n ranks:

forward   inputs are cut per their placement (Shard: the rank's contiguous chunk, Replicate: the
          whole tensor, Partial: n random summands), the op runs per rank (through its lowering
          when one is registered), and the outputs are joined per the output placement (Shard:
          concatenated, Partial: summed, Replicate: every rank must agree) and compared with the
          op on the whole inputs; the default generator is seeded alike before the whole op and
          before each rank, so a random op must draw on each rank the block of the whole op's
          draw (its samples are compared bit for bit);
backward  a random output gradient G is handed out per the dual of the output placement
          (Shard: the chunk, Replicate: shares summing to G, Partial: G on every rank), each rank
          backpropagates through its own local computation, and the input gradients are joined
          per the dual of each input's placement (Shard: concatenated, Replicate: summed,
          Partial: every rank must agree) and compared with the whole op's gradients.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.placement import divisible, fmt, local_shape, local_slices
from autopar.passes.rules import (
    LOWERINGS,
    RULES,
    LocalContext,
    OpCall,
    Rule1D,
    TensorArg,
    facts_of,
)
from autopar.passes.strategies import ints_not_partial
from autopar.passes.torch_compat import tree_leaves, tree_map
from tests.rule_samples import SAMPLES, Gen, Sample

MESH_SIZES = (2, 3)


# ---------------------------------------------------------------------------------------------
# Building the OpCall and the cases
# ---------------------------------------------------------------------------------------------

def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def _outputs(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def make_call(sample: Sample, args: tuple, kwargs: dict, out) -> OpCall:
    """What `strategies.op_call` would build for a traced node of this call."""
    n = 0

    def to_arg(a):
        nonlocal n
        if isinstance(a, torch.Tensor):
            t = TensorArg(n, tuple(a.shape), a.dtype, a.stride())
            n += 1
            return t
        return a

    cargs = tree_map(to_arg, args)
    ckwargs = tree_map(to_arg, dict(kwargs))
    inputs = [a for a in tree_leaves((cargs, ckwargs)) if isinstance(a, TensorArg)]
    assert [t.index for t in inputs] == list(range(len(inputs)))
    outs = _outputs(out)
    return OpCall(sample.op_name, sample.op, cargs, ckwargs, inputs,
                  [tuple(o.shape) for o in outs], isinstance(out, (list, tuple)))


def rule_text(rule: Rule1D) -> str:
    def one(p):
        return fmt((p,))

    out = rule.output
    out_s = "(" + ",".join(one(p) for p in out) + ")" if isinstance(out, tuple) else one(out)
    return ",".join(one(p) for p in rule.inputs) + "->" + out_s


def _out_placements(rule: Rule1D, call: OpCall) -> list:
    return list(rule.output) if call.multi_output else [rule.output]


def usable(rule: Rule1D, call: OpCall, n: int) -> bool:
    """The planner's filters for one mesh dimension of size n."""
    if not ints_not_partial(rule, call):
        return False
    if not all(divisible(t.shape, (p,), (n,)) for t, p in zip(call.inputs, rule.inputs)):
        return False
    return all(divisible(s, (p,), (n,)) for s, p in zip(call.out_shapes,
                                                         _out_placements(rule, call)))


@dataclass
class Case:
    sample: Sample
    n: int
    rule: Rule1D | None
    error: str | None = None

    @property
    def id(self) -> str:
        tail = rule_text(self.rule) if self.rule is not None else "ERROR"
        return f"{self.sample.id}-n{self.n}-{tail}"


_BUILT: dict[str, tuple[tuple, dict, Any, OpCall]] = {}


def built(sample: Sample):
    """(args, kwargs, global output, OpCall) of a sample, built once."""
    if sample.id not in _BUILT:
        args, kwargs = sample.build(Gen(_seed(sample.id)))
        with torch.no_grad():
            out = sample.op(*args, **kwargs)
        _BUILT[sample.id] = (args, kwargs, out, make_call(sample, args, kwargs, out))
    return _BUILT[sample.id]


def collect() -> list[Case]:
    cases = []
    for sample in SAMPLES:
        try:
            _, _, _, call = built(sample)
            rules = RULES[sample.op](call)
        except Exception as e:  # noqa: BLE001 (reported by the test, not at collection)
            cases.append(Case(sample, 0, None, f"{type(e).__name__}: {e}"))
            continue
        for n in MESH_SIZES:
            seen = set()
            for rule in rules:
                if rule in seen or not usable(rule, call, n):
                    continue
                seen.add(rule)
                cases.append(Case(sample, n, rule))
    return cases


CASES = collect()


# ---------------------------------------------------------------------------------------------
# Simulated ranks
# ---------------------------------------------------------------------------------------------

def _chunk(x: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    start, length = local_slices(x.shape, (Shard(dim),), (n,), (r,))[dim]
    return x.narrow(dim, start, length)


def _summands(x: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n different tensors adding up to x."""
    if x.dtype == torch.bool:
        raise AssertionError("a pending sum of booleans")
    if x.dtype.is_floating_point:
        parts = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-5, 6, x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
    return parts + [x - sum(parts)]


def scatter(x: torch.Tensor, p, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Each rank's local value of a tensor with placement p."""
    if isinstance(p, Shard):
        return [_chunk(x, p.dim, n, r).clone() for r in range(n)]
    if isinstance(p, Replicate):
        return [x.clone() for _ in range(n)]
    if isinstance(p, Partial):
        return _summands(x, n, gen)
    raise AssertionError(f"unknown placement {p}")


def _close(a: torch.Tensor, b: torch.Tensor, msg: str, precise: bool = True,
           exact: bool = False) -> None:
    """Bit for bit when `exact`; tight tolerances when everything was computed in float64, the
    dtype's precision otherwise."""
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{msg}\n{m}")
    elif precise and a.dtype == torch.float64:
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=lambda m: f"{msg}\n{m}")
    elif a.dtype in (torch.bfloat16, torch.float16):  # per-rank shares of ~1 summed: ulps of 1
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=3e-2, msg=lambda m: f"{msg}\n{m}")
    elif a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{msg}\n{m}")
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{msg}\n{m}")


def join(parts: list[torch.Tensor], p, what: str, exact: bool = False) -> torch.Tensor:
    """The global value of per-rank values held under placement p."""
    if isinstance(p, Shard):
        return torch.cat(parts, p.dim)
    if isinstance(p, Partial):
        assert parts[0].dtype != torch.bool, f"{what}: a pending sum of booleans"
        total = parts[0]
        for q in parts[1:]:
            total = total + q
        return total
    for r, q in enumerate(parts[1:], 1):
        _close(q, parts[0], f"{what}: Replicate, but rank {r} differs from rank 0",
               exact=exact)
    return parts[0]


def scatter_grad(g: torch.Tensor, p, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Local output gradients: the dual of the output placement."""
    if isinstance(p, Shard):
        return [_chunk(g, p.dim, n, r) for r in range(n)]
    if isinstance(p, Replicate):  # the gradient of a replicated value is a pending sum
        return _summands(g, n, gen)
    return [g for _ in range(n)]  # of a pending sum, a replicated value


def join_grad(parts: list[torch.Tensor], p, what: str) -> torch.Tensor:
    """Global input gradient from per-rank gradients: the dual of the input placement."""
    if isinstance(p, Shard):
        return torch.cat(parts, p.dim)
    if isinstance(p, Replicate):
        total = parts[0]
        for q in parts[1:]:
            total = total + q
        return total
    for r, q in enumerate(parts[1:], 1):
        _close(q, parts[0], f"{what}: input is Partial, so its gradient must be replicated, "
                            f"but rank {r} differs from rank 0")
    return parts[0]


def _grad_inputs(sample: Sample, tensors: list[torch.Tensor]) -> list[int]:
    return [i for i, t in enumerate(tensors)
            if t.dtype.is_floating_point and i not in sample.no_grad]


class _ThreadComm:
    """The collectives of n simulated ranks run in threads, for an op whose lowering exchanges
    something itself (`OpFacts.exchanges`: BatchNorm's batch statistics): an all-gather
    whose adjoint is a reduce-scatter, summing in rank order on every rank."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.local = threading.local()

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        self.slots[self.local.rank] = x
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total = total + other
        self.barrier.wait()
        return total

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        comm, n = self, len(self.slots)

        class _Gather(torch.autograd.Function):  # adjoint: the rank's block of the sum
            @staticmethod
            def forward(ctx, t):
                comm.slots[comm.local.rank] = t.detach()
                comm.barrier.wait()
                whole = torch.cat(list(comm.slots), dim)
                comm.barrier.wait()
                return whole

            @staticmethod
            def backward(ctx, grad):
                return comm._sum(grad).chunk(n, dim)[comm.local.rank].contiguous()

        return _Gather.apply(x)


def _exchanges(call: OpCall, rule: Rule1D, n: int) -> bool:
    """Whether the op's lowering under `rule` runs collectives of its own."""
    exchanges = facts_of(call.target).exchanges
    return exchanges is not None and bool(exchanges(call, tuple((p,) for p in rule.inputs),
                                                    (n,), lambda dt: dt.itemsize))


def _on_ranks(n: int, comm: _ThreadComm | None, work) -> list:
    """work(r) for each rank r: one after another, or with `comm` in one thread each."""
    if comm is None:
        return [work(r) for r in range(n)]
    results: list = [None] * n
    errors: list = []

    def run(r: int) -> None:
        comm.local.rank = r
        try:
            results[r] = work(r)
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _local_run(call: OpCall, locals_: list[torch.Tensor], rule: Rule1D, n: int, r: int,
               comm: _ThreadComm | None = None):
    def put(a):
        return locals_[a.index] if isinstance(a, TensorArg) else a

    args = tree_map(put, call.args)
    kwargs = tree_map(put, call.kwargs)
    outs_p = _out_placements(rule, call)
    ctx = LocalContext(
        (n,), (r,), tuple((p,) for p in rule.inputs),
        tuple((p,) for p in outs_p) if call.multi_output else (rule.output,),
        [local_shape(s, (p,), (n,)) for s, p in zip(call.out_shapes, outs_p)], comm=comm)
    lower = LOWERINGS.get(call.target)
    fn, args, kwargs = lower(call, args, kwargs, ctx) if lower else (call.target, args, kwargs)
    return _outputs(fn(*args, **kwargs))


def check(case: Case) -> None:
    sample, n, rule = case.sample, case.n, case.rule
    args, kwargs, _, call = built(sample)
    gen = torch.Generator().manual_seed(_seed(case.id))
    flat = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    grad_idx = _grad_inputs(sample, flat)
    outs_p = _out_placements(rule, call)

    # The whole op (random ops draw from the default generator, seeded alike for every rank).
    seed = _seed(case.id + "/draw")
    g_in = [t.detach().clone().requires_grad_(i in grad_idx) for i, t in enumerate(flat)]
    it = iter(g_in)
    g_args, g_kwargs = tree_map(
        lambda a: next(it) if isinstance(a, torch.Tensor) else a, (args, kwargs))
    torch.manual_seed(seed)
    g_outs = _outputs(sample.op(*g_args, **g_kwargs))
    # float64 throughout: tight tolerances; any float32 step: that dtype's tolerances
    precise = all(t.dtype == torch.float64 for t in (*flat, *g_outs) if t.is_floating_point())

    # Per rank.
    per_input = [scatter(t, p, n, gen) for t, p in zip(flat, rule.inputs)]
    l_in = [[per_input[i][r].detach().requires_grad_(i in grad_idx) for i in range(len(flat))]
            for r in range(n)]
    comm = _ThreadComm(n) if _exchanges(call, rule, n) else None

    def forward(r: int) -> list:
        if comm is None:  # (the generator is global: random ops run one rank at a time)
            torch.manual_seed(seed)
        return _local_run(call, l_in[r], rule, n, r, comm)

    l_outs = _on_ranks(n, comm, forward)

    for k, (go, p) in enumerate(zip(g_outs, outs_p)):
        parts = [l_outs[r][k] for r in range(n)]
        if isinstance(p, Shard):
            want = local_shape(go.shape, (p,), (n,))
            for r, q in enumerate(parts):
                assert tuple(q.shape) == want, (
                    f"{case.id}: output {k} on rank {r} has shape {tuple(q.shape)}, "
                    f"expected {want}")
        got = join(parts, p, f"{case.id}: output {k}", sample.exact)
        assert got.dtype == go.dtype, f"{case.id}: output {k} dtype {got.dtype} != {go.dtype}"
        _close(got, go.detach(), f"{case.id}: forward output {k} (placement {fmt((p,))})",
               precise, sample.exact)

    # Backward.
    diff = [k for k, o in enumerate(g_outs) if o.dtype.is_floating_point and o.requires_grad]
    if not diff or not grad_idx:
        return
    G = {k: torch.randn(g_outs[k].shape, generator=gen, dtype=g_outs[k].dtype) for k in diff}
    wrt = [g_in[i] for i in grad_idx]
    want = torch.autograd.grad([g_outs[k] for k in diff], wrt, [G[k] for k in diff],
                               allow_unused=True)
    local_G = {k: scatter_grad(G[k], outs_p[k], n, gen) for k in diff}
    got_parts: list[list[torch.Tensor]] = [[] for _ in grad_idx]

    def backward(r: int) -> list:
        outs = [k for k in diff if l_outs[r][k].requires_grad]
        leaves = [l_in[r][i] for i in grad_idx]
        grads = torch.autograd.grad([l_outs[r][k] for k in outs], leaves,
                                    [local_G[k][r] for k in outs],
                                    allow_unused=True) if outs else [None] * len(leaves)
        return [torch.zeros_like(leaf) if gr is None else gr for gr, leaf in zip(grads, leaves)]

    for grads in _on_ranks(n, comm, backward):
        for j, gr in enumerate(grads):
            got_parts[j].append(gr)
    # Gradients are exact too where nothing is summed across ranks: every placement Shard (a
    # replicated value's gradient is a sum of per-rank shares, which rounds).
    exact = sample.exact and all(isinstance(p, Shard) for p in (*rule.inputs, *outs_p))
    for j, i in enumerate(grad_idx):
        w = want[j] if want[j] is not None else torch.zeros_like(g_in[i])
        p = rule.inputs[i]
        got = join_grad(got_parts[j], p, f"{case.id}: gradient of input {i}")
        _close(got, w, f"{case.id}: gradient of input {i} (placement {fmt((p,))})", precise,
               exact)


# torch's own mse_loss backward warns for a broadcast target (the all-replicate case).
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_strategy(case: Case) -> None:
    if case.error is not None:
        pytest.fail(f"{case.sample.id}: building the sample or calling its rule failed: "
                    f"{case.error}")
    check(case)


def test_every_rule_has_a_sample() -> None:
    sampled = {s.op for s in SAMPLES}
    missing = sorted(str(op) for op in RULES if op not in sampled)
    assert not missing, f"ops with a sharding rule but no sample in tests/rule_samples.py: " \
                        f"{missing}"


def test_samples_name_registered_ops() -> None:
    stray = sorted({str(s.op) for s in SAMPLES if s.op not in RULES})
    assert not stray, f"samples for ops without a rule: {stray}"


def test_every_rule_is_exercised_beyond_replicate() -> None:
    """Each op has a sample where at least one strategy other than all-replicate divides."""
    def trivial(rule: Rule1D) -> bool:
        outs = rule.output if isinstance(rule.output, tuple) else (rule.output,)
        return all(isinstance(p, Replicate) for p in (*rule.inputs, *outs))

    exercised = {c.sample.op for c in CASES if c.rule is not None and not trivial(c.rule)}
    lacking = sorted(str(op) for op in RULES if op not in exercised)
    assert not lacking, f"ops whose samples exercise only the all-replicate strategy: {lacking}"


def test_a_max_pool_of_integers_keeps_its_spatial_dimensions_whole() -> None:
    """The halo past the edges is -inf, which no integer holds: an integer max pool shards
    its batch and channels only."""
    from tests.rule_samples import Sample

    aten = torch.ops.aten

    for dtype, spatial in ((torch.int64, False), (torch.float64, True)):
        sample = Sample(aten.max_pool2d.default, f"probe_{dtype}", lambda g, dt=dtype: (
            (g.f(2, 3, 8, 8).to(dt), [3, 3], [2, 2], [1, 1]), {}))
        _, _, _, call = built(sample)
        dims = {r.inputs[0].dim for r in RULES[aten.max_pool2d.default](call)
                if isinstance(r.inputs[0], Shard)}
        assert (dims >= {2, 3}) == spatial and {0, 1} <= dims, (dtype, dims)
