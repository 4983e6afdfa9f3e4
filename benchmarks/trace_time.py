"""Seconds to trace models (`autopar.passes.trace.trace`, what every plan and every rank's
`parallelize` starts with), the median of several traces in one warm process:

    python -m benchmarks.trace_time      # Hugging Face Llama, GPT-2, Mixtral; GPT; Llama-3 8B
    python benchmarks/at_checkout.py /tmp/old benchmarks/trace_time.py   # another commit's

The Hugging Face models are small (2 layers, hidden 64): their trace time is torch.export's
per-op work, which the model's width does not change. Hugging Face Llama at Llama-3 8B's
widths is on the meta device with its 32 layers (traced cut to two and copied,
passes/fold.py), as benchmarks/planning_time.py plans it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from autopar import zoo
from autopar.passes.trace import trace
from benchmarks.planning_time import llama

REPEATS = 5


def models() -> dict:
    """name -> (model, input ids)."""
    ids = torch.randint(0, 128, (4, 16))
    out = {
        "hf_llama": (zoo.hf_llama(), ids),
        "hf_gpt2": (zoo.hf_gpt2(), ids),
        "hf_mixtral": (zoo.hf_causal_lm(
            "Mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, vocab_size=128,
            max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
            pad_token_id=None), ids),
        "gpt": (zoo.GPT(zoo.GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4,
                                      n_embd=64)), ids),
    }
    out["hf_llama_8b_32_layers"] = (llama("8b", 32),
                                    torch.randint(0, 128256, (8, 4096), device="meta"))
    return out


def main() -> None:
    for name, (model, ids) in models().items():
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            trace(model, (ids,), zoo.lm_loss, ids)
            seconds.append(time.perf_counter() - start)
        print(f"{name:22s} median {statistics.median(seconds):.3f} s  "
              f"(min {min(seconds):.3f}, first {seconds[0]:.3f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
