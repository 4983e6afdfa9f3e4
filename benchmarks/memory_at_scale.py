"""A model no rank can hold, trained on 4 gloo ranks: measured per-rank peak against the plan.

    python -m benchmarks.memory_at_scale                    # MLP 24 x 2048 (101M parameters)
    python -m benchmarks.memory_at_scale --width 1024 --depth 16 --bucket-mib 1

The MLP is built on the meta device; its whole fp32 training state (parameters, gradients,
AdamW's two states: 16 bytes a parameter) is 3x the cap each rank may hold. autopar plans FSDP
within 95% of the cap (the planner frees gathered parameters after forward where the cap needs
it) and trains 3 AdamW steps. For each rank: the cap, the plan's predicted peak (and what
dominates it), and the peak measured over the steps as the bytes the malloc heap holds and as
the resident set, each above its level after the build plus the bytes of the rank's parameter
shards (tests/state_tasks.py `train_beyond_one_rank`), with their ratio to the prediction.
Run it on a quiet machine: it takes minutes.
"""

from __future__ import annotations

import argparse

from tests import state_tasks
from tests.world import World


def table(width: int, depth: int, batch: int, bucket_bytes: int, out=print) -> None:
    """Run the model on a world of 4 and print the markdown table."""
    world = World(4, timeout=1800)
    try:
        world.start()
        rows = world.run(state_tasks.train_beyond_one_rank, width, depth, batch,
                         bucket_bytes=bucket_bytes, margin=0.95)
    finally:
        world.close()
    r0 = rows[0]
    out(f"MLP {depth} x {width}: whole training state {r0['whole_state'] / 2**20:.0f} MiB, cap "
        f"{r0['cap'] / 2**20:.1f} MiB per rank; {r0['freed']} of {r0['parameters']} parameters "
        f"freed after forward; losses {', '.join(f'{v:.3f}' for v in r0['losses'])}")
    out("")
    out("| rank | cap | predicted peak | measured heap peak | heap / predicted | "
        "measured RSS peak | RSS / predicted |")
    out("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rank, r in enumerate(rows):
        out(f"| {rank} | {r['cap'] / 2**20:.1f} MiB | {r['predicted'] / 2**20:.1f} MiB | "
            f"{r['heap'] / 2**20:.1f} MiB | {r['heap'] / r['predicted']:.3f} | "
            f"{r['rss'] / 2**20:.1f} MiB | {r['rss'] / r['predicted']:.3f} |")
    split = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r0["split"].items())
    out("")
    out(f"predicted split (MiB, rank 0): {split}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mib", type=float, default=25)
    args = parser.parse_args()
    table(args.width, args.depth, args.batch, int(args.bucket_mib * 2**20))


if __name__ == "__main__":
    main()
