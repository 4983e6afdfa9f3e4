"""Bus bandwidth of single collectives against message size on a local gloo world.

    python -m benchmarks.collective_bandwidth [--world 4] [--sizes 1,4,16,32,64,128]

Each collective runs alone after a barrier (as in a training step, not back to back), on
buffers allocated once; the time is the median of 3 calls after one warm-up. Bus bandwidth
uses the cost model's algorithm factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter
(n-1)/n of the gathered size. Prints a markdown table. It shows why autopar buckets FSDP
gathers and why calibration measures sizes up to 16 MiB on CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.passes import torch_compat
from autopar.solver.cost import ALGO_FACTOR
from benchmarks.common import init_gloo
from tests.world import free_port


def worker(rank: int, world: int, port: int, sizes: list[int], out: dict) -> None:
    init_gloo(rank, world, port)
    rows = []
    for mib in sizes:
        numel = mib * 2**20 // 4 // world * world
        full, part = torch.ones(numel), torch.ones(numel // world)
        calls = {"all_reduce": lambda f=full: torch_compat.all_reduce(f),
                 "all_gather": lambda f=full, p=part: torch_compat.all_gather_single(f, p),
                 "reduce_scatter":
                     lambda f=full, p=part: torch_compat.reduce_scatter_single(p, f)}
        for kind, fn in calls.items():
            times = []
            for _ in range(4):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            t = statistics.median(times[1:])
            rows.append((mib, kind, t, ALGO_FACTOR[kind](world) * numel * 4 / t))
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="1,4,16,32,64,128", help="MiB, comma separated")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(worker, args=(a.world, port, sizes, out), nprocs=a.world)
    print(f"\n{a.world} gloo ranks on {os.cpu_count()} CPU cores, one collective at a time\n")
    print("| MiB | collective | ms | bus GB/s |")
    print("|---|---|---|---|")
    for mib, kind, t, bw in out["rows"]:
        print(f"| {mib} | {kind} | {t * 1e3:.1f} | {bw / 1e9:.2f} |")


if __name__ == "__main__":
    main()
