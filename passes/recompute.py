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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    "selective" | "full") and its layer block, the blocks' names, and `transient`: the ops of one
    recomputed block, priced as kept (backward recomputes one block at a time, so one block's
    activations are live again at the peak)."""

    mode_of: dict[str, str] = field(default_factory=dict)
    block_of: dict[str, int] = field(default_factory=dict)  # recomputed op -> its block
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


def recompute_plan(program: TracedProgram, graph: StrategyGraph, mode: str,
                   keep_user: bool = True) -> Recompute:
    """Recompute every layer block of `graph` in `mode` ("none", "selective" or "full"); with
    `keep_user`, the ops the model runs under torch.utils.checkpoint recompute in full
    whatever `mode` is."""
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
        mode_of = {n: mode for n in recomputable if blocks.of_node[n] in layers}
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
    return Recompute(mode_of, {n: blocks.of_node[n] for n in mode_of},
                     tuple(blocks.names[b] for b in chosen), transient,
                     tuple(blocks.names[b] for b in sorted(user_blocks)), keep_user)
