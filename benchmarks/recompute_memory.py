"""What recomputation saves and costs, measured on gloo ranks against the plan's prediction.

    python -m benchmarks.recompute_memory            # GPT, 4 layers, 2 ranks, data / tensor

For no, selective and full recomputation: the bytes a step holds from the start of forward to
the start of backward on rank 0, measured twice (tests/cost_tasks.py `measured_activations`):
the profiler's tensor allocations less frees, which misses the frees gloo's threads do of
collective buffers, and the growth of the process's malloc heap, which sees them; against the
plan's predicted activations, the
plan's "recomputed" bytes (one block's activations live again while backward recomputes it),
and the predicted step time, each as a ratio to no recomputation in the same run.
"""

from __future__ import annotations

import argparse

from tests import cost_tasks
from tests.world import World

MODEL = ("gpt", {"vocab_size": 128, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 64,
                 "batch": 8})


def table(forces=("data", "tensor"), out=print) -> None:
    """Run every case on a world of 2 and print the markdown table."""
    world = World(2)
    rows = []
    try:
        world.start()
        for force in forces:
            base = None
            for mode in ("none", "selective", "full"):
                r = world.run(cost_tasks.measured_activations, MODEL, (2,), force, mode)[0]
                p = r["predicted"]
                base = base or r
                rows.append((force, mode, r["measured"], r["heap"], p["activations"],
                             p.get("recomputed", 0.0), r["heap"] / base["heap"],
                             r["step_time"] / base["step_time"]))
    finally:
        world.close()
    out("| plan | recompute | held, profiler | held, heap | predicted activations | "
        "error vs heap | predicted recomputed | held vs none | predicted step vs none |")
    out("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for force, mode, m, h, p, again, held, step in rows:
        out(f"| {force} | {mode} | {m / 2**20:.3f} MiB | {h / 2**20:.3f} MiB | "
            f"{p / 2**20:.3f} MiB | {p / h - 1:+.1%} | {again / 2**20:.3f} MiB | {held:.2f} | "
            f"{step:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forces", default="data,tensor")
    args = parser.parse_args()
    table(tuple(args.forces.split(",")))


if __name__ == "__main__":
    main()
