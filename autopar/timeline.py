"""What a planned step does when: the step's phases in order, and a pipeline schedule's slots.

`step_segments(plan)` splits the predicted step time into its parts in the order they run:
forward compute, the forward collectives, backward compute, the backward collectives, gradient
synchronization, and for pipelines the bubble. A collective the step waits for follows the
compute; what of a kind runs beside compute and hides under it (`PlanCost.hidden`: FSDP
gathers, reduce-scatters and gradient synchronization on hardware whose collectives overlap
compute) is a segment's `hidden` seconds, not in its `seconds`, so the segments follow each
other and their seconds add up to `plan.cost.step_time`. The cost prices each collective
kind per step (`PlanCost.communication`); the plan's collectives (`plan.collectives`, each
with its phase) say how a kind divides between forward and backward, and its time is split
in that proportion.

`pipeline_slots(pipeline, forward_fraction)` lays out a pipeline schedule from the plan's
seconds per microbatch of each stage: every stage runs the microbatches' forwards in order and
their backwards in order, a forward waits for the previous stage's, a backward for the next
stage's, each pp rank runs one slot at a time, and a stage holds at most its `in_flight`
microbatches between their forward and backward (GPipe: every forward before any backward;
1F1B and interleaved: a ready backward first). It is a picture of the schedule the plan priced,
not a trace of torch.distributed.pipelining's (sends are not drawn).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

# The order of a step's phases (and of the collective kinds inside one).
PHASES = ("forward", "backward", "gradient sync", "pipeline bubble")


@dataclass(frozen=True)
class Segment:
    """One part of a step: `phase` (see PHASES), `what` ("compute" or a collective kind),
    the seconds the step spends on it, and the seconds more of it that ran hidden under
    compute."""

    phase: str
    what: str
    seconds: float
    hidden: float = 0.0


def step_segments(plan) -> list[Segment]:
    """The predicted step time of `plan` (an autopar.Plan) as consecutive segments, in the
    order they run; their seconds add up to the cost's compute plus its communication."""
    cost = plan.cost
    by_phase: dict[tuple[str, str], float] = defaultdict(float)
    for c in plan.collectives:
        by_phase[c.kind, c.phase] += c.time
    parts: dict[str, list[Segment]] = {phase: [] for phase in PHASES}
    if cost.compute_forward:
        parts["forward"].append(Segment("forward", "compute", cost.compute_forward))
        parts["backward"].append(Segment("backward", "compute",
                                         cost.compute - cost.compute_forward))
    else:
        parts["forward"].append(Segment("forward", "compute (forward + backward)",
                                        cost.compute))
    hidden = getattr(cost, "hidden", {})
    for kind, seconds in cost.communication.items():
        if not seconds:
            continue
        under = hidden.get(kind, 0.0)
        if kind == "gradient_sync":
            parts["gradient sync"].append(Segment("gradient sync", kind, seconds - under, under))
        elif kind == "pipeline_bubble":
            parts["pipeline bubble"].append(Segment("pipeline bubble", "idle", seconds))
        else:
            forward, backward = by_phase[kind, "forward"], by_phase[kind, "backward"]
            share = forward / (forward + backward) if forward + backward else 1.0
            for phase, part in (("forward", share), ("backward", 1 - share)):
                if part:
                    parts[phase].append(Segment(phase, kind, (seconds - under) * part,
                                                under * part))
    return [s for phase in PHASES for s in parts[phase] if s.seconds > 0 or s.hidden > 0]


@dataclass(frozen=True)
class Slot:
    """One stage's forward or backward of one microbatch, on pp rank `rank`, from `start` to
    `end` seconds into the step."""

    rank: int
    stage: int
    microbatch: int
    backward: bool
    start: float
    end: float


def pipeline_slots(pipeline, forward_fraction: float = 1 / 3) -> list[Slot]:
    """The schedule of `pipeline` (an autopar.plan.PipelinePlan) as slots (see the module
    docstring); a stage's forward takes `forward_fraction` of its seconds per microbatch."""
    stages, m = pipeline.num_stages, pipeline.microbatches
    ranks = max(1, stages // max(1, pipeline.virtual_stages))
    seconds = list(pipeline.stage_time) or [1.0] * stages
    limit = [max(1, math.ceil(k)) for k in pipeline.in_flight] or [m] * stages
    gpipe = pipeline.schedule == "gpipe"
    ends: dict[tuple[int, int, bool], float] = {}
    nxt = {(s, b): 0 for s in range(stages) for b in (False, True)}  # next microbatch
    free = [0.0] * ranks
    slots: list[Slot] = []
    while len(slots) < 2 * stages * m:
        best = None
        for (s, b), mb in nxt.items():
            if mb >= m:
                continue
            r = s % ranks
            if b:
                needs = [(s, mb, False)] + ([(s + 1, mb, True)] if s + 1 < stages else [])
                if gpipe and any(nxt[t, False] < m for t in range(r, stages, ranks)):
                    continue
            else:
                needs = [(s - 1, mb, False)] if s else []
                if nxt[s, False] - nxt[s, True] >= limit[s]:
                    continue
            if any(n not in ends for n in needs):
                continue
            start = max([free[r], *(ends[n] for n in needs)])
            key = (start, b == gpipe, mb, s)
            if best is None or key < best[0]:
                best = (key, s, b, mb)
        if best is None:  # cannot happen with limits of at least one; never loop forever
            break
        (start, *_), s, b, mb = best
        t = seconds[s] * (1 - forward_fraction if b else forward_fraction)
        slots.append(Slot(s % ranks, s, mb, b, start, start + t))
        ends[s, mb, b] = start + t
        free[s % ranks] = start + t
        nxt[s, b] += 1
    return slots
