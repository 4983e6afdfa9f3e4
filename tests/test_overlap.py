"""Collectives beside compute: on GPUs the runtime's FSDP gathers and gradient buckets run on
their own stream and hide under compute; the cost model prices only what is exposed."""

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.passes import strategies
from autopar.passes.trace import trace, trace_example
from autopar.solver.cost import CostModel, Split, step_seconds
from autopar.solver.ilp import plan_split, plan_time, solve
from autopar.timeline import step_segments
from autopar.zoo import hf_llama, lm_loss
from tests.models import MLP


def test_a_pass_takes_the_longer_of_its_compute_and_its_side_collectives():
    total = Split(forward=3.0, backward=6.0, side_forward=2.0, side_backward=8.0)
    assert step_seconds(total, overlap=False) == (19.0, 0.0, 0.0)
    assert step_seconds(total, overlap=True) == (3.0 + 8.0, 2.0, 6.0)
    # a tenth of the side collectives (the first and last buckets) has nothing to hide under
    step, hidden_f, hidden_b = step_seconds(total, overlap=True, edge=0.1)
    assert (hidden_f, hidden_b) == pytest.approx((1.8, 6.0))
    assert step == pytest.approx(3.2 + 8.0)


def _llama(layers=2):
    with torch.device("meta"):
        model = hf_llama(num_hidden_layers=layers, vocab_size=32000,
                         max_position_embeddings=4096, hidden_size=2048,
                         num_attention_heads=16, num_key_value_heads=8, intermediate_size=5632)
    ids = torch.randint(0, 32000, (8, 2048), device="meta")
    return model, (ids, ids)


def test_fsdp_gathers_and_reduce_scatters_hide_under_compute_on_gpus():
    """FSDP on 8 H100s: the gathers and reduce-scatters are priced and listed in full, and the
    step is shorter than compute plus communication by what hides; each pass hides no more
    than its compute; the timeline's segments add up to the step with the hidden part
    apart."""
    model, example = _llama()
    plan = autopar.plan(model, autopar.MeshSpec((8,), hardware="h100"), example,
                        loss_fn=lm_loss, force="fsdp")
    cost = plan.cost
    hidden = sum(cost.hidden.values())
    assert hidden > 0.5 * cost.communication_total
    assert set(cost.hidden) <= {"all_gather", "reduce_scatter", "gradient_sync"}
    assert cost.step_time == pytest.approx(cost.compute + cost.communication_total - hidden)
    assert cost.step_time >= max(cost.compute, cost.communication_total)
    assert cost.step_time == pytest.approx(cost.solver_objective, rel=1e-6)
    segments = step_segments(plan)
    assert sum(s.seconds for s in segments) == pytest.approx(cost.step_time)
    assert sum(s.hidden for s in segments) == pytest.approx(hidden)
    assert "hidden under compute" in plan.table()


def test_tensor_parallel_collectives_stay_on_the_critical_path():
    model, example = _llama()
    plan = autopar.plan(model, autopar.MeshSpec((8,), hardware="h100"), example,
                        loss_fn=lm_loss, force="tensor")
    assert plan.cost.communication["all_reduce"] + plan.cost.communication["reduce_scatter"] \
        + plan.cost.communication["all_gather"] > 0
    assert not set(plan.cost.hidden) - {"gradient_sync"}


def test_a_model_within_one_bucket_hides_nothing():
    """Its gradients are synchronized in one bucket once backward ends."""
    torch.manual_seed(0)
    model = MLP([128, 128, 128])
    x, y = torch.randn(1024, 128), torch.randint(0, 128, (1024,))
    plan = autopar.plan(model, autopar.MeshSpec((4,), hardware="h100"), (x, y),
                        loss_fn=F.cross_entropy, force="data")
    assert plan.cost.communication["gradient_sync"] > 0 and not plan.cost.hidden


def test_gloo_on_cpus_adds_every_collective():
    model, example = _llama()
    plan = autopar.plan(model, autopar.MeshSpec((8,), hardware="cpu"), example,
                        loss_fn=lm_loss, force="fsdp")
    assert not plan.cost.hidden
    assert plan.cost.step_time == pytest.approx(plan.cost.compute
                                                + plan.cost.communication_total)


def test_the_solvers_optimum_is_its_plans_overlapped_price():
    """The ILP's objective (critical seconds plus each pass's exposed side seconds) is the
    step of the plan it returns, shorter than the same plan with every collective added."""
    model, example = _llama()
    program = trace(model, example[:1], lm_loss, example[1])
    graph = strategies.build(program, (8,))
    cost = CostModel(autopar.MeshSpec((8,), hardware="h100"), graph=graph)
    sol = solve(graph, cost)
    assert plan_time(graph, cost, sol.choice) == pytest.approx(sol.objective, rel=1e-6)
    total = plan_split(graph, cost, sol.choice)
    assert total.side_backward > 0  # parameters synchronized or gathered beside compute
    assert step_seconds(total, False)[0] > sol.objective


def test_edge_share_is_one_bucket_of_what_trains():
    torch.manual_seed(0)
    model = MLP([256, 256, 256])
    x, y = torch.randn(64, 256), torch.randint(0, 256, (64,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (4,))
    params = 2 * (256 * 256 + 256) * 4
    assert CostModel(autopar.MeshSpec((4,), hardware="h100"), graph=graph,
                     bucket_bytes=params / 4).edge_share() == pytest.approx(0.25)
    assert CostModel(autopar.MeshSpec((4,), hardware="h100"), graph=graph).edge_share() == 1.0


def test_the_ilp_prices_a_pass_whose_collectives_outlast_its_compute_exactly():
    """Slow links under overlap (a made-up profile), small buckets: the relaxed solve's plan
    (every side second hidden but the unhidden share) has side collectives outlasting its
    compute, so the solver prices each pass exactly and solves again; its answer equals
    enumeration (it balances the side collectives against compute)."""
    import dataclasses

    from tests.test_solver_properties import brute_force

    slow = dataclasses.replace(autopar.CPU, name="slow-overlapped", overlap=True,
                               intra_node=dataclasses.replace(autopar.CPU.intra_node,
                                                              bandwidth=2e6))
    torch.manual_seed(0)
    model = MLP([32, 32, 32], activation="relu")
    x, y = torch.randn(64, 32), torch.randint(0, 32, (64,))
    graph = strategies.build(trace(model, (x,), F.cross_entropy, y), (2,))
    cost = CostModel(autopar.MeshSpec((2,), hardware=slow), bucket_bytes=1024, graph=graph)
    sol = solve(graph, cost)
    assert cost.edge_share() < 0.2
    # the exact rows were added (the same problem without overlap has none)
    plain = CostModel(autopar.MeshSpec((2,), hardware=autopar.CPU), bucket_bytes=1024,
                      graph=graph)
    assert sol.num_constraints > solve(graph, plain).num_constraints
    assert sol.objective == pytest.approx(brute_force(graph, cost), rel=1e-6)
    assert plan_time(graph, cost, sol.choice) == pytest.approx(sol.objective, rel=1e-6)


def _slow_overlapped_mlp():
    """An MLP on 2 ranks of a made-up profile whose links are slow and overlapped, with small
    buckets (side collectives outlast compute), and a budget binding between its least and
    its fastest plan's memory."""
    import dataclasses

    from autopar.solver.memory import plan_memory

    slow = dataclasses.replace(autopar.CPU, name="slow-overlapped", overlap=True,
                               intra_node=dataclasses.replace(autopar.CPU.intra_node,
                                                              bandwidth=2e6))
    torch.manual_seed(0)
    model = MLP([64, 64, 64, 64], activation="relu")
    x, y = torch.randn(64, 64), torch.randint(0, 64, (64,))
    graph = strategies.build(trace(model, (x,), F.cross_entropy, y), (2,))
    cost = CostModel(autopar.MeshSpec((2,), hardware=slow), bucket_bytes=1024, graph=graph)
    hi = plan_memory(graph, cost, solve(graph, cost).choice)
    lo = plan_memory(graph, cost, solve(graph, cost, minimize="memory").choice)
    return graph, cost, lo + 0.85 * (hi - lo)


def test_re_solves_under_a_binding_budget_skip_the_solve_without_it(monkeypatch):
    """Once the fastest plan did not fit, the re-solves go straight to the budget: one HiGHS
    solve each, not a solve without the budget first (on Llama-3 70B over 512 x 2 H100s that
    first solve took 7 s with the exact rows, for a plan known not to fit)."""
    from autopar.solver import ilp, mip

    graph, cost, budget = _slow_overlapped_mlp()
    calls = []
    real = mip.solve
    monkeypatch.setattr(mip, "solve",
                        lambda prog, *a: calls.append(prog.num_constraints) or real(prog, *a))
    sol = solve(graph, cost, memory_budget=budget)
    # without the budget, under it (relaxed), under it with the exact rows (its plan proven
    # optimal: nothing more)
    assert len(calls) == 3
    assert calls[1] == calls[0] + 1 < calls[2]
    assert sol.objective == pytest.approx(plan_time(graph, cost, sol.choice), rel=1e-6)
    assert ilp.plan_memory(graph, cost, sol.choice) <= budget


def test_an_exact_re_solve_that_finds_nothing_faster_leaves_the_weighted_ones_to_try(
        monkeypatch):
    """When the exact re-solve stops at a plan no faster than the relaxed one (HiGHS did so
    on Llama-3 70B over 512 x 2 H100s: "optimal" at three times the relaxed plan's step), the
    solves weighing side seconds against critical ones still run, as when the exact solve
    finds nothing: both give the same answer."""
    from autopar.solver import ilp, ilp_rows
    from autopar.solver.cost import NO_TIME

    graph, cost, budget = _slow_overlapped_mlp()
    real, solve_real = ilp_rows.overlapped_passes, ilp._solve
    shares = []
    monkeypatch.setattr(ilp, "_solve", lambda task, how, *a: shares.append(how.side_share)
                        or solve_real(task, how, *a))

    def blind(prog, side, scale, edge, unit):  # the exact rows, side seconds unseen
        real(prog, [(var, NO_TIME) for var, _ in side], scale, edge, unit)

    monkeypatch.setattr(ilp_rows, "overlapped_passes", blind)
    blinded = solve(graph, cost, memory_budget=budget)
    # relaxed, exact (blind), then the first weight
    assert shares[:3] == [None, None, ilp.SCALARIZED[0]]
    assert shares[3:] == list(ilp.SCALARIZED[1:len(shares) - 2])

    def nothing(*a):
        raise ilp.NoFeasiblePlan("no plan in time")

    monkeypatch.setattr(ilp_rows, "overlapped_passes", nothing)
    assert solve(graph, cost, memory_budget=budget).choice == blinded.choice


def test_large_problems_skip_the_exact_solve_for_weighted_ones(monkeypatch):
    """Above EXACT_VARIABLES the exact re-solve is not tried (HiGHS rarely finishes it on
    large models): the weights of SCALARIZED are solved in turn while the plan's collectives
    still outlast its compute, and the fastest plan, priced exactly, is kept. Weights cannot
    reach an optimum that balances each pass's collectives against its compute exactly, as
    this one does (0.009 s): the weighted plans put them all in one pass, which is why small
    problems are solved exactly."""
    from autopar.solver import ilp

    graph, cost, _ = _slow_overlapped_mlp()
    exact = solve(graph, cost)
    shares, plans = [], []
    solve_real = ilp._solve

    def recorded(task, how, *a):
        sol = solve_real(task, how, *a)
        shares.append(how.side_share)
        plans.append(sol)
        return sol

    monkeypatch.setattr(ilp, "_solve", recorded)
    monkeypatch.setattr(ilp, "EXACT_VARIABLES", 0)
    weighed = solve(graph, cost)
    assert shares[-1] is None  # the outer solve returns last
    assert shares[:-1] == list(ilp.SCALARIZED[:len(shares) - 1]) and len(shares) > 1
    # a weight is tried only after the plan of the one before still had collectives exposed
    assert all(ilp.side_bound(p.split, cost.edge_share()) for p in plans[:-2])
    for p in plans[:-1]:  # each weighed plan's step is its exact price
        assert p.objective == pytest.approx(plan_time(graph, cost, p.choice), rel=1e-6)
    assert weighed.objective <= min(p.objective for p in plans[:-1]) * (1 + 1e-9)
    assert weighed.objective == pytest.approx(plan_time(graph, cost, weighed.choice), rel=1e-6)
    assert exact.objective < weighed.objective
    bal = exact.split
    assert bal.side_forward == pytest.approx(bal.forward, rel=0.05)


def test_the_solvers_bound_is_below_every_plan_whatever_the_budget():
    """`Solution.bound` (the relaxed optimum without the budget) is below the exact optimum
    (enumerated), below the plan found under a binding budget, which reports the same bound,
    and comes with the error when no plan fits."""
    from autopar.solver.ilp import NoFeasiblePlan
    from tests.test_solver_properties import brute_force

    graph, cost, budget = _slow_overlapped_mlp()
    free = solve(graph, cost)
    assert 0 < free.bound <= brute_force(graph, cost) * (1 + 1e-3)
    assert free.bound < free.objective  # relaxed: the side collectives do not all hide
    binding = solve(graph, cost, memory_budget=budget)
    assert binding.bound == pytest.approx(free.bound) and binding.bound < binding.objective
    with pytest.raises(NoFeasiblePlan) as e:
        solve(graph, cost, memory_budget=1.0)
    assert e.value.bound == pytest.approx(free.bound)


def test_a_level_whose_last_fastest_plan_does_not_fit_goes_to_the_budget_at_once(
        monkeypatch):
    """`fastest` carries the plans solved without the budget from level to level: when the
    last one is over this level's budget too, the solve goes to the budget at once (one HiGHS
    solve fewer) and returns the plan it returned without the memo; when it fits, the solve
    without the budget runs first, as without the memo."""
    from autopar.solver import mip
    from autopar.solver.memory import plan_memory

    graph, cost, budget = _slow_overlapped_mlp()
    calls = []
    real = mip.solve
    monkeypatch.setattr(mip, "solve",
                        lambda prog, *a: calls.append(prog.num_constraints) or real(prog, *a))
    memo: list = []
    plain = solve(graph, cost, memory_budget=budget, fastest=memo)
    assert len(memo) == 1 and plan_memory(graph, cost, memo[0]) > budget
    before, calls[:] = list(calls), []
    again = solve(graph, cost, memory_budget=budget, fastest=memo)
    assert calls == before[1:]  # all but the solve without the budget
    assert again.choice == plain.choice and again.objective == pytest.approx(plain.objective)
    assert len(memo) == 1 and again.bound is None  # nothing solved without the budget
    calls.clear()
    roomy = solve(graph, cost, memory_budget=plan_memory(graph, cost, memo[0]), fastest=memo)
    # the memo's plan fits: solved without the budget first (then refined), as without memo
    assert calls[0] == before[0] and len(memo) == 2 and memo[1] == memo[0]
    assert roomy.bound == pytest.approx(plain.bound)
