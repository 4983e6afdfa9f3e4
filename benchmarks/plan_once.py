"""One cold `autopar.plan` call of a Llama-3-shaped model on the meta device (this process's
first), for timing planning commit against commit:

    python -m benchmarks.plan_once 70b 80          # Llama-3 70B widths, 80 layers, H100 (8, 8)
    python -m benchmarks.plan_once 8b 32 16x4

Prints the seconds, the plan's step, peak and hash (the same plan from two commits has the
same hash). Run it against another checkout's code with benchmarks/at_checkout.py.
"""

from __future__ import annotations

import sys
import time

import torch

import autopar
from autopar.zoo import lm_loss
from benchmarks.planning_time import llama


def main() -> None:
    size, layers = sys.argv[1], int(sys.argv[2])
    mesh = tuple(int(s) for s in (sys.argv[3] if len(sys.argv) > 3 else "8x8").split("x"))
    model = llama(size, layers)
    ids = torch.randint(0, 128256, (8, 4096), device="meta")
    start = time.perf_counter()
    plan = autopar.plan(model, autopar.MeshSpec(mesh, hardware="h100"), (ids, ids),
                        loss_fn=lm_loss)
    took = time.perf_counter() - start
    print(f"{size} {layers} layers on {'x'.join(map(str, mesh))}: {took:.2f} s, step "
          f"{plan.cost.step_time * 1e3:.1f} ms, peak {plan.cost.peak_memory / 2**30:.2f} GiB, "
          f"hash {plan.hash()}")


if __name__ == "__main__":
    main()
