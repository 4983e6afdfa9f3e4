"""Relaxations worked out in a forked child while the planner solves (autopar/foresight.py):
the same plans as planned alone, whatever the child does."""

import os
import time

import pytest
import torch

import autopar
from autopar import foresight, planner
from autopar.passes.forked import ForkedStream, can_fork
from autopar.zoo import GPT, GPTConfig, lm_loss

SPEC = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs os.fork and a second core")


def _items(parent: int):
    yield 1
    yield {"two": 2.0}
    if os.getpid() != parent:
        raise ValueError("the stream ends here")
    yield 3


def test_a_forked_stream_sends_each_item_and_ends_at_an_error():
    parent = os.getpid()
    stream = ForkedStream(lambda: _items(parent))
    assert stream.next() == 1
    assert stream.next() == {"two": 2.0}
    assert stream.next() is None  # the child raised: no more items, and the child is gone
    assert stream.pid is None and stream.next() is None
    unpicklable = ForkedStream(lambda: iter([1, lambda: None, 3]))
    assert unpicklable.next() == 1 and unpicklable.next() is None
    waiting = ForkedStream(lambda: (time.sleep(60) for _ in range(1)))
    waiting.cancel()
    assert waiting.pid is None and waiting.next() is None


class _Recorded(foresight.Foresight):
    """A Foresight that records itself and what its children answered."""

    made: list = []

    def __init__(self, work):
        super().__init__(work)
        self.served = []
        _Recorded.made.append(self)

    def get(self, m, key):
        value = super().get(m, key)
        if value is not None:
            self.served.append((m, key))
        return value


def _gpt():
    model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64))
    x = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(0))
    return model, (x, torch.roll(x, -1, 1))


@pytest.fixture
def recorded(monkeypatch):
    """Foresight for any program (the 4-layer GPT is below LARGE_PROGRAM), recorded; the
    planner's level solves counted by (microbatches, recomputation, freed)."""
    monkeypatch.setattr(planner, "LARGE_PROGRAM", 0)
    monkeypatch.setattr(planner, "Foresight", _Recorded)
    _Recorded.made = []
    solved = []
    solve_plan = planner.solve_plan

    def counted(*args, **kwargs):
        solved.append((kwargs["accumulation"], kwargs["recompute"], kwargs["reshard"]))
        return solve_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "solve_plan", counted)
    return solved


def _budgeted(model, example):
    """A budget that fits only with recomputation over several microbatches."""
    free = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=float("inf"))
    return free.cost.peak_memory * 0.45


def test_the_plan_with_counts_foreseen_is_the_plan_planned_alone(monkeypatch, recorded):
    """A memory search whose first count fits nothing goes on to the next: the child works
    out the first count's middle levels and the next count's relaxations, the planner takes
    its decisions from them (fewer solves of its own) and plans what it planned alone."""
    model, example = _gpt()
    budget = _budgeted(model, example)
    recorded.clear()
    _Recorded.made = []
    plan = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=budget)
    ahead, = _Recorded.made
    assert ahead.served  # the child's values were used...
    assert {m for m, _ in ahead.served} >= {1, 2}
    assert not ahead.children  # ...and no child outlives the planning
    foreseen = list(recorded)
    recorded.clear()
    monkeypatch.setattr(foresight.Foresight, "possible", staticmethod(lambda: False))
    alone = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=budget)
    assert len(_Recorded.made) == 1  # no foresight without a second core
    assert plan.accumulation > 1 and plan.recompute.mode != "none"
    assert plan.hash() == alone.hash()
    assert plan.cost.step_time == alone.cost.step_time
    assert len(foreseen) < len(recorded)  # levels ruled out by the child's numbers


def test_a_child_that_stops_leaves_the_planner_to_work_it_out(monkeypatch, recorded):
    """Whatever the child does not send (it raised, died or was cut short), the planner works
    out itself: the same plan."""
    model, example = _gpt()
    budget = _budgeted(model, example)
    monkeypatch.setattr(foresight.Foresight, "possible", staticmethod(lambda: False))
    alone = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=budget)
    monkeypatch.setattr(foresight.Foresight, "possible", staticmethod(lambda: True))
    foreseen = planner.foreseen

    def stops(trace_at, mesh, options, wanted):
        items = foreseen(trace_at, mesh, options, wanted)
        yield next(items)
        os._exit(1)  # dies after its first item

    monkeypatch.setattr(planner, "foreseen", stops)
    plan = autopar.plan(model, SPEC, example, loss_fn=lm_loss, memory_budget=budget)
    assert plan.hash() == alone.hash()
    assert all(len(a.served) <= 1 and not a.children for a in _Recorded.made)
