"""autopar's runtime against hand-written parallelism, on 4 local gloo ranks (CPU, fp32).

    python -m benchmarks.runtime_vs_baselines [--layers 6 --hidden 512 --steps 6]
    python -m benchmarks.runtime_vs_baselines --model resnet [--width 32 --image 32]

For one GPT (autopar.zoo's with an untied head, benchmarks/common.py: about 27M parameters by
default) it times a training step (forward, backward, AdamW) of
  - torch DistributedDataParallel        vs autopar forced "data"
  - FSDP2 (fully_shard per block + root, reshard_after_forward=True)  vs autopar forced "fsdp"
    with reshard_after_forward=True
  - FSDP2 with reshard_after_forward=False  vs autopar forced "fsdp", reshard_after_forward=False,
    and vs autopar forced "zero2" (ZeRO-2: parameters whole, optimizer state and gradients
    sharded)
  - DTensor tensor parallel (Colwise qkv/fc, Rowwise proj, each rank its heads)  vs autopar
    forced "tensor"
  - autopar's own plan                    vs the best baseline
With `--model resnet` (tests/models.py's ResNet in torchvision's layout, BatchNorm in training
mode, batch of images) the setups are DDP, FSDP2 (fully_shard per residual block) and
autopar's data, FSDP and solver plans. DDP's BatchNorm normalizes each rank's quarter of the
batch by its own statistics (SyncBatchNorm runs on GPUs only), where autopar's sums them over
the ranks, as one device over the whole batch: DDP does less communication and computes
something else; `--frozen-bn` puts every BatchNorm in eval mode, where they compute the same.
Each timing is the median over the measured steps (after 2 warm-up steps), taken on rank 0
between barriers; all setups are built first and then stepped round-robin in one process
group, so ratios compare like with like even while the machine's load drifts. Per-rank memory
is the bytes of parameters, gradients and optimizer state the rank holds, and the peak of
rank 0's malloc heap over one more step (tests/cost_tasks.py `heap_bytes`, sampled every
0.5 ms; not during the timed steps). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.zoo import CausalSelfAttention, lm_loss
from benchmarks.common import bench_gpt, init_gloo
from tests.models import ResNet
from tests.world import free_port

WORLD = 4


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(params, opt) -> int:
    """Bytes of parameters (the storages they live in, once each: a ZeRO shard lives in its
    whole copy), gradients and optimizer state this rank holds."""
    storages = {}
    for p in params:
        s = _local(p.detach()).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    total = sum(storages.values())
    for p in params:
        if p.grad is not None:
            total += _local(p.grad).numel() * p.element_size()
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += _local(v).numel() * v.element_size()
    return total


class _LocalHeads(CausalSelfAttention):
    """Attention over this rank's heads, as Megatron runs it: q, k and v of its heads come out
    of the column-parallel c_attn (see `_heads_by_rank`), the row-parallel c_proj sums."""

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = (t.view(B, T, -1, self.n_embd // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def _heads_by_rank(attn: CausalSelfAttention, ranks: int) -> None:
    """Reorder c_attn's output rows from (q | k | v) to (q, k, v of rank 0's heads | rank 1's
    | ...), so that a column-parallel c_attn gives each rank the q, k and v of its own heads,
    and run the attention on those."""
    with torch.no_grad():
        for p in (attn.c_attn.weight, attn.c_attn.bias):
            p.copy_(p.view(3, ranks, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))
    attn.__class__ = _LocalHeads


def setups(model, mesh, x, y, calibrated=None, loss_fn=lm_loss):
    """name -> (step function, params, optimizer), built lazily; with a `calibrated` profile
    (autopar.calibrate of `mesh`) the solver also plans with it. A ResNet (`model` without
    GPT blocks) gets DDP, FSDP2 and autopar's data, FSDP and solver plans."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cnn = isinstance(model, ResNet)
    rows = x.shape[0] // world
    xl, yl = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]

    def ddp():
        m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        return lambda: loss_fn(m(xl), yl).backward(), list(m.parameters())

    def fsdp2(reshard: bool):
        def build():
            from torch.distributed.fsdp import fully_shard
            m = copy.deepcopy(model)
            for b in ([b for stage in m.layers for b in stage] if cnn else m.h):
                fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
            return lambda: loss_fn(m(xl), yl).backward(), list(m.parameters())
        return build

    def dtensor_tp():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        m = copy.deepcopy(model)
        plan = {}
        for i, block in enumerate(m.h):
            _heads_by_rank(block.attn, world)
            for n in ("attn.c_attn", "mlp.c_fc"):
                plan[f"h.{i}.{n}"] = ColwiseParallel()
            for n in ("attn.c_proj", "mlp.c_proj"):
                plan[f"h.{i}.{n}"] = RowwiseParallel()
        parallelize_module(m, mesh, plan)
        return lambda: loss_fn(m(x), y).backward(), list(m.parameters())

    def autopar_with(force, hardware=None, **options):
        def build():
            pm = autopar.parallelize(copy.deepcopy(model), mesh, loss_fn=loss_fn,
                                     example_inputs=(x, y), force=force, hardware=hardware,
                                     **options)
            return lambda: pm.step(x, y), list(pm.parameters())
        return build

    if cnn:
        return {"DDP": ddp, "autopar data": autopar_with("data"), "FSDP2": fsdp2(True),
                "autopar fsdp": autopar_with("fsdp", reshard_after_forward=True),
                "autopar solver": autopar_with(None)}
    out = {"DDP": ddp, "autopar data": autopar_with("data"), "FSDP2": fsdp2(True),
           "autopar fsdp": autopar_with("fsdp", reshard_after_forward=True),
           "FSDP2 kept": fsdp2(False),
           "autopar fsdp kept": autopar_with("fsdp", reshard_after_forward=False),
           "autopar zero2": autopar_with("zero2"),
           "DTensor TP": dtensor_tp,
           "autopar tensor": autopar_with("tensor"), "autopar solver": autopar_with(None)}
    if calibrated is not None:
        out["autopar solver (calibrated)"] = autopar_with(None, calibrated)
    return out


def build_model(sizes: dict, batch: int):
    """The benchmark's model, a batch and its loss: the GPT, or with `sizes["model"]` "resnet"
    the ResNet over images of `sizes["image"]` pixels square."""
    g = torch.Generator().manual_seed(1)
    if sizes.get("model") == "resnet":
        model = ResNet(width=sizes["width"], blocks=(2, 2, 2))
        if sizes.get("frozen_bn"):  # BatchNorm in eval mode: no batch statistics to sum
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.eval()
        x = torch.randn(batch, 3, sizes["image"], sizes["image"], generator=g)
        return model, x, torch.randint(0, 10, (batch,), generator=g), F.cross_entropy
    model = bench_gpt(**{k: sizes[k] for k in ("layers", "hidden", "heads", "vocab", "seq")})
    x = torch.randint(0, sizes["vocab"], (batch, sizes["seq"]), generator=g)
    y = torch.randint(0, sizes["vocab"], (batch, sizes["seq"]), generator=g)
    return model, x, y, lm_loss


def worker(rank: int, port: int, sizes: dict, batch: int, steps: int, out: dict,
           calibrate: bool = True, only: tuple[str, ...] = ()) -> None:
    init_gloo(rank, WORLD, port)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model, x, y, loss_fn = build_model(sizes, batch)
    calibrated = autopar.calibrate(mesh) if calibrate else None
    if calibrated is not None and rank == 0:
        c = calibrated.measured["compute"]
        print(f"calibrated: link alpha {calibrated.intra_node.alpha * 1e6:.0f} us, bandwidth "
              f"{calibrated.intra_node.bandwidth / 1e9:.2f} GB/s; float32 "
              f"{calibrated.flops['float32'] / 1e9:.1f} GFLOP/s per rank (probe factors: "
              f"throughput {c['throughput_factor']:.2f}, op cost {c['op_cost_factor']:.2f})",
              flush=True)
    steppers, states = {}, {}
    for name, build in setups(model, mesh, x, y, calibrated, loss_fn).items():
        if only and name not in only:
            continue
        step_fn, params = build()
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=sizes.get("foreach") or None)

        def step(step_fn=step_fn, opt=opt):
            opt.zero_grad(set_to_none=True)
            step_fn()
            opt.step()

        steppers[name], states[name] = step, (params, opt)
    # Round-robin: every setup's step i runs between the others' steps i, so load drift on
    # this shared machine hits all setups alike.
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for i in range(2 + steps):
        for name, step in steppers.items():
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t)
    from tests.cost_tasks import heap_bytes
    from tests.state_tasks import PeakSampler
    peaks = {}
    for name, step in steppers.items():  # one more step each, its heap peak sampled
        dist.barrier()
        before = heap_bytes() or 0
        with PeakSampler() as sampled:
            step()
        peaks[name] = sampled.peak - before
    results = {name: (statistics.median(ts), state_bytes(*states[name]), peaks[name])
               for name, ts in times.items()}
    if rank == 0:
        for name, (t, mem, peak) in results.items():
            print(f"{name}: {t * 1e3:.1f} ms, {mem / 2**20:.1f} MiB, peak +{peak / 2**20:.1f} "
                  "MiB", flush=True)
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="gpt", choices=("gpt", "resnet"))
    ap.add_argument("--width", type=int, default=32, help="the ResNet's first stage's channels")
    ap.add_argument("--image", type=int, default=32, help="the ResNet's image size")
    ap.add_argument("--frozen-bn", action="store_true",
                    help="the ResNet's BatchNorm in eval mode (DDP then computes what one "
                         "device does)")
    ap.add_argument("--foreach", action="store_true",
                    help="every setup's AdamW with foreach=True (torch's default on CPU is a "
                         "loop over the parameters, slow over DTensors)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the solver's plan on a calibrated profile")
    ap.add_argument("--only", default="",
                    help="comma-separated setups to run (e.g. 'DDP,autopar data,autopar "
                         "solver'); default all")
    a = ap.parse_args()
    only = tuple(n.strip() for n in a.only.split(",") if n.strip())
    sizes = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab,
             "seq": a.seq, "model": a.model, "width": a.width, "image": a.image,
             "frozen_bn": a.frozen_bn, "foreach": a.foreach}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(sizes, a.batch)[0].parameters())
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(worker, args=(port, sizes, a.batch, a.steps, out, not a.no_calibrate, only),
             nprocs=WORLD)
    res = dict(out)
    baselines = [k for k in ("DDP", "FSDP2", "FSDP2 kept", "DTensor TP") if k in res]
    what = f"ResNet {n_params / 1e6:.2f}M parameters, batch {a.batch}x3x{a.image}x{a.image}" \
        if a.model == "resnet" else f"GPT {n_params / 1e6:.1f}M parameters, batch {a.batch}x{a.seq}"
    print(f"\n{what}, {WORLD} gloo ranks on {os.cpu_count()} CPU cores, fp32, median of "
          f"{a.steps} steps\n")
    print("| setup | baseline ms | autopar ms | ratio | baseline MiB/rank | autopar MiB/rank "
          "| baseline step peak MiB | autopar step peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for base, ours in (("DDP", "autopar data"), ("FSDP2", "autopar fsdp"),
                       ("FSDP2 kept", "autopar fsdp kept"), ("FSDP2 kept", "autopar zero2"),
                       ("DTensor TP", "autopar tensor")):
        if base not in res or ours not in res:
            continue
        (tb, mb, pb), (to, mo, po) = res[base], res[ours]
        print(f"| {base} vs {ours} | {tb * 1e3:.0f} | {to * 1e3:.0f} | {to / tb:.2f} | "
              f"{mb / 2**20:.1f} | {mo / 2**20:.1f} | {pb / 2**20:.1f} | {po / 2**20:.1f} |")
    best = min(res[k][0] for k in baselines) if baselines else None
    for name in ("autopar solver", "autopar solver (calibrated)"):
        if name in res and best is not None:
            ts, ms, ps = res[name]
            print(f"| best baseline vs {name} | {best * 1e3:.0f} | {ts * 1e3:.0f} | "
                  f"{ts / best:.2f} | | {ms / 2**20:.1f} | | {ps / 2**20:.1f} |")


if __name__ == "__main__":
    main()
