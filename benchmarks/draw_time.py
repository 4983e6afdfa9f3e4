"""What a rank pays to draw dropout's mask of its block, in the two modes of randomness.

    python -m benchmarks.draw_time [--elements 26] [--repeats 3]

A dropout of a float32 tensor of 2**elements elements (the whole, global tensor), sharded over
n ranks along its first dimension: each rank's lowered op (passes/rules/random.py) runs on its
block of 1/n of the rows, for n = 1 to 32. Eager randomness draws the whole tensor on every
rank and keeps the block; counter randomness computes the block from the step's key. The
figures are one rank's op's seconds (the median of `repeats` after a warm-up) and extra bytes
(the growth of a fresh process's peak RSS over the op, less its result), with the ratio to the
same mode at n = 1 measured in the same run. One thread: nothing else may run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from autopar.passes.rules.random import counter_dropout_block, dropout_block
from autopar.passes.rules.random_stream import STREAM


def one_rank(mode: str, shape: tuple[int, int], n: int, repeats: int) -> tuple[float, int]:
    """(median seconds after a warm-up, peak bytes beyond its input and result) of rank 0's
    dropout of its block of `shape` sharded n ways on dimension 0."""
    times = []
    for _ in range(repeats + 1):
        x, block, layout = _inputs(shape, n)
        with STREAM.step(torch.device("cpu"), counter=mode == "counter"):
            start = time.perf_counter()
            _op(mode, x, shape, block, layout)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), _extra_bytes(mode, shape, n)


def _inputs(shape: tuple[int, int], n: int):
    rows = shape[0] // n
    return torch.ones(rows, shape[1]), ((0, rows), (0, shape[1])), (shape[1], 1)


def _op(mode: str, x, shape, block, layout) -> torch.Tensor:
    if mode == "counter":
        return counter_dropout_block(x, 0.1, "dropout", shape, block)
    return dropout_block(x, 0.1, shape, layout, block)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        line = next(row for row in f if row.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _extra_bytes(mode: str, shape: tuple[int, int], n: int) -> int:
    """The op's growth of a fresh process's peak RSS (Linux: reset through clear_refs
    before the op), less its result's bytes."""
    code = (
        "import torch\n"
        "from benchmarks.draw_time import _inputs, _op, _status\n"
        "from autopar.passes.rules.random_stream import STREAM\n"
        f"x, block, layout = _inputs({shape}, {n})\n"
        "before = _status('VmRSS')\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # the peak RSS starts again here\n"
        f"with STREAM.step(torch.device('cpu'), counter={mode == 'counter'}):\n"
        f"    out = _op({mode!r}, x, {shape}, block, layout)\n"
        "print(_status('VmHWM') - before - out.numel() * out.element_size())\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return max(0, int(got.stdout.split()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=26, help="log2 of the whole tensor's size")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cols = 1024
    shape = (2**args.elements // cols, cols)
    print(f"dropout(p=0.1) of a float32 tensor of {shape[0]} x {shape[1]} "
          f"({shape[0] * cols * 4 / 2**20:.0f} MiB), sharded on dimension 0; one rank's op\n")
    print("| ranks | block MiB | eager s | eager / 1 rank | eager extra MiB | counter s | "
          "counter / 1 rank | counter extra MiB | counter / eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {}
    for n in (1, 2, 4, 8, 16, 32):
        got = {mode: one_rank(mode, shape, n, args.repeats) for mode in ("eager", "counter")}
        base = base or got
        e, c = got["eager"], got["counter"]
        print(f"| {n} | {shape[0] // n * cols * 4 / 2**20:.0f} | {e[0]:.3f} | "
              f"{e[0] / base['eager'][0]:.2f} | {e[1] / 2**20:.0f} | {c[0]:.3f} | "
              f"{c[0] / base['counter'][0]:.3f} | {c[1] / 2**20:.0f} | {c[0] / e[0]:.3f} |")


if __name__ == "__main__":
    main()
