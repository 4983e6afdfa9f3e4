"""What the gloo ranks run for tests/test_checkpoint.py: checkpoints saved under one plan and
mesh, loaded under another, and the ways a checkpoint can be wrong."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
import autopar.checkpoint as ckpt
from tests.pipeline_tasks import mesh_for as named_mesh
from tests.pipeline_tasks import normed_blocks
from tests.rank_tasks import ATOL, RTOL, build, check_equal, in_float64, mesh_for


def _gpt(mesh_shape, force):
    model, loss_fn, (x, y) = build("gpt")
    model, (x, y) = in_float64(model, (x, y))
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                             example_inputs=(x, y), force=force)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2), loss_fn, x, y


def resume_across_plans(path: str, first: tuple, second: tuple) -> float:
    """Train 2 steps under plan `first` (mesh shape, force), save, load into a model planned
    as `second`, train 2 more steps; the parameters equal 4 uninterrupted steps under `first`.
    Returns the largest difference."""
    pm, opt, _, x, y = _gpt(*first)
    for _ in range(2):
        opt.zero_grad()
        pm.step(x, y)
        opt.step()
    ckpt.save(path, pm, opt, extra={"step": 2})
    other, other_opt, _, _, _ = _gpt(*second)
    extra = ckpt.load(path, other, other_opt)
    assert extra == {"step": 2}, extra
    for p_opt, model in ((opt, pm), (other_opt, other)):
        for _ in range(2):
            p_opt.zero_grad()
            model.step(x, y)
            p_opt.step()
    a, b = pm.full_parameters(), other.full_parameters()
    check_equal("parameter after resuming", b, a)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def full_state_dict_round_trip(mesh_shape, force) -> None:
    """full_state_dict() loads into a plain single-device model (strict) and equals it; a
    single-device state dict loads into the parallelized model."""
    pm, opt, loss_fn, x, y = _gpt(mesh_shape, force)
    opt.zero_grad()
    pm.step(x, y)
    opt.step()
    full = pm.full_state_dict()
    plain, _, _ = build("gpt")
    plain = plain.double()
    plain.load_state_dict(full)  # strict
    with torch.no_grad():
        torch.testing.assert_close(pm(x), plain(x), rtol=RTOL, atol=ATOL)
    fresh, _, _ = build("gpt")
    pm.load_state_dict(copy.deepcopy(fresh.double().state_dict()))
    check_equal("parameter after load_state_dict", pm.full_parameters(),
                dict(fresh.named_parameters()))


def bad_checkpoint(path: str, kind: str) -> str:
    """Load a checkpoint that does not fit; returns "Type: message" of what was raised."""
    pm, opt, _, x, y = _gpt((dist.get_world_size(),), "data")
    try:
        if kind == "other_model":
            other, loss_fn, (xo, yo) = build("mlp")
            po = autopar.parallelize(other, mesh_for((dist.get_world_size(),)),
                                     loss_fn=loss_fn, example_inputs=(xo, yo))
            ckpt.save(path, po)
            ckpt.load(path, pm, opt)
        elif kind == "other_dtype":
            single, loss_fn, (xs, ys) = build("gpt")  # float32
            po = autopar.parallelize(single, mesh_for((dist.get_world_size(),)),
                                     loss_fn=loss_fn, example_inputs=(xs, ys))
            ckpt.save(path, po)
            ckpt.load(path, pm, opt)
        elif kind == "no_checkpoint":
            ckpt.load(path + "-nothing-here", pm, opt)
        elif kind == "state_dict_of_other_shapes":
            other, _, _ = build("gpt")
            sd = {k: v.double() for k, v in other.state_dict().items()}
            sd["wte.weight"] = sd["wte.weight"][:10]
            pm.load_state_dict(sd)
        else:
            raise ValueError(kind)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def failed_save_keeps_the_previous(path: str) -> tuple[str, float]:
    """A save that fails on rank 1 raises on every rank and leaves the checkpoint already at
    `path` loadable, with its values; returns the error and the largest difference after
    loading it back."""
    pm, opt, _, x, y = _gpt((dist.get_world_size(),), "fsdp")
    ckpt.save(path, pm, opt)
    before = pm.full_parameters()
    opt.zero_grad()
    pm.step(x, y)
    opt.step()
    from torch.distributed.checkpoint import filesystem
    original = filesystem.FileSystemWriter.write_data
    if dist.get_rank() == 1:  # this rank's disk fills up while it writes its shards
        def broken(self, plan, planner):
            raise OSError("disk full (injected)")
        filesystem.FileSystemWriter.write_data = broken
    try:
        ckpt.save(path, pm, opt)
        message = "no error"
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    finally:
        filesystem.FileSystemWriter.write_data = original
    ckpt.load(path, pm, opt)
    after = pm.full_parameters()
    return message, max((before[n] - after[n]).abs().max().item() for n in before)


def resume_into_and_out_of_a_pipeline(path: str, first: tuple, second: tuple) -> None:
    """BatchNorm blocks (buffers written in forward): 2 AdamW steps under `first` (mesh shape,
    dimension names, force), a checkpoint, 2 more steps under `second` loaded from it; the
    losses, parameters and buffers equal 4 steps on one device. A pp rank holds its stages'
    tensors only: the checkpoint of the others' must still load."""
    model, ref, x, y = normed_blocks("bn")
    later = copy.deepcopy(model)

    def built(m, shape, names, force):
        pm = autopar.parallelize(m, named_mesh(shape, names), loss_fn=F.cross_entropy,
                                 example_inputs=(x, y), microbatches=1, force=force)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2)

    pm, opt = built(model, *first)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        if step == 2:
            ckpt.save(path, pm, opt)
            pm, opt = built(later, *second)
            ckpt.load(path, pm, opt)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.step(x, y)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        opt.step()
        ref_opt.step()
    full = pm.full_state_dict()
    assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
    check_equal("state after resuming", full, ref.state_dict())
