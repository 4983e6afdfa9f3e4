"""The mesh as the planner's choice: given a number of devices, try the mesh shapes and plan
each.

    plan = autopar.plan(model, autopar.Cluster(64, hardware="h100"), example, loss_fn=...)
    plan.mesh             # the mesh chosen, e.g. (8, 8) named ("dp", "tp")
    plan.mesh_search      # every shape tried: predicted step time and memory, or why not

A candidate mesh is (pp, dp, tp) with size-1 dimensions left out: tp (the innermost
dimension, consecutive devices) stays inside a node, where the fast link is, and divides the
devices per node; pp cuts the model into pipeline stages (where its layers can be cut, unless
`pipeline=False`); dp takes the rest. The intra-op solver decides on every non-pp dimension
whether it holds data parallelism, FSDP, tensor parallelism or a mix, so the names only say
which dimension is inside a node. The model is traced once for all candidates (the trace
does not depend on the mesh).

Candidates are planned in worker processes at once (`PlanOptions.search_workers`; by default
one per CPU core), forked from the caller after the trace, so each starts from the traced
model without pickling it; a worker sends its plan (or why none fits) back. A candidate is
planned in steps (one microbatch count each, autopar/planner.py `plan_round`): a worker sends
back where the candidate stands and its next step joins the queue, so the steps of a long
candidate spread over the workers. Ties are broken in candidate order whatever finished
first, so the result does not depend on the workers.

Pipelined candidates are planned after the others, each first bounded by its relaxed
pipeline (autopar/pipeline_plan.py `relaxed_step`: layer blocks at their fastest, no memory
budget, worked out by the workers beside the candidates without stages): one that cannot step
faster than the fastest plan without stages is not planned further (its row says so), which
spares the stage solves of most of them.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from autopar.solver.ilp import NoFeasiblePlan, Outpaced
from autopar.solver.stages import StageError

from .hardware import HardwareProfile, get_profile
from .mesh import MeshSpec, check_devices_per_node
from .options import PlanOptions
from .plan import Plan
from .progress import Progress

__all__ = ["Cluster", "candidate_meshes", "search_mesh"]


@dataclass(frozen=True)
class Cluster:
    """Devices to plan for when the mesh is the planner's to choose: how many, how many share
    a node (default: the hardware's), what they are, and whether pipeline stages may be
    tried: by default (None) where the model's layers can be cut into stages (its pipelined
    trace finds them), with True always (a mesh that cannot be cut says why on its row), with
    False never."""

    devices: int
    hardware: str | HardwareProfile = "h100"
    devices_per_node: int | None = None
    pipeline: bool | None = None

    def __post_init__(self):
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"a cluster needs a positive number of devices, not "
                             f"{self.devices!r}")
        profile = get_profile(self.hardware)
        check_devices_per_node(self.devices_per_node, profile)
        per = self.devices_per_node or profile.devices_per_node
        if self.devices > per and self.devices % per:
            raise ValueError(
                f"{self.devices} devices do not fill nodes of {per}: devices_per_node must "
                f"divide the device count (or be at least the count: part of one node); "
                f"e.g. {self.devices} devices in nodes of "
                + ", ".join(str(d) for d in range(1, min(self.devices, 16) + 1)
                            if self.devices % d == 0))

    @property
    def per_node(self) -> int:
        """Devices per node (the hardware's unless given), at most the device count."""
        per = self.devices_per_node or get_profile(self.hardware).devices_per_node
        return min(per, self.devices)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(cluster: Cluster, layers: int | None = None) -> list[MeshSpec]:
    """Every (pp, dp, tp) mesh of the cluster's devices, size-1 dimensions left out: tp a
    divisor of the devices per node, pp (see `Cluster.pipeline`) a divisor of the rest and,
    given the model's number of `layers`, of that (stages of whole layers alike)."""
    out, seen = [], set()
    n, per = cluster.devices, cluster.per_node
    for tp in _divisors(per):
        rest = n // tp
        pps = [pp for pp in _divisors(rest) if layers is None or pp == 1 or layers % pp == 0]
        staged = cluster.pipeline or cluster.pipeline is None and (layers or 0) > 1
        for pp in (pps if staged else [1]):
            dp = rest // pp
            dims = [(s, name) for s, name in ((pp, "pp"), (dp, "dp"), (tp, "tp")) if s > 1]
            dims = dims or [(1, "dp")]
            if len(dims) == 1 and dims[0][1] == "tp":
                dims = [(dims[0][0], "dp")]  # one dimension: the same mesh as all dp
            if tuple(dims) in seen:
                continue
            seen.add(tuple(dims))
            out.append(MeshSpec(tuple(s for s, _ in dims), tuple(nm for _, nm in dims),
                                cluster.hardware, cluster.devices_per_node))
    return out


def search_mesh(cluster: Cluster, plan_for, options: PlanOptions,
                layers: int | None = None, floor_for=None) -> Plan:
    """The best plan over `candidate_meshes(cluster)`: `plan_for(mesh, state, beat)` takes one
    step of planning a candidate (`state`: None at the first, then what the step before
    returned) and returns (plan, None) when done, (None, state) when there is more to plan
    (raising NoFeasiblePlan or StageError when nothing fits, Outpaced when it cannot step
    faster than `beat` seconds: given to pipelined candidates, the fastest plan of the
    others, or None); in `options.search_workers` processes.
    Ties go to fewer, then smaller, pp and tp degrees. The returned plan's `mesh_search` ranks
    every candidate. `layers`: the model's number of layers (see `candidate_meshes`).
    `floor_for(mesh)`: seconds under which no plan of a pipelined candidate steps (its
    relaxed step), worked out while the candidates without stages are planned; those it does
    not bound are then planned without `beat`."""
    tried = []
    best: Plan | None = None
    meshes = candidate_meshes(cluster, layers)
    planned = _plan_all(meshes, plan_for, options, floor_for)
    for mesh, (plan, why, seconds) in zip(meshes, planned):
        row = {"shape": list(mesh.shape), "names": list(mesh.names)}
        if plan is None:
            row.update(step_time=None, peak_memory=None, why=why)
        else:
            row.update(step_time=plan.cost.step_time, peak_memory=plan.cost.peak_memory,
                       why="")
            if best is None or _better(plan, best):
                best = plan
        row["seconds"] = seconds
        tried.append(row)
    tried.sort(key=lambda r: (r["step_time"] is None, r["step_time"] or 0.0))
    if best is None:
        reasons = "; ".join(f"{tuple(r['shape'])}: {r['why']}" for r in tried[:4])
        raise NoFeasiblePlan(f"no mesh of {cluster.devices} {get_profile(cluster.hardware).name} "
                             f"devices fits the model ({reasons}); use more devices, "
                             "bf16-mixed precision or a smaller batch")
    return dataclasses.replace(best, mesh_search=tried)


def workers(options: PlanOptions, candidates: int) -> int:
    """Processes the search plans `candidates` meshes in (`PlanOptions.search_workers`): one
    where processes cannot be forked."""
    if candidates < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return max(1, min(options.search_workers or cores, candidates))


# The search's planning function and candidates, for the forked workers (set before forking:
# a worker inherits them, nothing is pickled on the way in).
_FORKED: dict = {}


def _plan_one(i: int, state=None, progress=None, beat: float | None = None
              ) -> tuple[Plan | None, str, float, object]:
    """One step of candidate `i` (see `search_mesh`): (plan, "", seconds, None) when it is
    planned, (None, why none fits or why it cannot be fastest, seconds, None) when not,
    (None, "", seconds, state) when there is more to plan."""
    plan_for, meshes = _FORKED["plan_for"], _FORKED["meshes"]
    mesh = meshes[i]
    if state is None:
        Progress(progress)(f"mesh {i + 1} of {len(meshes)}: "
                           + " x ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.shape)))
    start = time.perf_counter()
    try:
        plan, state = plan_for(mesh, state, beat)
    except (NoFeasiblePlan, StageError) as e:
        return None, str(e).splitlines()[0][:200], time.perf_counter() - start, None
    except Outpaced as e:
        return None, f"bounded: {e}"[:200], time.perf_counter() - start, None
    except Exception as e:  # noqa: BLE001 - see _cannot_pipeline
        return None, _cannot_pipeline(mesh, e), time.perf_counter() - start, None
    return plan, "", time.perf_counter() - start, state


def _cannot_pipeline(mesh: MeshSpec, e: Exception) -> str:
    """Why a pipelined candidate has no plan, where planning it raised `e` (re-raised for a
    candidate without stages): a pipeline the model or the options cannot have (what
    pipelines do not support yet) is one candidate the search passes over, saying why on
    its row, as it does one that does not fit."""
    if mesh.pipeline_dim is None:
        raise e
    return f"{type(e).__name__}: {str(e).splitlines()[0]}"[:200]


def _floor_one(i: int, progress=None) -> tuple[float | None, str, float]:
    """The relaxed step of pipelined candidate `i` (`search_mesh`'s `floor_for`): (seconds,
    "", seconds taken), or (None, why it has no plan, seconds taken)."""
    mesh = _FORKED["meshes"][i]
    Progress(progress)("bounding mesh " + " x ".join(f"{n}={s}" for n, s in
                                                     zip(mesh.names, mesh.shape)))
    start = time.perf_counter()
    try:
        return _FORKED["floor_for"](mesh), "", time.perf_counter() - start
    except (NoFeasiblePlan, StageError) as e:
        return None, str(e).splitlines()[0][:200], time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - see _cannot_pipeline
        return None, _cannot_pipeline(mesh, e), time.perf_counter() - start


def _plan_all(meshes: list[MeshSpec], plan_for, options: PlanOptions,
              floor_for=None) -> list[tuple]:
    """Every candidate planned to the end (`_plan_one` until it returns no state): (plan,
    why, seconds), in candidate order; in this process, or in forked workers (`workers`).
    The candidates without pipeline stages first, the pipelined ones' relaxed steps
    (`floor_for`) beside them; then the pipelined ones that the fastest of those does not
    bound (see the module docstring)."""
    _FORKED.update(plan_for=plan_for, floor_for=floor_for, meshes=meshes)
    flat = [i for i, m in enumerate(meshes) if m.pipeline_dim is None]
    piped = [i for i, m in enumerate(meshes) if m.pipeline_dim is not None]
    try:
        n = workers(options, len(meshes))
        if n == 1:
            return _in_order(_both(flat, piped, options, None, 1), meshes)
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            return _in_order(_both(flat, piped, options, pool, n), meshes)
    finally:
        _FORKED.clear()


def _both(flat: list[int], piped: list[int], options: PlanOptions, pool, n: int) -> dict:
    """`_plan_all`'s two rounds: the candidates without stages (and the pipelined ones'
    relaxed steps, where `floor_for` is given), then the pipelined ones."""
    floors = piped if _FORKED["floor_for"] is not None else []
    done, bounds = _steps(flat, None, options, pool, n, floors)
    beat = _fastest(done)
    if not floors:
        return done | _steps(piped, beat, options, pool, n)[0]
    rest = []
    for i in piped:
        floor, why, took = bounds[i]
        if why:
            done[i] = (None, why, took)
        elif beat is not None and floor >= beat:
            done[i] = (None, f"bounded: {Outpaced.by_relaxed_pipeline(floor, beat)}"[:200], took)
        else:
            rest.append(i)
    planned = _steps(rest, None, options, pool, n)[0]  # (bounded already: no beat)
    return done | {i: (plan, why, took + bounds[i][2]) for i, (plan, why, took)
                   in planned.items()}


def _fastest(done: dict[int, tuple]) -> float | None:
    """The fastest step of the plans in `done` (None when none fits)."""
    steps = [plan.cost.step_time for plan, _, _ in done.values() if plan is not None]
    return min(steps) if steps else None


def _in_order(done: dict[int, tuple], meshes: list[MeshSpec]) -> list[tuple]:
    return [done[i] for i in range(len(meshes))]


def _steps(indices: list[int], beat: float | None, options: PlanOptions, pool=None,
           n: int = 1, floors: list[int] = ()) -> tuple[dict[int, tuple], dict[int, tuple]]:
    """Candidates `indices` planned to the end, each bounded by `beat`, and the relaxed
    steps of the pipelined candidates `floors` (`_floor_one`): ({index: (plan, why,
    seconds)}, {index: (floor, why, seconds)}); in this process (`pool` None) or in the
    pool's `n` workers, which take the steps as they come free, those of meshes of more
    dimensions first, the relaxed steps last."""
    meshes = _FORKED["meshes"]
    done: dict[int, tuple] = {}
    if pool is None:
        for i in indices:
            state, seconds = None, 0.0
            while True:
                plan, why, took, state = _plan_one(i, state, options.progress, beat)
                seconds += took
                if state is None:
                    done[i] = (plan, why, seconds)
                    break
        return done, {i: _floor_one(i, options.progress) for i in floors}
    # The workers take the steps of meshes of more dimensions first: they have more
    # strategies to price and solve (Llama-3 70B over 1,024 H100s: 16-21 s each for
    # 512 x 2, 256 x 4 and 128 x 8, 4.5 s for 1,024), so the short ones fill in at the end
    # instead of leaving one worker alone with a long one (longest first); of those, first
    # steps first: each may bring another. The relaxed steps (1-6 s each) fill in after
    # them, while a worker would otherwise wait for the other's last candidate.
    queue = [(i, None, False) for i in indices] + [(i, None, True) for i in floors]
    seconds = dict.fromkeys(indices, 0.0)
    bounds: dict[int, tuple] = {}
    running: dict = {}
    while queue or running:
        while queue and len(running) < n:
            queue.sort(key=lambda t: (t[2], -len(meshes[t[0]].shape), t[1] is not None, t[0]))
            i, state, floor = queue.pop(0)
            future = pool.submit(_floor_one, i, options.progress) if floor else \
                pool.submit(_plan_one, i, state, options.progress, beat)
            running[future] = (i, floor)
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in finished:
            i, floor = running.pop(future)
            if floor:
                bounds[i] = future.result()
                continue
            plan, why, took, state = future.result()
            seconds[i] += took
            if state is None:
                done[i] = (plan, why, seconds[i])
            else:
                queue.append((i, state, False))
    return done, bounds


def _better(plan: Plan, best: Plan) -> bool:
    a, b = plan.cost.step_time, best.cost.step_time
    if abs(a - b) > 1e-9 * max(a, b):
        return a < b
    return sum(plan.mesh.shape) < sum(best.mesh.shape)
