"""Recomputed runs: a rank's training program with its recomputed ops under checkpoint.

The ops a plan recomputes (passes/recompute.py, by traced node) are found in the rank's
program by the record the rewrite left on every node (`passes.emitted`). Each maximal run of
consecutive local ops of one run of a block (`Recompute.block_of`) and one mode becomes one
submodule called through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: in
forward it runs and keeps
only its inputs (full recomputation), or also the outputs of its products and attention
(selective: a `create_selective_checkpoint_contexts` policy); in backward it runs again first.

The resharding of an activation (the collectives and slices of tensor and sequence
parallelism, emitted for an op recomputed in full) is part of that op's run: backward issues
those collectives again, and the run keeps what they read, not what they made, as Megatron-LM's
and torchtitan's full activation checkpointing do (priced by `CostModel.recollected`). Every
rank of a collective's group runs the same program, so they all issue it again at the same
point of backward. Under selective recomputation collectives end a run, and their results are
kept. A local slice (a view, of a parameter too) joins its consumer's run in either mode, so a
tensor-parallel bias sliced for its product does not split a block. FSDP gathers always end a
run; an FSDP parameter the plan frees after forward is not
kept by the runs that use it either: with `session` (what
`runtime.regather.resharding` puts on the mesh's collectives), a run is handed the gathered
parameter in forward but keeps only the session's token for it, and backward gathers it again
before running the block again, as FSDP2's pre-forward hook does under activation
checkpointing. Random ops recompute the same numbers:
checkpoint restores the default generator's state (CPU, and the device's) before running
again, and autopar's random lowerings draw from it (passes/rules/random.py). What runs is op
for op what ran without recomputation, so gradients are bit for bit the same.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .emitted import META_KEY
from .recompute import SAVED_ATEN, Recompute
from .rules.random_stream import STREAM
from .torch_compat import outside_dispatch_modes

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


class Tokens(Protocol):
    """Saved-tensor hooks (as `torch.autograd.graph.saved_tensors_hooks` takes them): `pack`
    returns a token for a tensor it can make again, or the tensor itself; `unpack` makes the
    tensor from its token."""

    def pack(self, t: torch.Tensor) -> Any: ...
    def unpack(self, token: Any) -> torch.Tensor: ...


class RecomputedRun(torch.nn.Module):
    """A run of ops executed under non-reentrant checkpoint, in "full" or "selective" mode.
    `session()` gives the tokens for inputs the run need not keep (None: it keeps all)."""

    def __init__(self, run: fx.GraphModule, mode: str,
                 session: Callable[[], Tokens | None] | None = None):
        super().__init__()
        self.run = run
        self.mode = mode
        self.session = session

    def forward(self, *inputs):
        """The run's outputs; backward recomputes what it did not keep."""
        session = self.session() if self.session is not None else None
        kept = [session.pack(x) if isinstance(x, torch.Tensor) else x
                for x in inputs] if session is not None and torch.is_grad_enabled() else None
        if kept is None or all(k is x for k, x in zip(kept, inputs)):
            return self._checkpoint(self.run, inputs)
        forward = [list(inputs)]  # the inputs themselves, once: forward runs on them
        # (the closure must not hold them: checkpoint keeps it until backward)
        deferred = [(i, x.requires_grad) for i, (k, x) in enumerate(zip(kept, inputs))
                    if k is not x]

        def run(*tokens):
            if forward:
                return self.run(*forward.pop())
            # backward: gather again, outside selective checkpoint's recompute mode; a gathered
            # tensor asks for a gradient as in forward, so its ops save what they saved then
            xs = list(tokens)
            with outside_dispatch_modes():
                for i, grad in deferred:
                    xs[i] = session.unpack(tokens[i]).detach().requires_grad_(grad)
            return self.run(*xs)

        return self._checkpoint(run, kept)

    def _checkpoint(self, fn, inputs):
        at = STREAM.microbatch

        def run(*xs):  # (checkpoint restores the generator: the same numbers, same rows)
            with STREAM.again_at(at):
                return fn(*xs)

        if self.mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            return checkpoint(run, *inputs, use_reentrant=False, context_fn=context)
        return checkpoint(run, *inputs, use_reentrant=False)


def _key(node: fx.Node, recompute: Recompute, ops: frozenset[str]):
    """(block, mode) of a node that belongs in a recomputed run, else None. `ops`: the traced
    ops the program computes (a collective moving anything else, a parameter or input, ends a
    run)."""
    record = node.meta.get(META_KEY)
    if node.op != "call_function" or record is None:
        return None
    if record.role in RUN_ROLES:
        op = record.origin
    elif record.role == "slice" or (record.role == "collective" and record.origin in ops and
                                    recompute.mode_of.get(record.consumer) == "full"):
        op = record.consumer  # a slice is a view (of a parameter too): it never ends a run
    else:
        return None
    mode = recompute.mode_of.get(op)
    return None if mode is None else (recompute.block_of.get(op), mode)


def _computed_ops(gm: fx.GraphModule) -> frozenset[str]:
    return frozenset(record.origin for node in gm.graph.nodes
                     if (record := node.meta.get(META_KEY)) is not None
                     and record.role in RUN_ROLES)


def recomputed_runs(gm: fx.GraphModule, recompute: Recompute
                    ) -> list[tuple[list[fx.Node], str]]:
    """The maximal runs of consecutive nodes of `gm` of one recomputed block and mode, each
    with its mode."""
    runs, current, key = [], [], None
    ops = _computed_ops(gm)
    for node in gm.graph.nodes:
        k = _key(node, recompute, ops)
        if k is not None and k == key:
            current.append(node)
            continue
        if current:
            runs.append((current, key[1]))
        current, key = ([node], k) if k is not None else ([], None)
    if current:
        runs.append((current, key[1]))
    return runs


def wrap_recomputed(gm: fx.GraphModule, recompute: Recompute,
                    session: Callable[[], Tokens | None] | None = None) -> fx.GraphModule:
    """`gm` (a rank's training program, changed in place and returned) with each recomputed
    run replaced by a call of a `RecomputedRun` submodule (`session`: see RecomputedRun)."""
    if not recompute.mode_of:
        return gm
    graph = gm.graph
    for i, (run, mode) in enumerate(recomputed_runs(gm, recompute)):
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
        gm.add_submodule(name, RecomputedRun(fx.GraphModule(gm, sub), mode, session))
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
