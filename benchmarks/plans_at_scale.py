"""Plans at the scale people train: GPT-3-style models from Megatron-LM's weak-scaling table
(Narayanan et al. 2021: sequence 2048, vocabulary 51200, global batch 512 to 1536) on simulated
A100-80GB meshes with the tensor-parallel degree Megatron used, bf16-mixed AdamW.

    python -m benchmarks.plans_at_scale      # 1.7B on 32 GPUs, 7.5B on 128, 18.4B on 256,
                                             # 39.1B on 512 (pipelined: 2 stages)
    python -m benchmarks.plans_at_scale --models llama3-8b,llama3-70b   # on H100 meshes
    python -m benchmarks.plans_at_scale --recompute none  # as before recomputation existed
    python -m benchmarks.plans_at_scale --dropout 0.1     # Hugging Face GPT-2 at Megatron's
                                                          # shapes with its default dropout
    python -m benchmarks.plans_at_scale --dropout 0.1 --randomness eager  # whole draws

For each model: the seconds `autopar.plan` takes, the predicted step, memory per device against
the budget (split by kind), the gradient-accumulation microbatches and what recomputes; the
plan's own table is printed below the summary.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.zoo import GPT, GPTConfig, hf_gpt2, hf_llama, lm_loss

# name: (layers, hidden, heads, mesh shape, mesh names, global batch) from Megatron-LM's table
MODELS = {
    "1.7B": (24, 2304, 24, (32,), ("dp",), 512),
    "7.5B": (36, 4096, 32, (32, 4), ("dp", "tp"), 512),
    "18.4B": (40, 6144, 48, (32, 8), ("dp", "tp"), 1024),
    "39.1B": (48, 8192, 64, (32, 2, 8), ("dp", "pp", "tp"), 1536),
}
# Llama-3 shapes (Hugging Face Llama from config, sequence 4096) on H100 meshes:
# name: (layers, hidden, heads, KV heads, FFN, mesh shape, mesh names, global batch)
LLAMAS = {
    "llama3-8b": (32, 4096, 32, 8, 14336, (8, 8), ("dp", "tp"), 64),
    "llama3-70b": (80, 8192, 64, 8, 28672, (32, 8), ("dp", "tp"), 256),
}


def build(name: str, dropout: float | None = None):
    """(meta-device model, token batch, mesh) for a model of MODELS or LLAMAS; with `dropout`
    a MODELS shape is Hugging Face's GPT-2 with that embedding, residual and attention
    dropout (the GPT-2 architecture Megatron-LM's GPT follows)."""
    if name in LLAMAS:
        layers, hidden, heads, kv, ffn, shape, names, batch = LLAMAS[name]
        seq, hardware = 4096, "h100"
        with torch.device("meta"):
            model = hf_llama(num_hidden_layers=layers, hidden_size=hidden,
                             num_attention_heads=heads, num_key_value_heads=kv,
                             intermediate_size=ffn, vocab_size=128256,
                             max_position_embeddings=seq)
    else:
        layers, hidden, heads, shape, names, batch = MODELS[name]
        seq, hardware = 2048, "a100"
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=51200, block_size=seq, n_layer=layers,
                                  n_head=heads, n_embd=hidden)) if dropout is None else \
                hf_gpt2(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=51200,
                        n_positions=seq, dropout=dropout)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, ids, autopar.MeshSpec(shape, names=names, hardware=hardware)


def plan(name: str, recompute: str | None, dropout: float | None = None,
         randomness: str = "auto"):
    """Plan model `name` on its mesh; returns (plan, seconds)."""
    model, ids, spec = build(name, dropout)
    start = time.perf_counter()
    p = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss, precision="bf16-mixed",
                     recompute=recompute, time_limit=60, randomness=randomness)
    return p, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"of {', '.join([*MODELS, *LLAMAS])} (the Llama-3 shapes take over 10 "
                    "minutes together on a 2-core machine)")
    ap.add_argument("--recompute", default=None, help="none, selective or full (default: the "
                    "planner decides)")
    ap.add_argument("--tables", action="store_true", help="print each plan's table too")
    ap.add_argument("--dropout", type=float, default=None, help="Hugging Face GPT-2 with this "
                    "dropout instead of autopar's GPT (Megatron-LM's shapes only)")
    ap.add_argument("--randomness", default="auto", help="auto, eager or counter")
    args = ap.parse_args()
    rows, tables = [], []
    for name in args.models.split(","):
        try:
            p, secs = plan(name, args.recompute, args.dropout, args.randomness)
        except autopar.NoFeasiblePlan as e:
            rows.append(f"| {name} | - | no plan: {str(e)[:200]} ||||||")
            continue
        mem = p.cost.memory
        micro = p.pipeline.microbatches if p.pipeline is not None else p.accumulation
        split = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in mem.items())
        rows.append(f"| {name} | {'x'.join(map(str, p.mesh.shape))} | {secs:.1f} | "
                    f"{p.cost.step_time:.2f} | {p.cost.peak_memory / 2**30:.1f} of "
                    f"{p.cost.memory_budget / 2**30:.1f} ({split}) | {micro} | "
                    f"{p.recompute.mode} ({len(p.recompute.blocks)} blocks) | "
                    f"{p.randomness or '-'} |")
        tables.append(f"### {name}\n\n```\n{p}\n```")
    print("| model | mesh | plan() s | step s | GiB per device (by kind) | microbatches | "
          "recompute | randomness |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.tables:
        print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
