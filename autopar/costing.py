"""The cost model a plan's options ask for: the optimizer, gradient buckets and precision they
price (`cost_model`), and op times measured on this machine when `options.profile` says so
(`profiler`, autopar/profile.py). The planner's levels and a pipeline's stages price alike."""

from __future__ import annotations

from autopar.passes.strategies import StrategyGraph
from autopar.solver.cost import CostModel

from .mesh import MeshSpec
from .options import PlanOptions


def cost_model(mesh: MeshSpec, graph: StrategyGraph, options: PlanOptions,
               info=None) -> CostModel:
    """The cost model of `graph` on `mesh` for the optimizer, bucket size and precision
    `options` price (`info`: the graph's solver/memory.py `node_infos`, when known)."""
    return CostModel(mesh, options.optimizer, options.bucket_bytes, graph=graph, info=info,
                     precision=options.precision)


def profiler(profile):
    """The op profiler `profile` (options.profile) asks for (True: time ops on this machine;
    None or False: none)."""
    if profile in (None, False):
        return None
    if profile is True:
        from .profile import OpProfiler  # (imports the rewrite: only when measuring)
        return OpProfiler()
    return profile


def measured(cost: CostModel, graph: StrategyGraph, profile) -> CostModel:
    """`cost` with the op times of `graph` measured by `profile` (a `profiler`), or `cost`
    itself when there is none."""
    if profile is None:
        return cost
    return cost.copy(measured=profile.measure(graph, cost))
