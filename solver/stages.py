"""Pipeline stages: cut a chain of layer blocks into contiguous stages, for a schedule.

The model's graph is coarsened into a chain of layer blocks (passes.pipeline_split); each block
is priced on the submesh a stage runs on (the mesh without "pp") by solving the intra-op ILP for
it once (identical blocks, e.g. transformer layers, share one solve: solver/stage_pricing.py
`price_blocks`). Then, for each candidate
schedule, microbatch count m and number of virtual stages v, an ILP cuts the chain:

Sets and data (S = p v stages; stage s runs on pp rank s mod p)
  b = 0..N-1   blocks in graph order
  t_b          seconds per microbatch of block b, forward + backward (compute and resharding)
  c_b          seconds per microbatch to move what crosses a cut after block b to the next
               stage (activations forward, their gradients backward)
  g_b          seconds per step of gradient synchronization of block b's parameters
  w_b          bytes per device of block b's parameters, gradients and optimizer state
  a_b          bytes per device of the activations block b keeps for backward, per microbatch
  k_r          microbatches in flight on pp rank r, per local stage (see `in_flight`)
  M            bytes per device
Per microbatch of size mb (the graph was priced at batch tb), sigma = mb / tb and
  t_b = f_b + (t_b(tb) - f_b - d_b) sigma + d_b m sigma + g'_b (m - 1) / m
  c_b likewise (without d_b and g'_b),   a_b = a_b(tb) sigma
where f_b is the part that does not shrink with the microbatch (kernel launch floors, collective
latencies); g'_b the seconds of adding a microbatch's gradients of block b's parameters to
those of the microbatches before it (autograd's accumulation, from the second microbatch on);
d_b the seconds of block b's random draws (dropout masks) at batch tb: every microbatch draws
what one device draws for the whole batch (m mb = m sigma tb) and keeps its own rows, so that
a pipelined model draws one device's numbers (passes/rules/random.py). Every pp rank also
draws every stage's numbers once per step, to move its generator where one device has it at
each of its stages (runtime/pipeline.py): R = m sigma sum_b d_b seconds, added to the
objective. In counter randomness (each rank computes its block of a microbatch's numbers) d_b
is 0: the draws are in t_b, shrinking with the microbatch, and nothing is replayed.
Variables
  x[b,s] in {0,1}   block b runs in stage s
  y[b,s] in [0,1]   block b is the last block of stage s < S-1 (a cut follows it)
  T, C, G >= 0      the busiest pp rank's time per microbatch, the slowest stage's, the
                    longest gradient sync
Constraints
  sum_s x[b,s] = 1
  z_b = sum_s s x[b,s];  z_0 = 0;  z_{N-1} = S-1;  0 <= z_{b+1} - z_b <= 1
                                               (contiguous stages, in order, none empty)
  y[b,s] >= x[b,s] - x[b+1,s]
  T_s = sum_b t_b x[b,s] + c_b y[b,s]          (seconds per microbatch of stage s)
  T  >= sum_{s on r} T_s                       for every pp rank r
  C  >= T_s                                    for every stage s
  G  >= sum_{s on r} sum_b g_b x[b,s]
  sum_{s on r} sum_b (w_b + k_r a_b) x[b,s] <= M - D
                                               (D: the largest block's random draw for the
                                               whole batch, held while its op runs)
Objective (seconds per step)
  v = 1:            min sum_s T_s + (m - 1) C + G + R
  v > 1, m >= p:    min m T + (p - 1) C + G + R
  v > 1, m < p:     min sum_s T_s + (m - 1) C + G + R
Interleaved 1F1B on hardware whose communication overlaps compute (`hides_sends`) sends beside
its other chunks' work in the steady state: there the busiest rank's time is bounded by its
work and by its sends separately, T >= sum_{s on r} (T_s - c_s) and T >= sum_{s on r} c_s
(c_s the sends of stage s), while the fill and drain (C) still wait for them.
With one stage per rank (C = T): the first microbatch crosses every stage, the others follow at
the pace of the slowest (plus the gradient sync after the last). With v virtual stages per rank
and at least p microbatches, every rank works through its m v chunk-microbatches and the fill
and drain cost p - 1 chunks: balanced chunks of c seconds take (m v + p - 1) c, a bubble
fraction of (p - 1) / (v m). With fewer microbatches than ranks each chunk waits for its input
to come round the ring: (p v + m - 1) c.

The linear constraints above are written x[b,s] -> x[b-1,s] or x[b-1,s-1] for contiguity (the
"staircase" form), with the redundant bounds p T >= sum_s T_s, S C >= sum_s T_s and C >= max t_b
to tighten the relaxation. Solver: CP-SAT, single-threaded under a deterministic time limit, so
the same problem always gets the same cut. Measured on a 32-layer Llama chain (34 blocks, 4 pp
ranks): HiGHS through pywraplp found no cut within 20 s for 2 to 4 virtual stages; CP-SAT
finds its best known cut within a second, though proving optimality among many nearly
identical blocks can take far longer (the solution records whether it was proven).

Every (schedule, m, v) candidate gets its own solve, in order of a lower bound (perfectly
balanced stages, free sends); candidates whose bound cannot beat the best found are skipped.
After the cut, autopar/pipeline_plan.py solves each stage's intra-op ILP on the submesh and
prices the result under this module's step model (solver/stage_pricing.py: `solve_subgraph`,
identical stages once, and `price_pipeline`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SCHEDULES = ("1f1b", "gpipe", "interleaved")
TICK = 1e-8  # seconds per integer time unit inside the stage solver
TIE = 1000  # weight of the objective against the balancing tie-break (see solve_stages)


class StageError(ValueError):
    """The model cannot be cut into the stages asked for (the message says what to change)."""


# -- schedules ---------------------------------------------------------------------------------

def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step relative to its useful work, for balanced stages:
    (p - 1) / m for GPipe and 1F1B, divided by the virtual stages per rank for interleaved
    1F1B (which with fewer microbatches than ranks idles more: (v (p - m) + m - 1) / (v m))."""
    if schedule != "interleaved":
        return (p - 1) / m
    if m < p:
        return (v * (p - m) + m - 1) / (v * m)
    return (p - 1) / (m * v)


def objective_weights(p: int, m: int, v: int) -> tuple[int, int, int]:
    """Weights of (sum of stage times, busiest rank, slowest stage) in the objective."""
    if v > 1 and m >= p:
        return 0, m, p - 1
    return 1, 0, m - 1


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Microbatches whose activations pp rank `rank` holds at its peak, per local stage.

    GPipe runs every forward before any backward: m. 1F1B starts backward once the pipe is
    full: min(m, p - rank). Interleaved 1F1B (torch.distributed.pipelining's) warms up
    (v - 1) x (microbatches per round) + 2 (p - 1 - rank) chunk forwards, capped at m v, then
    holds one more; spread over the rank's v chunks.
    """
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - rank))
    per_round = m // max(1, m // p)
    chunks = min(m * v, (v - 1) * per_round + 2 * (p - 1 - rank) + 1)
    return chunks / v


def schedule_problem(schedule: str, p: int, m: int, v: int) -> str | None:
    """Why `schedule` cannot run m microbatches on p ranks with v stages each (None if it can)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}"
    if m < 1:
        return "the number of microbatches must be at least 1"
    if schedule == "interleaved":
        if v < 2:
            return "interleaved 1F1B needs at least 2 virtual stages per pp rank"
        rounds = max(1, m // p)
        if m % rounds:
            return (f"interleaved 1F1B on {p} pp ranks runs microbatches in rounds of "
                    f"{m // rounds}; {m} microbatches is not a multiple")
    elif v != 1:
        return f"{schedule} runs one stage per pp rank (virtual_stages=1)"
    if schedule == "1f1b" and m < p:
        return f"1F1B needs at least as many microbatches as pp ranks ({m} < {p})"
    return None


# -- blocks ------------------------------------------------------------------------------------

@dataclass
class Block:
    """One layer block, priced at the traced batch (see the module docstring)."""

    name: str
    time: float              # t_b at the traced batch (s per microbatch, fwd + bwd)
    time_fixed: float        # f_b: the part that does not shrink with the microbatch
    grad_sync: float         # g_b (s per step)
    param_bytes: float       # w_b
    act_bytes: float         # a_b at the traced batch
    cut_time: float = 0.0    # c_b at the traced batch (0 for the last block)
    cut_fixed: float = 0.0
    draw: float = 0.0        # d_b: seconds of its random draws at the traced batch (in time)
    accumulate: float = 0.0  # g'_b: seconds of adding a microbatch's gradients (not in time)
    drawn: float = 0.0       # bytes of its largest random draw at the traced batch
    # bytes of its largest random draw that do not grow with the batch (counter randomness
    # draws a block in chunks: solver/memory.py draw_bytes)
    drawn_fixed: float = 0.0


def microbatch_time(block: Block, sigma: float, m: int) -> float:
    """t_b: seconds of `block` per microbatch of sigma times the traced batch, in a step of
    m microbatches (each draws the whole batch's random numbers and adds its gradients to the
    step's: the module docstring)."""
    return block.time_fixed + (block.time - block.time_fixed - block.draw) * sigma \
        + block.draw * m * sigma + block.accumulate * (m - 1) / m


def replay_time(blocks: list[Block], sigma: float, m: int) -> float:
    """R: seconds every pp rank spends once per step drawing every block's random numbers
    for the whole batch (runtime/pipeline.py moves its generator past them)."""
    return sum(b.draw for b in blocks) * m * sigma


@dataclass
class StageSolution:
    """A cut of the chain for one schedule and microbatch count."""

    schedule: str
    microbatches: int
    virtual_stages: int
    cuts: list[int]                # first block of stages 1..S-1
    objective: float               # predicted seconds per step
    stage_time: list[float]        # seconds per microbatch
    rank_memory: list[float]       # bytes per device
    in_flight: list[float]         # per stage
    solve_time: float = 0.0
    optimal: bool = True           # proven optimal (else the best found in the time limit)
    candidates: list[tuple[str, int, int, float]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, len(self.rank_memory), self.microbatches,
                               self.virtual_stages)


def solve_stages(blocks: list[Block], p: int, schedule: str, m: int, v: int, sigma: float,
                 memory_budget: float | None, time_limit: float = 1.0, *,
                 overlap: bool = False) -> StageSolution | None:
    """The ILP of the module docstring, on CP-SAT; None when no cut fits the memory budget.
    With `overlap` (the hardware's) and a schedule that `hides_sends`, the busiest rank's
    time bounds its work and its sends separately (`step_time`'s `sends`).

    Times are integers of TICK seconds for CP-SAT; the objective is scaled by TIE, plus the
    busiest rank's time as a tie-break toward balanced ranks (with one microbatch any cut is
    as fast). `time_limit` is CP-SAT's deterministic time, so
    the same problem always gets the same answer; the result says whether it is proven
    optimal."""
    from ortools.sat.python import cp_model  # imported when first solving: import is slow

    n, num_stages = len(blocks), p * v
    if num_stages > n:
        raise StageError(too_few_blocks(blocks, num_stages, p, v))
    start = time.perf_counter()
    t = [microbatch_time(b, sigma, m) for b in blocks]
    c = [b.cut_fixed + (b.cut_time - b.cut_fixed) * sigma for b in blocks]
    a = [b.act_bytes * sigma for b in blocks]
    k = [in_flight(schedule, p, m, v, r) for r in range(p)]
    # the largest random draw, of the whole batch in every microbatch, while its op runs
    # (solver/memory.py draw_bytes), on any rank: off the budget
    drawn = max((b.drawn * m * sigma + b.drawn_fixed for b in blocks), default=0.0)
    ti, ci, gi = ([round(x / TICK) for x in xs] for xs in (t, c, [b.grad_sync for b in blocks]))
    model = cp_model.CpModel()
    # Block b can only be in stages s with s <= b and S - 1 - s <= n - 1 - b.
    span = {b: range(max(0, num_stages - n + b), min(b, num_stages - 1) + 1) for b in range(n)}
    x = {(b, s): model.NewBoolVar(f"x{b},{s}") for b in range(n) for s in span[b]}
    for b in range(n):
        model.AddExactlyOne(x[b, s] for s in span[b])
    model.Add(x[0, 0] == 1)
    model.Add(x[n - 1, num_stages - 1] == 1)
    for b in range(1, n):  # contiguous, in order: block b follows b - 1 or starts the next stage
        for s in span[b]:
            model.AddBoolOr([x[b - 1, q] for q in (s, s - 1) if (b - 1, q) in x]
                            + [x[b, s].Not()])
    y = {}
    for b in range(n - 1):
        for s in span[b]:
            if s < num_stages - 1 and ci[b]:
                y[b, s] = model.NewBoolVar(f"y{b},{s}")
                model.AddBoolOr([x[b, s].Not(), y[b, s]]
                                + ([x[b + 1, s]] if (b + 1, s) in x else []))
    horizon = sum(ti) + sum(ci) + 1
    work = [sum(ti[b] * x[b, s] for b in range(n) if (b, s) in x) for s in range(num_stages)]
    sends = [sum(ci[b] * y[b, s] for b in range(n - 1) if (b, s) in y)
             for s in range(num_stages)]
    stage_t = [w + c for w, c in zip(work, sends)]
    hide = hides_sends(schedule, overlap)
    busiest = model.NewIntVar(0, horizon, "T")
    slowest = model.NewIntVar(0, horizon, "C")
    sync = model.NewIntVar(0, sum(gi) + 1, "G")
    for s in range(num_stages):
        model.Add(slowest >= stage_t[s])
    # Redundant, for a tighter relaxation: the busiest rank does at least its share, the
    # slowest stage at least the average and at least the longest block.
    model.Add(p * busiest >= sum(work if hide else stage_t))
    model.Add(num_stages * slowest >= sum(stage_t))
    model.Add(slowest >= max(ti))
    for r in range(p):
        mine = range(r, num_stages, p)
        if hide:  # the pace: the longer of the rank's work and its sends beside it
            model.Add(busiest >= sum(work[s] for s in mine))
            model.Add(busiest >= sum(sends[s] for s in mine))
        else:
            model.Add(busiest >= sum(stage_t[s] for s in mine))
        model.Add(sync >= sum(gi[b] * x[b, s] for s in mine for b in range(n) if (b, s) in x))
        if memory_budget is not None and memory_budget != float("inf"):
            model.Add(sum(round(blocks[b].param_bytes + k[r] * a[b]) * x[b, s] for s in mine
                          for b in range(n) if (b, s) in x) <= int(memory_budget - drawn))
    ws, wt, wc = objective_weights(p, m, v)
    model.Minimize(TIE * (ws * sum(stage_t) + wt * busiest + wc * slowest + sync) + busiest)
    for (b, s), var in x.items():  # start from the cut that balances block times
        model.AddHint(var, s == _balanced(t, num_stages)[b])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        return None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise StageError(f"the stage solver found no cut of {n} blocks into {num_stages} "
                         f"stages within its time limit ({solver.StatusName(status)})")
    stage = [next(s for s in span[b] if solver.Value(x[b, s])) for b in range(n)]
    cuts = [b for b in range(1, n) if stage[b] != stage[b - 1]]
    sent = [sum(c[b] for b in range(n - 1) if stage[b] == s and stage[b + 1] != s)
            for s in range(num_stages)]
    times = [sum(t[b] for b in range(n) if stage[b] == s) + sent[s] for s in range(num_stages)]
    syncs = [sum(blocks[b].grad_sync for b in range(n) if stage[b] == s)
             for s in range(num_stages)]
    memory = [sum(blocks[b].param_bytes + k[r] * a[b] for b in range(n) if stage[b] % p == r)
              + drawn for r in range(p)]
    return StageSolution(schedule, m, v, cuts,
                         step_time(times, syncs, p, m, v, sent if hide else None,
                                   replay_time(blocks, sigma, m)), times,
                         memory, [k[s % p] for s in range(num_stages)],
                         time.perf_counter() - start, status == cp_model.OPTIMAL)


def _balanced(t: list[float], num_stages: int) -> list[int]:
    """The stage of each block when cuts fall nearest equal shares of the total time."""
    n, total = len(t), sum(t) or 1.0
    stage, acc = [], 0.0
    for b, tb in enumerate(t):
        s = min(int((acc + tb / 2) / total * num_stages), num_stages - 1)
        s = max(s, num_stages - n + b, stage[-1] if stage else 0)  # room for the stages left
        s = min(s, b, (stage[-1] + 1) if stage else 0)
        stage.append(s)
        acc += tb
    return stage


def step_time(stage_time: list[float], grad_sync: list[float], p: int, m: int, v: int,
              sends: list[float] | None = None, replay: float = 0.0) -> float:
    """The objective of the module docstring for given per-stage times (s per step). With
    `sends` (each stage's seconds of sends within its time, for a schedule that issues them
    beside compute: `hides_sends`) a rank's steady-state pace is the longer of its work and
    its sends (`rank_pace`); the fill and drain wait for every send. `replay`: R, the
    step's draws every pp rank runs once (`replay_time`)."""
    syncs = [sum(grad_sync[r::p]) for r in range(p)]
    ws, wt, wc = objective_weights(p, m, v)
    return ws * sum(stage_time) + wt * max(rank_pace(stage_time, p, sends)) \
        + wc * max(stage_time) + max(syncs) + replay


def rank_pace(stage_time: list[float], p: int, sends: list[float] | None = None) -> list[float]:
    """Seconds per microbatch of each pp rank's stages in the steady state: their times
    summed, or with `sends` (see `step_time`) the longer of the rest and the sends."""
    if sends is None:
        return [sum(stage_time[r::p]) for r in range(p)]
    return [max(sum(stage_time[r::p]) - sum(sends[r::p]), sum(sends[r::p])) for r in range(p)]


def hides_sends(schedule: str, overlap: bool) -> bool:
    """Whether the runtime's `schedule` sends between stages beside compute in its steady
    state, on hardware whose communication overlaps compute (`overlap`).
    torch.distributed.pipelining's interleaved 1F1B (`_PipelineScheduleRuntime`) posts each
    receive when its sender sends and waits for it only before the chunk that needs it, so a
    rank's transfers run under its other chunks' compute. Its GPipe and 1F1B wait for each
    receive just before the compute that needs it (1F1B: with the previous send), and a
    send completes only once its receiver has posted the receive: there every transfer is on
    the critical path."""
    return overlap and schedule == "interleaved"


def too_few_blocks(blocks: list[Block], num_stages: int, p: int, v: int) -> str:
    names = ", ".join(b.name for b in blocks)
    extra = f" ({p} pp ranks x {v} virtual stages)" if v > 1 else ""
    return (f"cannot cut the model into {num_stages} pipeline stages{extra}: its graph has "
            f"only {len(blocks)} layer blocks ({names}), and autopar cuts only between blocks. "
            f"Use a pp mesh dimension of at most {len(blocks)}"
            + (", fewer virtual stages" if v > 1 else "") + ", or a deeper model.")


def choose(blocks: list[Block], p: int, batch: int, traced_batch: int,
           memory_budget: float | None, *, microbatches: int | None = None,
           schedule: str | tuple[str, ...] | None = None, virtual_stages: int | None = None,
           time_limit: float = 1.0, max_microbatches: int = 128,
           max_virtual_stages: int = 4, overlap: bool = False,
           split_by: tuple[int, ...] = ()) -> StageSolution:
    """The best (schedule, microbatch count, virtual stages, cuts) over the candidates the
    options leave open: every schedule (or those named); microbatch counts that divide the
    batch (up to `max_microbatches`) into microbatches each stage mesh dimension (of sizes
    `split_by`) can still shard where it can shard the batch (`microbatch_counts`);
    2 .. `max_virtual_stages` virtual stages for
    interleaved. Candidates are solved in order of a lower bound on their step time (perfectly
    balanced stages, free sends) and skipped once the bound cannot beat the best found. Ties go
    to less memory, then to the earlier candidate (1F1B before GPipe before interleaved, fewer
    microbatches). `overlap`: the hardware's (see `solve_stages`)."""
    candidates = schedule_candidates(blocks, p, batch, microbatches, schedule,
                                     virtual_stages, max_microbatches, max_virtual_stages,
                                     split_by)

    def bound(cand):
        return candidate_floor(blocks, p, batch, traced_batch, cand)

    order = sorted(range(len(candidates)), key=lambda i: (bound(candidates[i]), i))
    best: StageSolution | None = None
    best_i = -1
    tried = []
    start = time.perf_counter()
    for i in order:
        sched, m, v = candidates[i]
        if best is not None and bound(candidates[i]) > best.objective * (1 + 1e-9):
            break
        sol = solve_stages(blocks, p, sched, m, v, (batch / m) / traced_batch, memory_budget,
                           time_limit, overlap=overlap)
        if sol is None:
            continue
        tried.append((sched, m, v, sol.objective))
        better = best is None or sol.objective < best.objective * (1 - 1e-9)
        tie = best is not None and sol.objective <= best.objective * (1 + 1e-9)
        if better or (tie and (max(sol.rank_memory), i) < (max(best.rank_memory), best_i)):
            best, best_i = sol, i
    if best is None:
        raise StageError(no_fit(blocks, memory_budget, p))
    best.candidates = tried
    best.solve_time = time.perf_counter() - start
    return best


def schedule_candidates(blocks: list[Block], p: int, batch: int,
                        microbatches: int | None = None,
                        schedule: str | tuple[str, ...] | None = None,
                        virtual_stages: int | None = None, max_microbatches: int = 128,
                        max_virtual_stages: int = 4, split_by: tuple[int, ...] = ()
                        ) -> list[tuple[str, int, int]]:
    """The (schedule, microbatch count, virtual stages) `choose` tries for the layer blocks
    on `p` pp ranks (see there); StageError when none fits the options."""
    n = len(blocks)
    if p * (virtual_stages or 1) > n:
        raise StageError(too_few_blocks(blocks, p * (virtual_stages or 1), p,
                                        virtual_stages or 1))
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise StageError(f"the batch of {batch} does not split into {microbatches} "
                         f"microbatches; choose a divisor of {batch} ("
                         + ", ".join(str(d) for d in divisors(batch, batch)) + ")")
    ms = [microbatches] if microbatches else \
        microbatch_counts(batch, max_microbatches, split_by, p)
    schedules = [schedule] if isinstance(schedule, str) else list(schedule or SCHEDULES)
    candidates: list[tuple[str, int, int]] = []
    reasons = []
    for sched in schedules:
        if sched == "interleaved":
            top = min(n // p, max_virtual_stages)
            vs = [virtual_stages] if virtual_stages else list(range(2, top + 1))
        else:
            vs = [virtual_stages or 1]
        for v in vs:
            for m in ms:
                why = schedule_problem(sched, p, m, v)
                if why is None and p * v <= n:
                    candidates.append((sched, m, v))
                elif why:
                    reasons.append(why)
                elif schedule == "interleaved":
                    reasons.append(too_few_blocks(blocks, p * v, p, v))
    if not candidates:
        raise StageError("no pipeline schedule fits the options: " + "; ".join(
            dict.fromkeys(reasons)))
    return candidates


def candidate_floor(blocks: list[Block], p: int, batch: int, traced_batch: int,
                    candidate: tuple[str, int, int]) -> float:
    """A lower bound on `solve_stages`' objective (`step_time`) for `candidate` (schedule,
    m, v): stages perfectly balanced, sends free, every pp rank synchronizing an equal share
    of the gradients."""
    _, m, v = candidate
    sigma = (batch / m) / traced_batch
    times = [microbatch_time(b, sigma, m) for b in blocks]
    work = sum(times)
    ws, wt, wc = objective_weights(p, m, v)
    busiest = max(work / p, _whole_blocks(times, p, p - 1))
    slowest = max(work / (p * v), max(times), _whole_blocks(times, p * v, p * v - 1))
    return ws * work + wt * busiest + wc * slowest \
        + sum(b.grad_sync for b in blocks) / p + replay_time(blocks, sigma, m)


def _whole_blocks(times: list[float], bins: int, last: int) -> float:
    """The least load of the fullest of `bins` (stages, or pp ranks) that hold whole blocks
    of `times`: bin 0 the first block, bin `last` the last one, and the blocks between (each
    taking at least the least of their times, t) spread over all of them. Bins holding k of
    those blocks and their fixed blocks e_r fit under T when sum_r floor((T - e_r) / t) >= k:
    the least such T, by bisection (a lower bound whatever the cut: 80 equal layers over 8
    pp ranks, the last also holding the head, put 11 layers on some rank, or 10 and the
    head, where the average is 10.1)."""
    middle = times[1:-1]
    if bins < 2 or not middle or min(middle) <= 0:
        return 0.0
    t, k = min(middle), len(middle)
    fixed = [0.0] * bins
    fixed[0] += times[0]
    fixed[last] += times[-1]

    def holds(limit: float) -> bool:
        return sum(int((limit - e) // t) for e in fixed if limit >= e) >= k

    low, high = max(fixed), max(fixed) + (k + 1) * t
    for _ in range(60):
        mid = (low + high) / 2
        if holds(mid):
            high = mid
        else:
            low = mid
    return low


def no_fit(blocks: list[Block], memory_budget: float | None, p: int) -> str:
    big = max(blocks, key=lambda b: b.param_bytes + b.act_bytes)
    total = sum(b.param_bytes for b in blocks)
    return (f"no cut of the model's {len(blocks)} layer blocks into stages on {p} pp ranks "
            f"fits {memory_budget / 2**30:.2f} GiB per device (parameters, gradients and "
            f"optimizer state alone are {total / 2**30:.2f} GiB; the largest block, {big.name}, "
            f"needs {(big.param_bytes + big.act_bytes) / 2**30:.2f} GiB). The graph cannot "
            "be cut inside a block: use more pp ranks, shard more on the other mesh "
            "dimensions, or a smaller batch.")


def microbatch_counts(batch: int, limit: int, split_by: tuple[int, ...], p: int = 1
                      ) -> list[int]:
    """The microbatch counts (up to `limit`) that divide `batch` into microbatches each mesh
    dimension of `split_by`'s sizes still divides where it divides the batch, when one of
    them fills the `p` pp ranks' pipeline (at least p microbatches); else every divisor.

    The blocks are priced at the whole batch, where a mesh dimension dividing it shards the
    samples; a microbatch it no longer divides (2304 samples over dp 24 in 64 microbatches of
    36) falls back to sharding something else, at a price the cut never saw. A batch too
    small to keep that and fill the pipeline (8 samples over dp 8 on 2 pp ranks) keeps every
    count: one microbatch would leave each pp rank idle half the step."""
    keep = [n for n in split_by if n > 1 and batch % n == 0]
    counts = divisors(batch, limit)
    whole = [m for m in counts if all((batch // m) % n == 0 for n in keep)]
    return whole if max(whole) >= p else counts


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]

