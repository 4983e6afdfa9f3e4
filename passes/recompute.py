"""Activation recomputation: which ops of a traced graph recompute in backward, and how.

A plan recomputes whole layer blocks (the model's repeated layers, `layer_blocks`), in one of two
modes, as Megatron-LM and torchtitan do:

- "full": the block keeps only its inputs for backward; backward runs its forward again first.
- "selective": the block keeps the outputs of its matrix products and attention (what is
  costly to compute again) and recomputes everything else (norms, activations, elementwise
  ops, views), after Korthikanti et al. 2022.

What runs (runtime/recompute.py) wraps runs of a rank's local ops in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (selective: with a policy from
`create_selective_checkpoint_contexts` that saves the ops `saved_under_selective` names).
Under full recomputation the resharding collectives of activations (tensor and sequence
parallelism) are inside the runs too, so backward issues them again and the runs keep what they
read, as Megatron-LM and torchtitan do; under selective recomputation their results are kept.
The planner prices either (solver/cost.py `recollected`), so backward issues no collective the
plan did not price.

Ops the model itself runs under `torch.utils.checkpoint` (non-reentrant) are recomputed in
full unless the plan says otherwise (`PlanOptions.recompute="none"`).

State updated in forward (a buffer written in place: BatchNorm's running statistics in training
mode, a counter) is updated once per forward, as on one device: the plan recomputes no op that
writes it (run again in backward, it would take the update twice) or reads it (it would read
it updated), `run_once`. Such an op keeps what it keeps without recomputation and cuts its
block's recomputed run in two; each run is priced as the rank runs it (`Recompute.block_of`
gives every run its own number). Ops the model itself checkpoints are recomputed as it wrote
them, writes included (torch.utils.checkpoint on one device updates such state twice too).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from .graph_queries import input_base, state_writes
from .pipeline_split import layer_blocks
from .strategies import OP, SNode, StrategyGraph
from .trace import TracedProgram

MODES = ("none", "selective", "full")

# ATen ops (at the dispatch level, below autograd: what a selective checkpoint policy sees)
# whose outputs a selectively recomputed block keeps.
SAVED_ATEN = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def saved_under_selective(node: SNode, product) -> bool:
    """Whether a selectively recomputed block keeps `node`'s output: matrix products (`product`:
    the op's product slots from its facts, or None) and attention."""
    return node.kind == OP and (product is not None or node.op.startswith(
        ("scaled_dot_product", "_scaled_dot_product")))


@dataclass(frozen=True)
class Recompute:
    """The recomputation of one plan: the mode of every recomputed op (traced node name ->
    "selective" | "full") and its run (`block_of`: the number of the checkpointed run of its
    layer block it runs in, one per block unless ops that run once cut it), the blocks' names,
    and `transient`: the ops of one recomputed block, priced as kept (backward recomputes one
    block at a time, so one block's activations are live again at the peak)."""

    mode_of: dict[str, str] = field(default_factory=dict)
    block_of: dict[str, int] = field(default_factory=dict)  # recomputed op -> its run
    blocks: tuple[str, ...] = ()
    transient: frozenset[str] = frozenset()
    user: tuple[str, ...] = ()   # blocks the model checkpoints itself (torch.utils.checkpoint)
    user_kept: bool = True       # whether those checkpoints recompute (else the plan drops them)

    @property
    def mode(self) -> str:
        """"none", "selective", "full", or "mixed" (the model's own checkpoints in full, the
        other blocks selectively)."""
        modes = set(self.mode_of.values())
        return "none" if not modes else modes.pop() if len(modes) == 1 else "mixed"

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return {"mode_of": dict(self.mode_of), "block_of": dict(self.block_of),
                "blocks": list(self.blocks),
                "transient": sorted(self.transient), "user": list(self.user),
                "user_kept": self.user_kept}

    @staticmethod
    def from_dict(d: dict | None) -> Recompute:
        """Inverse of to_dict."""
        d = d or {}
        return Recompute(dict(d.get("mode_of", {})), dict(d.get("block_of", {})),
                         tuple(d.get("blocks", ())),
                         frozenset(d.get("transient", ())), tuple(d.get("user", ())),
                         d.get("user_kept", True))


NONE = Recompute()


def updated_state(program: TracedProgram) -> dict[str, set[str]]:
    """The ops of `program` that write into a graph input in forward, with what they write:
    `program.writes`, and norms in training mode (their running statistics, which
    aten.batch_norm's schema does not declare: passes/trace.py `state_writes`)."""
    return state_writes(program.graph_module, program.writes)


def run_once(program: TracedProgram) -> frozenset[str]:
    """The ops of `program` that must run once per forward, never again in backward: those that
    update state in place (`updated_state`), which would take the update twice, and those that
    read that state (through views too), which would read it updated."""
    writers = updated_state(program)
    state = set().union(*writers.values())
    readers = {node.name for node in program.graph.nodes if node.op == "call_function" and any(
        (base := input_base(a)) is not None and base.name in state
        for a in node.all_input_nodes)}
    return frozenset(writers) | readers


def _runs(program: TracedProgram, mode_of: dict[str, str],
          block_of: dict[str, int]) -> dict[str, int]:
    """The run of every recomputed op (`mode_of`, in layer blocks `block_of`): the maximal runs
    of consecutive ops, in the program's order, of one block and mode, numbered from 0. The
    rank's program emits the ops in this order and checkpoints these runs
    (passes/recompute_regions.py): an op that is not recomputed ends a run."""
    run_of: dict[str, int] = {}
    key, count = None, -1
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        mode = mode_of.get(node.name)
        k = None if mode is None else (block_of[node.name], mode)
        if k is not None and k != key:
            count += 1
        key = k
        if k is not None:
            run_of[node.name] = count
    return run_of


def recompute_plan(program: TracedProgram, graph: StrategyGraph, mode: str,
                   keep_user: bool = True) -> Recompute:
    """Recompute every layer block of `graph` in `mode` ("none", "selective" or "full"), but
    not its ops that must run once (`run_once`); with `keep_user`, the ops the model runs under
    torch.utils.checkpoint recompute in full whatever `mode` is."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
    blocks = layer_blocks(program, graph)
    layers = set(range(len(blocks.names)))
    if len(blocks.names) > 2 and blocks.names[0].startswith("before "):
        layers.discard(0)
    if len(blocks.names) > 2 and blocks.names[-1].startswith("after "):
        layers.discard(len(blocks.names) - 1)
    recomputable = {n for n, b in blocks.of_node.items()
                    if graph.nodes[n].kind == OP and graph.nodes[n].requires_grad}
    mode_of: dict[str, str] = {}
    if mode != "none":
        once = run_once(program)
        mode_of = {n: mode for n in recomputable - once if blocks.of_node[n] in layers}
    user = program.checkpointed & recomputable
    if keep_user:
        mode_of.update(dict.fromkeys(user, "full"))
    user_blocks = {blocks.of_node[n] for n in user}
    chosen = sorted({blocks.of_node[n] for n in mode_of})
    # One block's activations are live again while backward recomputes it: price the largest
    # (by op count; identical layers are alike) as kept.
    transient: frozenset[str] = frozenset()
    if chosen:
        size = {b: sum(1 for n in mode_of if blocks.of_node[n] == b) for b in chosen}
        peak = max(chosen, key=lambda b: size[b])
        transient = frozenset(n for n in mode_of if blocks.of_node[n] == peak)
    return Recompute(mode_of, _runs(program, mode_of, blocks.of_node),
                     tuple(blocks.names[b] for b in chosen), transient,
                     tuple(blocks.names[b] for b in sorted(user_blocks)), keep_user)
