"""Per-rank bytes of parameters, gradients and optimizer state under each storage, measured.

    python -m benchmarks.state_bytes [--layers 4 --hidden 256]

One GPT (tests' family, fp32, AdamW) on 4 gloo ranks under DDP, ZeRO-1, ZeRO-2, FSDP (gathered
parameters kept, and freed after forward) and, on a 2 x 2 mesh, FSDP x tensor parallel. For
each, rank 0's measured bytes (the storages its parameters live in; the gradients they carry
after a synchronized step; AdamW's state after its first step: tests/cost_tasks.py
`storage_bytes`) against the memory model's prediction and ZeRO's closed form
(`autopar.solver.memory.zero_memory`: 4 + 4 + 8 bytes per parameter, the sharded parts divided
by the ranks, plus AdamW's step scalar per tensor). Prints a markdown table.
"""

from __future__ import annotations

import argparse

from autopar.solver.memory import zero_memory
from tests import cost_tasks
from tests.world import World

KINDS = ("parameters", "gradients", "optimizer")
SETUPS = [("DDP", (4,), "data", {}, "ddp"), ("ZeRO-1", (4,), "zero1", {}, "zero1"),
          ("ZeRO-2", (4,), "zero2", {}, "zero2"),
          ("FSDP kept", (4,), "fsdp", {"reshard_after_forward": False}, "fsdp"),
          ("FSDP freed", (4,), "fsdp", {"reshard_after_forward": True}, "fsdp"),
          ("FSDP x TP", (2, 2), {"dp": "fsdp", "tp": "tensor"}, {}, None)]


def kib(b: float) -> str:
    return f"{b / 2**10:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    model = ("gpt", {"vocab_size": 512, "block_size": 64, "n_layer": a.layers, "n_head": 4,
                     "n_embd": a.hidden, "batch": 4})
    world = World(4, timeout=1800)
    rows = []
    try:
        world.start()
        for label, mesh, force, options, setup in SETUPS:
            got = world.run(cost_tasks.storage_bytes, model, mesh, force, options)[0]
            rows.append((label, setup, got))
    finally:
        world.close()
    got = rows[0][2]
    print(f"GPT {a.layers} x {a.hidden}: {got['params'] / 1e6:.2f}M parameters in "
          f"{got['tensors']} tensors, fp32, AdamW, 4 ranks; KiB on rank 0, measured / model / "
          "ZeRO formula\n")
    print("| setup | parameters | gradients | optimizer state |")
    print("|---|---|---|---|")
    for label, setup, got in rows:
        formula = None
        if setup is not None:  # ZeRO-1 with one microbatch frees whole gradients as ZeRO-2
            formula = zero_memory(got["params"], 4, setup, precision="fp32",
                                  tensors=got["tensors"])
        cells = []
        for k in KINDS:
            f = kib(formula[k]) if formula else "-"
            cells.append(f"{kib(got['measured'][k])} / {kib(got['predicted'][k])} / {f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
