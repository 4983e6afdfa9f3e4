"""Overhead of autopar's rewritten program on a mesh of one device, against the plain model.

    python benchmarks/single_device_overhead.py [--layers 6 --hidden 512 --steps 10]

One process, a gloo group of one rank, the benchmark GPT (benchmarks/bench_model.py). A step is
forward + backward + AdamW; the two setups alternate step by step so drift hits both alike.
Prints a markdown table with the median step times and their ratio (target <= 1.02).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_model import BenchConfig, BenchGPT, loss_fn  # noqa: E402

import autopar  # noqa: E402
from tests.world import free_port  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    cfg = BenchConfig(layers=a.layers, hidden=a.hidden)
    torch.manual_seed(0)
    plain = BenchGPT(cfg)
    x = torch.randint(0, cfg.vocab, (a.batch, cfg.seq))
    y = torch.randint(0, cfg.vocab, (a.batch, cfg.seq))
    pm = autopar.parallelize(copy.deepcopy(plain), mesh, loss_fn=loss_fn, example_inputs=(x, y))
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_ours = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def plain_step():
        opt_plain.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        opt_plain.step()

    def our_step():
        opt_ours.zero_grad(set_to_none=True)
        pm.step(x, y)
        opt_ours.step()

    times = {"plain": [], "autopar": []}
    for i in range(a.steps + 2):
        for name, fn in (("plain", plain_step), ("autopar", our_step)):
            t = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t)
    p, o = statistics.median(times["plain"]), statistics.median(times["autopar"])
    n = sum(q.numel() for q in plain.parameters())
    print(f"\nGPT {n / 1e6:.1f}M parameters, batch {a.batch}x{cfg.seq}, 1 rank, {a.threads} "
          f"threads, fp32, median of {a.steps} steps\n")
    print("| plain model ms | autopar (mesh of 1) ms | ratio |")
    print("|---|---|---|")
    print(f"| {p * 1e3:.1f} | {o * 1e3:.1f} | {o / p:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
