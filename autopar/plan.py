"""The Plan: autopar's decision as plain data, printable, serializable and hashable."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from autopar.passes.placement import Placements, fmt, parse

from .mesh import MeshSpec

FORMAT_VERSION = 1


@dataclass
class OpEntry:
    """One op group: its ATen op, the placements of its inputs and output, stage, time (s)."""

    name: str
    op: str
    inputs: list[str]
    output: str | list[str]
    stage: int
    time: float
    source: str = ""


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
    """Predicted seconds per step and bytes per device."""

    step_time: float
    compute: float
    communication: dict[str, float]
    memory: dict[str, float]
    solver_objective: float = 0.0

    @property
    def communication_total(self) -> float:
        return sum(self.communication.values())

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())


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

    # -- identity ------------------------------------------------------------------------------
    def hash(self) -> str:
        """Hash of the decision (mesh, graph, every node's placements); equal plans, equal hash."""
        payload = json.dumps({"mesh": list(self.mesh.shape), "graph": self.graph_fingerprint,
                              "strategies": self.strategies}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return {
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
        }

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
            d.get("solver", ""), d.get("unsupported_ops", []))

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
    def __str__(self) -> str:
        return render(self)

    def __repr__(self) -> str:
        return (f"Plan(mesh={self.mesh.shape}, step={self.cost.step_time * 1e3:.3f} ms, "
                f"hash={self.hash()})")


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def render(plan: Plan) -> str:
    """The plan as one readable table, with collectives and the cost summary."""
    names = ",".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))
    lines = [f"autopar plan  mesh ({names}) on {plan.mesh.hardware}  hash {plan.hash()}",
             f"solved by {plan.solver} in {plan.solve_time:.2f} s", ""]
    by_node: dict[str, list[Collective]] = {}
    for c in plan.collectives:
        by_node.setdefault(c.at, []).append(c)
    rows = [("op group", "aten op", "inputs", "output", "ms", "collectives")]
    for o in plan.ops:
        out = o.output if isinstance(o.output, str) else "(" + ",".join(o.output) + ")"
        coll = " ".join(f"{c.kind}[{plan.mesh.names[c.mesh_dim]}]"
                        for c in by_node.get(o.name, []) if c.phase == "forward")
        rows.append((o.name, o.op, " ".join(o.inputs), out, _ms(o.time), coll))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    lines.append("parameters (storage placement):")
    groups: dict[str, list[str]] = {}
    for name, p in plan.parameters.items():
        groups.setdefault(fmt(p), []).append(name)
    for p, ns in groups.items():
        shown = ", ".join(ns[:4]) + (f", ... ({len(ns)} in all)" if len(ns) > 4 else "")
        lines.append(f"  {p}: {shown}")
    lines.append("")
    kinds: dict[tuple[str, str], list[Collective]] = {}
    for c in plan.collectives:
        kinds.setdefault((c.phase, c.kind), []).append(c)
    lines.append("collectives per step:")
    for (phase, kind), cs in sorted(kinds.items()):
        lines.append(f"  {phase:13s} {kind:15s} x{len(cs):<4d} {_mib(sum(c.bytes for c in cs))}"
                     f" MiB  {_ms(sum(c.time for c in cs))} ms")
    cost = plan.cost
    comm = ", ".join(f"{k} {_ms(v)}" for k, v in sorted(cost.communication.items()) if v)
    lines.append("")
    lines.append(f"predicted step {_ms(cost.step_time)} ms = compute {_ms(cost.compute)} ms + "
                 f"communication {_ms(cost.communication_total)} ms ({comm or 'none'})")
    mem = ", ".join(f"{k} {_mib(v)}" for k, v in cost.memory.items())
    lines.append(f"memory per device {_mib(cost.peak_memory)} MiB ({mem})")
    if plan.unsupported_ops:
        lines.append(f"replicated (no sharding rule): {', '.join(plan.unsupported_ops)}")
    return "\n".join(lines)
