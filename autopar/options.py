"""PlanOptions: every setting of planning and running, as one frozen value.

`autopar.plan` and `autopar.parallelize` take the same options (an `options=PlanOptions(...)`,
or the same fields as keyword arguments), the plan records them, and those that change what
runs are part of the plan's hash, so ranks with different options cannot run together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SOLVERS = ("HIGHS", "SCIP", "CBC", "CP_SAT", "random")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ON_NEW_SHAPE = ("replan", "raise")
RECOMPUTE = ("none", "selective", "full")
RANDOMNESS = ("auto", "eager", "counter")


@dataclass(frozen=True)
class PlanOptions:
    """How to plan and run a model.

    Planning:
      memory_budget   bytes per device (None: the hardware's memory less its reserve)
      force           pin mesh dimensions to a standard style ("data", "fsdp", "tensor"), by
                      dimension name or index, or one style for every dimension
      solver          MIP solver: "HIGHS" (HiGHS through highspy), or an OR-Tools backend
                      ("SCIP", "CBC", "CP_SAT"), or "random" for a valid plan drawn with `seed`
      time_limit      seconds the solver may take
      optimizer       what the cost model prices: "adamw", "adam", "sgd-momentum", "sgd"
      precision       "fp32", or "bf16-mixed": float32 master weights (what the optimizer
                      steps) and gradients, compute in bfloat16 (FSDP2's
                      MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
      bucket_bytes    collectives over many parameters (gradient all-reduce, FSDP gathers and
                      their reduce-scatters) are grouped in buckets of about this many bytes
                      (DDP's bucket_cap_mb); smaller buckets hold less in flight
      profile         True to time ops on this machine (cached; see autopar.profile), or an
                      autopar.profile.OpProfiler; None for the roofline
    Recomputation:
      recompute       "none", "selective" (keep products' and attention's outputs, recompute
                      the rest) or "full" (keep each block's inputs only), for every layer
                      block; None (the default): the planner recomputes only when the plan
                      does not fit otherwise, choosing the fastest that fits. Blocks the model
                      runs under torch.utils.checkpoint recompute in full unless "none".
    FSDP:
      reshard_after_forward  for parameters stored sharded and gathered whole for their use
                      (FSDP): True frees each gathered parameter after its last use in forward
                      and gathers it again for backward (FSDP2's reshard_after_forward=True);
                      False keeps it gathered from forward to backward (faster, more memory);
                      None (the default): the planner decides per parameter, keeping gathered
                      what the memory budget holds, the last used in forward first (backward
                      needs them first)
    Microbatches:
      microbatches    on a mesh without "pp": gradient accumulation over that many
                      microbatches a step (None: the planner accumulates only when the whole
                      batch does not fit); with "pp": the pipeline's microbatches
      loss_reduction  how the loss combines a batch ("mean" or "sum"), for microbatches
                      (accumulation or pipelines) of a loss whose last op does not say;
                      None (the default): such a loss is not split into microbatches
    Randomness (dropout, SDPA's dropout, rand_like and the like):
      randomness      "eager": every rank draws each random op's whole tensor from the default
                      generator and keeps its block: bit for bit eager PyTorch on one device,
                      at a cost per rank that grows with the global batch; "counter": every
                      rank computes its block from the step's key (one draw of the default
                      generator a step): the same numbers under every plan, mesh and
                      microbatch count, equal to autopar on one device, at a block's cost;
                      "auto" (the default): "eager" while the largest random op's whole tensor
                      has at most EAGER_DRAW_LIMIT elements; above, "counter", or "eager"
                      where its whole draws fit and the planner prices it faster
    Pipelines (a mesh dimension named "pp"):
      schedule ("gpipe", "1f1b", "interleaved"), virtual_stages
    Inputs:
      per_rank_inputs names of mesh dimensions over which every rank passes its own slice of
                      the batch (dimension 0 of every input and the target, concatenated in
                      mesh order), as a DistributedSampler over those dimensions gives it;
                      () (the default): every rank passes the whole, global batch
      on_new_shape    what a call with inputs of another shape than planned does: "replan"
                      (plan once more for that shape, keeping the parameters where they are;
                      plans are cached per shape) or "raise"
    Mesh search (an autopar.Cluster instead of a mesh):
      search_workers  processes that plan candidate meshes at once (forked from the calling
                      process; the plan is the same however many): None (the default) one per
                      CPU core, at most one per candidate; 1 plans them one after another here
    Display:
      progress        report planning's stages on stderr: True, False, or None (the default)
                      when stderr is a terminal
    """

    memory_budget: float | None = None
    force: Any = None
    solver: str = "HIGHS"
    time_limit: float = 60.0
    seed: int = 0
    optimizer: str = "adamw"
    precision: str = "fp32"
    profile: Any = field(default=None, compare=False)
    bucket_bytes: int = 25 * 2**20
    recompute: str | None = None
    reshard_after_forward: bool | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    loss_reduction: str | None = None
    randomness: str = "auto"
    per_rank_inputs: tuple[str, ...] = ()
    on_new_shape: str = "replan"
    search_workers: int | None = field(default=None, compare=False)
    progress: bool | None = field(default=None, compare=False)

    def __post_init__(self):
        if isinstance(self.force, dict):  # frozen: keep a copy the caller cannot change
            object.__setattr__(self, "force", dict(self.force))
        if isinstance(self.per_rank_inputs, str):
            object.__setattr__(self, "per_rank_inputs", (self.per_rank_inputs,))
        object.__setattr__(self, "per_rank_inputs", tuple(self.per_rank_inputs))
        _one_of("solver", self.solver.upper() if self.solver != "random" else self.solver,
                SOLVERS)
        if self.schedule is not None:
            _one_of("schedule", self.schedule, SCHEDULES)
        if self.loss_reduction is not None:
            _one_of("loss_reduction", self.loss_reduction, ("mean", "sum"))
        _one_of("precision", self.precision, ("fp32", "bf16-mixed"))
        _one_of("on_new_shape", self.on_new_shape, ON_NEW_SHAPE)
        _one_of("randomness", self.randomness, RANDOMNESS)
        if self.recompute is not None:
            _one_of("recompute", self.recompute, RECOMPUTE)
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError("reshard_after_forward must be True, False or None (the planner "
                             f"decides), not {self.reshard_after_forward!r}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, not {self.bucket_bytes}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, not {self.microbatches}")
        if self.search_workers is not None and (not isinstance(self.search_workers, int)
                                                or self.search_workers < 1):
            raise ValueError(f"search_workers must be a positive number of processes (or None: "
                             f"one per CPU core), not {self.search_workers!r}")

    @staticmethod
    def of(options: PlanOptions | None, **changes) -> PlanOptions:
        """`options` (default ones when None) with the given fields replaced; an unknown field
        is an error naming the known ones."""
        base = options if options is not None else PlanOptions()
        known = {f.name for f in dataclasses.fields(PlanOptions)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; PlanOptions has "
                            f"{', '.join(sorted(known))}")
        return dataclasses.replace(base, **changes) if changes else base

    def decision(self) -> dict:
        """The options that change what runs (part of the plan's hash)."""
        return {"optimizer": self.optimizer, "precision": self.precision,
                "loss_reduction": self.loss_reduction, "bucket_bytes": self.bucket_bytes,
                "per_rank_inputs": list(self.per_rank_inputs)}

    def to_dict(self) -> dict:
        """Plain data for JSON (the profile is recorded as whether one was used)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["profile"] = self.profile is not None and self.profile is not False
        out["per_rank_inputs"] = list(self.per_rank_inputs)
        if isinstance(self.force, dict):
            out["force"] = {str(k): v for k, v in self.force.items()}
        return out

    @staticmethod
    def from_dict(d: dict) -> PlanOptions:
        """Inverse of to_dict (a profile used for the plan is not restored)."""
        d = dict(d)
        d["profile"] = None
        d["per_rank_inputs"] = tuple(d.get("per_rank_inputs", ()))
        force = d.get("force")
        if isinstance(force, dict):
            d["force"] = {int(k) if k.isdigit() else k: v for k, v in force.items()}
        known = {f.name for f in dataclasses.fields(PlanOptions)}
        return PlanOptions(**{k: v for k, v in d.items() if k in known})

    def summary(self) -> str:
        """One line for the printed plan: the options that differ from the defaults."""
        default = PlanOptions()
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name not in ("profile", "progress", "search_workers")
                 and getattr(self, f.name) != getattr(default, f.name)]
        if self.profile not in (None, False):
            parts.append("profile=measured")
        return ", ".join(parts) or "defaults"


def _one_of(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}, not {value!r}")
