"""Pipeline plans for Llama-shaped models on simulated H100s: stage cuts, step time, bubble.

    python -m benchmarks.pipeline_llama --layers 8 32 [--hidden 4096] [--precision bf16-mixed]

Builds Hugging Face Llama from a Llama-3-8B-like config (hidden 4096, 32 heads, 8 KV heads,
MLP 14336, vocabulary 128256) with the given number of layers on the meta device (no weights,
no downloads) and plans it with autopar.plan on MeshSpec((4, 8), names=("pp", "tp")); the
solver picks the schedule, the microbatch count and the cuts. No processes, no GPUs.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.zoo import hf_llama, lm_loss


def plan_llama(layers: int, hidden: int, mlp: int, heads: int, kv_heads: int, vocab: int,
               batch: int, seq: int, mesh: tuple[int, int], precision: str, **options):
    with torch.device("meta"):
        model = hf_llama(num_hidden_layers=layers, hidden_size=hidden,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=seq)
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    spec = autopar.MeshSpec(mesh, names=("pp", "tp"), hardware="h100")
    start = time.perf_counter()
    plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss, precision=precision, **options)
    return plan, time.perf_counter() - start


def summary(plan, seconds: float) -> str:
    comm = plan.cost.communication
    return "\n".join(
        [f"  predicted step {plan.cost.step_time * 1e3:.1f} ms (compute "
         f"{plan.cost.compute * 1e3:.1f} ms, bubble + waits "
         f"{comm.get('pipeline_bubble', 0) * 1e3:.1f} ms, p2p {comm.get('p2p', 0) * 1e3:.1f} "
         f"ms); planned in {seconds:.1f} s"]
        + ["  " + line for line in plan.pipeline.lines()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument("--schedule", default=None)
    args = ap.parse_args()
    for layers in args.layers:
        plan, seconds = plan_llama(layers, args.hidden, args.mlp, args.heads, args.kv_heads,
                                   args.vocab, args.batch, args.seq, (4, 8), args.precision,
                                   microbatches=args.microbatches, schedule=args.schedule)
        print(f"Llama, {layers} layers, hidden {args.hidden}, batch {args.batch} x "
              f"{args.seq} tokens, {args.precision}, mesh pp=4 x tp=8 (H100):")
        print(summary(plan, seconds))


if __name__ == "__main__":
    main()
