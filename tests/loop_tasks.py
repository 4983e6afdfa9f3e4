"""What the gloo ranks run for tests/test_training_loop.py: the calls a training loop makes
(gradient clipping, parameter groups by name, state_dict, train/eval, a new batch size, per-rank
batches, keyword inputs, a model that computes its own loss), each checked against the
single-device model trained the same way."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar import zoo
from tests.pipeline_tasks import normed_blocks
from tests.rank_tasks import (
    ATOL,
    RTOL,
    build,
    check_equal,
    check_training,
    in_float64,
    mesh_for,
)


def _pair(name, mesh_shape, force=None, **options):
    model, loss_fn, (x, y) = build(name)
    model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force,
                             **options)
    return pm, ref, loss_fn, x, y


def _same_parameters(pm, ref) -> None:
    check_equal("parameter", pm.full_parameters(),
                {n: p.detach() for n, p in ref.named_parameters()})


def clip_equivalence(name, mesh_shape, force=None, pmodel_method: bool = False) -> float:
    """torch.nn.utils.clip_grad_norm_ over pmodel.parameters() (or pmodel.clip_grad_norm_)
    clips by the global norm, as on one device: the norms, and the parameters after the
    clipped AdamW steps, are equal. Returns the first step's norm."""
    pm, ref, loss_fn, x, y = _pair(name, mesh_shape, force)
    pm.build((x, y))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    first = None
    for _ in range(2):
        opt.zero_grad()
        pm.step(x, y)
        if pmodel_method:
            norm = pm.clip_grad_norm_(0.05)
        else:
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        first = first if first is not None else float(norm)
        opt.step()
        ref_opt.step()
    _same_parameters(pm, ref)
    return first


def _groups(named):
    decay, no_decay = [], []
    for n, p in named:
        (no_decay if n.endswith("bias") or ".ln" in n or "norm" in n else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def param_groups_by_name(name, mesh_shape, force=None) -> list[str]:
    """Optimizer groups built from named_parameters() (no weight decay for biases and norms)
    train as on one device; returns the names pmodel gives."""
    pm, ref, loss_fn, x, y = _pair(name, mesh_shape, force)
    pm.build((x, y))
    names = [n for n, _ in pm.named_parameters()]
    opt = torch.optim.AdamW(_groups(pm.named_parameters()), lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(ref.named_parameters()), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        pm.step(x, y)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    _same_parameters(pm, ref)
    return names


def state_dict_keys(name, mesh_shape, force=None) -> tuple[list[str], list[str], list[str]]:
    """The keys of pmodel.state_dict() and of the model's own, and the types of its values."""
    pm, ref, loss_fn, x, y = _pair(name, mesh_shape, force)
    pm.build((x, y))
    sd = pm.state_dict()
    return sorted(sd), sorted(ref.state_dict()), sorted({type(v).__name__ for v in sd.values()})


def state_saved_by_one_rank(mesh_shape, force, path: str) -> str:
    """pmodel.state_dict() saved by rank 0 alone with torch.save (as with
    DistributedDataParallel) holds rank 0's shards: loading it on every rank is an error
    naming autopar.checkpoint.save (was: each rank loaded rank 0's blocks, silently). Each
    rank saving and loading its own state dict loads exactly. Returns the error."""
    pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
    pm.step(x, y)
    want = pm.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(pm.state_dict(), path)
    mine = io.BytesIO()
    torch.save(pm.state_dict(), mine)
    dist.barrier()
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    try:
        pm.load_state_dict(torch.load(path, weights_only=False))
    except ValueError as e:
        error = str(e)
    else:
        raise AssertionError("rank 0's shards were loaded on every rank")
    mine.seek(0)
    pm.load_state_dict(torch.load(mine, weights_only=False))
    check_equal("parameter", pm.full_state_dict(), want)
    return error


def weight_average(mesh_shape, force=None) -> str:
    """A parallelized model cannot be copied (torch's AveragedModel deep-copies its model):
    the error says how to average its weights instead, and that recipe (copies of the
    parameters' shards, lerp_ after each step, loaded to evaluate, the trained weights loaded
    back) evaluates as AveragedModel's EMA does on one device and trains on as before.
    Returns the error."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
    pm.step(x, y)
    try:
        copy.deepcopy(pm)
    except TypeError as e:
        error = str(e)
    else:
        raise AssertionError("a parallelized model was deep-copied")
    decay = 0.5
    ref_avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(decay))
    avg = {}
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        pm.step(x, y)
        loss_fn(ref(x), y).backward()
        opt.step()
        ref_opt.step()
        with torch.no_grad():  # (AveragedModel's first update copies the weights)
            for n, p in pm.named_parameters():
                avg[n] = avg[n].lerp_(p.detach(), 1 - decay) if n in avg else p.detach().clone()
        ref_avg.update_parameters(ref)
    live = {n: t.detach().clone() for n, t in pm.state_dict().items()}
    pm.load_state_dict(avg, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref_avg(x), rtol=RTOL, atol=ATOL)
    pm.load_state_dict(live)
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=RTOL, atol=ATOL)
    return error


def rank0_alone_evaluates(mesh_shape, force=None) -> str:
    """DistributedDataParallel code evaluating on rank 0 alone: rank 0's inference call meets
    the other ranks' next step() in the control plane's agreement, and every rank raises
    saying so (was: an error about input shapes). Returns the error."""
    pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
    pm.step(x, y)
    try:
        if dist.get_rank() == 0:
            with torch.no_grad():
                pm(x)
        pm.step(x, y)
    except autopar.RankError as e:
        return str(e)
    raise AssertionError("a call on rank 0 alone ran")


def module_tree(mesh_shape, force=None) -> list[str]:
    """The parallelized model's module tree has the model's containers: `pmodel.h[0]`,
    `pmodel.h[-1]`, `len(pmodel.h)` and iterating work as on the model, and a mode set
    through an index is the submodule's. Returns the names of the parameters under
    pmodel.h[-1]."""
    pm, ref, loss_fn, x, y = _pair("gpt", mesh_shape, force)
    pm.build((x, y))
    assert isinstance(pm.h, torch.nn.ModuleList) and len(pm.h) == len(ref.h) == 2
    assert pm.h[0] is pm.get_submodule("h.0") and list(pm.h) == [pm.h[0], pm.h[1]]
    pm.h[0].eval()
    assert not pm.get_submodule("h.0").training and pm.get_submodule("h.1").training
    pm.train()
    return [n for n, _ in pm.h[-1].named_parameters()]


def ranks_build_different_models(mesh_shape, force=None) -> None:
    """Every rank builds its model from its own seed: all train rank 0's model."""
    torch.manual_seed(0)
    ref = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                n_embd=32)).double()
    torch.manual_seed(1000 + dist.get_rank())
    mine = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                 n_embd=32)).double()
    if dist.get_rank() == 0:
        mine.load_state_dict(ref.state_dict())
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(7))
    y = torch.roll(x, -1, 1)
    pm = autopar.parallelize(mine, mesh_for(mesh_shape), loss_fn=zoo.lm_loss, force=force)
    loss = pm.step(x, y)
    ref_loss = zoo.lm_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    _same_parameters(pm, ref)
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})


def new_batch_replans(name, mesh_shape, force=None) -> int:
    """A batch of another size than planned is planned again (parameters stay put) and
    computes what the single-device model computes; returns the number of plans built."""
    pm, ref, loss_fn, x, y = _pair(name, mesh_shape, force)
    for xs, ys in ((x, y), (torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])), (x, y)):
        loss = pm.step(xs, ys)
        ref.zero_grad()
        ref_loss = loss_fn(ref(xs), ys)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
        for p in pm.parameters():
            p.grad = None
        with torch.no_grad():
            torch.testing.assert_close(pm(xs), ref(xs), rtol=RTOL, atol=ATOL)
    return len(pm.plans)


def per_rank_batches(name, mesh_shape, per_rank: tuple[str, ...], force=None) -> None:
    """Each rank passes its slice of the global batch (as a DistributedSampler over the
    `per_rank` mesh dimensions would): loss and gradients equal the global batch's on one
    device, and the forward call returns this rank's rows."""
    pm, ref, loss_fn, x, y = _pair(name, mesh_shape, force, per_rank_inputs=per_rank)
    mesh = mesh_for(mesh_shape)
    names = mesh.mesh_dim_names
    coords = mesh.get_coordinate()
    index, pieces = 0, 1
    for k, n in enumerate(names):
        if n in per_rank:
            index, pieces = index * mesh.shape[k] + coords[k], pieces * mesh.shape[k]
    rows = x.shape[0] // pieces
    xs, ys = x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]
    loss = pm.step(xs, ys)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    with torch.no_grad():
        torch.testing.assert_close(pm(xs), ref(x)[index * rows:(index + 1) * rows],
                                   rtol=RTOL, atol=ATOL)


def hf_keyword_batch(mesh_shape, force=None) -> None:
    """A Hugging Face causal LM given a dict batch with labels computes its own loss: step(**batch)
    with no loss_fn equals model(**batch).loss and its gradients on one device. The batch as
    `example_kwargs` alone builds the model at parallelize (it was silently ignored)."""
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    pm = autopar.parallelize(model, mesh_for(mesh_shape), force=force, example_kwargs=batch)
    assert pm.plans, "example_kwargs alone did not build the model"
    loss = pm.step(**batch)
    out = ref(**batch)
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss.detach(), rtol=RTOL, atol=ATOL)
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=batch["attention_mask"])
        want = ref(input_ids=ids, attention_mask=batch["attention_mask"])
    torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)


def backward_through_inference(mesh_shape, force=None) -> list[str]:
    """The loop DistributedDataParallel takes, `loss_fn(pmodel(x), y).backward()`, raises,
    naming pmodel.step (pmodel(x) runs without autograd: the parameters would get no gradient),
    alone or beside a weight penalty that reaches the parameters directly (trained on the
    penalty alone before); the first leaves no gradient, and training goes on with step(). Under
    torch.no_grad() the outputs are plain tensors. Returns the errors."""
    pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
    errors = []
    for penalty in (False, True):
        out = pm(x)
        assert out.requires_grad
        torch.testing.assert_close(out.detach(), ref(x).detach(), rtol=RTOL, atol=ATOL)
        loss = loss_fn(out, y)
        if penalty:
            loss = loss + 1e-4 * sum(p.pow(2).sum() for p in pm.parameters())
        try:
            loss.backward()
        except RuntimeError as e:
            errors.append(str(e))
        else:
            raise AssertionError("backward through pmodel(x) ran")
        if not penalty:
            assert all(p.grad is None for p in pm.parameters())
    pm.zero_grad()  # what the penalty's backward reached before the loss's failed
    with torch.no_grad():
        assert not pm(x).requires_grad
    loss = pm.step(x, y)
    loss_fn(ref(x), y).backward()
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    return errors


def optimizer_over_the_model(mesh_shape, force=None) -> list[str]:
    """An optimizer over the parameters of the model passed to parallelize built before it
    (as DistributedDataParallel allows) holds tensors the build replaced by the parallelized
    model's, which never get a gradient: its step raises, naming what to build it over. One
    built after the build over model.parameters() (the parallelized model's shards) steps;
    once the model and the parallelized model are dropped, both are freed with their shards
    and programs. Returns the errors."""
    model, loss_fn, (x, y) = build("mlp")
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force)
    pm.step(x, y)
    late = torch.optim.AdamW(list(model.parameters())[2:], lr=0.1)
    errors = []
    before = [p.detach().clone() for p in early.param_groups[0]["params"]]
    try:
        early.step()
    except RuntimeError as e:
        errors.append(str(e))
    assert all(torch.equal(a, p) for a, p in zip(before, early.param_groups[0]["params"]))
    before = [p.detach().full_tensor() for p in late.param_groups[0]["params"]]
    late.step()
    assert not any(torch.equal(a, p.detach().full_tensor())
                   for a, p in zip(before, late.param_groups[0]["params"]))
    torch.optim.AdamW(pm.parameters(), lr=0.1).step()
    gone = weakref.ref(pm)
    del pm, model, late
    gc.collect()
    # (a leak kept it: the pricing caches held resharding errors with the frames they unwound)
    assert gone() is None, "the parallelized model outlived its last reference"
    return errors


def original_model_changes(mesh_shape, force=None) -> str:
    """Changes made on the model passed to parallelize after it, as one makes them on the
    model DistributedDataParallel wraps: model.eval() for a validation pass and model.train()
    after it, a plain attribute set on it, act on the parallelized model (were ignored: the
    validation ran with dropout); weights loaded into it with load_state_dict are the
    parallelized model's; a hook registered on it, and a parameter assigned anew on it, are
    errors naming the module, or the parameter and model.load_state_dict (were ignored).
    Returns the last error."""
    torch.manual_seed(0)
    model = _Scaled().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force)

    def same_step(seed: int) -> None:
        torch.manual_seed(seed)
        loss = pm.step(x, y)
        torch.manual_seed(seed)
        ref_loss = F.cross_entropy(ref(x), y)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)

    same_step(1)
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=RTOL, atol=ATOL)
    model.train()
    ref.train()
    model.scale = ref.scale = 2.0
    same_step(2)
    assert pm.training and pm.scale == 2.0
    handle = model.out.register_forward_hook(lambda mod, args, out: out * 2)
    try:
        pm.step(x, y)
    except Exception as e:  # noqa: BLE001 - raised on every rank, before any collective
        assert "hook was registered on (or removed from) module out" in str(e), e
    else:
        raise AssertionError("a hook registered on the model passed to parallelize was ignored")
    handle.remove()
    same_step(3)
    with torch.no_grad():  # weights loaded into the model are the parallelized model's
        for p in ref.parameters():
            p.mul_(0.5)
    model.load_state_dict(ref.state_dict())
    same_step(4)
    model.inp.weight = torch.nn.Parameter(ref.inp.weight.detach().clone())
    try:
        pm.step(x, y)
    except Exception as e:  # noqa: BLE001 - raised on every rank, before any collective
        return str(e)
    raise AssertionError("a parameter assigned anew on the model passed to parallelize was "
                         "ignored")


def train_and_eval_modes(mesh_shape, force=None) -> None:
    """A model with dropout: in eval mode the forward call applies none (it equals the
    single-device model in eval mode); back in train mode, steps draw their masks as one
    device does."""
    model, loss_fn, (x, y) = build("hf_gpt2_dropout")
    model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force)
    torch.manual_seed(5)
    loss = pm.step(x, y)
    torch.manual_seed(5)
    ref_loss = loss_fn(ref(x), y)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=RTOL, atol=ATOL)
    eval_loss = pm.step(x, y)  # a loss in eval mode: no dropout either
    torch.testing.assert_close(eval_loss, loss_fn(ref(x), y).detach(), rtol=RTOL, atol=ATOL)
    pm.train()
    ref.train()
    torch.manual_seed(6)
    loss = pm.step(x, y)
    torch.manual_seed(6)
    torch.testing.assert_close(loss, loss_fn(ref(x), y).detach(), rtol=RTOL, atol=ATOL)


def batchnorm(mesh_shape, force=None, training: bool = False) -> None:
    """BatchNorm equals one device: in eval mode it reads the running statistics; in training
    mode it normalizes over the whole batch and updates the running statistics (and the
    count of batches) as one device does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.train(training)
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force)
    loss = pm.step(x, y)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    loss = pm.step(x, y)  # a second step: statistics updated twice
    loss_fn_ref = F.cross_entropy(ref(x), y)
    torch.testing.assert_close(loss, loss_fn_ref.detach(), rtol=RTOL, atol=ATOL)
    sd = pm.state_dict()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(sd[f"1.{name}"], getattr(ref[1], name), rtol=RTOL, atol=ATOL)


def accumulation_equivalence(mesh_shape, force=None, microbatches=None,
                             budget_between: bool = False) -> int:
    """A step that accumulates gradients over microbatches equals the big batch on one
    device: loss, gradients, parameters after AdamW steps. The count is asked for
    (`microbatches`), or (`budget_between`) chosen by the planner: the memory budget is set
    between the smallest peak of one microbatch of half the batch and of the whole batch,
    so that only accumulation fits. Returns the count the plan uses."""
    from autopar.passes import strategies
    from autopar.passes.trace import trace
    from autopar.solver.cost import CostModel
    from autopar.solver.diagnose import min_memory

    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                  n_embd=32)).double()
    x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(5))
    y = torch.roll(x, -1, 1)
    ref = copy.deepcopy(model)
    budget = None
    if budget_between:
        spec = autopar.MeshSpec.from_device_mesh(mesh_for(mesh_shape))
        smallest = []
        for rows in (16, 8):
            graph = strategies.build(trace(model, (x[:rows],), zoo.lm_loss, y[:rows]),
                                     spec.shape, zero=True)  # the planner's candidates
            smallest.append(min_memory(graph, CostModel(spec, graph=graph))[0])
        assert smallest[1] < smallest[0], smallest
        budget = sum(smallest) / 2
    # the minima above neither recompute nor free gathered parameters: nor may the planner
    others = {"recompute": "none", "reshard_after_forward": False} if budget_between else {}
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=zoo.lm_loss, force=force,
                             microbatches=microbatches, memory_budget=budget,
                             example_inputs=(x, y), **others)
    check_training(pm, ref, zoo.lm_loss, x, y, 2)
    return max(p.accumulation for p in pm.plans)


def plan_chooses_the_mesh() -> list:
    """A plan for a device count (the planner chose the mesh), saved and loaded, builds its
    own DeviceMesh in parallelize and trains as on one device. Returns the mesh shape."""
    model, loss_fn, (x, y) = build("gpt")
    model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    plan = autopar.plan(model, autopar.Cluster(dist.get_world_size(), hardware="cpu"),
                        (x, y), loss_fn=loss_fn)
    plan = autopar.Plan.from_dict(plan.to_dict())
    pm = autopar.parallelize(model, plan=plan, loss_fn=loss_fn, example_inputs=(x, y))
    check_training(pm, ref, loss_fn, x, y, 2)
    return list(plan.mesh.shape)


def optimizer_kernels(mesh_shape, force) -> None:
    """Optimizers that update the parameters below autograd train as on one device: AdamW's
    foreach and fused kernels (foreach is torch's default for DTensors on GPUs) and an update
    through `p.data`, as hand-written optimizers make it. Under ZeRO the whole copies the
    programs use are gathered from the stepped shards before every step, whichever way
    they were stepped."""
    for kind in ("foreach", "fused", "data"):
        pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
        pm.build((x, y))
        kw = {kind: True} if kind != "data" else {}
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, **kw)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = pm.step(x, y)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
            if kind == "data":
                mine = dict(ref.named_parameters())
                for n, p in pm.named_parameters():
                    p.data.add_(p.grad.data, alpha=-0.1)
                    mine[n].data.add_(mine[n].grad.data, alpha=-0.1)
            else:
                opt.step()
                ref_opt.step()
        _same_parameters(pm, ref)


def _sum_loss(output, target):
    return F.cross_entropy(output, target, reduction="sum")


def accumulation_weights(mesh_shape, force=None) -> str:
    """Gradient accumulation weights each microbatch's loss as the whole batch's loss
    weighs it: targets padded with ignore_index unevenly over the batch (the mean divides by
    the targets each microbatch counts; a microbatch counting none adds nothing), and a loss
    summed over the batch (weight 1, read from the loss's last op, whatever loss_reduction
    says). BatchNorm in training mode
    cannot be split: asking for microbatches is an error naming it. Returns that error."""
    pm, ref, loss_fn, x, y = _pair("gpt_padded", mesh_shape, force, microbatches=4)
    pm.build((x, y))
    check_training(pm, ref, loss_fn, x, y, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8)).double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=_sum_loss, force=force,
                             microbatches=2, example_inputs=(x, y))
    check_training(pm, ref, _sum_loss, x, y, 2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.Linear(32, 8)).double()
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy,
                             force=force, microbatches=2)
    try:
        pm.step(x, y)
    except Exception as e:  # raised on every rank (planning is agreed)
        return str(e)
    raise AssertionError("microbatches=2 with BatchNorm in training mode did not raise")


def submodule_modes(mesh_shape, force=None) -> None:
    """Each module runs in its own mode, as on one device: BatchNorm frozen (eval) inside a
    model in training mode before parallelize, then through the parallelized model's own
    submodule after it (eval of one block, train of the whole), and dropout (a module without
    parameters) switched off alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.Dropout(0.5), torch.nn.Linear(32, 8)).double()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    model.train()
    model[1].eval()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force,
                             example_inputs=(x, y))
    for step, modes in enumerate(((), ((2, False),), ((1, True), (2, False)))):
        for i, training in modes:
            pm.get_submodule(str(i)).train(training)
            ref[i].train(training)
        torch.manual_seed(step)
        loss = pm.step(x, y)
        torch.manual_seed(step)
        ref_loss = F.cross_entropy(ref(x), y)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        state = pm.state_dict()
        check_equal("buffer", state, {n: b for n, b in ref.named_buffers() if n in state})
    pm.train()
    ref.train()
    torch.manual_seed(9)
    loss = pm.step(x, y)
    torch.manual_seed(9)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x), y).detach(), rtol=RTOL, atol=ATOL)


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 8)

    def forward(self, x, temperature):
        return self.net(x) / temperature


def scalar_input(mesh_shape, force=None) -> None:
    """A 0-dimensional tensor input (a temperature) beside the batch: it is not split, and
    training and inference give the single-device numbers."""
    torch.manual_seed(0)
    model = _Tempered().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    t = torch.tensor(2.0, dtype=torch.float64)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force)
    loss = pm.step(x, t, y)
    ref_loss = F.cross_entropy(ref(x, t), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    with torch.no_grad():
        torch.testing.assert_close(pm(x, t), ref(x, t), rtol=RTOL, atol=ATOL)


AUX_WEIGHT = 1.0  # a global the loss function of `traced_values` reads
SHIFT = 0.0  # a global _Scaled's forward reads


@dataclasses.dataclass
class _Settings:
    gain: float = 1.0
    note: str = "a field forward never reads"


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.25)
        self.out = torch.nn.Linear(32, 8)
        self.scale = 1.0   # read by forward
        self.calls = 0     # a counter forward never reads
        self.config = _Settings()  # a configuration object, as Hugging Face models keep

    def forward(self, x):
        h = self.drop(torch.relu(self.inp(x))) * self.scale * self.config.gain
        return self.out(h + SHIFT)


def traced_values(mesh_shape, force=None) -> None:
    """Python values the trace read, changed between steps, change the next step as on one
    device: a module attribute, a Dropout's p and a configuration object's field set through
    the parallelized model, a global forward reads, a global coefficient, a loss module's
    label smoothing and a class-weight tensor the loss captures (changed in place). A counter
    forward never reads changes nothing; a value changed at every step is refused after a
    few, saying what to do instead."""
    global AUX_WEIGHT, SHIFT
    torch.manual_seed(0)
    model = _Scaled().double()
    ref = copy.deepcopy(model)
    weight = torch.ones(8, dtype=torch.float64)
    crit = torch.nn.CrossEntropyLoss(weight=weight)

    def loss_fn(out, y):
        return crit(out, y) * AUX_WEIGHT

    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force,
                             example_inputs=(x, y))

    def same(step: int) -> None:
        torch.manual_seed(step)
        loss = pm.step(x, y)
        ref.zero_grad()
        torch.manual_seed(step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
        pm.zero_grad()

    same(0)
    for step, change in enumerate([
            lambda m: setattr(m, "scale", 2.0),
            lambda m: setattr(m.drop, "p", 0.5),
            lambda m: setattr(m.config, "gain", 1.5),
            lambda m: None if m is ref else globals().__setitem__("SHIFT", 0.25),
            lambda m: None if m is ref else globals().__setitem__("AUX_WEIGHT", 0.5),
            lambda m: None if m is ref else setattr(crit, "label_smoothing", 0.1),
            lambda m: None if m is ref else weight.copy_(torch.arange(1.0, 9.0))], 1):
        change(pm)
        change(ref)
        same(step)
    for step in range(8, 8 + 10):  # more changes than programs are traced for
        pm.calls += 1
        same(step)
    try:
        for scale in range(3, 3 + 10):
            pm.scale = ref.scale = float(scale)
            same(100 + scale)
    except autopar.RankError as e:
        assert "changed 8 times" in str(e) and "model.scale" in str(e), e
        assert "register_buffer" in str(e), e
    else:
        raise AssertionError("a value changed at every step was traced again every step")
    finally:
        AUX_WEIGHT, SHIFT = 1.0, 0.0


def parametrized_weights(mesh_shape, force=None) -> None:
    """Weights under torch.nn.utils.parametrizations train as on one device: spectral_norm
    (whose power iteration updates its buffers under no_grad with `out=` ops) and
    weight_norm: losses, gradients, parameters, the power iteration's buffers and inference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8)).double()
    torch.nn.utils.parametrizations.spectral_norm(model[0])
    torch.nn.utils.parametrizations.weight_norm(model[2])
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force,
                             example_inputs=(x, y))
    check_training(pm, ref, F.cross_entropy, x, y, 3)


class _Held(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 8)
        self.register_buffer("gate", torch.ones(32))
        self.temperature = torch.tensor(1.0)  # a plain tensor attribute

    def forward(self, x, mask=None):
        h = torch.relu(self.inp(x)) * self.gate
        if mask is not None:
            h = h * mask
        return self.out(h) / self.temperature


def reassigned_state(mesh_shape, force=None) -> None:
    """State replaced on the parallelized model between steps, as a loop might: a buffer
    assigned anew, a plain tensor attribute assigned anew and changed in place, gradients
    rescaled by assignment (p.grad = p.grad * 2: full_grads reads them), and inference with a
    keyword input after a step that took it."""
    torch.manual_seed(0)
    model = _Held().double()
    model.temperature = model.temperature.double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    mask = (torch.rand(8, 32) > 0.3).double()
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=F.cross_entropy, force=force,
                             example_inputs=(x, y), example_kwargs={"mask": mask})
    for change in [
            lambda m: setattr(m, "gate", torch.linspace(0.5, 1.5, 32, dtype=torch.float64)),
            lambda m: setattr(m, "temperature", torch.tensor(2.0, dtype=torch.float64)),
            lambda m: m.temperature.fill_(0.5),
            lambda m: m.register_buffer("gate", torch.full((32,), 0.25, dtype=torch.float64))]:
        change(pm)
        change(ref)
        loss = pm.step(x, y, mask=mask)
        ref.zero_grad()
        ref_loss = F.cross_entropy(ref(x, mask=mask), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        for params in (pm.parameters(), ref.parameters()):
            for p in params:
                p.grad = p.grad * 2.0
        check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
        pm.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(pm(x, mask=mask), ref(x, mask=mask), rtol=RTOL, atol=ATOL)


def state_snapshot(mesh_shape, force=None) -> None:
    """A snapshot of the model's and the optimizer's state, kept as a loop keeps its best
    model (copy.deepcopy, or torch.save to memory), restores both exactly after more steps,
    on every rank (ZeRO's shards start partway into their whole copies)."""
    pm, ref, loss_fn, x, y = _pair("mlp", mesh_shape, force)
    pm.step(x, y)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.step()
    snap = copy.deepcopy({"model": pm.state_dict(), "optimizer": opt.state_dict()})
    buffer = io.BytesIO()
    torch.save(snap, buffer)
    want = pm.full_parameters()
    for _ in range(2):
        pm.zero_grad()
        pm.step(x, y)
        opt.step()
    for restore in (snap, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        pm.load_state_dict(restore["model"])
        opt.load_state_dict(restore["optimizer"])
        check_equal("parameter", pm.full_parameters(), want)
    pm.zero_grad()
    pm.step(x, y)
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    _same_parameters(pm, ref)


def frozen_batch_norm(force, microbatches: int) -> list[str]:
    """BatchNorm blocks whose norms are frozen in eval mode (fine-tuning) train as on one
    device, under `microbatches` of gradient accumulation too; returns the placements of the
    norms' inputs in the training plan."""
    model, ref, x, y = normed_blocks("bn")
    for m in (model, ref):
        m.norms.eval()
    pm = autopar.parallelize(model, mesh_for((2,)), loss_fn=F.cross_entropy,
                             example_inputs=(x, y), force=force, microbatches=microbatches)
    train = pm.plan
    assert train.accumulation == microbatches
    check_training(pm, ref, F.cross_entropy, x, y, 2)
    return [o["inputs"][0] for o in train.to_dict()["ops"] if o["op"] == "batch_norm.default"]
