"""The cost model a plan's options ask for: the optimizer, gradient buckets and precision they
price (`cost_model`), and op times measured on this machine when `options.profile` says so
(`profiler`, autopar/profile.py). The planner's levels and a pipeline's stages price alike."""

from __future__ import annotations

from autopar.passes.strategies import StrategyGraph
from autopar.solver.cost import CostModel
from autopar.solver.flops import drawn_elements

from .mesh import MeshSpec
from .options import PlanOptions
from .plan import Plan

# randomness="auto" draws eagerly (bit for bit eager PyTorch) while the largest random op's
# whole tensor, at the global batch, has at most this many elements (64 MiB of float32)
EAGER_DRAW_LIMIT = 2**24


def cost_model(mesh: MeshSpec, graph: StrategyGraph, options: PlanOptions,
               info=None, microbatches: int = 1) -> CostModel:
    """The cost model of `graph` on `mesh` for the optimizer, bucket size, precision and
    randomness `options` price (`info`: the graph's solver/memory.py `node_infos`, when
    known; `microbatches`: the global batch is that many times the traced one)."""
    return CostModel(mesh, options.optimizer, options.bucket_bytes, graph=graph, info=info,
                     precision=options.precision,
                     randomness=randomness(graph, options, microbatches))


def randomness(graph: StrategyGraph, options: PlanOptions, microbatches: int = 1) -> str:
    """How the random ops of `graph` draw (passes/rules/random.py): "" when it has none, else
    `options.randomness`, where "auto" is "eager" while the largest whole tensor a random op
    draws at the global batch (`microbatches` times the traced one) has at most
    EAGER_DRAW_LIMIT elements, and "counter" beyond (the global batch decides, not the mesh;
    beyond the limit the planner also prices eager draws where they fit and keeps the faster
    plan: `eager_could_fit`)."""
    largest = max((drawn_elements(v) for v in graph.nodes.values()), default=0)
    if not largest:
        return ""
    if options.randomness != "auto":
        return options.randomness
    return "eager" if largest * microbatches <= EAGER_DRAW_LIMIT else "counter"


def eager_could_fit(plan: Plan, graph: StrategyGraph, mesh: MeshSpec,
                    options: PlanOptions) -> bool:
    """Whether `plan`, drawing in counter mode, is worth planning again with eager draws: the
    whole tensor of its largest random op at the global batch (times what the eager lowering
    holds per element, solver/memory.py `draw_bytes`) takes at most half the memory budget
    (`mesh`'s, or the options')."""
    if plan.randomness != "counter":
        return False
    budget = options.memory_budget if options.memory_budget is not None else \
        mesh.profile.memory_budget
    largest = max((drawn_elements(v) * (2 * v.out_dtypes[0].itemsize + 1)
                   for v in graph.nodes.values() if v.out_dtypes), default=0)
    m = plan.pipeline.microbatches if plan.pipeline is not None else plan.accumulation
    return largest * m <= budget / 2


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
