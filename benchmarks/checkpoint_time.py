"""Distributed checkpoints: autopar's sharded state against FSDP2's, saved and loaded with DCP.

    python -m benchmarks.checkpoint_time [--layers 6 --hidden 512 --rounds 3]

On 4 local gloo ranks, the benchmark GPT (benchmarks/common.py) trained one AdamW step under
FSDP2 (`fully_shard` per block and root) and under autopar forced "fsdp": the seconds
`torch.distributed.checkpoint` takes to save the model and optimizer state (each rank its
shards, `get_state_dict` for FSDP2, `autopar.checkpoint.save` for autopar, which also checks
and moves the folder into place) and to load it back (`set_state_dict` / `autopar.checkpoint.
load`, which checks names, shapes and dtypes first), median of the rounds, each on rank 0
between barriers, with the ratio autopar / FSDP2 and the bytes written. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import autopar
import autopar.checkpoint
from autopar.zoo import lm_loss as loss_fn
from benchmarks.common import bench_gpt, init_gloo
from tests.world import free_port

WORLD = 4


def _timed(fn, path: str) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn(path)
    dist.barrier()
    return time.perf_counter() - t


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(rank: int, port: int, sizes: dict, rounds: int, root: str, out: dict) -> None:
    init_gloo(rank, WORLD, port)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = bench_gpt(**sizes)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, sizes["vocab"], (WORLD * 2, sizes["seq"]), generator=g)
    y = torch.randint(0, sizes["vocab"], (WORLD * 2, sizes["seq"]), generator=g)
    rows = x.shape[0] // WORLD
    xl, yl = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]

    from torch.distributed.fsdp import fully_shard
    fsdp = copy.deepcopy(model)
    for b in fsdp.h:
        fully_shard(b, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    loss_fn(fsdp(xl), yl).backward()
    fsdp_opt.step()

    pm = autopar.parallelize(copy.deepcopy(model), mesh, loss_fn=loss_fn, example_inputs=(x, y),
                             force="fsdp")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    pm.step(x, y)
    opt.step()

    def fsdp_save(path):
        msd, osd = get_state_dict(fsdp, fsdp_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def fsdp_load(path):
        msd, osd = get_state_dict(fsdp, fsdp_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fsdp, fsdp_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    cases = {"FSDP2": (fsdp_save, fsdp_load),
             "autopar fsdp": (lambda path: autopar.checkpoint.save(path, pm, opt),
                              lambda path: autopar.checkpoint.load(path, pm, opt))}
    times = {name: {"save": [], "load": []} for name in cases}
    written = {}
    for i in range(rounds):
        for name, (save, load) in cases.items():
            path = os.path.join(root, f"{name.replace(' ', '_')}-{i}")
            times[name]["save"].append(_timed(save, path))
            times[name]["load"].append(_timed(load, path))
            written[name] = _folder_bytes(path)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        out.update({name: (statistics.median(t["save"]), statistics.median(t["load"]),
                           written[name]) for name, t in times.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    sizes = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab,
             "seq": a.seq}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in bench_gpt(**sizes).parameters())
    out = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(worker, args=(free_port(), sizes, a.rounds, root, out), nprocs=WORLD)
    res = dict(out)
    print(f"\nGPT {n_params / 1e6:.1f}M parameters with AdamW state, {WORLD} gloo ranks on "
          f"{os.cpu_count()} CPU cores, median of {a.rounds} rounds\n")
    print("| setup | save s | load s | written MiB | save vs FSDP2 | load vs FSDP2 |")
    print("|---|---:|---:|---:|---:|---:|")
    base = res["FSDP2"]
    for name, (s, ld, nbytes) in res.items():
        print(f"| {name} | {s:.3f} | {ld:.3f} | {nbytes / 2**20:.1f} | {s / base[0]:.2f} | "
              f"{ld / base[1]:.2f} |")


if __name__ == "__main__":
    main()
