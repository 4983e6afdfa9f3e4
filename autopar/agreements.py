"""The control plane's agreements: what every rank of a parallelized model checks with the
others before any collective of the model, so that a mistake on one rank raises on every rank
instead of hanging the others.

One `Agreements` per parallelized model, over its `Control` (runtime/control.py, small gloo
collectives):
- `inputs`: every rank passed its own checks of the call, the same shapes and dtypes, and, for
  global inputs, the same values (per-rank inputs: the same within the ranks that share a
  slice of the batch); all in one small all-gather, which also carries the random state;
- `random_states`: a program that draws random numbers needs every rank's generator in one
  state (each rank draws its slice of what the single-device model would draw);
- `on_every_rank` / `plan_from_rank0`: work every rank does (tracing, matching, initializing),
  or a plan rank 0 solves and broadcasts; a failure anywhere raises on every rank;
- `same_plan`: every rank holds the plan of the same hash;
- `same_blocks`: a state dict about to be loaded is not one rank's shards saved by that rank
  alone.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from autopar.runtime.control import Control, RankError, agreed, content_hash, signature

from .inputs import Call
from .plan import Plan

T = TypeVar("T")


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans; raised on every rank before any collective of the model."""


def slice_groups(mesh, per_rank_inputs: tuple[str, ...]) -> Callable[[int], tuple]:
    """rank -> its coordinates on the per-rank input dimensions of `mesh` (ranks with equal
    coordinates receive the same slice)."""
    names = mesh.mesh_dim_names or ()
    dims = [k for k, n in enumerate(names) if n in per_rank_inputs]
    where = {}
    ranks = mesh.mesh
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in ranks.shape]).reshape(
            -1, ranks.dim()).tolist():
        where[int(ranks[tuple(idx)])] = tuple(idx[k] for k in dims)
    return where.__getitem__


def _rng_signature(device: torch.device) -> int:
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return signature(bytes(state.numpy()))


class Agreements:
    """The agreements of one parallelized model (see the module docstring)."""

    def __init__(self, control: Control, mesh, per_rank_inputs: tuple[str, ...],
                 device: torch.device):
        """`per_rank_inputs`: the mesh dimensions each rank passes its own slice along (empty:
        inputs are global); `device` the one whose generator the programs draw from."""
        self.control = control
        self.per_rank_inputs = tuple(per_rank_inputs or ())
        self.device = device
        self.same_slice = slice_groups(mesh, self.per_rank_inputs)

    def inputs(self, call: Call, error: str | None, what: str, key: tuple,
               moved: list | None = None) -> list[list[int]]:
        """Every rank learns whether every rank's inputs passed its checks (`error`: this
        rank's failure), and that all passed the same shapes and dtypes (`key`, the program's
        key) and, for global inputs, the same values (per-rank inputs: the same within the
        ranks that share a slice), and the same values of captured tensors changed in place
        (`moved`). Returns the agreed rows (shapes, values, random state) of every rank."""
        per_rank = bool(self.per_rank_inputs)
        target = call.target
        control = self.control
        rows = control.exchange(
            f"checking the inputs of {what}", error,
            [signature(key, None if target is None else
                       (tuple(target.shape), str(target.dtype))),
             signature(*(content_hash(t) for t in [*call.tensors, *(moved or ())]))
             if error is None else 0,
             _rng_signature(self.device), signature(what)])
        control.check_same(
            "ranks are in different calls of the parallelized model (a call on some ranks "
            "only, as DistributedDataParallel code evaluating on rank 0 alone makes): every "
            "rank makes each step() and inference call, whose collectives need them all; "
            "evaluate on every rank and report on one", rows, 3, what)
        control.check_same(
            f"ranks passed inputs of different shapes or dtypes to {what}", rows, 0,
            call.describe())
        control.check_same(
            f"ranks passed different values to {what}: " + (
                "with per_rank_inputs, ranks that share a slice of the batch (the same "
                "coordinates on " + ", ".join(self.per_rank_inputs) + ") must pass "
                "the same tensors" if per_rank else
                "inputs are global (every rank passes the whole batch, as in single-device "
                "code); to pass each rank its own slice, parallelize with per_rank_inputs="
                "(names of the data-parallel mesh dimensions)") + (
                "; or a tensor the loss function captures was changed in place to different "
                "values" if moved else ""),
            rows, 1, "", group_of=self.same_slice if per_rank else None)
        return rows

    def call_inputs(self, error: str | None) -> None:
        """Every rank learns whether every rank could split its call into inputs (`error`:
        this rank's failure); raises on every rank when one could not."""
        self.control.exchange("checking the call's inputs", error, [])

    def random_states(self, random_ops: list[str], rows: list[list[int]]) -> None:
        """A program that draws random numbers (`random_ops`) needs every rank's generator in
        one state (`rows`, from `inputs`)."""
        if random_ops:
            self.control.check_same(
                "the model draws random numbers (" + "; ".join(random_ops[:3]) + ") and ranks' "
                "random generators are in different states: seed every rank alike "
                "(torch.manual_seed(seed) on all ranks) so that each rank draws its slice of "
                "what the single-device model would draw; keep per-rank randomness (data "
                "shuffling) on a torch.Generator of its own", rows, 2)

    def on_every_rank(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` on every rank; an error anywhere raises on every rank (the raising rank's own
        error there, a RankError naming it elsewhere)."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
            error = e
        failed = [r for r, bad in enumerate(self.control.gather_objects(error is not None))
                  if bad]
        if error is not None:
            raise agreed(error)
        if failed:
            raise agreed(RankError(f"{what} failed on rank(s) {failed} (see the error there)"))
        return result

    def plan_from_rank0(self, solve: Callable[[], Plan]) -> Plan:
        """The plan `solve()` returns on rank 0, broadcast to every rank; its error, raised on
        every rank."""
        mine = None
        if self.control.rank == 0:
            try:
                mine = ("ok", solve().to_dict())
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
                mine = ("error", e)
        box = self.control.broadcast_object(mine)
        if box[0] == "error":
            raise agreed(box[1])
        return Plan.from_dict(box[1])

    def same_plan(self, plan: Plan) -> None:
        """Every rank holds `plan` (compared by hash), or every rank raises
        PlanMismatchError."""
        hashes = self.control.gather_objects(plan.hash())
        if len(set(hashes)) != 1:
            raise agreed(PlanMismatchError(
                "ranks hold different plans (hashes by rank: " + ", ".join(hashes) + "); pass "
                "the same plan (or the same model, inputs and options) on every rank"))

    def same_blocks(self, state_dict: dict, own: dict) -> str | None:
        """An error message when the sharded DTensors of `state_dict` hold the same local
        blocks on every rank: one rank's `state_dict()`, saved by that rank alone
        (torch.save on rank 0, as with DistributedDataParallel) and loaded on all, where each
        rank would take that rank's blocks for its own. Compared by the hash of the start of
        up to 32 such tensors, in one small all-gather (every rank calls load_state_dict);
        blocks that are all constant (a model initialized to zeros) say nothing."""
        shards = [n for n in sorted(set(own) & set(state_dict))
                  if hasattr(state_dict[n], "to_local") and hasattr(own[n], "placements") and
                  any(getattr(p, "dim", None) is not None and own[n].device_mesh.size(k) > 1
                      for k, p in enumerate(own[n].placements))][:32]
        blocks = [state_dict[n].to_local().detach().reshape(-1)[:1 << 16] for n in shards]
        mine = (tuple(content_hash(b) for b in blocks),
                any(b.numel() > 1 and bool((b != b[0]).any()) for b in blocks))
        rows = self.control.gather_objects(mine)
        if not mine[0] or not mine[1] or any(row != mine for row in rows):
            return None
        return ("the state dict holds the same blocks of its sharded tensors on every rank "
                f"({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}): it is one "
                "rank's pmodel.state_dict() (this rank's shards), saved by that rank alone, "
                "and each rank would load that rank's blocks as its own. Save with "
                "autopar.checkpoint.save(path, pmodel, optimizer) on every rank (any plan "
                "loads it), or torch.save(pmodel.full_state_dict(), path) (a collective: call "
                "it on every rank, save on one)")
