"""Overhead of autopar's rewritten program on a mesh of one device, against the plain model.

    python -m benchmarks.single_device_overhead [--layers 6 --hidden 512 --steps 10]
    python -m benchmarks.single_device_overhead --model resnet [--width 32 --image 32]

One process, a gloo group of one rank, the benchmark GPT (benchmarks/common.py) or the tests'
ResNet (BatchNorm frozen in eval mode). A step is forward + backward + AdamW; the two setups
alternate step by step so drift hits both alike. Prints a markdown table with the median
step times and their ratio (target <= 1.02).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.zoo import lm_loss
from benchmarks.common import bench_gpt, init_gloo
from tests.models import ResNet
from tests.world import free_port


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=("gpt", "resnet"), default="gpt")
    ap.add_argument("--width", type=int, default=32, help="the ResNet's first width")
    ap.add_argument("--image", type=int, default=32, help="the ResNet's image size")
    ap.add_argument("--foreach", action="store_true", help="AdamW with foreach=True (torch's "
                    "default on CPU loops over the parameters, slow over DTensors)")
    a = ap.parse_args()
    init_gloo(0, 1, free_port(), threads=a.threads)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    if a.model == "gpt":
        plain, loss_fn = bench_gpt(layers=a.layers, hidden=a.hidden), lm_loss
        vocab, seq = plain.config.vocab_size, plain.config.block_size
        x = torch.randint(0, vocab, (a.batch, seq))
        y = torch.randint(0, vocab, (a.batch, seq))
        shape = f"{a.batch}x{seq}"
    else:
        plain, loss_fn = ResNet(width=a.width), torch.nn.functional.cross_entropy
        for m in plain.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
        x, y = torch.randn(a.batch, 3, a.image, a.image), torch.randint(0, 10, (a.batch,))
        shape = f"{a.batch}x3x{a.image}x{a.image}"
    pm = autopar.parallelize(copy.deepcopy(plain), mesh, loss_fn=loss_fn, example_inputs=(x, y))
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4, foreach=a.foreach or None)
    opt_ours = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=a.foreach or None)

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
    print(f"\n{a.model} {n / 1e6:.2f}M parameters, batch {shape}, 1 rank, {a.threads} "
          f"threads, fp32, median of {a.steps} steps\n")
    print("| plain model ms | autopar (mesh of 1) ms | ratio |")
    print("|---|---|---|")
    print(f"| {p * 1e3:.1f} | {o * 1e3:.1f} | {o / p:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
