"""Pipeline plans of a model with dropout on simulated H100s: what the draws cost.

    python -m benchmarks.pipeline_dropout [--layers 12] [--batch 64] [--seq 1024]
                                          [--randomness eager|counter]

In eager randomness every microbatch draws the whole batch's dropout masks of its stage (so
that the model trains with one device's numbers), and every pp rank draws all stages' masks
once more per step; in counter randomness a microbatch computes its own block of them. This
plans GPT-2 (124M: 12 layers of 768, vocabulary 50257, built on the meta device) with dropout
0.1 and without it on MeshSpec((4, 2), names=("pp", "dp")), the solver choosing schedule,
microbatches and cuts, then prices the dropout model at every microbatch count the solver
considers for 1F1B. No processes, no GPUs.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.zoo import hf_gpt2, lm_loss


def plan_gpt2(dropout: float, layers: int, batch: int, seq: int, **options):
    """The plan of GPT-2 with `dropout` on (pp 4, dp 2) H100s, and its planning seconds."""
    with torch.device("meta"):
        model = hf_gpt2(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257,
                        n_positions=seq, dropout=dropout)
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    spec = autopar.MeshSpec((4, 2), names=("pp", "dp"), hardware="h100")
    start = time.perf_counter()
    plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss, precision="bf16-mixed",
                        **options)
    return plan, time.perf_counter() - start


def row(name: str, plan, seconds: float) -> str:
    pipe = plan.pipeline
    return (f"| {name} | {pipe.schedule} | {pipe.microbatches} | {pipe.virtual_stages} | "
            f"{plan.cost.step_time * 1e3:.1f} | {plan.cost.compute * 1e3:.1f} | "
            f"{seconds:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--randomness", default="auto", help="auto, eager or counter")
    args = ap.parse_args()
    print("| model | schedule | microbatches | virtual stages | step ms | compute ms "
          "| planned in s |")
    print("|---|---|---|---|---|---|---|")
    for dropout in (0.0, 0.1):
        plan, seconds = plan_gpt2(dropout, args.layers, args.batch, args.seq,
                                  randomness=args.randomness)
        print(row(f"dropout {dropout}, free", plan, seconds), flush=True)
    for m in args.counts:
        plan, seconds = plan_gpt2(0.1, args.layers, args.batch, args.seq, microbatches=m,
                                  schedule="1f1b", randomness=args.randomness)
        print(row(f"dropout 0.1, 1F1B x {m}", plan, seconds), flush=True)


if __name__ == "__main__":
    main()
