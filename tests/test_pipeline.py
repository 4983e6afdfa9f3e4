"""Pipeline parallelism: the stage solver's formulas and choices, layer blocks, pipelined plans,
bad input, and equivalence with single-device training on gloo ranks (2 and 4 stages on (2,)
and (4,) meshes, pp x dp on (2, 2), the test GPT and a Hugging Face Llama)."""

import dataclasses
import itertools
import random

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import schedules as torch_schedules

import autopar
from autopar.choice import choice_from_plan
from autopar.passes import strategies
from autopar.passes.pipeline_split import layer_blocks, split_stages
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import trace
from autopar.solver import stage_pricing as sp
from autopar.solver import stages as st
from autopar.solver.stages import Block, StageError
from autopar.zoo import hf_llama, lm_loss
from tests import pipeline_tasks, rank_tasks
from tests.models import ResidualMLP

# -- the formulas --------------------------------------------------------------------------------


def test_bubble_fraction_cases():
    assert st.bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert st.bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert st.bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    assert st.bubble_fraction("interleaved", 4, 8, 4) == pytest.approx(3 / 32)
    assert st.bubble_fraction("1f1b", 2, 1) == 1.0
    # interleaved with fewer microbatches than ranks: each chunk waits for the ring
    assert st.bubble_fraction("interleaved", 4, 2, 2) == pytest.approx(5 / 4)


def test_microbatches_in_flight():
    assert [st.in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8, 8, 8, 8]
    assert [st.in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [st.in_flight("1f1b", 4, 2, 1, r) for r in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (4, 10, 2), (2, 2, 2)])
def test_interleaved_in_flight_follows_torch(p, m, v):
    """Interleaved 1F1B holds its warm-up forwards plus one: what torch's schedule computes
    (a private helper: this test fails loudly if PyTorch changes it)."""
    rounds = max(1, m // p)
    for r in range(p):
        warmup = torch_schedules._get_warmup_ops(r, v, m // rounds, p, m)
        assert st.in_flight("interleaved", p, m, v, r) == pytest.approx(
            min(m * v, warmup + 1) / v)


def test_schedule_constraints():
    assert st.schedule_problem("1f1b", 4, 4, 1) is None
    assert "at least as many microbatches" in st.schedule_problem("1f1b", 4, 2, 1)
    assert "2 virtual stages" in st.schedule_problem("interleaved", 4, 8, 1)
    assert "multiple" in st.schedule_problem("interleaved", 4, 9, 2)
    assert "unknown schedule" in st.schedule_problem("zero-bubble", 4, 8, 1)


# -- the stage ILP on synthetic chains ---------------------------------------------------------

def chain(times, *, fixed=0.0, params=0.0, acts=0.0, cut=1e-6, cut_fixed=0.0):
    return [Block(f"b{i}", t, min(fixed, t), 0.0, params, acts, cut, cut_fixed)
            for i, t in enumerate(times)]


def brute_force(blocks, p, m, v=1, sigma=1.0, hide_sends=False):
    """Min over every contiguous cut of the objective, evaluated directly (with
    `hide_sends`, a rank's pace the longer of its work and its sends)."""
    n = len(blocks)
    best = None
    for cuts in itertools.combinations(range(1, n), p * v - 1):
        bounds = [0, *cuts, n]
        times, sends = [], []
        for s in range(p * v):
            lo, hi = bounds[s], bounds[s + 1]
            t = sum(b.time_fixed + (b.time - b.time_fixed - b.draw) * sigma
                    + b.draw * m * sigma + b.accumulate * (m - 1) / m for b in blocks[lo:hi])
            c = 0.0
            if s < p * v - 1:
                b = blocks[hi - 1]
                c = b.cut_fixed + (b.cut_time - b.cut_fixed) * sigma
            times.append(t + c)
            sends.append(c)
        value = st.step_time(times, [0.0] * (p * v), p, m, v, sends if hide_sends else None,
                             sum(b.draw for b in blocks) * m * sigma)
        best = value if best is None else min(best, value)
    return best


def test_equal_blocks_are_cut_evenly():
    sol = st.solve_stages(chain([1e-3] * 8), 4, "1f1b", 8, 1, 1.0, None)
    assert sol.cuts == [2, 4, 6]
    assert sol.objective == pytest.approx(st.step_time(sol.stage_time, [0] * 4, 4, 8, 1))


@pytest.mark.parametrize("seed", range(6))
def test_stage_ilp_equals_brute_force(seed):
    rng = random.Random(seed)
    blocks = chain([rng.uniform(1e-4, 1e-3) for _ in range(rng.randint(4, 7))])
    for b in blocks:
        b.cut_time = rng.uniform(0, 2e-4)
        b.draw = rng.choice([0.0, 0.3]) * b.time  # dropout masks: whole-batch draws
        b.accumulate = rng.choice([0.0, 0.1]) * b.time  # adding microbatches' gradients
    p, m = rng.choice([2, 3]), rng.choice([1, 2, 4, 8])
    sol = st.solve_stages(blocks, p, "gpipe", m, 1, 1 / m, None)
    assert sol.objective == pytest.approx(brute_force(blocks, p, m, sigma=1 / m), rel=1e-6)
    if len(blocks) >= 2 * p and st.schedule_problem("interleaved", p, m, 2) is None:
        sol = st.solve_stages(blocks, p, "interleaved", m, 2, 1 / m, None)
        assert sol.objective == pytest.approx(brute_force(blocks, p, m, 2, 1 / m), rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_sends_hide_under_compute_where_the_hardware_overlaps(seed):
    """Interleaved 1F1B's steady state runs a rank's sends beside its other chunks' work: on
    overlapping hardware the stage ILP prices the longer of the two (brute force agrees) and
    never more than with every send exposed; GPipe and 1F1B wait for each transfer."""
    rng = random.Random(seed)
    blocks = chain([rng.uniform(1e-4, 1e-3) for _ in range(rng.randint(4, 7))])
    for b in blocks:
        b.cut_time = rng.uniform(1e-4, 2e-3)  # sends as long as the work: hiding matters
    p, m = 2, rng.choice([2, 4, 8])
    hidden = st.solve_stages(blocks, p, "interleaved", m, 2, 1.0, None, overlap=True)
    exposed = st.solve_stages(blocks, p, "interleaved", m, 2, 1.0, None)
    assert hidden.objective == pytest.approx(brute_force(blocks, p, m, 2, hide_sends=True),
                                             rel=1e-6)
    assert exposed.objective == pytest.approx(brute_force(blocks, p, m, 2), rel=1e-6)
    assert hidden.objective < exposed.objective
    for sched in ("gpipe", "1f1b"):
        assert not st.hides_sends(sched, True)
        with_overlap = st.solve_stages(blocks, p, sched, m, 1, 1.0, None, overlap=True)
        assert with_overlap.objective == pytest.approx(brute_force(blocks, p, m), rel=1e-6)
    assert not st.hides_sends("interleaved", False)


def test_pipelined_plan_on_overlapping_hardware_hides_interleaved_sends():
    """The plan's step is compute + communication - hidden, the hidden part the busiest
    rank's sends (at most its work) for interleaved 1F1B on an H100, none for 1F1B."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec((2,), names=("pp",), hardware="h100")
    plans = {sched: autopar.plan(model, spec, (x, y), loss_fn=loss_fn, schedule=sched,
                                 microbatches=2, **({"virtual_stages": 2}
                                                    if sched == "interleaved" else {}))
             for sched in ("interleaved", "1f1b")}
    inter, plain = plans["interleaved"].cost, plans["1f1b"].cost
    assert set(inter.hidden) == {"p2p"} and 0 < inter.hidden["p2p"] <= inter.communication["p2p"]
    assert inter.step_time == pytest.approx(inter.compute + inter.communication_total
                                            - inter.hidden["p2p"], rel=1e-6)
    assert plain.hidden == {}
    assert plain.step_time == pytest.approx(plain.compute + plain.communication_total, rel=1e-6)
    assert plans["interleaved"].pipeline.num_stages == 4
    # the stage ILP chose the cut by the step it reports
    assert inter.solver_objective == pytest.approx(inter.step_time, rel=1e-6)


def test_a_dropout_pipeline_prices_whole_batch_draws_every_microbatch():
    """A pipelined model with dropout draws, in every microbatch, the whole batch's masks of
    its stages, and every pp rank draws all stages' masks once more per step: against the
    same model with dropout p=0 (the same ops, drawing nothing), the busiest rank's compute
    grows by m times its stages' whole-batch draws and all stages' once, not by one batch's
    draws as drawing per microbatch would."""
    from autopar.solver.cost import CostModel

    plans, x, y = {}, None, None
    for p in (0.0, 0.1):
        with torch.device("meta"):
            model = ResidualMLP(128, 8, dropout=p)
            x, y = torch.randn(65536, 128), torch.randn(65536, 128)
        spec = autopar.MeshSpec((4,), names=("pp",), hardware="h100")
        plans[p] = autopar.plan(model, spec, (x, y), loss_fn=nn.functional.mse_loss,
                                schedule="1f1b")
    plain, drop = plans[0.0], plans[0.1]
    m = drop.pipeline.microbatches
    assert m > 1 and m == plain.pipeline.microbatches
    assert drop.pipeline.cuts == plain.pipeline.cuts == [2, 4, 6]
    graph = strategies.build(trace(model, (x,), nn.functional.mse_loss, y), (1,))
    cost = CostModel(autopar.MeshSpec((1,), hardware="h100"), graph=graph)
    draws = sum(cost.draw_time(v) for v in graph.nodes.values())  # the whole batch, once
    mine = draws / 4  # the busiest rank's two blocks of eight
    more = drop.cost.compute - plain.cost.compute
    assert more == pytest.approx(m * mine + draws, rel=1e-3)
    # memory: the largest whole-batch draw, held while its op runs (float32: 2 x 4 + 1 bytes)
    assert drop.cost.memory["draws"] == 65536 * 128 * 9 and "draws" not in plain.cost.memory


def test_memory_decides_the_cut():
    """Balanced by time the first stage would hold the two heavy blocks; within the budget it
    must not."""
    blocks = chain([1e-3] * 4)
    blocks[0].param_bytes = blocks[1].param_bytes = 6.0
    sol = st.solve_stages(blocks, 2, "gpipe", 1, 1, 1.0, 10.0)
    assert sol.cuts == [1] and max(sol.rank_memory) <= 10.0
    assert st.solve_stages(blocks, 2, "gpipe", 1, 1, 1.0, 5.0) is None


def test_prefers_more_microbatches_when_the_bubble_dominates():
    """Compute that shrinks with the microbatch: the fill and drain cost less with more
    microbatches, so the solver takes as many as the batch allows."""
    best = st.choose(chain([1e-2] * 8, fixed=1e-6), 4, 64, 64, None, schedule="1f1b")
    assert best.microbatches == 64 and best.bubble == pytest.approx(3 / 64)


def test_whole_batch_draws_cost_every_microbatch():
    """Each microbatch draws the whole batch's random numbers (d_b m sigma per microbatch),
    and every pp rank draws them all once more per step: draws grow with the microbatch
    count, so a chain whose blocks draw much takes fewer microbatches than the same chain
    drawing nothing (which takes as many as the batch allows)."""
    plain = chain([1e-2] * 8, fixed=1e-6)
    drawing = chain([1e-2] * 8, fixed=1e-6)
    for b in drawing:
        b.draw = 0.2 * b.time
    assert st.microbatch_time(drawing[0], 1 / 4, 4) == pytest.approx(
        1e-6 + (0.8e-2 - 1e-6) / 4 + 0.2e-2)
    assert st.replay_time(drawing, 1 / 4, 4) == pytest.approx(8 * 0.2e-2)
    free = st.choose(plain, 4, 64, 64, None, schedule="1f1b")
    best = st.choose(drawing, 4, 64, 64, None, schedule="1f1b")
    assert free.microbatches == 64 and 4 <= best.microbatches < 16
    sigma = 1 / best.microbatches
    assert best.objective == pytest.approx(st.step_time(
        best.stage_time, [0.0] * 4, 4, best.microbatches, 1,
        replay=st.replay_time(drawing, sigma, best.microbatches)), rel=1e-6)
    assert best.objective > free.objective


def test_prefers_few_microbatches_when_overheads_dominate():
    """Per-microbatch costs that do not shrink (launches, message latency) favour fewer."""
    best = st.choose(chain([1e-4] * 8, fixed=1e-4, cut=1e-3, cut_fixed=1e-3), 4, 64, 64,
                     None, schedule="1f1b")
    assert best.microbatches == 4


def test_prefers_interleaving_when_the_bubble_dominates():
    """With the microbatch count fixed and cheap sends, virtual stages shrink the bubble."""
    best = st.choose(chain([1e-3] * 8), 4, 4, 4, None, microbatches=4)
    assert best.schedule == "interleaved" and best.virtual_stages == 2
    assert best.bubble == pytest.approx(3 / 8)
    # Sends that cost as much as a block: more cuts no longer pay.
    slow = st.choose(chain([1e-3] * 8, cut=2e-3, cut_fixed=2e-3), 4, 4, 4, None,
                     microbatches=4)
    assert slow.schedule != "interleaved"


def test_memory_of_in_flight_microbatches_picks_the_schedule():
    """GPipe keeps every microbatch's activations; 1F1B at most p of them. Equal in time, 1F1B
    wins the tie on memory; under a budget only 1F1B fits."""
    blocks = chain([1e-3] * 4, acts=1.0)
    best = st.choose(blocks, 2, 8, 8, None, microbatches=8, schedule=("gpipe", "1f1b"))
    assert best.schedule == "1f1b"
    gpipe = st.solve_stages(blocks, 2, "gpipe", 8, 1, 1 / 8, None)
    assert max(gpipe.rank_memory) == pytest.approx(2 * 8 / 8)  # 2 blocks x 8 microbatches of 1/8
    assert st.solve_stages(blocks, 2, "gpipe", 8, 1, 1 / 8, 1.5) is None
    assert st.choose(blocks, 2, 8, 8, 1.5, microbatches=8, schedule="1f1b").schedule == "1f1b"


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(StageError, match="only 3 layer blocks"):
        st.choose(chain([1e-3] * 3), 4, 8, 8, None)


def test_batch_not_divisible_is_a_clear_error():
    with pytest.raises(StageError, match="batch of 6 does not split into 4 microbatches"):
        st.choose(chain([1e-3] * 4), 2, 6, 6, None, microbatches=4)


def test_no_cut_fits_is_a_clear_error():
    blocks = chain([1e-3] * 4, params=10.0)
    with pytest.raises(StageError, match="cannot be cut inside a block"):
        st.choose(blocks, 2, 4, 4, 15.0)


# -- layer blocks ------------------------------------------------------------------------------

def _graph(name, mesh_shape=(1,)):
    model, loss_fn, (x, y) = rank_tasks.build(name)
    program = trace(model, (x,), loss_fn, y)
    return program, strategies.build(program, mesh_shape)


def test_layer_blocks_of_the_gpt():
    program, graph = _graph("gpt")
    blocks = layer_blocks(program, graph)
    assert blocks.names == ["before h.0", "h.0", "h.1", "after h.1"]
    ops = {graph.nodes[n].op: b for n, b in blocks.of_node.items()}
    assert ops["embedding.default"] == 0 and ops["cross_entropy_loss.default"] == 3
    order = [blocks.of_node[n] for n in graph.nodes if n in blocks.of_node]
    assert order == sorted(order)  # contiguous in graph order


def test_layer_blocks_of_llama_and_of_a_sequential():
    program, graph = _graph("hf_llama")
    assert [n.split(".")[-1] for n in layer_blocks(program, graph).names[1:3]] == ["0", "1"]
    program, graph = _graph("mlp")  # nn.Sequential: Linear, GELU, Linear, GELU, Linear
    assert layer_blocks(program, graph).names == ["net.0", "net.1", "net.2", "net.3",
                                                  "net.4", "after net.4"]


# -- pipelined plans (no processes) ------------------------------------------------------------

def gpt_pp_plan(shape=(2,), names=("pp",), **options):
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec(shape, names=names, hardware="cpu")
    return autopar.plan(model, spec, (x, y), loss_fn=loss_fn, **options)


def test_pipelined_plan_describes_stages():
    plan = gpt_pp_plan(microbatches=2, schedule="1f1b")
    pipe = plan.pipeline
    assert (pipe.schedule, pipe.microbatches, pipe.num_stages) == ("1f1b", 2, 2)
    assert pipe.bubble == pytest.approx(0.5)
    assert len(pipe.rank_memory) == 2 and len(pipe.stage_time) == 2
    assert pipe.in_flight == [2, 1]
    stages = [o.stage for o in plan.ops]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    assert plan.cost.step_time == pytest.approx(plan.cost.compute
                                                + plan.cost.communication_total)
    assert plan.cost.step_time == pytest.approx(
        st.step_time(pipe.stage_time, [0, 0], 2, 2, 1), rel=1e-6)
    assert {c.kind for c in plan.collectives if c.mesh_dim == 0} == {"p2p"}
    text = str(plan)
    assert "pipeline: 2 stages" in text and "bubble 0.500" in text and "pp rank 1" in text
    loaded = autopar.Plan.from_dict(plan.to_dict())
    assert loaded.hash() == plan.hash() and loaded.to_dict() == plan.to_dict()


def test_a_stages_fsdp_gathers_hide_under_its_compute_on_gpus():
    """On H100s each stage's prefetched FSDP gathers hide under its forward, and their
    gradients' reduce-scatters under its backward, each microbatch, but for one bucket's
    share: priced so per stage (`stage_pricing.price` against the same stage with gathers on the
    critical path) and in the plan's step. On gloo (no overlap) nothing hides."""
    from autopar.solver.cost import CostModel

    with torch.device("meta"):
        model = hf_llama(num_hidden_layers=4, vocab_size=8192, hidden_size=1024,
                         num_attention_heads=8, num_key_value_heads=4, intermediate_size=2816,
                         max_position_embeddings=2048)
    ids = torch.randint(0, 8192, (16, 2048), device="meta")
    spec = autopar.MeshSpec((2, 4), names=("pp", "dp"), hardware="h100")
    plan = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss, microbatches=4,
                        schedule="1f1b", force={"dp": "fsdp"}, bucket_bytes=2**20,
                        precision="bf16-mixed")
    hidden = plan.cost.hidden
    assert hidden["all_gather"] > 0 and hidden["reduce_scatter"] > 0
    assert hidden["all_gather"] < plan.cost.communication["all_gather"]  # one bucket's share
    assert plan.cost.step_time == pytest.approx(plan.cost.compute +
                                                plan.cost.exposed_communication)
    program = trace(model, (ids[:4],), lm_loss, ids[:4],
                    compute_dtype=torch.bfloat16)
    graph = strategies.build(program, (4,), zero=True)
    choice = choice_from_plan(plan, graph)
    stage_of = layer_blocks(program, graph).stage_of(plan.pipeline.cuts, 2)
    sub = sp.subgraph(graph, [n for n in graph.nodes if stage_of.get(n) == 1], choice)
    picked = {n: choice.get(n, v.strategies[0]) for n, v in sub.nodes.items()}
    cost = CostModel(spec.without(0), graph=graph, precision="bf16-mixed", bucket_bytes=2**20)
    serial = dataclasses.replace(spec.profile, overlap=False)  # the same H100, nothing hides
    alone = sp.price(sub, cost.copy(mesh=autopar.MeshSpec((4,), hardware=serial)), picked)
    bucketed = sp.price(sub, cost, picked)
    assert bucketed.hidden and not alone.hidden
    assert bucketed.time == pytest.approx(bucketed.compute + sum(
        bucketed.communication.values()) - sum(bucketed.hidden.values()))
    assert alone.time - bucketed.time == pytest.approx(sum(bucketed.hidden.values()))
    assert sum(bucketed.hidden.values()) > 0
    assert bucketed.compute == pytest.approx(alone.compute)
    assert bucketed.communication == pytest.approx(alone.communication)
    gloo = gpt_pp_plan((2, 2), ("pp", "dp"), microbatches=2, force={"dp": "fsdp"})
    assert set(gloo.cost.hidden) <= {"p2p"}


def test_a_pipelined_plan_without_a_budget():
    """memory_budget=float("inf") plans for time alone on a pp mesh too (the stage solver's
    memory rows are integers: it once raised OverflowError), as a budget nothing reaches."""
    free = gpt_pp_plan(microbatches=2, schedule="1f1b", memory_budget=float("inf"))
    roomy = gpt_pp_plan(microbatches=2, schedule="1f1b", memory_budget=2.0**60)
    assert free.pipeline.cuts == roomy.pipeline.cuts
    assert free.cost.step_time == pytest.approx(roomy.cost.step_time)


def test_plan_hash_covers_the_pipeline():
    assert gpt_pp_plan(microbatches=2, schedule="gpipe").hash() != \
        gpt_pp_plan(microbatches=2, schedule="1f1b").hash()


def test_pp_by_dp_placements_are_over_the_other_dimension():
    plan = gpt_pp_plan((2, 2), ("pp", "dp"), microbatches=2, force={"dp": "data"})
    assert all(len(p) == 1 for p in plan.parameters.values())
    assert plan.submesh_shape == (2,)
    assert {c.mesh_dim for c in plan.collectives if c.kind == "all_reduce"} == {1}


def test_three_dimensional_mesh_plans_each_stage_on_dp_by_tp():
    plan = gpt_pp_plan((2, 2, 2), ("pp", "dp", "tp"), microbatches=2)
    assert plan.submesh_shape == (2, 2) and plan.pipeline.num_stages == 2
    assert all(len(p) == 2 for p in plan.parameters.values())
    assert {c.mesh_dim for c in plan.collectives if c.kind == "p2p"} == {0}


def test_identical_stages_are_solved_once(monkeypatch):
    calls = []
    real = sp.solve

    def counting(graph, *args, **kwargs):
        calls.append(len(graph.nodes))
        return real(graph, *args, **kwargs)

    torch.manual_seed(0)
    model = ResidualMLP(16, 8)
    x = torch.randn(8, 4, 16)
    spec = autopar.MeshSpec((4,), names=("pp",), hardware="h100")
    monkeypatch.setattr(sp, "solve", counting)
    plan = autopar.plan(model, spec, (x, x), loss_fn=nn.functional.mse_loss, microbatches=4,
                        schedule="1f1b")
    assert plan.pipeline.cuts == [2, 4, 6]
    # Block pricing: the first layer (its input is the user's, needing no gradient), the
    # other seven (alike), the loss; stages: the first, the two middle ones (identical), the
    # last.
    assert len(calls) == 3 + 3


def test_a_llama_plan_shrinks_the_bubble():
    """On simulated H100s the layers of this Llama dominate per-microbatch overheads: rather
    than one microbatch (bubble (p - 1) / 1), the solver takes more or interleaves stages."""
    with torch.device("meta"):
        model = hf_llama(num_hidden_layers=4, hidden_size=1024, num_attention_heads=8,
                         num_key_value_heads=4, intermediate_size=2048, vocab_size=512,
                         max_position_embeddings=256)
    x = torch.zeros(16, 256, dtype=torch.long, device="meta")
    spec = autopar.MeshSpec((2, 2), names=("pp", "tp"), hardware="h100")
    plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss)
    pipe = plan.pipeline
    assert pipe.microbatches * pipe.virtual_stages >= 4 and pipe.bubble <= 0.25
    assert pipe.bubble == pytest.approx(st.bubble_fraction(pipe.schedule, 2, pipe.microbatches,
                                                           pipe.virtual_stages))


# -- bad input ---------------------------------------------------------------------------------

def test_more_stages_than_layer_blocks():
    with pytest.raises(StageError, match="only 4 layer blocks"):
        gpt_pp_plan((8,), ("pp",), microbatches=4)


def test_a_pipeline_never_splits_a_batch_whose_samples_mix():
    """A pipeline schedule runs the batch as microbatches, as gradient accumulation does: a
    loss comparing every sample with every other is refused at microbatches=2, and planned
    freely the pipeline keeps the batch whole."""
    model, _, (x, _) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec((2,), names=("pp",), hardware="cpu")

    def contrastive(logits, target):  # each sample's mean logits against every other's
        z = logits.mean(1)
        return nn.functional.cross_entropy(z @ z.t(), torch.arange(z.shape[0]))

    with pytest.raises(ValueError, match="microbatches=2: a pipeline schedule would not compute "
                                         "what the whole batch does: op .* in the loss "
                                         "function mixes the samples"):
        autopar.plan(model, spec, (x, x), loss_fn=contrastive, microbatches=2)
    assert autopar.plan(model, spec, (x, x), loss_fn=contrastive).pipeline.microbatches == 1


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(StageError, match="does not split into 3 microbatches"):
        gpt_pp_plan(microbatches=3)


def test_a_model_without_layers_cannot_be_cut():
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    spec = autopar.MeshSpec((2,), names=("pp",), hardware="cpu")
    with pytest.raises(StageError, match="only 1 layer blocks"):
        autopar.plan(model, spec, (x, x), loss_fn=nn.functional.mse_loss)


def test_a_block_too_big_for_the_budget():
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec((2,), names=("pp",), hardware="cpu")
    with pytest.raises(StageError, match="cannot be cut inside a block"):
        autopar.plan(model, spec, (x, y), loss_fn=loss_fn, microbatches=2,
                     memory_budget=20_000)


def test_inputs_must_share_the_batch_dimension():
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec((2,), names=("pp",), hardware="cpu")
    with pytest.raises(ValueError, match="dimension 0"):
        autopar.plan(model, spec, (x, y[:2]), loss_fn=loss_fn)


def test_pipeline_options_need_a_pp_dimension():
    """A schedule or virtual stages without a "pp" dimension is refused; microbatches alone
    accumulate gradients on any mesh."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    spec = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")
    for option in ({"schedule": "1f1b"}, {"virtual_stages": 2}):
        with pytest.raises(ValueError, match='"pp"'):
            autopar.plan(model, spec, (x, y), loss_fn=loss_fn, **option)
    plan = autopar.plan(model, spec, (x, y), loss_fn=loss_fn, microbatches=2)
    assert plan.accumulation == 2


# -- stage programs ----------------------------------------------------------------------------

class _Comm:
    shape = (2,)

    def all_gather(self, x, dim, mesh_dim):
        raise AssertionError("not run")

    reduce_scatter = all_reduce = all_to_all = all_gather_many = all_gather_start = all_gather


def _signature(gm):
    return [f"{n.op}:{getattr(n.target, '__name__', str(n.target))}:{len(n.args)}"
            for n in gm.graph.nodes]


@pytest.mark.parametrize("seed", range(3))
def test_stage_programs_are_the_same_across_a_stage_group(seed):
    """The ranks of one stage run the same program op for op (backward collective order), and
    every value a stage needs reaches it from the one before."""
    plan = gpt_pp_plan((2, 2), ("pp", "dp"), microbatches=2, solver="random", seed=seed)
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    program = trace(model, (x[:2],), loss_fn, y[:2])
    graph = strategies.build(program, (2,), zero=True)
    choice = choice_from_plan(plan, graph)
    blocks = layer_blocks(program, graph)
    first = [0, *plan.pipeline.cuts]
    stage_of = {n: max(k for k in range(2) if first[k] <= b) for n, b in blocks.of_node.items()}
    kinds = {n: v.kind for n, v in graph.nodes.items()}
    per_rank = []
    for coord in range(2):
        comm = _Comm()
        local = rewrite(program, graph, choice, (coord,), comm, stage_of=stage_of)
        per_rank.append(split_stages(local.train, graph, stage_of, kinds, 2))
    for s in range(2):
        assert _signature(per_rank[0][s].module) == _signature(per_rank[1][s].module)
    a, b = per_rank[0]
    assert [m.shape for m in a.sent] == [m.shape for m in b.received]
    assert any(m.requires_grad for m in b.received)


def test_fsdp_stages_gather_and_prefetch_their_own_buckets():
    """Under FSDP each stage's program gathers its own parameters in buckets (never one of
    another stage's), the first starting at the top of the stage, each next one as the stage
    waits for the one before; a parameter two stages use (the GPT's tied embedding and head)
    is gathered alone in each."""
    from autopar.passes.emitted import emitted

    plan = gpt_pp_plan((2, 2), ("pp", "dp"), microbatches=2, force={"dp": "fsdp"})
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    program = trace(model, (x[:2],), loss_fn, y[:2])
    graph = strategies.build(program, (2,), zero=True)
    choice = choice_from_plan(plan, graph)
    blocks = layer_blocks(program, graph)
    stage_of = blocks.stage_of(plan.pipeline.cuts, 2)
    kinds = {n: v.kind for n, v in graph.nodes.items()}
    local = rewrite(program, graph, choice, (0,), _Comm(), bucket_bytes=8 * 1024,
                    stage_of=stage_of)
    stages = split_stages(local.train, graph, stage_of, kinds, 2)
    used_in = {}  # parameter -> stages whose ops use it
    for v in graph.nodes.values():
        for u, _ in v.inputs:
            if graph.nodes[u].kind == "param" and v.name in stage_of:
                used_in.setdefault(u, set()).add(stage_of[v.name])
    tied = {u for u, ks in used_in.items() if len(ks) > 1}
    assert tied  # the GPT's embedding is its head
    for s, stage in enumerate(stages):
        nodes = list(stage.module.graph.nodes)
        role = {n: emitted(n).role for n in nodes if n.op not in ("output", "placeholder")}
        starts = [n for n in nodes if role.get(n) == "gather_start"]
        waits = [n for n in nodes if role.get(n) == "gather_wait"]
        assert len(starts) == len(waits) > 1, f"stage {s}"
        first_op = min(i for i, n in enumerate(nodes) if role.get(n) == "op")
        assert nodes.index(starts[0]) < first_op
        for j, w in enumerate(waits[:-1]):  # the next bucket starts as this one is waited for
            assert nodes.index(starts[j + 1]) < nodes.index(w)
        for w in waits:
            names = {p.name for p in w.args[0]}
            assert names and all(used_in[p] == {s} for p in names)
        assert set(stage.params) == {u for u, ks in used_in.items() if s in ks}
        alone = [n for n in nodes if role.get(n) == "collective" and n.args[0].op ==
                 "placeholder" and n.args[0].name in tied]
        assert alone, f"stage {s} gathers the tied parameter alone"


# -- equivalence on gloo -----------------------------------------------------------------------

EQUIVALENCE = [
    # model, mesh, names, options: every schedule, 2 and 4 stages, pp alone and pp x dp
    # targets padded with ignore_index, unevenly over the microbatches (one counts none):
    # each microbatch's loss weighs its count of targets over the batch's
    ("gpt_padded", (2,), ("pp",), {"microbatches": 4, "schedule": "1f1b"}),
    ("hf_llama", (2,), ("pp",), {"microbatches": 2, "schedule": "interleaved"}),
    ("gpt", (4,), ("pp",), {"microbatches": 2, "schedule": "gpipe"}),
    ("hf_llama", (4,), ("pp",), {"microbatches": 4, "schedule": "1f1b"}),
    ("gpt", (2, 2), ("pp", "dp"), {"microbatches": 2, "force": {"dp": "data"}}),
    ("gpt", (2, 2), ("pp", "dp"), {"microbatches": 2, "force": {"dp": "fsdp"}}),
    ("hf_llama", (2, 2), ("pp", "dp"), {"microbatches": 2}),
    # FSDP in buckets of a few parameters, prefetched inside each of a rank's two stages
    ("hf_llama", (2, 2), ("pp", "dp"), {"microbatches": 2, "schedule": "interleaved",
                                        "force": {"dp": "fsdp"}, "bucket_bytes": 4096}),
    # 3-D: pp x dp x tp (dp of size 1 on 4 ranks), tensor parallel inside each stage
    ("gpt", (2, 1, 2), ("pp", "dp", "tp"), {"microbatches": 2, "force": {"tp": "tensor"}}),
    # dropout (embedding, residual, SDPA's): every stage draws what one device draws there
    ("hf_gpt2_dropout", (2,), ("pp",), {"microbatches": 2, "schedule": "1f1b"}),
    # a plan made by autopar.plan, saved and loaded, then run
    ("gpt", (2,), ("pp",), {"microbatches": 4, "schedule": "gpipe", "given_plan": True}),
    # ZeRO inside the stages: ZeRO-1 with the tied embedding's shards summed over pp, and
    # ZeRO-2 reduce-scattering each microbatch in small buckets across interleaved stages
    ("gpt", (2, 2), ("pp", "dp"), {"microbatches": 2, "force": {"dp": "zero1"}}),
    ("hf_llama", (2, 2), ("pp", "dp"), {"microbatches": 2, "schedule": "interleaved",
                                        "force": {"dp": "zero2"}, "bucket_bytes": 4096}),
    # recomputation inside the stages: full and selective, interleaved, with FSDP, dropout
    # (recomputed in backward after other microbatches' forwards: the same numbers, rows)
    ("hf_gpt2_dropout", (2,), ("pp",), {"microbatches": 2, "schedule": "1f1b",
                                        "recompute": "full"}),
    ("hf_llama", (2,), ("pp",), {"microbatches": 2, "schedule": "interleaved",
                                 "recompute": "full"}),
    ("gpt", (2, 2), ("pp", "dp"), {"microbatches": 2, "recompute": "selective",
                                   "force": {"dp": "fsdp"}}),
]


def test_zero_in_the_stages_is_fsdp_kept_gathered_across_the_microbatches():
    """Inside pipeline stages FSDP regathers each parameter every microbatch, and ZeRO is FSDP
    keeping it gathered across the step's microbatches (gathered once a step, gradients
    reduce-scattered once: ZeRO-1, or every microbatch: ZeRO-2): priced so, and the plan says
    which (the EQUIVALENCE cases above train both on gloo ranks)."""
    model, loss_fn, example = rank_tasks.build("gpt")
    mesh = autopar.MeshSpec((2, 2), ("pp", "dp"), hardware="h100")
    plans = {style: autopar.plan(model, mesh, example, loss_fn=loss_fn, microbatches=2,
                                 force={"dp": style}) for style in ("fsdp", "zero1", "zero2")}
    fsdp, zero1, zero2 = (plans[s].cost.communication for s in ("fsdp", "zero1", "zero2"))
    assert fsdp["all_gather"] > 0 and fsdp["reduce_scatter"] > 0
    assert zero1["all_gather"] == zero1["reduce_scatter"] == 0 and zero1["gradient_sync"] > 0
    # (ZeRO-2's reduce-scatter every microbatch is its gradient synchronization)
    assert zero2["all_gather"] == zero2["reduce_scatter"] == 0
    assert zero2["gradient_sync"] > zero1["gradient_sync"]
    kept = "FSDP kept gathered across the step's microbatches"
    text = {s: " ".join(str(p).split()) for s, p in plans.items()}
    assert kept in text["zero1"] and "reduce-scattered once, after the last microbatch" \
        in text["zero1"]
    assert kept in text["zero2"] and "reduce-scattered every microbatch" in text["zero2"]
    assert kept not in text["fsdp"]
    flat = autopar.plan(model, autopar.MeshSpec((4,), ("dp",), hardware="h100"), example,
                        loss_fn=loss_fn, force={"dp": "zero1"})
    assert "ZeRO-1" in str(flat) and kept not in " ".join(str(flat).split())


@pytest.mark.parametrize("name,shape,names,options", EQUIVALENCE,
                         ids=[f"{m}-{'x'.join(map(str, s))}-" + "-".join(
                             str(v) if not isinstance(v, dict) else "".join(v.values())
                             for k, v in o.items() if k != "microbatches")
                              for m, s, _, o in EQUIVALENCE])
def test_pipelined_training_equals_single_device(world2, world4, name, shape, names, options):
    world = world2 if len(shape) == 1 and shape[0] == 2 else world4
    plan = world.run(pipeline_tasks.train_equivalence, name, shape, names, **options)[0]
    pipe = plan["pipeline"]
    assert pipe["microbatches"] == options["microbatches"]
    if "schedule" in options:
        assert pipe["schedule"] == options["schedule"]
    stages = shape[0] * pipe["virtual_stages"]
    assert len(pipe["cuts"]) == stages - 1
    if "recompute" in options:
        assert set(plan["recompute"]["mode_of"].values()) == {options["recompute"]}
    style = options.get("force", {}).get("dp", "")
    if style.startswith("zero"):
        assert set(plan["zero"].values()) == {int(style[-1])}


def test_pipelined_errors_reach_every_rank(world2):
    msgs = world2.run(pipeline_tasks.expect_error, "batch_not_divisible")
    assert all("does not split into 3 microbatches" in m for m in msgs), msgs
    msgs = world2.run(pipeline_tasks.expect_error, "other_batch_refused")
    assert all(m.startswith("RankError") and "inputs of shapes [(2, 16)] differ from the "
               "[(4, 16)] this pipeline was planned for" in m for m in msgs), msgs
    msgs = world2.run(pipeline_tasks.expect_error, "other_target")
    assert all(m.startswith("RankError") and "the target ((4, 8) torch.int64) differs from the "
               "(4, 16) torch.int64" in m for m in msgs), msgs
    msgs = world2.run(pipeline_tasks.expect_error, "value_changed")
    assert all("wte.scale_grad_by_freq: False -> True" in m and "traced once" in m
               for m in msgs), msgs
    msgs = world2.run(pipeline_tasks.expect_error, "samples_mix")
    assert all(m.startswith("ValueError: microbatches=2: a pipeline schedule would not") and
               "mixes the samples" in m for m in msgs), msgs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelined_model_takes_other_batch_sizes(world2, schedule):
    # (before: an error at any other batch size, even the smaller last batch of an epoch)
    for error in world2.run(pipeline_tasks.other_batches, schedule):
        if schedule == "gpipe":
            assert error == "", error
        else:
            assert "trains with its 1f1b schedule" in error and "1F1B needs at least as " \
                "many microbatches" in error and "inference takes any" in error, error


def test_a_pipelined_model_trains_in_the_modes_set_after_its_build(world2):
    # eval at parallelize (as from_pretrained leaves a model), train() before the first step:
    # dropout trains as on one device, whether the pipeline was built at that step or, with
    # example_inputs=, in eval mode at parallelize (then the first step adds training stages
    # in training mode; before: an error)
    for kind in ("train_set_before_build", "train_after_build"):
        worst = world2.run(pipeline_tasks.modes, kind)
        assert max(worst) < 1e-12, (kind, worst)


@pytest.mark.parametrize("norm", ["bn", "dropout"])
def test_a_pipelined_model_evaluates_between_training_steps(world2, norm):
    # eval mode after training, where the model computes other ops: inference stages traced
    # in eval mode, planned on the pipeline's stages, reading its parameters and buffers
    # (before: an error; the way out was a plain copy loaded from full_state_dict())
    worst = world2.run(pipeline_tasks.eval_between_steps, norm, (2,), ("pp",),
                       microbatches=1 if norm == "bn" else 2)
    assert max(worst) < 1e-12, worst


def test_a_pipelined_model_evaluates_on_two_dimensions(world4):
    worst = world4.run(pipeline_tasks.eval_between_steps, "dropout", (2, 2), ("pp", "dp"),
                       microbatches=2, force={"dp": "fsdp"})
    assert max(worst) < 1e-12, worst


def test_buffers_written_in_a_stage_are_current_on_every_rank(world2):
    world2.run(pipeline_tasks.written_buffers)


def test_microbatches_keep_the_batch_divisible_by_each_mesh_dimension():
    """The cut prices blocks at the whole batch, where dp 24 shards the samples: a microbatch
    count leaving 36 samples (2304 in 64) would leave dp nothing to shard, so only counts that
    keep each dimension dividing the microbatch are candidates (tp 8 too, it divides 2304)."""
    counts = st.microbatch_counts(2304, 128, (24, 8), 8)
    assert 64 not in counts and 96 in counts and 128 not in counts
    assert all((2304 // m) % 24 == 0 for m in counts)
    assert st.microbatch_counts(12, 128, (5,), 2) == st.divisors(12, 128)  # 5 never divides 12
    # 8 samples over dp 8 on 2 pp ranks: keeping dp's samples would leave one microbatch
    assert st.microbatch_counts(8, 128, (8,), 2) == [1, 2, 4, 8]


def test_layer_blocks_alike_are_priced_once_at_the_same_prices(monkeypatch):
    """The stage cut's block prices (`price_blocks`): blocks alike (the same structure,
    recomputation, gradient readers and resharding: a stack's middle layers) are priced once;
    each block's prices are those it has priced alone, recomputed or not; the last layer is
    priced apart (its output has fewer gradient readers: on Llama-3 70B's shapes that makes
    its add cheaper)."""
    from autopar.parallelized import pipeline_tracer
    from autopar.passes.pipeline_split import layer_blocks
    from autopar.passes.recompute import recompute_plan
    from autopar.solver.cost import CostModel

    with torch.device("meta"):
        model = hf_llama(num_hidden_layers=4, vocab_size=256, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    ids = torch.randint(0, 256, (4, 32), device="meta")
    # traced as bf16-mixed pipelines are: the last layer's output is read by the final norm
    # alone, every other layer's by the next norm and the residual add
    program = pipeline_tracer(model, (ids, ids), lm_loss, None, source=model,
                              dtype=torch.bfloat16)(1)
    graph = strategies.build(program, (2,), zero=True)
    blocks = layer_blocks(program, graph)
    link = autopar.MeshSpec((2, 2), ("pp", "dp"), hardware="h100").link(0)
    priced, real = [], sp.price  # the layers each price is for (none: not a layer's)

    def layer_of(sub):
        return next((n.split("_layers_")[1].split("_")[0] for n in sub.nodes
                     if "_layers_" in n and sub.nodes[n].kind == "param"), None)

    monkeypatch.setattr(sp, "price", lambda sub, *a: priced.append(layer_of(sub))
                        or real(sub, *a))
    for mode in ("none", "full"):
        cost = CostModel(autopar.MeshSpec((2,), hardware="h100"), graph=graph,
                         precision="bf16-mixed", recompute=recompute_plan(program, graph, mode))
        priced.clear()
        got = sp.price_blocks(graph, cost, blocks.of_node, blocks.names, link)
        assert len(got) == 6 and "3" in priced  # the last layer: fewer gradient readers
        if mode == "none":  # (under full recomputation no two layers' inputs are alike)
            assert priced.count("1") + priced.count("2") == 1  # alike
        members = {b: [n for n, k in blocks.of_node.items() if k == b] for b in range(6)}
        cache: dict = {}
        for b, block in enumerate(got):
            sub = sp.subgraph(graph, members[b], {})
            alone = real(sub, cost, sp.solve_subgraph(sub, cost, cache,
                                                      forced=sp.without_zero(sub)))
            assert (block.time, block.time_fixed, block.grad_sync, block.act_bytes) == \
                (alone.time, alone.time_fixed, alone.grad_sync, alone.memory["activations"])


@pytest.mark.parametrize("seed", range(6))
def test_a_candidates_floor_is_below_every_cut(seed):
    """`candidate_floor` (whole blocks balanced as well as they can be, sends free) is below
    the objective of every cut, for each schedule (brute force over small chains); with equal
    layers and a head on the last stage it is above the average's bound: some pp rank
    holds a whole layer more."""
    rng = random.Random(seed)
    n, p = rng.randint(5, 9), rng.choice([2, 3])
    blocks = chain([rng.uniform(1e-4, 3e-3) for _ in range(n)],
                   cut=rng.uniform(0, 1e-4), cut_fixed=1e-5)
    for sched, m, v in [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)]:
        if p * v > n:
            continue
        floor = st.candidate_floor(blocks, p, 8, 8, (sched, m, v))
        assert floor <= brute_force(blocks, p, m, v, sigma=2 / 8) * (1 + 1e-9)
    layers = chain([1e-3] + [2e-3] * 8 + [1e-3])  # embedding, 8 layers, head; 3 pp ranks
    floor = st.candidate_floor(layers, 3, 8, 8, ("1f1b", 8, 1))
    work = sum(b.time for b in layers) / 8
    assert floor > work + 7 * work / 3 and floor <= brute_force(layers, 3, 8, 1, 1 / 8)
