"""Predicted against published: torchtitan's Llama 3.1 throughput on H100s, planned by autopar.

torchtitan publishes tokens per second per GPU for hand-written setups (its
benchmarks/llama3_h100_202412_torchtitan.md, torchtitan 9dec370 with torch 1963fc8, December
2024; configs train_configs/llama3_8b.toml and llama3_70b.toml at that commit: sequence 8192,
AdamW, bf16 parameters with float32 gradient reduction). Their GPUs are Grand Teton H100s with
96 GB of HBM2e at 2.4 TB/s and a 500 W power limit (an SXM H100 is 80 GB of HBM3 at 3.35 TB/s
and 700 W); hosts of 8 over NVLink, 400 Gb/s RDMA per GPU between hosts.

For each published setup autopar plans the same model shape, batch, sequence and mesh, forced
to the same configuration (FSDP, or FSDP x tensor parallel; the same recomputation;
bf16-mixed), prices it on an H100 profile with that memory, and reports predicted tokens/s/GPU
against the published figure. Then it plans freely on the same GPUs (`autopar.Cluster`: the
mesh, the strategies, recomputation and microbatches are the solver's) and reports what it
predicts and what it chose.

    python -m benchmarks.torchtitan_compare              # all rows (about 3 minutes)
    python -m benchmarks.torchtitan_compare --rows 8b-8 --no-free
    python -m benchmarks.torchtitan_compare --rows 70b-256 --no-free --no-budget

The forced setups are planned within the GPUs' memory, as torchtitan ran them (each fits:
the 70B FSDP x TP row since full recomputation recomputes the block's tensor-parallel
collectives, as torchtitan's does); `--no-budget` plans them for time alone, with the
predicted peak printed next to theirs.

The configuration includes torchtitan's op-level selective checkpointing, which also
recomputes every second matmul of a block where autopar's selective recomputation keeps every
product: its extra seconds are added (`op_sac_extra`). The hardware is priced as the source
describes it (`GRAND_TETON`). The 70B row's figure is bf16 with torch.compile, from the
same team's June 2025 async-TP benchmark on the same hardware (the December table has 70B
only with Float8); autopar prices eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import torch

import autopar
from autopar.hardware import GB, H100, GiB
from autopar.measured import FLASH_H100
from autopar.solver.ilp import NoFeasiblePlan
from autopar.zoo import LLAMA3, Llama3, lm_loss

SOURCE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"

# Grand Teton's H100: 96 GB of HBM2e at 2.4 TB/s, the SXM part's links, a 500 W power limit
# (the source's footnote 2: its peak is "between SXM and NVL"). Its compute is priced from an
# SXM H100 measured at its 700 W limit (gpu_check's `power` part, benchmarks/RESULTS.md "One
# GPU, session 20"): an eager step of this model's layers draws 690 W there (so the limit
# binds) at a 1,478 MHz SM clock, 132 W idle. A 500 W limit leaves (500 - 132) / (690 - 132)
# of the dynamic power; with dynamic power ~ f V^2 and the voltage rising with the clock f
# (DVFS), f ~ power^(1/3): products and attention at 0.870 of the measured 700 W rates
# (0.812 if the voltage stayed put, f ~ power^(1/2)). Memory-bound ops at the HBM2e's rate.
# Attention at SDPA's flash backend's rates measured on that H100 (FlashAttention-2: the kernel
# it ran on H100s in torchtitan's PyTorch of December 2024; the built-in profile prices
# PyTorch 2.11's cuDNN kernel), scaled as the products.
STEP_POWER_W, IDLE_POWER_W, POWER_LIMIT_W = 690.0, 132.0, 500.0
PEAK_SHARE = ((POWER_LIMIT_W - IDLE_POWER_W) / (STEP_POWER_W - IDLE_POWER_W)) ** (1 / 3)
GRAND_TETON = dataclasses.replace(
    H100, name="h100-hbm2e-96gb-500w", memory_bandwidth=2.4e12, memory=96 * GB,
    flops={k: v * PEAK_SHARE for k, v in H100.flops.items()},
    attention={k: tuple((n, r * PEAK_SHARE) for n, r in v)
               for k, v in FLASH_H100.items()})
PRODUCTS = ("linear", "mm", "matmul", "addmm", "bmm")

@dataclasses.dataclass(frozen=True)
class Setup:
    key: str
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    force: dict
    local_batch: int          # sequences per data-parallel rank
    recompute: str
    published: float          # tokens/s/GPU
    memory: float             # GiB, published (nan: not published)
    where: str                # table and row of SOURCE
    note: str = ""

    @property
    def gpus(self) -> int:
        n = 1
        for s in self.mesh:
            n *= s
        return n

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.mesh[0]


SETUPS = [
    Setup("8b-8", "8B", (8,), ("dp",), {"dp": "fsdp"}, 2, "selective", 5762, 82.4,
          "Table 1, FSDP (eager, bf16)"),
    Setup("8b-128", "8B", (128,), ("dp",), {"dp": "fsdp"}, 2, "selective", 5605, 67.0,
          "Table 3, FSDP (eager, bf16)"),
    Setup("70b-256", "70B", (32, 8), ("dp", "tp"), {"dp": "fsdp", "tp": "tensor"}, 16, "full",
          597.3, float("nan"), "asyncTP file, bf16 vanilla TP (torch.compile)",
          "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025, same hardware): "
          "bf16 with torch.compile, which gave 1.16x eager on 8B (Table 1: 6,667 vs 5,762); "
          "the December table has 70B only with Float8 too (829 tok/s/GPU, 71.9 GiB)"),
]
SEQ = 8192


def build(setup: Setup):
    """(meta-device model, token batch) of a setup: torchtitan's Llama 3 (autopar.zoo.Llama3,
    causal SDPA as torchtitan calls it) at its sizes."""
    with torch.device("meta"):
        model = Llama3(LLAMA3[setup.model])
    ids = torch.empty(setup.global_batch, SEQ, dtype=torch.long, device="meta")
    return model, ids


def op_sac_extra(plan) -> float:
    """Seconds torchtitan's op-level selective checkpointing spends that autopar's selective
    recomputation does not: it saves the output of only every second matmul of a
    transformer block (`_save_list` and `mm_count` in torchtitan's parallelize_llama.py), so
    backward runs half of the blocks' products' forward again (a product's forward is a
    third of its forward and backward)."""
    products = [o.time for o in plan.ops if o.op.split(".")[0] in PRODUCTS
                and ".layers." in f".{o.module}"]
    return 0.5 * sum(products) / 3 * plan.accumulation


def step_time(plan, setup: Setup) -> float:
    """The predicted step of `setup`'s configuration: the plan's, plus what torchtitan's
    selective checkpointing recomputes beyond autopar's."""
    return plan.cost.step_time + (op_sac_extra(plan) if setup.recompute == "selective" else 0)


def tokens_per_gpu(plan, setup: Setup, step: float | None = None) -> float:
    """Predicted tokens per second per GPU of a plan of `setup`'s batch."""
    return setup.global_batch * SEQ / (step or plan.cost.step_time) / setup.gpus


def describe(plan) -> str:
    """Mesh, styles, recomputation and microbatches of a plan, in a few words."""
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))
    micro = plan.pipeline.microbatches if plan.pipeline is not None else plan.accumulation
    hidden = sum(plan.cost.hidden.values())
    return (f"{mesh}; recompute {plan.recompute.mode}; {micro} microbatch(es); "
            f"{plan.cost.peak_memory / GiB:.1f} GiB; compute {plan.cost.compute:.2f} s, "
            f"communication {plan.cost.communication_total:.2f} s "
            f"({hidden:.2f} s hidden)")


def run(setup: Setup, free: bool, budget: bool = True) -> list[str]:
    model, ids = build(setup)
    start = time.perf_counter()
    spec = autopar.MeshSpec(setup.mesh, names=setup.names, hardware=GRAND_TETON)
    # within the GPU's memory as torchtitan ran it; without `budget`, for time alone (the
    # plan's peak is reported next to theirs)
    kw = dict(loss_fn=lm_loss, precision="bf16-mixed", force=setup.force,
              recompute=setup.recompute, microbatches=1, time_limit=120)
    fits = ""
    try:
        forced = autopar.plan(model, spec, (ids, ids), memory_budget=None if budget else
                              float("inf"), **kw)
    except NoFeasiblePlan as e:  # the setup ran; autopar's memory model says it cannot
        smallest = re.search(r"smallest peak[^0-9]*([0-9.]+ GiB)", str(e))
        fits = ("over the GPU's memory in autopar's model (smallest peak "
                f"{smallest.group(1) if smallest else '?'}), planned for time alone; ")
        forced = autopar.plan(model, spec, (ids, ids), memory_budget=float("inf"), **kw)
    secs = time.perf_counter() - start
    predicted = tokens_per_gpu(forced, setup, step_time(forced, setup))
    out = [f"| {setup.model} | {setup.gpus} | {setup.where} | {setup.local_batch} x {SEQ} | "
           f"{setup.recompute} | {setup.published:,.0f} | {predicted:,.0f} | "
           f"{predicted / setup.published:.2f} | "
           + (f"{setup.memory} GiB published; " if setup.memory == setup.memory else "")
           + f"{fits}{describe(forced)}; planned in {secs:.0f} s |"
           + (f" {setup.note}" if setup.note else "")]
    if free:
        start = time.perf_counter()
        best = autopar.plan(model, autopar.Cluster(setup.gpus, hardware=GRAND_TETON),
                            (ids, ids), loss_fn=lm_loss, precision="bf16-mixed",
                            time_limit=120)
        secs = time.perf_counter() - start
        ranking = ", ".join(
            f"{'x'.join(map(str, r['shape']))} "
            + (f"{r['step_time']:.2f} s" if r["step_time"] is not None else "no plan")
            for r in best.mesh_search)
        out.append(f"| {setup.model} | {setup.gpus} | autopar, free | {setup.global_batch} "
                   f"sequences | {best.recompute.mode} | | {tokens_per_gpu(best, setup):,.0f} | "
                   f"{tokens_per_gpu(best, setup) / setup.published:.2f} | {describe(best)}; "
                   f"searched in {secs:.0f} s ({ranking}) |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(s.key for s in SETUPS),
                    help=f"of {', '.join(s.key for s in SETUPS)}")
    ap.add_argument("--no-free", action="store_true", help="skip the solver's free plans")
    ap.add_argument("--no-budget", action="store_true",
                    help="plan the forced setups for time alone, not within the GPUs' memory")
    args = ap.parse_args()
    print(f"Source: {SOURCE}; hardware profile {GRAND_TETON.name} (the H100 profile with "
          f"96 GB at 2.4 TB/s, compute at {PEAK_SHARE:.3f} of its measured 700 W rates); "
          "bf16-mixed AdamW, sequence 8192.\n")
    print("| model | GPUs | setup | batch per dp rank | recompute | published tok/s/GPU | "
          "predicted | ratio | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in args.rows.split(","):
        setup = next(s for s in SETUPS if s.key == key)
        for line in run(setup, not args.no_free, not args.no_budget):
            print(line, flush=True)


if __name__ == "__main__":
    main()
