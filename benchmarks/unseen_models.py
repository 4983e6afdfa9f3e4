"""Hugging Face architectures the test suite never trains, trained under autopar on 4 gloo
ranks against single-device training (tests/rank_tasks.py `train_equivalence`: the loss of
two AdamW steps, the first step's gradients, the parameters after them and the forward
output, in float64), for each plan setting below. Prints a markdown table: "ok", or the
first line of what failed.

    python -m benchmarks.unseen_models                     # every architecture, every setting
    python -m benchmarks.unseen_models --kinds Qwen2,Bloom

Each model is two layers of width 32 (4 heads, 2 key-value heads where the architecture has
them; 4 experts, 2 per token, for the mixtures), vocabulary 64, batch 4 x 16 tokens, built
from its config without downloads (autopar.zoo `hf_causal_lm`). Not a test: it takes about
13 minutes, and transformers' releases add and change architectures.
"""

from __future__ import annotations

import argparse
import time

from tests import rank_tasks
from tests.world import World

_DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                max_position_embeddings=16)
_NO_PAD = dict(_DECODER, pad_token_id=None)
# transformers prefix -> config fields (Gemma 2 and Bloom have no SDPA attention: eager)
KINDS: dict[str, dict] = {
    "Qwen2": _DECODER,
    "Qwen3": dict(_DECODER, head_dim=8),
    "Mistral": dict(_DECODER, sliding_window=None),
    "Gemma": dict(_DECODER, head_dim=8),
    "Gemma2": dict(_DECODER, head_dim=8, sliding_window=8, attn_implementation="eager"),
    "Phi3": _NO_PAD,
    "GPTNeoX": {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},
    "OPT": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                vocab_size=64, max_position_embeddings=16, word_embed_proj_dim=32,
                dropout=0.0, pad_token_id=None),
    "StableLm": _DECODER,
    "Olmo2": _NO_PAD,
    "Starcoder2": dict(_DECODER, residual_dropout=0.0, embedding_dropout=0.0),
    "Granite": _NO_PAD,
    "GPTJ": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, rotary_dim=4),
    "Bloom": dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=64,
                  attn_implementation="eager"),
    "Cohere": _NO_PAD,
    # mixtures of experts, their experts as batched_mm (grouped_mm has no float64 kernel)
    "Qwen2Moe": dict(_NO_PAD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16, decoder_sparse_step=1,
                     experts_implementation="batched_mm"),
    "Qwen3Moe": dict(_NO_PAD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     head_dim=8, decoder_sparse_step=1, experts_implementation="batched_mm"),
    "Olmoe": dict(_NO_PAD, num_experts=4, num_experts_per_tok=2,
                  experts_implementation="batched_mm"),
}
# (label, mesh, force, PlanOptions fields)
SETTINGS = [
    ("solver 2x2", (2, 2), None, None),
    ("fsdp 4", (4,), "fsdp", None),
    ("data x tensor", (2, 2), {0: "data", 1: "tensor"}, None),
    ("fsdp x tensor", (2, 2), {0: "fsdp", 1: "tensor"}, None),
    ("full recompute", (2, 2), None, {"recompute": "full"}),
    ("2 microbatches", (2, 2), None, {"microbatches": 2}),
    ("fsdp freed, selective", (4,), "fsdp", {"reshard_after_forward": True,
                                            "recompute": "selective"}),
    ("pp 2 x dp 2", (2, 2, 1), None, None),
    ("pp 2 x tp 2", (2, 1, 2), None, None),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated prefixes")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    print("| model | " + " | ".join(label for label, *_ in SETTINGS) + " |")
    print("|---" * (len(SETTINGS) + 1) + "|")
    start = time.perf_counter()
    with World(4, timeout=600) as world:
        for kind in kinds:
            cells = []
            for _, mesh, force, options in SETTINGS:
                name = ("hf", {"kind": kind, "fields": KINDS[kind], "batch": 4, "seq": 16})
                outcomes = world.outcomes(rank_tasks.train_equivalence, name, mesh, force,
                                          options=options)
                bad = [str(payload) for status, payload in outcomes if status != "ok"]
                cells.append("ok" if not bad else
                             next((line for line in reversed(bad[0].splitlines())
                                   if line.strip()), "failed")[:80].replace("|", "/"))
            print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{len(kinds)} models x {len(SETTINGS)} settings in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
