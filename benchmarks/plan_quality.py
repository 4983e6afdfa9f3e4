"""Plan quality: the solver's plan against every standard setup, under the same cost model.

    python -m benchmarks.plan_quality [--devices 8,64] [--models gpt,gpt2,llama]

For each model (on the meta device) and device count N (simulated H100s, 8 per node), the grid
is every factorization N = dp x tp with the data dimension plain data parallel (DDP) or fully
sharded (FSDP / ZeRO-3) and the tensor dimension Megatron tensor parallel: autopar.plan with
`force=` pins those styles (the ILP only fills in what the style leaves open). The solver plans
each factorization's mesh freely; its best is compared with the grid's best. A ratio <= 1.00
means the solver is never worse than the best uniform setup; below 1.00 it mixes per-op
strategies in a way no uniform setup does. Setups that exceed device memory are marked OOM.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.solver.ilp import NoFeasiblePlan
from autopar.zoo import GPT, GPTConfig, hf_gpt2, hf_llama, lm_loss


def gpt_small():
    """autopar.zoo's GPT at GPT-2-small size (tied head)."""
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                             n_embd=768)), 50304, 1024


def gpt2():
    """Hugging Face GPT-2 small."""
    with torch.device("meta"):
        return hf_gpt2(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                       n_positions=1024), 50257, 1024


def llama():
    """Hugging Face Llama at Llama-3-8B widths, 4 layers (the grid re-plans many times)."""
    with torch.device("meta"):
        return hf_llama(num_hidden_layers=4, hidden_size=4096, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                        max_position_embeddings=8192), 128256, 2048


MODELS = {"gpt": gpt_small, "gpt2": gpt2, "llama": llama}


def grid(n: int):
    """(label, mesh shape, names, force) for every standard setup on n devices."""
    tp = 1
    while tp <= min(n, 8):
        dp = n // tp
        for style in ("data", "fsdp"):
            if tp == 1:
                yield f"{'DDP' if style == 'data' else 'FSDP'} {dp}", (dp,), ("dp",), style
            else:
                yield (f"{'DDP' if style == 'data' else 'FSDP'} {dp} x TP {tp}", (dp, tp),
                       ("dp", "tp"), {"dp": style, "tp": "tensor"})
        tp *= 2


def predicted(model, shape, names, example, force) -> float | None:
    try:
        plan = autopar.plan(model, autopar.MeshSpec(shape, names=names, hardware="h100"),
                            example, loss_fn=lm_loss, force=force)
    except NoFeasiblePlan:
        return None
    return plan.cost.step_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--models", default="gpt,gpt2,llama")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    rows = []
    for name in a.models.split(","):
        model, vocab, seq = MODELS[name]()
        ids = torch.randint(0, vocab, (a.batch, seq), device="meta")
        for n in map(int, a.devices.split(",")):
            t = time.perf_counter()
            results = {}
            for label, shape, names, force in grid(n):
                results[label] = (predicted(model, shape, names, (ids, ids), force), shape,
                                  names)
            feasible = {k: v[0] for k, v in results.items() if v[0] is not None}
            best_label = min(feasible, key=feasible.get) if feasible else None
            shapes = {(v[1], v[2]) for v in results.values()}
            solver = {}
            for shape, names in shapes:
                solver[shape] = predicted(model, shape, names, (ids, ids), None)
            solver = {k: v for k, v in solver.items() if v is not None}
            if not feasible or not solver:
                print(f"{name} on {n} devices: no setup fits in memory", flush=True)
                continue
            best_shape = min(solver, key=solver.get)
            ratio = solver[best_shape] / feasible[best_label]
            beats = sum(1 for v in feasible.values() if solver[best_shape] < v * 0.9999)
            rows.append((name, n, best_label, feasible[best_label], "x".join(map(str, best_shape)),
                         solver[best_shape], ratio, beats, len(results),
                         len(results) - len(feasible), time.perf_counter() - t))
            print(rows[-1], flush=True)
    print(f"\nbatch {a.batch}, simulated H100 (80 GB, NVLink4 within 8-GPU nodes, NDR across)\n")
    print("| model | devices | best standard setup | its ms | solver mesh | solver ms | ratio | "
          "setups the solver beats | OOM setups | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3] * 1e3:.2f} | {r[4]} | {r[5] * 1e3:.2f} | "
              f"{r[6]:.3f} | {r[7]}/{r[8] - r[9]} | {r[9]} | {r[10]:.0f} |")


if __name__ == "__main__":
    main()
