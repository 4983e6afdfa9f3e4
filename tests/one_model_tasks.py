"""What the gloo ranks run for tests/test_one_model.py: the model passed to parallelize is the
parallelized model (as FSDP2's fully_shard and tensor parallel's parallelize_module work in
place): its calls, parameters, state dict and gradient clipping are the trained ones, and a
loss function reading its tensors reads the live ones, each checked against the
single-device model trained the same way in float64."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests import pipeline_tasks
from tests.rank_tasks import ATOL, RTOL, build, check_equal, grads_of, in_float64, mesh_for


class Net(nn.Module):
    """Two layers, class weights in a buffer and a plain coefficient, read by `penalized`."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.c = nn.Linear(32, 8)
        self.register_buffer("cw", torch.linspace(0.5, 1.5, 8))
        self.scale = 1e-2

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)))


def penalized(model: nn.Module):
    """A loss function reading `model`: class weights from its buffer, an L2 term on one of
    its parameters, scaled by a plain attribute."""

    def loss_fn(out, y):
        return F.cross_entropy(out, y, weight=model.cw) + \
            model.scale * model.c.weight.pow(2).sum()

    return loss_fn


def _net():
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(8, 16, dtype=torch.float64)
    return model, copy.deepcopy(model), x, torch.randint(0, 8, (8,))


def _whole(state: dict) -> dict:
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in state.items()}


def the_model_trains(mesh_shape, force, path: str) -> None:
    """After parallelize the model is the parallelized model: an optimizer over
    `model.parameters()` trains it (loss and parameters equal one device's), `model(x)` is
    the trained model's output, `model.state_dict()` is pmodel's, clip_grad_norm_ over
    `model.parameters()` clips by the global norm, autopar.checkpoint saves and loads it
    (at `path`), and the model's own full tensors are freed."""
    model, ref, x, y = _net()
    first = weakref.ref(model.a.weight)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy,
                             force=force, example_inputs=(x, y))
    gc.collect()
    assert first() is None, "the model's full tensors outlived the build"
    assert [id(p) for p in model.parameters()] == [id(p) for p in pm.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        loss = model.step(x, y)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        opt.step()
        ref_opt.step()
    check_equal("parameter", pm.full_parameters(), dict(ref.named_parameters()))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
    state, own = model.state_dict(keep_vars=True), pm.state_dict(keep_vars=True)
    assert list(state) == list(own) and all(state[n] is own[n] for n in own)
    check_equal("state", _whole(model.state_dict()), ref.state_dict())
    autopar.checkpoint.save(path, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    autopar.checkpoint.load(path, model, opt)
    check_equal("parameter", pm.full_parameters(), dict(ref.named_parameters()))


def loss_reading_the_model(mesh_shape, force) -> None:
    """A loss function reading the model passed to parallelize (class weights in its buffer,
    an L2 term on `model.c.weight` scaled by `model.scale`) computes on its live tensors: the
    loss, the gradients (the L2 term's included) and the parameters after two SGD steps equal
    one device's; the buffer changed in place or assigned anew and the coefficient set anew
    act at the next step."""
    model, ref, x, y = _net()
    loss_fn, ref_loss_fn = penalized(model), penalized(ref)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force,
                             example_inputs=(x, y))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:  # changed on the model, in place and anew, as on one device
            with torch.no_grad():
                model.cw.mul_(2.0)
                ref.cw.mul_(2.0)
            model.scale = ref.scale = 5e-2
        if step == 3:  # a buffer assigned anew
            model.cw = torch.linspace(2.0, 1.0, 8, dtype=torch.float64)
            ref.cw = torch.linspace(2.0, 1.0, 8, dtype=torch.float64)
        opt.zero_grad()
        loss = pm.step(x, y)
        ref_opt.zero_grad()
        ref_loss = ref_loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        check_equal("gradient", pm.full_grads(), grads_of(dict(ref.named_parameters())))
        opt.step()
        ref_opt.step()
    check_equal("parameter", pm.full_parameters(), dict(ref.named_parameters()))


def old_optimizer(mesh_shape, force) -> str:
    """An optimizer built over the model's parameters before parallelize holds tensors the
    model no longer has (the build replaced them by this rank's shards): its step raises,
    naming what to build it over."""
    model, _, x, y = _net()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy,
                             force=force)
    pm.step(x, y)
    try:
        early.step()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("an optimizer over the model's replaced parameters stepped")


def captured_tensor(which: str) -> str:
    """A loss function holding one of the model's tensors itself (taken from the model outside
    it: `which`, a parameter or a buffer) would keep it as a constant while the model trains:
    every rank raises, naming it and what to read instead. Returns "Type: message"."""
    model, _, x, y = _net()
    held = model.get_parameter(which) if which == "c.weight" else model.get_buffer(which)

    def loss_fn(out, t):
        if held.dim() == 2:
            return F.cross_entropy(out, t) + held.pow(2).sum()
        return F.cross_entropy(out, t, weight=held)

    pm = autopar.parallelize(model, mesh_for((2,)), loss_fn=loss_fn, force="data")
    try:
        pm.step(x, y)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    raise AssertionError("a loss capturing the model's tensor trained on a constant")


def parallelized_twice() -> str:
    """A model whose parallelize failed at its build is its own again: parallelized anew, it
    trains as one device; parallelizing it once more after that build is an error (its
    tensors are the parallelized model's). Returns that error."""
    model, ref, x, y = _net()
    try:
        autopar.parallelize(model, mesh_for((2,)), loss_fn=lambda out, t: out.sum(0),
                            example_inputs=(x, y), force="data")
    except Exception as e:  # noqa: BLE001 - a loss that is not a scalar, on every rank
        assert "scalar" in str(e), e
    else:
        raise AssertionError("a loss that is not a scalar built")
    assert type(model) is Net
    autopar.parallelize(model, mesh_for((2,)), loss_fn=F.cross_entropy, force="data")
    loss = model.step(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x), y).detach(), rtol=RTOL, atol=ATOL)
    try:
        autopar.parallelize(model, mesh_for((2,)), loss_fn=F.cross_entropy)
    except ValueError as e:
        return str(e)
    raise AssertionError("a parallelized model was parallelized again")


def pipelined() -> list[str]:
    """Under a pipelined plan the model holds this rank's stages' parameters (pmodel's, what
    `model.parameters()` gives) and meta tensors for the others: an optimizer over
    `model.parameters()` trains it through `model.step`, and `model(x)` equals one device's
    output. Returns the names of the meta parameters."""
    model, loss_fn, (x, y) = build("gpt")
    model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, pipeline_tasks.mesh_for((2,), ("pp",)), loss_fn=loss_fn,
                             example_inputs=(x, y), microbatches=2, schedule="1f1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss = model.step(x, y)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        opt.step()
        ref_opt.step()
    check_equal("parameter", pm.full_parameters(), dict(ref.named_parameters()))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
    assert [id(p) for p in model.parameters()] == [id(p) for p in pm.parameters()]
    meta = [n for n, p in nn.Module.named_parameters(model) if p.is_meta]
    assert meta and all(n not in dict(pm.named_parameters()) for n in meta)
    return meta


def given_plan(force) -> None:
    """A plan made by autopar.plan for a loss function reading the model runs it exactly."""
    model, ref, x, y = _net()
    loss_fn, ref_loss_fn = penalized(model), penalized(ref)
    mesh = mesh_for((2,))
    plan = autopar.plan(model, autopar.MeshSpec.from_device_mesh(mesh), (x, y),
                        loss_fn=loss_fn, force=force)
    pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, plan=plan, example_inputs=(x, y))
    loss = pm.step(x, y)
    ref_loss = ref_loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    check_equal("gradient", pm.full_grads(), grads_of(dict(ref.named_parameters())))
