"""Recomputed runs: a rank's training program with its recomputed ops under checkpoint.

The ops a plan recomputes (passes/recompute.py, by traced node) are found in the rank's
program by the record the rewrite left on every node (`passes.emitted`). Each maximal run of
consecutive local ops of one block and one mode becomes one submodule called through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: in forward it runs and keeps
only its inputs (full recomputation), or also the outputs of its products and attention
(selective: a `create_selective_checkpoint_contexts` policy); in backward it runs again first.

Collectives, FSDP gathers and slices end a run, so a collective is never issued again in
backward: its result is an input of the next run, kept. Random ops recompute the same numbers:
checkpoint restores the default generator's state (CPU, and the device's) before running
again, and autopar's random lowerings draw from it (passes/rules/random.py). What runs is op
for op what ran without recomputation, so gradients are bit for bit the same.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .emitted import META_KEY
from .recompute import SAVED_ATEN, Recompute

RUN_ROLES = ("op", "getitem")


def _saved_ops() -> frozenset:
    ops = set()
    for name in SAVED_ATEN:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


_SAVED = _saved_ops()


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep products and attention; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class RecomputedRun(torch.nn.Module):
    """A run of ops executed under non-reentrant checkpoint, in "full" or "selective" mode."""

    def __init__(self, run: fx.GraphModule, mode: str):
        super().__init__()
        self.run = run
        self.mode = mode

    def forward(self, *inputs):
        """The run's outputs; backward recomputes what it did not keep."""
        if self.mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            return checkpoint(self.run, *inputs, use_reentrant=False, context_fn=context)
        return checkpoint(self.run, *inputs, use_reentrant=False)


def _key(node: fx.Node, recompute: Recompute):
    """(block, mode) of a node that belongs in a recomputed run, else None."""
    record = node.meta.get(META_KEY)
    if node.op != "call_function" or record is None or record.role not in RUN_ROLES:
        return None
    mode = recompute.mode_of.get(record.origin)
    return None if mode is None else (recompute.block_of.get(record.origin), mode)


def recomputed_runs(gm: fx.GraphModule, recompute: Recompute) -> list[list[fx.Node]]:
    """The maximal runs of consecutive nodes of `gm` of one recomputed block and mode."""
    runs, current, key = [], [], None
    for node in gm.graph.nodes:
        k = _key(node, recompute)
        if k is not None and k == key:
            current.append(node)
            continue
        if current:
            runs.append(current)
        current, key = ([node], k) if k is not None else ([], None)
    if current:
        runs.append(current)
    return runs


def wrap_recomputed(gm: fx.GraphModule, recompute: Recompute) -> fx.GraphModule:
    """`gm` (a rank's training program, changed in place and returned) with each recomputed
    run replaced by a call of a `RecomputedRun` submodule."""
    if not recompute.mode_of:
        return gm
    graph = gm.graph
    for i, run in enumerate(recomputed_runs(gm, recompute)):
        members = set(run)
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs: list[fx.Node] = []
        for node in run:
            for a in node.all_input_nodes:
                if a not in members and a not in env:
                    env[a] = sub.placeholder(a.name)
                    inputs.append(a)
            env[node] = sub.node_copy(node, env.__getitem__)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        sub.output(tuple(env[n] for n in outputs))
        name = f"recomputed_{i}"
        gm.add_submodule(name, RecomputedRun(fx.GraphModule(gm, sub), _key(run[0], recompute)[1]))
        with graph.inserting_before(run[0]):
            call = graph.call_module(name, tuple(inputs))
            for j, n in enumerate(outputs):
                got = graph.call_function(operator.getitem, (call, j))
                got.meta = {k: v for k, v in n.meta.items() if k != META_KEY}
                n.replace_all_uses_with(
                    got, delete_user_cb=lambda u, inside=members: u not in inside)
        for node in reversed(run):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
