"""Measured op times for the cost model: time every distinct op the solver may run, on this
machine's device, and remember the times on disk.

    profiler = autopar.profile.OpProfiler()                 # this machine's device
    plan = autopar.plan(model, spec, example_inputs, loss_fn=loss_fn, profile=profiler)

For each node of the strategy graph and each of its strategies, the op runs on random tensors of
its local shapes (through its rule's lowering, exactly as a rank would run it) and its backward
on random gradients; forward and backward seconds are kept under the cost model's `op_key`
(op, local shapes, dtypes, other arguments, which inputs need gradients, placements for ops
that run differently on shards), so each distinct key is timed once, ever: the times live in
`<cache_dir>/<device>-torch<version>.json`, one file per device kind and torch version
(default cache_dir: ~/.cache/autopar/profiles). Views are timed too (on a CPU their dispatch is
most of a small model's step); the autograd engine's start, which a step pays once, is
subtracted from each backward. An op that cannot run on random inputs keeps its roofline time.

Times are taken on the calling process's device with what else runs on the machine at that
time: to price a gloo world whose ranks share a CPU, measure under the same sharing (or use a
calibrated roofline, autopar.calibrate).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import replace
from pathlib import Path

import torch

from autopar.passes.placement import local_shape
from autopar.passes.rewrite import local_context
from autopar.passes.rules import LOWERINGS, TensorArg
from autopar.passes.strategies import CONSTANT, SNode, Strategy, StrategyGraph
from autopar.passes.torch_compat import tree_leaves, tree_map
from autopar.solver.cost import CostModel

from .calibrate import device_sync, time_per_call

__all__ = ["OpProfiler", "default_cache_dir", "device_name"]


def default_cache_dir() -> Path:
    """~/.cache/autopar/profiles."""
    return Path.home() / ".cache" / "autopar" / "profiles"


def device_name(device: torch.device) -> str:
    """A file-name-safe name of the device kind: the GPU's name, or the CPU's model and the
    number of threads torch uses."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_model() + f"-{torch.get_num_threads()}threads"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{device.type}-{name}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class OpProfiler:
    """Times ops on one device and caches the times on disk (see the module docstring).

    `min_time` is the seconds of repeated calls per sample (5 samples, median); `cache_dir`
    None means `default_cache_dir()`, False keeps times in memory only.
    """

    def __init__(self, device: str | torch.device | None = None, cache_dir=None,
                 min_time: float = 0.01, samples: int = 5):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.min_time = min_time
        self.samples = samples
        self.name = device_name(self.device)
        self.path: Path | None = None
        if cache_dir is not False:
            folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
            self.path = folder / f"{self.name}-torch{torch.__version__}.json"
        self.times: dict[str, list[float] | None] = self._load()
        self.measured_now = 0  # keys timed by this profiler (not from the cache)
        self._engine: float | None = None

    # -- the cache -----------------------------------------------------------------------------
    def _load(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        with open(self.path) as f:
            data = json.load(f)
        return dict(data.get("times", {}))

    def save(self) -> None:
        """Write the times (merged with what the file holds now) to the cache file."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        merged = self._load()
        merged.update(self.times)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"device": self.name, "torch": torch.__version__, "times": merged}, f,
                      indent=0, sort_keys=True)
        os.replace(tmp, self.path)

    # -- measuring -----------------------------------------------------------------------------
    def measure(self, graph: StrategyGraph, cost: CostModel) -> dict[str, tuple[float, float]]:
        """(forward, backward) seconds of every op of `graph` under every strategy, by op key:
        from the cache where known, timed here otherwise (then saved)."""
        out: dict[str, tuple[float, float]] = {}
        todo: dict[str, tuple[SNode, Strategy]] = {}
        for v in graph.nodes.values():
            if not cost.is_measurable(v):
                continue
            for s in v.strategies:
                key = cost.op_key(v, s)
                if key in self.times:
                    if self.times[key] is not None:
                        out[key] = tuple(self.times[key])
                else:
                    todo.setdefault(key, (v, s))
        # Timing draws random inputs and runs random ops: the caller's generators are left as
        # they were, so that what a model draws does not depend on what was timed here.
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            for key, (v, s) in todo.items():
                got = self.time_op(v, s, cost)
                self.times[key] = list(got) if got is not None else None
                self.measured_now += 1
                if got is not None:
                    out[key] = got
        if todo:
            self.save()
        return out

    def time_op(self, node: SNode, strategy: Strategy, cost: CostModel
                ) -> tuple[float, float] | None:
        """(forward, backward) seconds of one op under one strategy, or None when it does not
        run on random inputs."""
        try:
            run, grad_of = self._runner(node, strategy, cost)
            fwd = self._timeit(run)
            if grad_of is None:
                return fwd, 0.0
            both = self._timeit(lambda: grad_of(run()))
        except Exception:  # noqa: BLE001 - an op we cannot replay keeps its roofline time
            return None
        return fwd, max(0.0, both - fwd - self.engine_overhead())

    def engine_overhead(self) -> float:
        """Seconds one backward call costs beyond its ops (starting the autograd engine), which
        a training step pays once, not per op: timed on a one-element op and subtracted."""
        if self._engine is None:
            x = torch.ones(1, device=self.device, requires_grad=True)
            seed = torch.ones(1, device=self.device)
            tiny = self._timeit(lambda: x.mul(1.0))
            both = self._timeit(lambda: torch.autograd.grad(x.mul(1.0), x, seed))
            self._engine = max(0.0, both - 2 * tiny)  # the op's backward ~ its forward
        return self._engine

    def _runner(self, node: SNode, strategy: Strategy, cost: CostModel):
        mesh_shape = cost.shape
        grads = cost.grad_inputs(node) if node.requires_grad and node.kind != CONSTANT else \
            tuple(False for _ in node.inputs)
        tensors = []
        for t, shape, p, g in zip(node.call.inputs, node.in_shapes, strategy.inputs, grads):
            tensors.append(_random(local_shape(shape, p, mesh_shape), cost.dtype(t.dtype),
                                   self.device, g))
        it = iter(tensors)
        args, kwargs = tree_map(lambda a: next(it) if isinstance(a, TensorArg) else a,
                                (node.call.args, node.call.kwargs))
        target = node.call.target
        lower = LOWERINGS.get(target)
        if lower is not None:
            ctx = replace(local_context(node, strategy, mesh_shape, tuple(0 for _ in mesh_shape)),
                          comm=_Repeated(mesh_shape))
            target, args, kwargs = lower(node.call, args, kwargs, ctx)

        def run():
            return target(*args, **kwargs)

        wants = [t for t, g in zip(tensors, grads) if g]
        if not wants:
            return run, None

        def grad_of(out):
            outs = [o for o in tree_leaves(out)
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.grad(outs, wants, [torch.ones_like(o) for o in outs],
                                allow_unused=True)

        return run, grad_of

    def _timeit(self, fn) -> float:
        return time_per_call(fn, self.min_time, device_sync(self.device), rounds=self.samples)


class _Repeated:
    """The collectives an op exchanges inside itself (BatchNorm's statistics, a convolution's
    halo) as one rank would see them, without the exchange: an all-gather returns as many
    copies of the local piece, so the op computes on the shapes it will have (the exchange
    is priced apart, `OpFacts.exchanges`)."""

    def __init__(self, mesh_shape: tuple[int, ...]):
        self.mesh_shape = mesh_shape

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        return torch.cat([x] * self.mesh_shape[mesh_dim], dim)


def _random(shape, dtype: torch.dtype, device: torch.device, grad: bool) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(grad)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)  # valid indices and class targets
