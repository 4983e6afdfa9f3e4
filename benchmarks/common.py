"""What the benchmarks share: the benchmark GPT and joining a local gloo world.

Benchmarks run from the repository root as modules (`python -m benchmarks.NAME`), so that
autopar, this module and the test harness (tests.world: a free port, a persistent world of
ranks) import as packages, with no sys.path edits.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.zoo import GPT, GPTConfig


def bench_gpt(layers: int = 6, hidden: int = 512, heads: int = 8, vocab: int = 8192,
              seq: int = 128) -> GPT:
    """The benchmark GPT (autopar.zoo's, with an untied LM head): about 27M parameters at the
    default sizes."""
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads,
                         n_embd=hidden, tie_weights=False))


def init_gloo(rank: int, world: int, port: int, threads: int = 1) -> None:
    """Join a gloo process group of `world` ranks on this host (its store at `port`), with
    `threads` intra-op threads per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
