"""The solver against every style a user could force, on Megatron-LM's weak-scaling table
(Narayanan et al. 2021, Table 1: GPT models of 1.7B to 145.6B parameters on 32 to 1,536
A100s, sequence 2048, vocabulary 51200, with the paper's tensor- and pipeline-parallel
degrees t and p and data parallel over the rest), bf16-mixed AdamW on simulated A100-80GB.

    python -m benchmarks.megatron_table1                    # every row (about 20 minutes)
    python -m benchmarks.megatron_table1 --models 1.7B,39.1B

For each row: the free plan's predicted step and planning seconds, the step of the plan
forced to each style (`force=`: data, fsdp, zero1, zero2, tensor) on every dimension and to
each on dp with tensor on tp (`--every`: every combination), "-" where the forced plan
does not fit, and the step Megatron-LM measured (the paper's model FLOPs with full recomputation,
96 B s l h^2 (1 + s / 6h + V / 16lh), over its GPUs at its achieved TFLOP/s). The last
column says whether any forced style beats the free plan by the planner's own prices
(it must not).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

import autopar
from autopar.zoo import GPT, GPTConfig, lm_loss

# name: (heads, hidden, layers, t, p, GPUs, global batch, achieved TFLOP/s per GPU)
TABLE1 = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 137),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, 138),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 142),
    "18.4B": (48, 6144, 40, 8, 1, 256, 1024, 135),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, 138),
    "76.1B": (80, 10240, 60, 8, 4, 1024, 1792, 140),
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 148),
}
SEQ, VOCAB = 2048, 51200
STYLES = ("data", "fsdp", "zero1", "zero2", "tensor")


def measured_step(name: str) -> float:
    """Seconds a step took in Megatron-LM (the paper's FLOPs over its throughput)."""
    heads, h, layers, t, p, gpus, batch, tflops = TABLE1[name]
    flops = 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))
    return flops / (gpus * tflops * 1e12)


def mesh(name: str) -> autopar.MeshSpec:
    """The paper's (d, p, t) as a mesh, dimensions of size 1 left out."""
    _, _, _, t, p, gpus, _, _ = TABLE1[name]
    dims = [("dp", gpus // (t * p)), ("pp", p), ("tp", t)]
    dims = [(n, s) for n, s in dims if s > 1]
    return autopar.MeshSpec(tuple(s for _, s in dims), names=tuple(n for n, _ in dims),
                            hardware="a100")


def plan(name: str, force=None):
    """(plan or None where none fits, seconds planning) of row `name` under `force`."""
    heads, hidden, layers, _, _, _, batch, _ = TABLE1[name]
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=heads,
                              n_embd=hidden))
    ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
    start = time.perf_counter()
    try:
        p = autopar.plan(model, mesh(name), (ids, ids), loss_fn=lm_loss,
                         precision="bf16-mixed", force=force, time_limit=60)
    except autopar.NoFeasiblePlan:
        p = None
    return p, time.perf_counter() - start


def forced_styles(spec: autopar.MeshSpec, every: bool = False) -> list[dict[str, str]]:
    """Each style on every mesh dimension but pp, and each style on dp with tensor on tp
    (Megatron-LM's own layout: data-parallel styles over dp, tensor parallel inside a node);
    with `every`, every combination of a style per dimension."""
    dims = [n for n in spec.names if n != "pp"]
    if every:
        return [dict(zip(dims, c)) for c in itertools.product(STYLES, repeat=len(dims))]
    combos = [{n: s for n in dims} for s in STYLES]
    if "tp" in dims:
        combos += [{"dp": s, "tp": "tensor"} for s in STYLES if s != "tensor"]
    return combos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(TABLE1), help=f"of {', '.join(TABLE1)}")
    ap.add_argument("--every", action="store_true", help="every combination of a style per "
                    "dimension (25 on dp x tp), not only each style alone and each on dp with "
                    "tensor on tp")
    args = ap.parse_args()
    print("| model | mesh | free step s (plan() s) | forced styles: step s | best forced | "
          "Megatron-LM measured s | free beaten? |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        spec = mesh(name)
        free, secs = plan(name)
        forced = []
        for f in forced_styles(spec, args.every):
            p, _ = plan(name, f)
            forced.append((f, p.cost.step_time if p is not None else None))
        fits = [(f, t) for f, t in forced if t is not None]
        best = min(fits, key=lambda ft: ft[1]) if fits else None
        free_t = free.cost.step_time if free is not None else None
        cells = ", ".join("x".join(f.values()) + " " + (f"{t:.2f}" if t is not None else "-")
                          for f, t in forced)
        beaten = "-" if free_t is None or best is None else \
            ("YES" if best[1] < free_t * (1 - 1e-4) else "no")
        shape = " x ".join(f"{n} {s}" for n, s in zip(spec.names, spec.shape))
        print(f"| {name} | {shape} | "
              + (f"{free_t:.2f} ({secs:.1f})" if free_t is not None else f"no plan ({secs:.1f})")
              + f" | {cells} | "
              + ("x".join(best[0].values()) + f" {best[1]:.2f}" if best else "none fits")
              + f" | {measured_step(name):.2f} | {beaten} |", flush=True)


if __name__ == "__main__":
    main()
