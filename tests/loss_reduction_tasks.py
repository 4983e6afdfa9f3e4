"""Rank tasks for tests/test_loss_reduction.py: gradient accumulation of losses divided by a
number, token-normalized cross-entropies, masked means and soft labels, trained against one
device in float64 or refused on every rank."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import autopar
from tests.rank_tasks import check_training, mesh_for

B = 8  # the batch's size, a Python int some losses below close over


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8)).double()


def _tokens():
    """Sequences of 4 tokens, targets padded with -100 unevenly over the batch (the first
    half counts 13 of its 16 targets, the second 6): a weight of 1/2 per microbatch, or one
    by each microbatch's count, would be wrong for a sum divided by the whole batch's count."""
    x = torch.randn(B, 4, 16, dtype=torch.float64)
    y = torch.randint(0, 8, (B, 4))
    for row, kept in enumerate((4, 3, 4, 2, 1, 0, 3, 2)):
        y[row, kept:] = -100
    return x, y


def exact(mesh_shape, force) -> list[str]:
    """Losses whose reduction autopar reads train with microbatches=2 as the whole batch on
    one device: a sum over the batch divided by its size as a Python int (weight 1 each) or
    read from a shape (the microbatch's size: 1/2 each), a cross-entropy summed over tokens
    divided by the whole batch's token count (a Python int), a cross-entropy against
    probability targets (a mean over samples). Returns the losses checked."""
    torch.manual_seed(1)
    x, y = torch.randn(B, 16, dtype=torch.float64), torch.randint(0, 8, (B,))
    tx, ty = _tokens()
    n_tokens = int((ty != -100).sum())
    soft = torch.randn(B, 8, dtype=torch.float64).softmax(-1)
    cases = {
        "sum / B": (lambda o, t: F.cross_entropy(o, t, reduction="none").sum() / B, x, y),
        "sum / shape": (lambda o, t: F.cross_entropy(o, t, reduction="none").sum()
                        / o.shape[0], x, y),
        "tokens / n_tokens": (lambda o, t: F.cross_entropy(
            o.flatten(0, 1), t.flatten(), reduction="sum", ignore_index=-100) / n_tokens,
            tx, ty),
        "soft labels": (F.cross_entropy, x, soft),
    }
    for name, (loss_fn, inputs, target) in cases.items():
        model = _mlp()
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, force=force,
                                 microbatches=2, example_inputs=(inputs, target))
        try:
            check_training(pm, ref, loss_fn, inputs, target, 2)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    return list(cases)


def refused(mesh_shape, force) -> dict[str, str]:
    """Losses autopar cannot weight per microbatch, asked for microbatches=2: the error each
    raises (on every rank), by name. A loss it cannot read trains as the whole batch once
    loss_reduction says what it is."""
    torch.manual_seed(1)
    x, y = _tokens()
    mask = (y > 0).to(torch.float64)  # the whole batch's, captured by the loss

    def captured_mask(o, t):
        return (F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none",
                                ignore_index=-100) * mask.flatten()).sum() / mask.sum()

    def target_mask(o, t):
        m = (t > 0).to(o.dtype).flatten()
        return (F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none",
                                ignore_index=-100) * m).sum() / m.sum()

    def token_count(o, t):
        return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum",
                               ignore_index=-100) / (t != -100).sum()

    def sums(o, t):  # a sum of two sums: loss_reduction="sum" says so
        return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum",
                               ignore_index=-100) + 0.01 * o.pow(2).sum()

    errors = {}
    for name, loss_fn in (("captured_mask", captured_mask), ("target_mask", target_mask),
                          ("token_count", token_count), ("sums", sums)):
        pm = autopar.parallelize(_mlp(), mesh_for(mesh_shape), loss_fn=loss_fn, force=force,
                                 microbatches=2)
        try:
            pm.step(x, y)
        except Exception as e:  # noqa: BLE001 - raised on every rank (planning is agreed)
            errors[name] = f"{type(e).__name__}: {e}"
        else:
            errors[name] = ""
    model = _mlp()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=sums, force=force,
                             microbatches=2, loss_reduction="sum", example_inputs=(x, y))
    check_training(pm, ref, sums, x, y, 2)
    return errors


def pipelined(size: int) -> str:
    """A GPT pipelined over `size` pp ranks in 2 microbatches, its cross-entropy summed over
    the tokens and divided by the batch's token count as a Python int, trains as the whole
    batch on one device (it gave half the loss). Returns the plan's schedule."""
    from tests import rank_tasks
    from tests.pipeline_tasks import mesh_for as pp_mesh

    model, _, (x, y) = rank_tasks.build("gpt")
    model, (x, y) = rank_tasks.in_float64(model, (x, y))
    n_tokens = y.numel()

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / n_tokens

    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, pp_mesh((size,), ("pp",)), loss_fn=loss_fn,
                             example_inputs=(x, y), microbatches=2)
    check_training(pm, ref, loss_fn, x, y, 2)
    return pm.plan.pipeline.schedule
