"""The Plan: autopar's decision as plain data, printable, serializable and hashable."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from autopar.passes.placement import Placements, fmt, parse
from autopar.passes.recompute import NONE as NO_RECOMPUTE
from autopar.passes.recompute import Recompute

from .explain import Explanation, explain
from .mesh import MeshSpec
from .options import PlanOptions
from .report import write as write_report
from .table import mib, ms
from .table import modules as module_table
from .table import ops as op_table

FORMAT_VERSION = 3  # 3: each node's strategy by its id (`Plan.choice`)


@dataclass
class OpEntry:
    """One op group: its ATen op, the placements of its inputs and output, stage, time (s).

    `module` is the model's module that runs it ("layers.3.mlp.up_proj"; "" for the model
    itself); `replicated` says why an op that every rank computes whole runs so (no sharding
    rule, no shard divides its shapes, or replicating is simply cheaper), "" when it shards."""

    name: str
    op: str
    inputs: list[str]
    output: str | list[str]
    stage: int
    time: float
    source: str = ""
    module: str = ""
    replicated: str = ""


@dataclass
class Collective:
    """One collective the program issues per step."""

    kind: str           # all_gather | reduce_scatter | all_reduce | all_to_all
    mesh_dim: int
    bytes: int
    time: float
    phase: str          # forward | backward | gradient sync
    at: str             # the node (or parameter) it serves


@dataclass
class PlanCost:
    """Predicted seconds per step and bytes per device.

    `step_time` = `compute` (forward + backward of every op on one device; `compute_forward` of
    it in the forward pass) + the sum of `communication` (seconds by collective kind, and
    gradient synchronization) - the sum of `hidden` (seconds of each kind that run beside
    compute and hide under it: on hardware whose collectives overlap compute, FSDP gathers,
    their gradients' reduce-scatters and gradient synchronization; each pass takes the longer of
    its compute and tensor-parallel collectives and its overlapped ones). `memory` is bytes per
    device by kind: parameters, gradients, optimizer (state, master weights) and activations
    (kept for backward); their sum is the predicted peak, within `memory_budget`. `precision`,
    `optimizer` and `compute_source` ("roofline" or "measured") say what the model priced.
    """

    step_time: float
    compute: float
    communication: dict[str, float]
    memory: dict[str, float]
    solver_objective: float = 0.0
    memory_budget: float = 0.0
    compute_forward: float = 0.0
    precision: str = "fp32"
    optimizer: str = "adamw"
    compute_source: str = "roofline"
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def communication_total(self) -> float:
        """Seconds of every collective, hidden or not."""
        return sum(self.communication.values())

    @property
    def exposed_communication(self) -> float:
        """Seconds of communication the step waits for (what `hidden` leaves)."""
        return self.communication_total - sum(self.hidden.values())

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())


def stage_dims(ndim: int, pp: int) -> list[int]:
    """The dimensions of a mesh of `ndim` dimensions that a pipeline stage's placements are
    over: every one but `pp`, in order (stage mesh dimension i is mesh dimension
    `stage_dims(ndim, pp)[i]`; none when pp is the only one)."""
    return [k for k in range(ndim) if k != pp]


@dataclass
class PipelinePlan:
    """How a pipelined plan cuts the model into stages (mesh dimension "pp").

    The model's graph is coarsened into a chain of layer blocks (`blocks`, module paths); stage
    k runs blocks `cuts[k-1]` (0 for k = 0) up to `cuts[k]` (the number of blocks for the last
    stage), on pp rank k mod (pp size): interleaved schedules place `virtual_stages` stages on
    each pp rank. Every other placement in the Plan (inputs, parameters, strategies, ops) is
    over the remaining mesh dimensions, the submesh each stage runs on; the Plan's graph is the
    model traced at the microbatch size (`batch_size // microbatches`).

    Times are seconds per microbatch (forward + backward) per stage; memory is bytes per device
    of each pp rank: parameters, gradients, optimizer state, and the activations of the
    microbatches the schedule keeps in flight (`in_flight`, per stage).
    """

    mesh_dim: int
    schedule: str                     # gpipe | 1f1b | interleaved
    microbatches: int
    virtual_stages: int               # stages per pp rank (1 unless interleaved)
    batch_size: int                   # the global batch the plan was made for
    blocks: list[str]
    cuts: list[int]                   # first block of stages 1..S-1
    bubble: float                     # (p - 1) / (virtual_stages * microbatches)
    stage_time: list[float] = field(default_factory=list)
    in_flight: list[float] = field(default_factory=list)
    rank_memory: list[dict[str, float]] = field(default_factory=list)
    loss_reduction: str | None = "mean"

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1

    def stage_dims(self, ndim: int) -> list[int]:
        """The mesh dimensions (of `ndim`) a stage's placements are over (`stage_dims`)."""
        return stage_dims(ndim, self.mesh_dim)

    def stage_coords(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        """A rank's coordinates (`coords`, on the whole mesh) on the stage mesh: on the
        dimensions but pp, (0,) on a mesh that is pp alone (its size-1 stand-in)."""
        return tuple(coords[k] for k in self.stage_dims(len(coords))) or (0,)

    def stage_blocks(self, stage: int) -> list[str]:
        """The blocks stage `stage` runs."""
        bounds = [0, *self.cuts, len(self.blocks)]
        return self.blocks[bounds[stage]:bounds[stage + 1]]

    def decision(self) -> dict:
        """What identifies the pipeline decision (for the plan's hash)."""
        return {"mesh_dim": self.mesh_dim, "schedule": self.schedule,
                "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
                "cuts": list(self.cuts), "loss_reduction": self.loss_reduction}

    def lines(self) -> list[str]:
        """The pipeline section of the printed plan."""
        out = [f"pipeline: {self.num_stages} stages ({self.virtual_stages} per pp rank), "
               f"schedule {self.schedule}, {self.microbatches} microbatches of "
               f"{self.batch_size // self.microbatches}, bubble {self.bubble:.3f}"]
        for k in range(self.num_stages):
            names = self.stage_blocks(k)
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            t = f"  {ms(self.stage_time[k])} ms/microbatch" if self.stage_time else ""
            held = f", {self.in_flight[k]:g} in flight" if self.in_flight else ""
            out.append(f"  stage {k}: {len(names)} blocks ({shown}){t}{held}")
        for r, mem in enumerate(self.rank_memory):
            out.append(f"  pp rank {r}: {mib(sum(mem.values()))} MiB per device (" +
                       ", ".join(f"{k} {mib(v)}" for k, v in mem.items()) + ")")
        return out


@dataclass
class Plan:
    """What autopar decided for one model on one mesh.

    `strategies` holds the exact placement of every graph node (input placements, output
    placements), which the rewrite pass executes; `ops`, `collectives` and `cost` describe it
    for people and programs. `graph_fingerprint` ties the plan to the traced graph it was made
    for, so a plan cannot silently be applied to another model.
    """

    mesh: MeshSpec
    inputs: list[Placements]
    parameters: dict[str, Placements]
    ops: list[OpEntry]
    collectives: list[Collective]
    cost: PlanCost
    strategies: dict[str, tuple[list[str], str | list[str]]]
    graph_fingerprint: str
    solve_time: float = 0.0
    solver: str = ""
    unsupported_ops: list[str] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    options: PlanOptions = field(default_factory=PlanOptions)
    accumulation: int = 1     # microbatches a step accumulates (gradient accumulation, no pp)
    mesh_search: list[dict] = field(default_factory=list)  # the meshes tried (autopar.search)
    # each op's and parameter's chosen strategy and next best candidates, priced with the
    # rest of the plan fixed (solver/alternatives.py; what `explain` shows)
    alternatives: dict = field(default_factory=dict)
    recompute: Recompute = NO_RECOMPUTE  # ops recomputed in backward (passes/recompute.py)
    # parameters (model names) gathered whole for their use (FSDP) whose gathered copies are
    # freed after forward and gathered again for backward (reshard after forward)
    resharded: list[str] = field(default_factory=list)
    # parameters (model names) stored replicated whose optimizer state (stage 1), and gradient
    # (stage 2), are sharded over their data-parallel ranks: ZeRO (passes/zero.py)
    zero: dict[str, int] = field(default_factory=dict)
    # each graph node's strategy by its id (its index among the node's candidates) and the
    # fingerprint of those candidate lists: what the build looks up (autopar/choice.py);
    # `strategies` says the same in placements, for people and for the hash
    choice: dict[str, int] = field(default_factory=dict)
    candidates: str = ""
    # how the model's random ops draw: "" (it draws none), "eager" (each rank draws the whole
    # tensor, bit for bit eager PyTorch) or "counter" (each rank computes its block from the
    # step's key: passes/rules/random.py)
    randomness: str = ""

    @property
    def submesh_shape(self) -> tuple[int, ...]:
        """The mesh the placements are over: the whole mesh, or without "pp" when pipelined
        (a size-1 stand-in when pp is the only dimension)."""
        return tuple(self.mesh.shape[k] for k in self.placement_dims) or (1,)

    @property
    def placement_dims(self) -> list[int]:
        """The mesh dimensions the placements are over, in order: every one, or all but "pp"
        when pipelined (`stage_dims`)."""
        if self.pipeline is None:
            return list(range(self.mesh.ndim))
        return self.pipeline.stage_dims(self.mesh.ndim)

    # -- identity ------------------------------------------------------------------------------
    def hash(self) -> str:
        """Hash of the decision (mesh, graph, every node's placements, the options that change
        what runs); equal plans, equal hash."""
        decision = {"mesh": list(self.mesh.shape), "graph": self.graph_fingerprint,
                    "strategies": self.strategies, "options": self.options.decision(),
                    "accumulation": self.accumulation,
                    "recompute": sorted(self.recompute.mode_of.items()),
                    "resharded": sorted(self.resharded), "zero": sorted(self.zero.items())}
        if self.randomness == "counter":  # (eager: what plans without the field ran)
            decision["randomness"] = self.randomness
        if self.pipeline is not None:
            decision["pipeline"] = self.pipeline.decision()
        payload = json.dumps(decision, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data for JSON."""
        out = {
            "version": FORMAT_VERSION,
            "mesh": self.mesh.to_dict(),
            "inputs": [fmt(p) for p in self.inputs],
            "parameters": {k: fmt(v) for k, v in self.parameters.items()},
            "ops": [asdict(o) for o in self.ops],
            "collectives": [asdict(c) for c in self.collectives],
            "cost": asdict(self.cost),
            "strategies": self.strategies,
            "graph_fingerprint": self.graph_fingerprint,
            "solve_time": self.solve_time,
            "solver": self.solver,
            "unsupported_ops": self.unsupported_ops,
            "options": self.options.to_dict(),
            "accumulation": self.accumulation,
            "mesh_search": self.mesh_search,
            "alternatives": self.alternatives,
            "recompute": self.recompute.to_dict(),
            "resharded": sorted(self.resharded),
            "zero": dict(sorted(self.zero.items())),
            "choice": self.choice,
            "candidates": self.candidates,
            "randomness": self.randomness,
        }
        if self.pipeline is not None:
            out["pipeline"] = asdict(self.pipeline)
        return out

    @staticmethod
    def from_dict(d: dict) -> Plan:
        """Inverse of to_dict."""
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format version {d.get('version')} is not {FORMAT_VERSION}")
        strategies = {k: (list(v[0]), v[1] if isinstance(v[1], str) else list(v[1]))
                      for k, v in d["strategies"].items()}
        return Plan(
            MeshSpec.from_dict(d["mesh"]), [parse(p) for p in d["inputs"]],
            {k: parse(v) for k, v in d["parameters"].items()},
            [OpEntry(**o) for o in d["ops"]], [Collective(**c) for c in d["collectives"]],
            PlanCost(**d["cost"]), strategies, d["graph_fingerprint"], d.get("solve_time", 0.0),
            d.get("solver", ""), d.get("unsupported_ops", []),
            PipelinePlan(**d["pipeline"]) if d.get("pipeline") else None,
            PlanOptions.from_dict(d.get("options", {})), d.get("accumulation", 1),
            d.get("mesh_search", []), d.get("alternatives", {}),
            Recompute.from_dict(d.get("recompute")), list(d.get("resharded", [])),
            {k: int(v) for k, v in d.get("zero", {}).items()},
            {k: int(v) for k, v in d["choice"].items()}, d["candidates"],
            d.get("randomness", ""))

    def save(self, path: str) -> None:
        """Write the plan as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @staticmethod
    def load(path: str) -> Plan:
        """Read a plan written by `save`."""
        with open(path) as f:
            return Plan.from_dict(json.load(f))

    # -- display -------------------------------------------------------------------------------
    def table(self, detail: str = "modules") -> str:
        """The plan as text: by the model's modules with identical layers folded
        (`detail="modules"`, what print shows) or one row per op (`detail="ops"`)."""
        if detail not in ("modules", "ops"):
            raise ValueError(f'detail must be "modules" or "ops", not {detail!r}')
        return module_table(self) if detail == "modules" else op_table(self)

    def __str__(self) -> str:
        return self.table()

    def to_html(self, path: str) -> None:
        """Write the plan as one self-contained HTML page at `path` (nothing fetched when it
        opens): the module tree with placements per mesh dimension, the predicted step as a
        chart, memory per device against the budget, the collectives ranked by time,
        recomputation and accumulation, and a pipeline's schedule (autopar/report.py)."""
        write_report(self, path)

    def explain(self, name: str) -> Explanation:
        """Why `name` (an op group, a parameter, or a module such as "layers.0.self_attn")
        runs as planned: the chosen strategy and the next best alternatives, each with its
        compute, collectives and memory, and the constraint that ruled it out. Prints as
        text; raises KeyError naming close matches for an unknown name."""
        return explain(self, name)

    def __repr__(self) -> str:
        return (f"Plan(mesh={self.mesh.shape}, step={self.cost.step_time * 1e3:.3f} ms, "
                f"hash={self.hash()})")
