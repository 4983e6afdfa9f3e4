"""Calibration: measure the machine a DeviceMesh runs on, and return a hardware profile of it.

    profile = autopar.calibrate(device_mesh)              # every rank calls it (collectives)
    spec = autopar.MeshSpec(device_mesh.shape, names=..., hardware=profile)
    plan = autopar.plan(model, spec, example_inputs, loss_fn=loss_fn)

For each mesh dimension, every collective kind is timed at several message sizes on the real
process groups (all groups of the dimension at once, as a plan runs them); on a mesh of several
dimensions also in turn with the other dimensions' collectives, as plans issue them (a rank
then waits on ranks of other groups as well: on CPUs whose cores the ranks share this costs
about twice the time of each dimension alone), each dimension taking its share of a turn in
proportion to its time alone. The link's alpha (seconds) and beta (seconds per byte) are
fitted by least squares to

    t = alpha + factor(kind, n) * bytes * beta

with the cost model's algorithm factors (all-reduce 2(n-1)/n, all-gather and reduce-scatter
(n-1)/n of the gathered size, all-to-all (n-1)/n), relative errors weighted equally: once over
all kinds (the link's alpha and beta) and once per kind (kept in `Link.per_kind`, since e.g.
gloo's reduce-scatter is not a ring and costs more than the ring model says). Mesh dimensions
are then grouped the way `MeshSpec.link` maps them (inside a node or across nodes,
with the number of ranks per host found from the host names) and one link is fitted per group.
Per-rank compute is measured with every rank busy at once (ranks sharing a machine share its
cores and memory bandwidth): dense matmul flop/s per dtype, elementwise memory bandwidth, and the
fixed cost of an op (forward + backward, per op) and of a view. Those are then checked against
training steps of a small transformer (autopar.zoo's GPT with one layer: embeddings,
attention, MLP, norms, a cross-entropy head) at three sizes, timed on every rank at once: a
step takes longer than the cost model predicts from the op figures alone (allocation,
autograd's bookkeeping, caches that a whole step overflows), and two factors fitted to the
three steps, `throughput_factor` (flop/s and bandwidth divided by it) and `op_cost_factor` (op
and view costs multiplied), make the model predict them. Every rank returns the same profile
(measurements are gathered, each taking the slowest rank's time).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from autopar.passes import torch_compat
from autopar.solver.cost import ALGO_FACTOR, CostModel

from .hardware import HardwareProfile, Link, get_profile
from .mesh import MeshSpec
from .zoo import GPT, GPTConfig, lm_loss

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
CPU_SIZES = (2**12, 2**16, 2**18, 2**20, 2**22, 2**24)
GPU_SIZES = (2**16, 2**20, 2**24, 2**26, 2**28)

__all__ = ["calibrate", "fit_link"]


def calibrate(mesh, hardware: str | HardwareProfile | None = None, *,
              sizes: tuple[int, ...] | None = None, kinds: tuple[str, ...] = KINDS,
              min_time: float = 0.02, compute: bool = True,
              compute_time: float = 0.1) -> HardwareProfile:
    """Measure `mesh` (a torch DeviceMesh; a collective: call on every rank) and return
    `hardware` (default: "cpu" for a CPU mesh, "h100" otherwise) with measured links,
    devices per node and (with `compute`) per-rank compute figures. `sizes` are the message
    sizes in bytes (default: 4 KiB to 16 MiB on CPUs, 64 KiB to 256 MiB on GPUs); each
    measurement repeats its collective for at least `min_time` seconds, and each compute
    measurement its op for `compute_time` seconds."""
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    base = get_profile(hardware or ("cpu" if device.type == "cpu" else "h100"))
    sizes = sizes or (CPU_SIZES if device.type == "cpu" else GPU_SIZES)
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    per_node = sum(1 for h in hosts if h == hosts[0])

    dims_used = [k for k in range(mesh.ndim) if mesh.size(k) > 1]
    groups = {k: mesh.get_group(k) for k in dims_used}
    sync = device_sync(device)
    samples: dict[int, list[tuple[str, int, float]]] = {k: [] for k in dims_used}
    alone: dict[int, list[tuple[str, int, float]]] = {k: [] for k in dims_used}
    for kind in kinds:
        for nbytes in sizes:
            fns = {k: _collective(kind, nbytes, mesh.size(k), groups[k], device)
                   for k in dims_used}
            times = {k: _slowest(time_per_call(fns[k], min_time, sync, groups[k]))
                     for k in dims_used}
            for k in dims_used:
                alone[k].append((kind, nbytes, times[k]))
            if len(dims_used) > 1:
                # Plans issue collectives on every dimension in turn; a rank then waits on
                # ranks of other groups too, which costs more than each dimension alone.
                def cycle(fns=fns):
                    for fn in fns.values():
                        fn()
                turn = _slowest(time_per_call(cycle, min_time, sync, dist.group.WORLD))
                times = {k: turn * t / sum(times.values()) for k, t in times.items()}
            for k in dims_used:
                samples[k].append((kind, nbytes, times[k]))
    spec = MeshSpec(tuple(mesh.shape), hardware=base, devices_per_node=per_node)
    by_link: dict[str, list] = {"intra": [], "inter": []}
    dims = {}
    for k, pts in samples.items():
        n = mesh.size(k)
        alpha, bandwidth = fit_link([(kind, nbytes, t) for kind, nbytes, t in pts], n)
        where = "intra" if spec.link(k) is base.intra_node else "inter"
        dims[str(k)] = {"size": n, "link": where, "alpha": alpha, "bandwidth": bandwidth,
                        "samples": [list(p) for p in pts],
                        "alone": [list(p) for p in alone[k]]}
        by_link[where] += [(kind, nbytes, t, n) for kind, nbytes, t in pts]
    links = {}
    for where, pts in by_link.items():
        if pts:
            alpha, bandwidth = fit_link([(kind, b, t) for kind, b, t, _ in pts],
                                        [n for *_, n in pts])
            per_kind = []
            for kind in kinds:
                mine = [(k, b, t, n) for k, b, t, n in pts if k == kind]
                if len({b for _, b, _, _ in mine}) >= 2:
                    per_kind.append((kind, *fit_link([(k, b, t) for k, b, t, _ in mine],
                                                     [n for *_, n in mine])))
            old = base.intra_node if where == "intra" else base.inter_node
            links[where] = Link(old.name + "-measured", alpha, bandwidth, tuple(per_kind))
    profile = base.with_links(links.get("intra"), links.get("inter"))
    measured = {"links": dims, "devices_per_node": per_node, "world_size": len(hosts)}
    if compute:
        figures = _compute(device, compute_time)
        flops = dict(base.flops)
        for dtype in ("float32", "bfloat16"):
            if f"matmul_{dtype}" in figures:
                flops[dtype] = figures[f"matmul_{dtype}"]
        profile = replace(profile, flops=flops, memory_bandwidth=figures["bandwidth"],
                          launch=figures["launch"], view_launch=figures["view"])
        figures.update(_probe_steps(profile, device, compute_time))
        profile = _scaled(profile, figures["throughput_factor"], figures["op_cost_factor"])
        measured["compute"] = figures
    return replace(profile, name=base.name + "-calibrated", devices_per_node=per_node,
                   measured=measured)


def _scaled(profile: HardwareProfile, throughput: float, op_cost: float) -> HardwareProfile:
    """`profile` with flop/s and memory bandwidth divided by `throughput`, and the fixed cost of
    an op and of a view multiplied by `op_cost`."""
    return replace(profile, flops={k: v / throughput for k, v in profile.flops.items()},
                   memory_bandwidth=profile.memory_bandwidth / throughput,
                   launch=profile.launch * op_cost, view_launch=profile.view_launch * op_cost)


def fit_link(points: list[tuple[str, int, float]], n: int | list[int]) -> tuple[float, float]:
    """Least-squares (alpha seconds, bandwidth bytes/s) of t = alpha + factor * bytes / bw over
    (kind, bytes, seconds) points of collectives over `n` ranks (one n per point, or one for
    all), minimizing relative errors. Both are kept positive."""
    ns = n if isinstance(n, list) else [n] * len(points)
    a = np.array([[1.0, ALGO_FACTOR[kind](m) * nbytes] for (kind, nbytes, _), m in
                  zip(points, ns)])
    t = np.maximum(np.array([p[2] for p in points]), 1e-9)
    w = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if beta <= 0:  # latency-bound everywhere: the largest message gives the bandwidth
        alpha = float(np.min(t))
        beta = max(1e-15, float(np.max((t - alpha) / a[:, 1])))
    if alpha < 0:
        alpha = 0.0
        beta = float(np.sum(w * w * t * a[:, 1]) / np.sum(w * w * a[:, 1] ** 2))
    return float(alpha), float(1.0 / beta)


# -- measurements ----------------------------------------------------------------------------------

def _slowest(seconds: float) -> float:
    """The slowest rank's value (every rank gets it)."""
    t = torch.tensor([float(seconds)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def time_per_call(fn, min_time: float, sync, group=None, rounds: int = 3) -> float:
    """Median seconds per call of `fn`, over `rounds` rounds of back-to-back calls that fill
    `min_time`; the ranks of `group` (if any) agree on the number of calls."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    calls = torch.tensor([max(1, min(10_000, int(min_time / once)))])
    if group is not None:
        dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=group)
    calls = int(calls[0])
    times = []
    for _ in range(rounds):
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _collective(kind: str, nbytes: int, n: int, group, device):
    """A call of collective `kind` moving `nbytes` (the gathered size) over `group`."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: torch_compat.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: torch_compat.all_gather_single(full, part, group=group)
    if kind == "reduce_scatter":
        return lambda: torch_compat.reduce_scatter_single(part, full, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: torch_compat.all_to_all_single(out, full, group=group)
    raise ValueError(f"unknown collective {kind!r}; choose from {KINDS}")


def device_sync(device):
    """A function that waits for `device` to finish its queued work (nothing on CPUs)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _compute(device, seconds: float) -> dict[str, float]:
    """Per-rank compute figures, every rank at once (the slowest rank's)."""
    sync = device_sync(device)
    dist.barrier()
    out = {}
    m = 512 if device.type == "cpu" else 8192
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        per_call = _slowest(time_per_call(lambda a=a, b=b: a @ b, seconds, sync))
        out[f"matmul_{name}"] = 2 * m**3 / per_call
    numel = 2**20 if device.type == "cpu" else 2**28
    x = torch.randn(numel, device=device)
    y = torch.randn(numel, device=device)
    z = torch.empty(numel, device=device)
    per_call = _slowest(time_per_call(lambda: torch.add(x, y, out=z), seconds, sync))
    out["bandwidth"] = 3 * 4 * numel / per_call
    # The fixed cost of an op: a chain of tiny ops of the kinds a layer runs (a product, a
    # norm, an activation, arithmetic), forward and backward, per op and pass.
    w = torch.ones(4, 4, device=device, requires_grad=True)
    b = torch.zeros(4, device=device, requires_grad=True)
    h0 = torch.ones(2, 4, device=device, requires_grad=True)
    layer = (lambda h: torch.nn.functional.linear(h, w, b),
             lambda h: torch.nn.functional.layer_norm(h, (4,), b, b),
             torch.nn.functional.gelu, lambda h: h * 0.5)

    def chain():
        h = h0
        for _ in range(8):
            for op in layer:
                h = op(h)
        h.sum().backward()

    out["launch"] = _slowest(time_per_call(chain, seconds, sync)) / (2 * 8 * len(layer) + 2)
    v = torch.ones(4, 4, device=device)
    out["view"] = _slowest(time_per_call(lambda: v.view(16), seconds / 2, sync))
    return out


# Probe sizes (vocab, hidden, heads, batch, sequence) of a one-layer GPT, the op mix of the models
# autopar plans: a tiny one whose step is mostly the fixed cost of its ops, and two whose steps
# are mostly arithmetic.
_PROBES = {"cpu": ((256, 32, 2, 1, 16), (2048, 256, 4, 1, 128), (2048, 256, 4, 8, 128)),
           "gpu": ((1024, 256, 4, 1, 64), (32768, 2048, 16, 1, 1024),
                   (32768, 2048, 16, 8, 1024))}


def _probe_steps(profile: HardwareProfile, device, seconds: float) -> dict:
    """Time training steps (forward + backward) of a one-layer GPT at three sizes on every rank
    at once, and fit the factors by which the cost model's two parts of a compute prediction from
    `profile` on one device (the roofline, and the fixed cost of each op and view) must be
    scaled to predict them: least squares on relative errors, neither factor below 1."""
    from autopar.passes import strategies
    from autopar.passes.trace import trace
    gen = torch.Generator().manual_seed(0)
    whole_cost = CostModel(MeshSpec((1,), hardware=profile))
    roofline_cost = CostModel(MeshSpec((1,), hardware=_scaled(profile, 1.0, 0.0)))
    rows, out = [], {}
    for vocab, hidden, heads, batch, seq in _PROBES["cpu" if device.type == "cpu" else "gpu"]:
        with torch.device(device):
            model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=1, n_head=heads,
                                  n_embd=hidden))
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

        def step(model=model, ids=ids):
            model.zero_grad(set_to_none=True)
            lm_loss(model(ids), ids).backward()

        t = _slowest(time_per_call(step, seconds, device_sync(device), dist.group.WORLD))
        # On one device every op has one strategy: the plan's compute is their sum.
        graph = strategies.build(trace(model, (ids,), lm_loss, ids), (1,))
        whole, roof = (sum(cost.copy(graph=graph).compute_time(v, v.strategies[0])
                           for v in graph.nodes.values())
                       for cost in (whole_cost, roofline_cost))
        rows.append((roof / t, (whole - roof) / t))
        out[f"probe_{hidden}x{batch * seq}"] = {"measured": t, "roofline": roof,
                                               "fixed": whole - roof}
    out["throughput_factor"], out["op_cost_factor"] = fit_factors(rows)
    return out


def fit_factors(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) >= 1 minimizing sum (a r + b f - 1)^2 over rows (r, f): the roofline and fixed
    parts of each prediction divided by its measurement."""
    r, f = np.array(rows).T
    (a, b), *_ = np.linalg.lstsq(np.stack([r, f], axis=1), np.ones(len(rows)), rcond=None)
    if a < 1:
        a = 1.0
        b = float(np.dot(f, 1 - r) / max(np.dot(f, f), 1e-30))
    if b < 1:
        b = 1.0
        a = max(1.0, float(np.dot(r, 1 - f) / max(np.dot(r, r), 1e-30)))
    return float(a), float(b)
