"""A stack of identical layers is traced once and copied (passes/fold.py): the graph is the one
export gives for the whole model, models whose layers differ are traced whole, and folded models
train exactly as on one device."""

import os
import time

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import api, zoo
from autopar.passes import fold
from autopar.passes import trace as trace_module
from autopar.passes.forked import Forked, can_fork
from autopar.passes.trace import TraceError, trace
from tests import rank_tasks


def _signature(program) -> list:
    """The graph with node names replaced by positions and placeholders by what they hold:
    equal for equal programs."""
    names: dict = {}
    for n in program.graph.nodes:
        names[n] = ("input", program.params.get(n.name) or program.buffers.get(n.name) or
                    n.name) if n.op == "placeholder" else len(names)
    out = []
    for n in program.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: names[a])
        val = n.meta.get("val")
        out.append((n.op, names[n] if n.op == "placeholder" else str(n.target), str(args),
                    tuple(val.shape) if isinstance(val, torch.Tensor) else None,
                    [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()]))
    return out


def _both(model, example, loss_fn):
    x, y = example
    whole = trace(model, (x,), loss_fn, y, fold=False)
    folded = trace(model, (x,), loss_fn, y)
    return whole, folded


@pytest.mark.parametrize("name", ["gpt_deep", "hf_llama_deep"])
def test_folded_trace_is_the_whole_trace(name):
    """Same nodes, arguments, shapes, module paths, parameter names and order, buffers."""
    model, loss_fn, example = rank_tasks.build(name)
    whole, folded = _both(model, example, loss_fn)
    assert _signature(folded) == _signature(whole)
    assert list(folded.params.values()) == list(whole.params.values())
    assert folded.buffers == whole.buffers and folded.frozen == whole.frozen
    assert folded.folded and not whole.folded


def test_a_stack_is_found_only_when_its_layers_match():
    torch.manual_seed(0)
    deep = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32))
    stack = fold.repeated_layers(deep)
    assert stack is not None and stack.path == "h" and len(stack.children) == 4
    shallow = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4,
                                    n_embd=32))
    assert fold.repeated_layers(shallow) is None  # fewer than MIN_LAYERS
    widths = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)] + [nn.Linear(8, 4)])
    assert fold.repeated_layers(nn.Sequential(widths)) is None  # shapes differ
    shared = nn.Linear(8, 8)
    once = nn.Sequential(nn.ModuleList([shared] * 4))
    assert fold.repeated_layers(once) is None  # one layer four times: tied, not copies


class _Layer(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        return F.relu(x) if self.index % 3 else torch.tanh(x)  # every third layer differs


class _ByIndex(nn.Module):
    """Layers that branch on their index."""

    def __init__(self, n=6):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(i) for i in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.layers = nn.ModuleList([_Plain() for _ in range(n)])


class _AllOutputs(_Stack):
    """The code after the stack reads every layer, not only the last."""

    def forward(self, x):
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return sum(outs)


class _ByDepth(_Stack):
    """The code after the stack depends on how many layers there are."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x / len(self.layers)


class _Between(_Stack):
    """Code between the layers."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


class _Sequential(_Stack):
    """The same layers, one feeding the next: folded."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("model_cls,folds", [(_ByIndex, False), (_AllOutputs, False),
                                              (_ByDepth, False), (_Between, False),
                                              (_Sequential, True)])
def test_layers_that_differ_are_traced_whole(model_cls, folds):
    """The record of the whole model and of the model cut to two layers tells these apart:
    the trace is the whole one (a copied layer would compute something else); the same
    layers one after another are folded, to the same graph."""
    torch.manual_seed(0)
    model = model_cls()
    example = (torch.randn(4, 8), torch.randn(4, 8))
    whole, folded = _both(model, example, F.mse_loss)
    assert fold.repeated_layers(model) is not None
    assert folded.folded == ("layers" if folds else "")
    assert _signature(folded) == _signature(whole)


@pytest.mark.parametrize("name,force", [("gpt_deep", None), ("gpt_deep", "fsdp"),
                                        ("hf_llama_deep", "tensor")])
def test_folded_models_train_as_on_one_device(world2, name, force):
    world2.run(rank_tasks.train_equivalence, name, (2,), force)


class _SixthCounts(_Stack):
    """Only the sixth layer's call changes Python state: the two-layer export cannot see it."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 5:
                layer.calls = getattr(layer, "calls", 0) + 1
        return x


@pytest.mark.parametrize("model_cls,folds", [(_Sequential, True), (_ByIndex, False)])
def test_the_check_beside_the_export_gives_the_same_trace(monkeypatch, model_cls, folds):
    """With `beside` the whole model's record runs in a forked child while the tracer
    exports two layers: the graph is the one the in-process check gives (for layers that
    differ, the whole model exported after the child says so)."""
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 4)
    forked = []
    monkeypatch.setattr(trace_module, "Forked",
                        lambda fn: forked.append(1) or Forked(fn))
    torch.manual_seed(0)
    model = model_cls()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    here = trace(model, (x,), F.mse_loss, y)
    there = trace(model, (x,), F.mse_loss, y, beside=True)
    assert forked == [1]
    assert there.folded == here.folded == ("layers" if folds else "")
    assert _signature(there) == _signature(here)


def test_a_side_effect_seen_beside_the_export_is_raised(monkeypatch):
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 4)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"model.layers.5.calls was set to 1"):
        trace(_SixthCounts(), (x,), F.mse_loss, y, beside=True)


class _FifthLayer(_Layer):
    def forward(self, x):
        x = self.fc(x)
        return torch.tanh(x) if self.index == 4 else F.relu(x)


class _FifthDiffers(_ByIndex):
    """Only the fifth layer differs: two layers export and copy without complaint, only the
    whole model's record tells."""

    def __init__(self, n=6):
        super().__init__(n)
        self.layers = nn.ModuleList([_FifthLayer(i) for i in range(n)])


def _plan_counting_traces(monkeypatch, model, folds: list, **kw):
    """autopar.plan of `model` on a (2,) CPU mesh, appending the `fold` argument of every
    trace it makes to `folds`."""
    traced = api.trace
    monkeypatch.setattr(api, "trace", lambda *a, **k: folds.append(k["fold"]) or traced(*a, **k))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return autopar.plan(model, autopar.MeshSpec((2,)), (x, y), loss_fn=F.mse_loss, **kw)


@pytest.mark.parametrize("model_cls,folds", [(_Sequential, [True]),
                                              (_FifthDiffers, [True, False])])
def test_plan_waits_for_the_check_beside_the_planning(monkeypatch, model_cls, folds):
    """autopar.plan plans from the two layers copied while the check runs, and returns that
    plan only when the check says the layers are copies; layers that differ are planned
    again from every layer traced: the plan the in-process check gives."""
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 4)
    torch.manual_seed(0)
    model = model_cls()
    traced = []
    plan = _plan_counting_traces(monkeypatch, model, traced)
    assert traced == folds
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 100)  # checked in this process
    alone = _plan_counting_traces(monkeypatch, model, [])
    assert plan.hash() == alone.hash()


def test_plan_raises_the_planning_error_of_the_whole_trace(monkeypatch):
    """A plan that fails on the copied layers is not the user's error until the check says
    they are copies: layers that differ raise what planning every layer raises."""
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 4)
    traced = []
    with pytest.raises(autopar.NoFeasiblePlan):
        _plan_counting_traces(monkeypatch, _FifthDiffers(), traced, memory_budget=1.0)
    assert traced == [True, False]


def test_a_side_effect_seen_beside_the_planning_is_raised(monkeypatch):
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 4)
    with pytest.raises(TraceError, match=r"model.layers.5.calls was set to 1"):
        _plan_counting_traces(monkeypatch, _SixthCounts(), [])


class _TwoArgumentError(Exception):
    """Pickles (as its first argument) but does not unpickle (its class needs two)."""

    def __init__(self, what, where):
        super().__init__(what)
        self.where = where


def _raise_in_child_only(parent: int):
    if os.getpid() != parent:
        raise _TwoArgumentError("child", 1)
    return "here"


def test_a_forked_call_returns_raises_and_falls_back():
    if not can_fork():
        pytest.skip("needs os.fork and a second core")
    assert Forked(lambda: [1, 2]).result() == [1, 2]
    with pytest.raises(ValueError, match="no"):
        Forked(lambda: (_ for _ in ()).throw(ValueError("no"))).result()
    parent = os.getpid()
    # a child that dies without answering: the value is computed here
    assert Forked(lambda: os.getpid() if os.getpid() == parent else os._exit(1)).result() \
        == parent
    assert Forked(lambda: lambda: None).result() is not None  # unpicklable: computed here
    # an answer this process cannot rebuild: computed here
    assert Forked(lambda: _raise_in_child_only(parent)).result() == "here"
    waiting = Forked(lambda: time.sleep(60))
    waiting.cancel()
    assert waiting.pid is None


def test_a_stack_found_copies_is_not_checked_again_at_another_batch(monkeypatch):
    """Planning that splits the batch into microbatches traces the model at each size; the
    layers' check runs at the first only (the same layers), and every trace is folded."""
    monkeypatch.setattr(trace_module, "BESIDE_LAYERS", 100)  # checked in this process
    checks = []
    verdict = trace_module._fold_verdict
    monkeypatch.setattr(trace_module, "_fold_verdict",
                        lambda *a, **k: checks.append(1) or verdict(*a, **k))
    torch.manual_seed(0)
    model = _Sequential(8)
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    folds: list = []
    traced = api.trace
    monkeypatch.setattr(api, "trace", lambda *a, **k: folds.append(k["fold"]) or
                        traced(*a, **k))
    # on one device: 25,664 bytes for the whole batch, 17,472 for two microbatches
    plan = autopar.plan(model, autopar.MeshSpec((1,)), (x, y), loss_fn=F.mse_loss,
                        memory_budget=20_000, recompute="none")
    assert plan.accumulation == 2 and folds == [True, True] and checks == [1]
    whole = trace(model, (x[:32],), F.mse_loss, y[:32], fold=False)
    copied = trace(model, (x[:32],), F.mse_loss, y[:32], copies=True)
    assert copied.folded and _signature(copied) == _signature(whole) and checks == [1]
