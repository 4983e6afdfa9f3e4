"""Plan hashes of the benchmark models: a refactor that must not change behaviour keeps them.

    python -m benchmarks.plan_hashes | diff benchmarks/plan_hashes.txt -

Plans (no processes) the models of benchmarks.plan_quality and benchmarks.plans_at_scale on
meshes that reach every planner path: free solve, forced styles, fsdp, recomputation chosen
under a tight budget, gradient accumulation, bf16-mixed, pipelines, and a mesh searched from a
device count. Each line is `case  hash  step-seconds  peak-GiB`; a refactor's diff is empty.
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.zoo import GPT, GPTConfig, hf_gpt2, hf_llama, lm_loss


def gpt():
    """A small autopar.zoo GPT on the meta device."""
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, block_size=256, n_layer=4, n_head=4, n_embd=256))


def gpt2_dropout():
    """Hugging Face GPT-2 with dropout 0.1 everywhere, on the meta device."""
    with torch.device("meta"):
        return hf_gpt2(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                       dropout=0.1)


def llama(layers=4):
    """Hugging Face Llama at small widths on the meta device."""
    with torch.device("meta"):
        return hf_llama(num_hidden_layers=layers, hidden_size=512, num_attention_heads=8,
                        num_key_value_heads=4, intermediate_size=1024, vocab_size=8192,
                        max_position_embeddings=512)


def ids(batch, seq):
    return torch.empty(batch, seq, dtype=torch.long, device="meta")


CASES = {
    "gpt 8 free": (gpt, (8,), ("dp",), dict()),
    "gpt 2x4 free": (gpt, (2, 4), ("dp", "tp"), dict()),
    "gpt 2x4 force data/tensor": (gpt, (2, 4), ("dp", "tp"), dict(force={"dp": "data",
                                                                         "tp": "tensor"})),
    "gpt 8 fsdp": (gpt, (8,), ("dp",), dict(force="fsdp")),
    "gpt 8 bf16": (gpt, (8,), ("dp",), dict(precision="bf16-mixed")),
    "gpt 8 recompute full": (gpt, (8,), ("dp",), dict(recompute="full")),
    "gpt 8 micro 2": (gpt, (8,), ("dp",), dict(microbatches=2, loss_reduction="mean")),
    "gpt 8 tight": (gpt, (8,), ("dp",), dict(memory_budget=96 * 2**20)),
    "gpt2 dropout 2x4": (gpt2_dropout, (2, 4), ("dp", "tp"), dict()),
    "llama 2x4 free": (llama, (2, 4), ("dp", "tp"), dict()),
    "llama pp2 x dp4": (llama, (2, 4), ("pp", "dp"), dict(microbatches=4)),
    "llama pp2 x tp2 x dp2": (llama, (2, 2, 2), ("pp", "tp", "dp"), dict(microbatches=4)),
    "llama 8 devices searched": (llama, 8, None, dict()),
    "llama 8 devices, pipelines": (llama, 8, "pipeline", dict(microbatches=4)),
}


def run(case: str) -> str:
    """One line: the case, its plan's hash, predicted step seconds and peak GiB."""
    make, shape, names, kw = CASES[case]
    model = make()
    batch, seq = 16, 256
    mesh = (autopar.Cluster(shape, hardware="h100", pipeline=names == "pipeline")
            if isinstance(shape, int)
            else autopar.MeshSpec(shape, names=names, hardware="h100"))
    try:
        p = autopar.plan(model, mesh, (ids(batch, seq), ids(batch, seq)), loss_fn=lm_loss,
                         time_limit=30, **kw)
    except autopar.NoFeasiblePlan as e:
        return f"{case:28s} no plan: {str(e).splitlines()[0][:80]}"
    return (f"{case:28s} {p.hash()}  {p.cost.step_time:.6f}  "
            f"{p.cost.peak_memory / 2**30:.4f}  {'x'.join(map(str, p.mesh.shape))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    args = ap.parse_args()
    for case in (args.cases.split(",") if args.cases else CASES):
        print(run(case), flush=True)


if __name__ == "__main__":
    main()
