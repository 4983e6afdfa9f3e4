"""The two modes of randomness: "counter" (each rank computes its block of a random op from the
step's key: every plan, mesh and microbatch count draws the same numbers, at a block's cost)
and "eager" (every rank draws the whole tensor: bit for bit eager PyTorch; tested against one
device in test_equivalence.py and test_pipeline.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.costing import EAGER_DRAW_LIMIT, eager_could_fit, randomness
from autopar.passes import strategies
from autopar.passes.rules import counter_rng
from autopar.passes.rules.random import counter_drawn_like_block, counter_dropout_block
from autopar.passes.rules.random_stream import STREAM, RandomStream
from autopar.passes.trace import trace_example
from autopar.solver.cost import CostModel
from autopar.solver.memory import draw_bytes, memory_split
from tests import random_tasks
from tests.world import get_world

aten = torch.ops.aten


def _signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


def test_counter_bits_are_splitmix64_of_key_and_index():
    """The tensor code computes the definition (`python_bits`): SplitMix64 of key + (i + 1) x
    GAMMA for element i of the whole tensor, in row-major order."""
    key = counter_rng.op_key(2024, "native_dropout_3")
    got = counter_rng.bits(key, (3, 5, 7), ((0, 3), (0, 5), (0, 7)), "cpu")
    assert got.flatten().tolist() == [_signed(counter_rng.python_bits(key, i))
                                      for i in range(105)]
    # Stafford's Mix13 of a known value (SplitMix64 seeded with 0, first output)
    assert counter_rng.python_bits(0, 0) == 0xE220A8397B1DCDAF
    # a dropout mask: element i kept by the 16-bit lane i mod 4 of word i div 4, whether the
    # block is one run of the whole tensor (read as int16 lanes) or not (lane by lane)
    want = torch.tensor([counter_rng.python_keep(key, 0.3, i) for i in range(6 * 10)])
    want = want.view(6, 10)
    for block in (((0, 6), (0, 10)), ((1, 3), (0, 10)), ((1, 3), (2, 5)), ((5, 1), (3, 1))):
        where = tuple(slice(s, s + n) for s, n in block)
        assert torch.equal(counter_rng.keep_mask(key, 0.3, (6, 10), block, "cpu"), want[where])


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_a_block_is_the_block_of_the_whole_draw(monkeypatch, chunk):
    """Any block, cut into chunks of any size, holds what the whole draw holds there: two
    ranks' blocks never share numbers one device draws apart, and no rank draws more than its
    block."""
    monkeypatch.setattr(counter_rng, "CHUNK", chunk)
    key, shape = counter_rng.op_key(7, "dropout"), (4, 6, 10)
    whole = ((0, 4), (0, 6), (0, 10))
    for block in (((1, 2), (2, 3), (3, 4)), ((0, 4), (3, 3), (0, 10)), ((3, 1), (5, 1), (9, 1))):
        where = tuple(slice(s, s + n) for s, n in block)
        assert torch.equal(counter_rng.keep_mask(key, 0.3, shape, block, "cpu"),
                           counter_rng.keep_mask(key, 0.3, shape, whole, "cpu")[where])
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            assert torch.equal(counter_rng.uniform(key, shape, block, dtype, "cpu"),
                               counter_rng.uniform(key, shape, whole, dtype, "cpu")[where])
        assert torch.equal(counter_rng.normal(key, key + 1, shape, block, torch.float32, "cpu"),
                           counter_rng.normal(key, key + 1, shape, whole, torch.float32,
                                              "cpu")[where])


def test_counter_numbers_have_their_distributions():
    """Dropout keeps 1 - p of the elements; uniforms are in [0, 1) with mean 1/2; normals have
    mean 0 and variance 1; integers cover [low, high) evenly."""
    key, n = counter_rng.op_key(1, "x"), 1 << 20
    whole = ((0, n),)
    keep = counter_rng.keep_mask(key, 0.1, (n,), whole, "cpu").double().mean().item()
    assert abs(keep - 0.9) < 5 * math.sqrt(0.09 / n)
    u = counter_rng.uniform(key, (n,), whole, torch.float32, "cpu")
    assert 0 <= u.min() and u.max() < 1 and abs(u.double().mean().item() - 0.5) < 0.002
    z = counter_rng.normal(key, key + 1, (n,), whole, torch.float64, "cpu")
    assert abs(z.mean().item()) < 0.005 and abs(z.var().item() - 1) < 0.01
    k = counter_rng.integers(key, 3, 10, (n,), whole, torch.int64, "cpu")
    counts = torch.bincount(k, minlength=10)[3:].double()
    assert k.min() == 3 and k.max() == 9 and (counts / counts.mean() - 1).abs().max() < 0.02
    # neighbouring elements and keys are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]).double())[0, 1].item()) < 0.005
    u2 = counter_rng.uniform(counter_rng.op_key(2, "x"), (n,), whole, torch.float32, "cpu")
    assert abs(torch.corrcoef(torch.stack([u, u2]).double())[0, 1].item()) < 0.005


def test_ops_steps_and_streams_have_keys_of_their_own():
    """Two ops of a step, one op in two steps, and an op's second stream draw with different
    keys; a random op outside a step is an error, not a reused key."""
    keys = {counter_rng.op_key(s, name, k) for s in (1, 2) for name in ("a", "b") for k in (0, 1)}
    assert len(keys) == 8
    stream = RandomStream()
    with pytest.raises(RuntimeError, match="outside a step"):
        stream.op_key("dropout")
    torch.manual_seed(0)
    with stream.step(torch.device("cpu"), counter=True):
        first = stream.op_key("dropout")
    assert stream.key is None and stream.microbatch == 0
    torch.manual_seed(0)
    with stream.step(torch.device("cpu"), counter=True):
        assert stream.op_key("dropout") == first  # seeded alike, keyed alike
        second = RandomStream()
        second.begin(torch.device("cpu"), True)
        assert second.op_key("dropout") != first  # the next step's key


def test_microbatches_draw_their_rows_of_the_whole_batch():
    """Under accumulation microbatch i draws rows [i r, (i + 1) r) of the whole batch's
    numbers: the microbatches together draw what the whole batch draws at once (dropout and
    rand_like)."""
    x = torch.ones(8, 5, dtype=torch.float64)
    torch.manual_seed(3)
    with STREAM.step(torch.device("cpu"), counter=True):
        whole = counter_dropout_block(x, 0.5, "dropout", (8, 5), ((0, 8), (0, 5)))
        noise = counter_drawn_like_block(aten.rand_like.default, x, (), {}, "rand_like",
                                         (8, 5), ((0, 8), (0, 5)))
    parts, noises = [], []
    torch.manual_seed(3)
    with STREAM.step(torch.device("cpu"), counter=True):
        for i in range(4):
            STREAM.at_microbatch(i)
            parts.append(counter_dropout_block(x[:2], 0.5, "dropout", (8, 5),
                                               ((0, 2), (0, 5)), (0, 2)))
            noises.append(counter_drawn_like_block(aten.rand_like.default, x[:2], (), {},
                                                   "rand_like", (8, 5), ((0, 2), (0, 5)),
                                                   (0, 2)))
    assert torch.equal(torch.cat(parts), whole) and torch.equal(torch.cat(noises), noise)
    assert set(whole.unique().tolist()) == {0.0, 2.0} and noise.dtype == torch.float64
    with STREAM.step(torch.device("cpu"), counter=True):  # low precision: still below 1
        low = counter_drawn_like_block(aten.rand_like.default, torch.ones(256, 256,
                                       dtype=torch.bfloat16), (), {}, "rand_like",
                                       (256, 256), ((0, 256), (0, 256)))
    assert low.dtype == torch.bfloat16 and 0 <= low.min() and low.max() < 1


def _graph(model, x, y, mesh=(2,)):
    return strategies.build(trace_example(model, (x, y), F.mse_loss), mesh)


def test_auto_draws_eagerly_below_the_limit_and_by_counter_above():
    """randomness="auto" is eager while the largest random op's whole tensor at the global
    batch has at most EAGER_DRAW_LIMIT elements (the batch decides, not the mesh); a model
    without random ops has no mode."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    graph = _graph(model, x, y)
    options = autopar.PlanOptions()
    assert randomness(graph, options) == "eager"
    assert randomness(graph, options, EAGER_DRAW_LIMIT // (8 * 64)) == "eager"
    assert randomness(graph, options, EAGER_DRAW_LIMIT // (8 * 64) + 1) == "counter"
    assert randomness(graph, autopar.PlanOptions(randomness="counter")) == "counter"
    plain = _graph(nn.Sequential(nn.Linear(16, 4)), x, y)
    assert randomness(plain, autopar.PlanOptions(randomness="counter")) == ""
    with pytest.raises(ValueError, match="randomness must be one of"):
        autopar.PlanOptions(randomness="fast")


def test_counter_draws_cost_a_block_not_the_whole_batch():
    """Eager: the draw is the whole batch's on every rank (m x the microbatch's elements).
    Counter: the draw holds DRAW_BYTES_PER_ELEMENT per element of the rank's block, at most
    CHUNK elements, whatever the accumulation; its time is the block's, so a sharded
    strategy draws in 1/n of the replicated one's time."""
    model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.1), nn.Linear(256, 8))
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    graph = _graph(model, x, y)
    mesh = autopar.MeshSpec((2,), hardware="h100")
    drop = next(v for v in graph.nodes.values()
                if v.call is not None and "dropout" in str(v.call.target))
    by_out = {str(s.output): s for s in drop.strategies}
    sharded = next(s for k, s in by_out.items() if "Shard(dim=0)" in k)
    whole = next(s for k, s in by_out.items() if "Replicate" in k)
    for m in (1, 4):
        eager = CostModel(mesh, graph=graph, accumulation=m)
        counter = CostModel(mesh, graph=graph, accumulation=m, randomness="counter")
        assert draw_bytes(graph, eager) == 32 * 256 * m * (2 * 4 + 1)
        assert draw_bytes(graph, counter) == 32 * 256 * counter_rng.DRAW_BYTES_PER_ELEMENT
        choice = {n: v.strategies[0] for n, v in graph.nodes.items()}
        choice[drop.name] = sharded
        assert memory_split(graph, counter, choice)["draws"] == \
            16 * 256 * counter_rng.DRAW_BYTES_PER_ELEMENT
        assert counter.draw_time(drop, sharded) == pytest.approx(
            counter.draw_time(drop, whole) / 2)
        assert counter.draw_time(drop) == 0.0 and eager.draw_time(drop) > 0


def test_the_plan_records_its_randomness():
    """The plan says how its random ops draw; the counter mode is part of its hash (ranks of
    the two modes cannot run together) and survives saving."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    spec = autopar.MeshSpec((2,))
    eager = autopar.plan(model, spec, (x, y), loss_fn=F.mse_loss)
    counter = autopar.plan(model, spec, (x, y), loss_fn=F.mse_loss, randomness="counter")
    assert eager.randomness == "eager" and counter.randomness == "counter"
    assert eager.hash() != counter.hash()
    again = autopar.Plan.from_dict(counter.to_dict())
    assert again.randomness == "counter" and again.hash() == counter.hash()
    assert "randomness: counter" in str(counter)
    plain = autopar.plan(nn.Linear(16, 4), spec, (x, y), loss_fn=F.mse_loss)
    assert plain.randomness == ""


def _runs(world, name, shape, names, runs):
    return world.run(random_tasks.counter_training, name, shape, names, runs)[0]


@pytest.mark.parametrize("name", ["hf_gpt2_dropout", "noisy"])
def test_counter_randomness_trains_alike_under_every_plan(world2, world4, name):
    """GPT-2 with embedding, residual and SDPA dropout, and an MLP with rand_like, randn_like,
    bernoulli and dropout, in counter randomness: one device, data, FSDP, tensor parallel,
    accumulation over 2 microbatches, full recomputation, data x tensor and a 1F1B pipeline
    x data, without and with full recomputation in its stages, give the same losses and
    parameters after two AdamW steps (float64, to rounding)."""
    got = _runs(get_world(1), name, (1,), ("dp",), [{}])
    got += _runs(world2, name, (2,), ("dp",),
                 [{"force": "data"}, {"force": "fsdp"}, {"force": "tensor"},
                  {"force": "data", "microbatches": 2}, {"force": "data", "recompute": "full"}])
    got += _runs(world4, name, (2, 2), ("dp", "tp"), [{"force": {"dp": "data", "tp": "tensor"}}])
    got += _runs(world4, name, (2, 2), ("pp", "dp"),
                 [{"microbatches": 2, "schedule": "1f1b", "force": {"dp": "data"}},
                  {"microbatches": 2, "schedule": "1f1b", "force": {"dp": "data"},
                   "recompute": "full"}])
    assert [r["randomness"] for r in got] == ["counter"] * 9
    assert got[4]["accumulation"] == 2 and got[7]["pipeline"] == 2
    reference = got[0]
    for run in got[1:]:
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-12)
        for k, want in reference["parameters"].items():
            torch.testing.assert_close(run["parameters"][k], want, rtol=1e-9, atol=1e-12)


def test_auto_keeps_the_faster_mode_the_planner_prices():
    """Above EAGER_DRAW_LIMIT, "auto" plans eager draws too where their whole tensors fit in
    half the budget, and keeps the faster plan: never slower than a mode forced by hand. Where
    the whole draw does not fit, eager is not tried."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.1), nn.Linear(1024, 1024))
        x, y = torch.empty(2**15, 1024), torch.empty(2**15, 1024)  # 2**25 elements dropped
    spec = autopar.MeshSpec((2,), hardware="h100")
    plans = {mode: autopar.plan(model, spec, (x, y), loss_fn=F.mse_loss, randomness=mode)
             for mode in ("auto", "eager", "counter")}
    fastest = min(("eager", "counter"), key=lambda m: plans[m].cost.step_time)
    assert plans["auto"].randomness == fastest
    assert plans["auto"].cost.step_time == plans[fastest].cost.step_time
    counter = plans["counter"]
    graph = _graph(nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1)), torch.randn(8, 16),
                   torch.randn(8, 64))
    whole = 8 * 64 * (2 * 4 + 1)  # the eager lowering's bytes of the whole draw
    options = autopar.PlanOptions(memory_budget=2 * whole)
    assert eager_could_fit(counter, graph, spec, options)
    assert not eager_could_fit(counter, graph, spec,
                               autopar.PlanOptions(memory_budget=2 * whole - 1))
