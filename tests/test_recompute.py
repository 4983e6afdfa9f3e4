"""Activation recomputation: priced by the planner, chosen when memory needs it, run under
torch.utils.checkpoint with the same numbers as without, and the model's own checkpoints kept."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import autopar
from autopar import planner
from autopar.passes.trace import TraceError, trace_example
from autopar.solver.ilp import NoFeasiblePlan
from autopar.zoo import GPT, GPTConfig, lm_loss
from tests import cost_tasks, rank_tasks
from tests.rank_tasks import build

SPEC = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")


def _text(plan) -> str:
    """The printed plan with its wrapped lines joined."""
    return " ".join(str(plan).split())


def _plan(name="gpt", **options):
    model, loss_fn, example = build(name)
    return autopar.plan(model, SPEC, example, loss_fn=loss_fn, **options)


def test_recomputation_trades_time_for_memory():
    """Full recomputation keeps less than selective, which keeps less than none; each costs
    more time (backward runs the recomputed forward again); the plan says what recomputes."""
    plans = {r: _plan(recompute=r, force="data") for r in ("none", "selective", "full")}
    act = {r: p.cost.memory["activations"] for r, p in plans.items()}
    step = {r: p.cost.step_time for r, p in plans.items()}
    assert act["full"] < act["selective"] < act["none"]
    assert step["none"] < step["selective"] < step["full"]
    assert plans["none"].recompute.mode == "none" and not plans["none"].recompute.mode_of
    for r in ("selective", "full"):
        assert plans[r].recompute.mode == r
        assert plans[r].recompute.blocks == ("h.0", "h.1")  # the layers, not embedding or head
        assert f"recomputation: {r} in 2 blocks (h.0, h.1)" in _text(plans[r])
    # the extra time is the recomputed forward: compute grows by less than the forward
    extra = plans["full"].cost.compute - plans["none"].cost.compute
    assert 0 < extra < plans["none"].cost.compute_forward


def test_planner_recomputes_only_when_the_plan_does_not_fit_otherwise():
    """With room, nothing recomputes; with a budget only recomputation meets (gradient
    accumulation ruled out), the planner recomputes, and the plan fits its budget."""
    assert _plan(force="data").recompute.mode == "none"
    none, full = (_plan(recompute=r, force="data") for r in ("none", "full"))
    budget = (none.cost.peak_memory + full.cost.peak_memory) / 2
    plan = _plan(force="data", memory_budget=budget, microbatches=1)
    assert plan.recompute.mode in ("selective", "full")
    assert plan.cost.peak_memory <= budget
    with pytest.raises(NoFeasiblePlan, match="recomputation"):
        _plan(force="data", memory_budget=full.cost.peak_memory * 0.9, microbatches=1)


def test_plan_round_trips_its_recomputation():
    plan = _plan(recompute="selective")
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again.recompute == plan.recompute and again.hash() == plan.hash()
    assert _plan(recompute="full").hash() != plan.hash()


def test_bad_recompute_option():
    with pytest.raises(ValueError, match="recompute must be one of"):
        _plan(recompute="some")
    model, loss_fn, example = build("gpt")
    pp = autopar.MeshSpec((2,), names=("pp",), hardware="cpu")
    # a pipeline recomputes its stages' layer blocks as asked (tests/test_pipeline.py trains it)
    plan = autopar.plan(model, pp, example, loss_fn=loss_fn, recompute="full")
    assert set(plan.recompute.mode_of.values()) == {"full"}


class _Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return cp.checkpoint(self.fc, x, use_reentrant=True)


def test_reentrant_checkpoint_is_refused():
    """A reentrant checkpoint runs its forward without autograd: a trace would lose the
    gradients of what it wraps, so it is refused, with the fix."""
    with pytest.raises(TraceError, match="use_reentrant=False"):
        autopar.plan(_Reentrant(), SPEC, (torch.randn(4, 8), torch.randn(4, 8)),
                     loss_fn=nn.functional.mse_loss)


def test_model_checkpointing_is_kept_unless_the_plan_says_otherwise():
    """Hugging Face gradient checkpointing (non-reentrant) marks the decoder layers: the plan
    recomputes them in full, and says so; recompute="none" drops them, and says that."""
    kept = _plan("hf_llama_checkpointed")
    assert len(kept.recompute.user) == 3 and kept.recompute.mode == "full"
    assert "torch.utils.checkpoint regions" in _text(kept)
    assert "recompute in full" in _text(kept)
    dropped = _plan("hf_llama_checkpointed", recompute="none")
    assert not dropped.recompute.mode_of and "decided otherwise" in _text(dropped)
    assert dropped.cost.memory["activations"] > kept.cost.memory["activations"]


# -- on ranks ------------------------------------------------------------------------------------

CASES = [("full", "data"), ("full", "fsdp"), ("full", "tensor"), ("selective", "data"),
         ("selective", "tensor")]


@pytest.mark.parametrize("mode,force", CASES, ids=lambda c: str(c))
def test_recomputed_training_equals_one_device(world2, mode, force):
    """Loss, gradients and parameters after three steps equal single-device training (float64,
    the equivalence tests' tolerance), with every layer block recomputed."""
    plan = world2.run(rank_tasks.train_equivalence, "gpt", (2,), force,
                      options={"recompute": mode})[0]
    assert set(plan["recompute"]["mode_of"].values()) == {mode}


def test_recomputation_on_a_two_by_two_mesh(world4):
    world4.run(rank_tasks.train_equivalence, "hf_llama", (2, 2), {"dp": "fsdp", "tp": "tensor"},
               options={"recompute": "full"})


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_recomputed_dropout_draws_the_same_numbers(world2, force):
    """Dropout inside recomputed blocks draws in backward what it drew in forward (checkpoint
    restores the generator): training still equals one device."""
    plan = world2.run(rank_tasks.dropout_equivalence, "hf_gpt2_dropout", (2,), force,
                      options={"recompute": "full"})[0]
    assert plan["recompute"]["mode_of"]


def test_model_checkpointing_trains_as_on_one_device(world2):
    plan = world2.run(rank_tasks.train_equivalence, "hf_llama_checkpointed", (2,), "data")[0]
    assert plan["recompute"]["user"]


@pytest.mark.parametrize("name", ["batchnorm_blocks", "offset_blocks"])
def test_state_updated_in_forward_is_updated_once(world2, name):
    """Layer blocks that update a buffer in forward (BatchNorm's running statistics in training
    mode; an offset read, then advanced under torch.no_grad()) train as on one device under
    full and selective recomputation: buffers, losses and parameters after two steps. The ops
    that write or read the buffer run once (backward does not run them again, which would
    update the buffer twice, or read it updated); they cut each block's recomputed run in two,
    and the plan numbers (prices) the runs the ranks checkpoint."""
    for mode in ("full", "selective"):
        plan = world2.run(rank_tasks.train_equivalence, name, (2,), "data",
                          options={"recompute": mode, "microbatches": 1})[0]["recompute"]
        recomputed = set(plan["mode_of"])
        assert {"linear_1", "tanh"} <= recomputed  # the first block's product and activation
        assert not {"batch_norm", "add_"} & recomputed  # the norm, the offset's update
        if name == "offset_blocks":
            assert "add" not in recomputed  # reads the offset
        assert len(set(plan["block_of"].values())) > len(plan["blocks"]) == 3


def test_measured_activations_follow_the_prediction(world2):
    """What a step holds from forward into backward, measured on the ranks (the profiler's
    tensor allocations less frees), is within 10% of the plan's predicted activations with no,
    selective and full recomputation; recomputation shrinks it, and the plan prices one
    block's activations on top ("recomputed"), live again while backward recomputes it."""
    model = ("gpt", {"vocab_size": 128, "block_size": 64, "n_layer": 4, "n_head": 4,
                     "n_embd": 64, "batch": 8})
    held = {}
    for mode in ("none", "selective", "full"):
        # Data parallel: under tensor parallelism a step holds about 2 MiB more at the start of
        # backward than autograd saves, with or without recomputation (see RESULTS.md).
        for got in world2.run(cost_tasks.measured_activations, model, (2,), "data", mode):
            predicted = got["predicted"]
            assert got["mode"] == mode
            assert got["measured"] == pytest.approx(predicted["activations"], rel=0.10), \
                (mode, got)
            assert (predicted.get("recomputed", 0) > 0) == (mode != "none")
            held[mode] = got["measured"]
    assert held["full"] < held["selective"] < held["none"]


DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
        "all_reduce": "all_reduce", "all_to_all": "all_to_all"}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_full_recomputation_issues_tensor_parallel_collectives_again(world2, mode):
    """Under tensor parallelism a fully recomputed block's collectives are inside its run:
    backward issues each of them again (and keeps what they read), as the plan prices it;
    selective recomputation keeps their results and issues none again. Counted on the ranks:
    what forward issues is what the plan lists for forward, and what backward issues inside
    recomputed runs is the plan's backward collectives less the duals of its forward ones."""
    for got in world2.run(cost_tasks.issued_collectives, "gpt", (2,), "tensor", mode):
        counts = got["counts"]
        planned = Counter(map(tuple, got["planned"]))
        kinds = DUAL.keys()
        issued = {k: sum(n for key, n in counts.items() if key.startswith("forward/")
                         and key.endswith("/" + k)) for k in kinds}
        assert issued == {k: planned[(k, "forward")] for k in kinds}
        again = {k: counts.get(f"backward/run/{k}", 0) for k in kinds}
        priced = {k: planned[(k, "backward")] - planned[(DUAL[k], "forward")] for k in kinds}
        assert again == priced
        in_runs = {k: counts.get(f"forward/run/{k}", 0) for k in kinds}
        if mode == "full":
            assert again == in_runs and sum(again.values()) > 0
        else:
            assert sum(again.values()) == sum(in_runs.values()) == 0


def test_compute_floor_bounds_every_plan_of_its_level():
    """Each op at its cheapest strategy is a floor on a plan's compute, hence its step: below
    the compute of the plan the solver finds with each recomputation mode, and higher the
    more the mode recomputes."""
    model, loss_fn, example = build("gpt")
    program = trace_example(model, example, loss_fn)
    options = autopar.PlanOptions()
    floors = {}
    for mode in ("none", "selective", "full"):
        plan = _plan(recompute=mode)
        floors[mode] = planner.level_floor(program, SPEC, options, mode)
        assert 0 < floors[mode] <= plan.cost.compute * (1 + 1e-9) <= plan.cost.step_time
    assert floors["none"] < floors["selective"] < floors["full"]


def test_planner_skips_levels_its_solvers_bound_puts_within_the_gap(monkeypatch):
    """Each level of the memory search only adds work to every plan (parameters gathered
    again, ops recomputed), so the first level's bound (the solver's optimum without the
    budget) is below every plan found; once a plan fits within LEVEL_GAP of it, the next
    levels are not solved, and with no gap allowed they are."""
    none = _plan(recompute="none")
    budget = none.cost.peak_memory * 1.05  # fits without recomputation, and memory binds
    tried, bounds, steps = [], [], []
    solve_plan = planner.solve_plan

    def counted(*args, **kwargs):
        tried.append(kwargs.get("recompute"))
        if kwargs.get("bounds") is not None:
            bounds.append(kwargs["bounds"])
        plan, graph = solve_plan(*args, **kwargs)
        steps.append(plan.cost.step_time)
        return plan, graph

    monkeypatch.setattr(planner, "solve_plan", counted)
    monkeypatch.setattr(planner, "level_floor", lambda *a: 0.0)  # floors rule nothing out
    for gap, skipped in ((float("inf"), True), (-1.0, False)):
        for seen in (tried, bounds, steps):
            seen.clear()
        monkeypatch.setattr(planner, "LEVEL_GAP", gap)
        plan = _plan(memory_budget=budget, microbatches=1)
        assert plan.recompute.mode == "none"
        (bound,), = bounds  # the first level's, one per microbatch count
        assert 0 < bound <= min(steps) * (1 + 1e-3)
        assert ("selective" in tried) is not skipped


def test_planner_skips_recomputation_that_cannot_beat_a_plan_that_fits(monkeypatch):
    """Once a plan fits, a recomputation level whose compute floor is no faster is not
    solved; with floors that never rule out, the same budget tries the next levels."""
    none, full = (_plan(recompute=r, force="data") for r in ("none", "full"))
    budget = none.cost.peak_memory * 1.05  # fits without recomputation, and memory binds
    tried = []
    solve_plan = planner.solve_plan

    def counted(*args, **kwargs):
        tried.append(kwargs.get("recompute"))
        return solve_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "solve_plan", counted)
    for floor, expect in ((float("inf"), ["none", "none"]), (0.0, None)):
        tried.clear()
        monkeypatch.setattr(planner, "level_floor", lambda *a, f=floor: f)
        plan = _plan(force="data", memory_budget=budget, microbatches=1)
        assert plan.recompute.mode == "none"
        if expect is not None:
            assert tried == expect
        else:
            assert "selective" in tried  # memory binds: the next level is tried


def test_a_later_count_skips_the_plan_without_the_budget_when_nothing_it_keeps_fits(
        monkeypatch):
    """After a plan fits (full recomputation, the whole batch), the next microbatch count
    solves the relaxation of its level that frees parameters first: when not even that fits,
    neither that level nor the one keeping them gathered is solved (the fastest plan without
    the budget, 1.6 s of Llama-3 70B's planning on (8, 8)), and the plan found is the one
    found with both solved."""
    model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64))
    x = torch.randint(0, 128, (8, 64))
    example = (x, torch.roll(x, -1, 1))
    free = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=float("inf"))
    tried = []
    solve_plan = planner.solve_plan

    def counted(*args, **kwargs):
        if not kwargs.get("relax_only"):
            tried.append((kwargs["accumulation"], kwargs["recompute"], kwargs["reshard"]))
        return solve_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "solve_plan", counted)
    plans = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(planner, "_first_freeing", lambda *a: None)
        tried.clear()
        plans.append(autopar.plan(model, SPEC, example, loss_fn=lm_loss,
                                  memory_budget=free.cost.peak_memory * 0.45))
        at = {k: [(r, freed) for m, r, freed in tried if m == k] for k in (1, 2)}
        for level in (("none", False), ("none", True)):
            assert level in at[1] and (level in at[2]) is not check
    assert plans[0].accumulation == 2 and plans[0].recompute.mode == "full"
    assert plans[0].hash() == plans[1].hash()


def test_levels_of_a_search_cluster_and_plan_recomputation_once(monkeypatch):
    """The levels of the memory search share one strategy graph: its clustering and each
    recomputation mode's plan are worked out once, however many levels are solved."""
    none = _plan(recompute="none")
    clustered, planned, tried = [], [], []
    cluster, recompute_plan, solve_plan = planner.cluster, planner.recompute_plan, \
        planner.solve_plan
    monkeypatch.setattr(planner, "cluster", lambda *a, **k: clustered.append(1) or
                        cluster(*a, **k))
    monkeypatch.setattr(planner, "recompute_plan", lambda p, g, mode, **k:
                        planned.append(mode) or recompute_plan(p, g, mode, **k))
    monkeypatch.setattr(planner, "solve_plan", lambda *a, **k: tried.append(k["recompute"])
                        or solve_plan(*a, **k))
    monkeypatch.setattr(planner, "LEVEL_GAP", -1.0)  # every level solved
    _plan(memory_budget=none.cost.peak_memory * 1.05, microbatches=1)
    assert len(tried) >= 3 and len(set(tried)) == 3
    assert len(clustered) == 1
    assert sorted(planned) == ["full", "none", "selective"]
