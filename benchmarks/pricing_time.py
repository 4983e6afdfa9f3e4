"""Seconds to price each level of the planner's memory search on one mesh (solver/ilp.py
`priced_problem`: the prices of every strategy and placement pair, built once per level and
most of a mesh search's time besides HiGHS), for Llama-3 70B's 80 layers at one microbatch of
1,024 4096-token sequences, bf16-mixed, on the H100 profile:

    python -m benchmarks.pricing_time 256x4
    python benchmarks/at_checkout.py /tmp/old benchmarks/pricing_time.py 256x4   # another commit

Each round prices the four levels of one microbatch count in a search's order (parameters kept
gathered, then freed after forward, then selective and full recomputation) from a new strategy
graph, so each level's cost model starts as a search's does; the graph's building is not
timed. Prints each level's seconds, the minimum over ROUNDS rounds, and their sum.
"""

from __future__ import annotations

import sys
import time

import torch

from autopar import MeshSpec, PlanOptions, planner
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import trace
from autopar.solver.ilp import priced_problem
from autopar.solver.specs import compute_dtype
from benchmarks.planning_time import llama, lm_loss

ROUNDS = 3
LEVELS = (("none", False), ("none", True), ("selective", True), ("full", True))


def main() -> None:
    shape = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "256x4").split("x"))
    options = PlanOptions(precision="bf16-mixed")
    ids = torch.randint(0, 128256, (1024, 4096), device="meta")
    program = trace(llama("70b", 80), (ids,), lm_loss, ids,
                    compute_dtype=compute_dtype(options.precision))
    mesh = MeshSpec(shape, hardware="h100")
    best: dict = {}
    for _ in range(ROUNDS):
        program.strategy_graphs.clear()  # a new graph: every cost model starts afresh
        for recompute, reshard in LEVELS:
            graph, cost = planner.priced_level(program, mesh, options, recompute, reshard)
            clusters = planner.clustered(program, graph)
            forced, discouraged = allowed_strategies(
                graph, planner.styles_by_dim(mesh, options.force))
            start = time.perf_counter()
            priced_problem(graph, cost, clusters, forced, discouraged, relaxation=reshard)
            took = time.perf_counter() - start
            key = f"{recompute}{', freed' if reshard else ''}"
            best[key] = min(best.get(key, took), took)
    print(f"70b (80 layers) on {'x'.join(map(str, shape))}: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in best.items())
          + f"; sum {sum(best.values()):.2f} s")


if __name__ == "__main__":
    sys.exit(main())
