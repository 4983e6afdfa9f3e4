"""Functions the gloo ranks run for the pipeline tests (module level, so ranks import them).

`train_equivalence` trains a pipelined model and a single-device copy side by side on every rank
and raises (with the largest differences) when loss, gradients, parameters after the optimizer
steps or the inference output disagree; the test sees the traceback.
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autopar
from tests import rank_tasks

_MESHES: dict = {}


def mesh_for(shape: tuple[int, ...], names: tuple[str, ...]):
    """One DeviceMesh per shape and names per process (creating one is a collective)."""
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


def train_equivalence(name: str, shape: tuple[int, ...], names: tuple[str, ...],
                      steps: int = 3, given_plan: bool = False, **options) -> dict | None:
    """Loss, gradients, parameters after `steps` AdamW steps and the inference output of the
    pipelined model equal single-device training. `options` go to autopar.parallelize
    (microbatches, schedule, virtual_stages, force), or with `given_plan` to autopar.plan on
    every rank, whose plan (saved and loaded) parallelize then runs. Returns the plan as data
    (rank 0)."""
    model, loss_fn, (x, y) = rank_tasks.build(name)
    model, (x, y) = rank_tasks.in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    mesh = mesh_for(shape, names)
    if given_plan:
        plan = autopar.plan(model, autopar.MeshSpec.from_device_mesh(mesh), (x, y),
                            loss_fn=loss_fn, **options)
        plan = autopar.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, plan=plan, example_inputs=(x, y))
    else:
        pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, example_inputs=(x, y),
                                 **options)
    rank_tasks.check_training(pm, ref, loss_fn, x, y, steps)
    return pm.plan.to_dict() if dist.get_rank() == 0 else None


def expect_error(kind: str) -> str:
    """Run one misuse of a pipelined mesh on every rank; return the error's message."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    size = dist.get_world_size()
    try:
        if kind == "batch_not_divisible":
            autopar.parallelize(model, mesh_for((size,), ("pp",)), loss_fn=loss_fn,
                                example_inputs=(x, y), microbatches=3)
        elif kind == "other_batch_refused":
            pm = autopar.parallelize(model, mesh_for((size,), ("pp",)), loss_fn=loss_fn,
                                     example_inputs=(x, y), microbatches=2,
                                     on_new_shape="raise")
            pm.step(x[:2], y[:2])
        elif kind == "other_target":  # the inputs of the build, a target of another shape
            pm = autopar.parallelize(model, mesh_for((size,), ("pp",)), loss_fn=loss_fn,
                                     example_inputs=(x, y), microbatches=2)
            pm.step(x, y[:, :8].contiguous())
        elif kind == "value_changed":  # a value forward reads, changed after the first step
            pm = autopar.parallelize(model, mesh_for((size,), ("pp",)), loss_fn=loss_fn,
                                     example_inputs=(x, y), microbatches=2)
            pm.step(x, y)
            pm.wte.scale_grad_by_freq = True
            pm.step(x, y)
        elif kind == "samples_mix":  # a loss centring the logits on the batch's mean
            autopar.parallelize(model, mesh_for((size,), ("pp",)), loss_fn=lambda out, t:
                                loss_fn(out - out.mean(0, keepdim=True), t),
                                example_inputs=(x, y), microbatches=2)
        else:
            raise ValueError(kind)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"


class NormedBlocks(nn.Module):
    """Four residual blocks h + tanh(norm(Linear(h))), the norm BatchNorm ("bn") or dropout
    ("dropout"): ops whose train and eval modes differ."""

    def __init__(self, norm: str):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.lins = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(16) if norm == "bn" else nn.Dropout(0.3)
                                    for _ in range(4)])
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for lin, norm in zip(self.lins, self.norms):
            h = h + torch.tanh(norm(lin(h)))
        return self.out(h)


def normed_blocks(norm: str):
    """NormedBlocks(norm) in float64, a copy of it (the single-device reference) and a batch."""
    torch.manual_seed(0)
    model = NormedBlocks(norm).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    return model, copy.deepcopy(model), x, torch.randint(0, 4, (8,))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def modes(kind: str) -> float:
    """A pipelined model's train / eval modes, the model in eval mode at parallelize (as
    from_pretrained leaves it) and pmodel.train() before the first step:
    "train_set_before_build" builds in training mode; "train_after_build" (example_inputs=)
    builds in eval mode and adds the training stages at the first step, where the model
    computes other ops (dropout). Returns the largest loss difference to one device training
    with dropout."""
    mesh = mesh_for((2,), ("pp",))
    model, ref, x, y = normed_blocks("dropout")
    model.eval()
    given = {"example_inputs": (x, y)} if kind == "train_after_build" else {}
    pm = autopar.parallelize(model, mesh, loss_fn=F.cross_entropy, microbatches=2, **given)
    pm.train()
    ref.train()
    worst = 0.0
    for step in range(2):
        torch.manual_seed(7 + step)
        loss = pm.step(x, y)
        torch.manual_seed(7 + step)
        worst = max(worst, abs(float(loss - F.cross_entropy(ref(x), y).detach())))
    return worst


def other_batches(schedule: str) -> str:
    """A pipelined model given batches of another size than its build's (a smaller last
    batch, another size for evaluation) or shorter sequences plans them on its stages and
    schedule, with the
    parameters where they are, over as many microbatches as the build's or the most under
    that the batch splits into: steps and inference equal one device's. A batch the schedule
    cannot train on (3 rows: one microbatch, which 1F1B on 2 pp ranks does not run) still
    infers, and its step is an error saying so. Returns that error ("" if none)."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    model, (x, y) = rank_tasks.in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for((2,), ("pp",)), loss_fn=loss_fn,
                             example_inputs=(x, y), microbatches=2, schedule=schedule)
    error = ""
    # (rows, sequence length): a shorter sequence too (a language model's target is shaped
    # as its tokens: inference there traces with such a target)
    for rows, seq in ((len(x), x.shape[1]), (2, x.shape[1]), (3, x.shape[1]), (2, 8),
                      (2, x.shape[1])):
        xs, ys = x[:rows, :seq].contiguous(), y[:rows, :seq].contiguous()
        with torch.no_grad():
            torch.testing.assert_close(pm(xs), ref(xs), rtol=rank_tasks.RTOL,
                                       atol=rank_tasks.ATOL)
        pm.zero_grad()
        ref.zero_grad()
        try:
            loss = pm.step(xs, ys)
        except ValueError as e:
            error = str(e)
            continue
        ref_loss = loss_fn(ref(xs), ys)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rank_tasks.RTOL,
                                   atol=rank_tasks.ATOL)
        rank_tasks.check_equal("gradient", pm.full_grads(),
                               {n: p.grad for n, p in ref.named_parameters()})
    assert [p.pipeline.batch_size for p in pm.plans] == [len(x), 2, 3, 2], pm.plans
    return error


def eval_between_steps(norm: str, shape: tuple[int, ...], names: tuple[str, ...],
                       **options) -> float:
    """A pipelined model with BatchNorm or dropout ("bn", "dropout") trained, evaluated in
    eval mode (pmodel.eval(), pmodel(x)), trained on and evaluated again, as a training loop
    validates between steps: losses, eval outputs (BatchNorm's running statistics, no
    dropout) and the parameters after the AdamW steps equal one device's. Returns the largest
    difference."""
    model, ref, x, y = normed_blocks(norm)
    pm = autopar.parallelize(model, mesh_for(shape, names), loss_fn=F.cross_entropy,
                             example_inputs=(x, y), **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(3):
        pm.train()
        ref.train()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.manual_seed(7 + step)
        loss = pm.step(x, y)
        torch.manual_seed(7 + step)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        worst = max(worst, abs(float(loss - ref_loss.detach())))
        if step == 1:
            continue  # two steps in a row, with the eval stages built
        pm.eval()
        ref.eval()
        with torch.no_grad():
            got, want = pm(x), ref(x)
        worst = max(worst, float((got - want).abs().max()))
    full = pm.full_state_dict()
    for n, t in ref.state_dict().items():
        if t.is_floating_point():
            worst = max(worst, float((full[n] - t).abs().max()))
    train_plan, eval_plan = pm.plans  # the eval plan on the training plan's stages
    assert pm.plan is eval_plan and eval_plan.pipeline.cuts == train_plan.pipeline.cuts
    assert eval_plan.parameters == train_plan.parameters
    return worst


def written_buffers() -> None:
    """BatchNorm's running statistics, written in forward by one stage: after two steps every
    rank's state_dict() and full_state_dict() hold one device's buffers; full_state_dict()
    holds every stage's tensors (a plain model loads it), and load_state_dict() takes a
    single-device state dict."""
    model, ref, x, y = normed_blocks("bn")
    pm = autopar.parallelize(model, mesh_for((2,), ("pp",)), loss_fn=F.cross_entropy,
                             example_inputs=(x, y), microbatches=1)
    for _ in range(2):
        pm.step(x, y)
        F.cross_entropy(ref(x), y)
    want = dict(ref.named_buffers())
    rank_tasks.check_equal("buffer", pm.state_dict(), want)
    full = pm.full_state_dict()  # every stage's tensors, in the model's order, on every rank
    assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
    rank_tasks.check_equal("state", full, ref.state_dict())
    plain = NormedBlocks("bn").double()
    plain.load_state_dict(full)  # strict
    fresh = NormedBlocks("bn").double()  # a single-device state dict loads (each rank its part)
    pm.load_state_dict(fresh.state_dict())
    rank_tasks.check_equal("state after load_state_dict", pm.full_state_dict(),
                           fresh.state_dict())


def mixed_precision_errors(shape: tuple[int, ...], names: tuple[str, ...], **options) -> dict:
    """bf16-mixed pipelined training of the GPT against rank_tasks.MixedReference: relative
    errors of the loss and the gradients (as rank_tasks.mixed_precision_errors measures)."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    ref = rank_tasks.MixedReference(copy.deepcopy(model))
    pm = autopar.parallelize(model, mesh_for(shape, names), loss_fn=loss_fn,
                             example_inputs=(x, y), precision="bf16-mixed", **options)
    loss = pm.step(x, y)
    ref_loss = ref.step(loss_fn, x, y)
    grads = pm.full_grads()
    return {"loss": abs(float(loss - ref_loss)) / abs(float(ref_loss)),
            "gradient": max(rank_tasks.relative_error(grads[n], p.grad)
                            for n, p in ref.master.named_parameters())}


def cast_copies_kept(shape: tuple[int, ...], names: tuple[str, ...], **options) -> dict:
    """bf16-mixed pipelined training of the GPT: for each parameter, how many distinct casts
    of it to bfloat16 autograd keeps over a step (a saved tensor whose autograd history
    reaches the parameter's leaf through a dtype cast and views only), and the most
    microbatches this rank holds at once."""
    model, loss_fn, (x, y) = rank_tasks.build("gpt")
    pm = autopar.parallelize(model, mesh_for(shape, names), loss_fn=loss_fn,
                             example_inputs=(x, y), precision="bf16-mixed", **options)
    leaves = {id(p) for p in pm.parameters()}
    casts: dict[int, set[int]] = {}

    def cast_of(fn):  # the cast node a saved tensor's history starts with, through views
        while fn is not None and type(fn).__name__ != "ToCopyBackward0":
            nexts = [f for f, _ in fn.next_functions if f is not None]
            if len(nexts) != 1 or not type(fn).__name__.endswith(
                    ("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                     "ExpandBackward0", "UnsqueezeBackward0", "SliceBackward0",
                     "AliasBackward0")):
                return None
            fn = nexts[0]
        return fn

    def pack(t):
        fn = cast_of(t.grad_fn) if t.dtype == torch.bfloat16 else None
        if fn is not None:
            leaf = fn.next_functions[0][0]
            var = getattr(leaf, "variable", None)
            if var is not None and id(var) in leaves:
                casts.setdefault(id(var), set()).add(id(fn))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.step(x, y)
    return {"copies": sorted({len(c) for c in casts.values()}),
            "microbatches": pm.plan.pipeline.microbatches}
