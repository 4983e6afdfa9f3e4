"""How a loss combines its batch decides how gradient accumulation weights each microbatch's
loss (passes/loss_weights.py). A sum divided by a number is read exactly, whether the number
is the whole batch's (a Python int the loss closes over) or the microbatch's (read from a
shape); soft labels are a mean over samples; a loss autopar cannot read is never split on an
assumption: microbatches= is refused naming its last op, and the planner does not accumulate
it by itself, until loss_reduction= says what it is."""

import re

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.passes.loss_weights import microbatch_weights, of_program
from autopar.passes.trace import trace
from autopar.solver.ilp import NoFeasiblePlan
from tests import loss_reduction_tasks

FORCE = ["data", "fsdp"]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_numbers_dividing_the_loss_weigh_microbatches():
    """A microbatch program is traced at the microbatch's shapes: a number the loss closes
    over stays the whole batch's (sum / 8: weight 1 each), a size read from a shape becomes
    the microbatch's (sum / x.shape[0]: 1/2 each), a constant factor on a mean changes
    nothing, and a negated sum is read through its negation."""
    mlp, x, y = _mlp(), torch.randn(8, 16), torch.randint(0, 8, (8,))

    def weights(loss_fn):
        whole = trace(mlp, (x,), loss_fn, y)
        half = trace(mlp, (x[:4],), loss_fn, y[:4])
        return microbatch_weights(of_program(half, whole=whole), [4, 4], 2, True)

    assert weights(lambda o, t: F.cross_entropy(o, t, reduction="none").sum() / 8) == [1, 1]
    assert weights(lambda o, t: F.cross_entropy(o, t, reduction="sum") / 8 * 0.5) == [1, 1]
    assert weights(lambda o, t: F.cross_entropy(o, t, reduction="none").sum()
                   / o.shape[0]) == [0.5, 0.5]
    assert weights(lambda o, t: F.cross_entropy(o, t) * 3) == [0.5, 0.5]
    assert weights(lambda o, t: -(F.log_softmax(o, -1) * F.one_hot(t, 8)).sum() / 8) == [1, 1]
    assert weights(lambda o, t: F.mse_loss(o, F.one_hot(t, 8).float()) * o.shape[0]) == [1, 1]


def test_soft_labels_are_a_mean_over_samples():
    """A cross-entropy against probability targets averages over the samples (class weights
    or not), not over targets counted as ignore_index leaves them: it is weighted 1/m, with
    per_rank_inputs too (it was refused there, for a reason speaking of ignore_index)."""
    mlp, x = _mlp(), torch.randn(8, 16)
    soft = torch.randn(8, 8).softmax(-1)
    for loss_fn in (F.cross_entropy, lambda o, t: F.cross_entropy(o, t, weight=torch.rand(8))):
        weights = of_program(trace(mlp, (x,), loss_fn, soft), per_rank_inputs=True)
        assert weights.kind == "mean" and not weights.exact(), weights


def test_unreadable_loss_is_refused_unless_loss_reduction_says():
    """A loss autopar cannot read (a sum of two sums) is refused under microbatches=2 naming
    its last op, asking for loss_reduction; given, it accumulates."""
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))

    def sums(o, t):
        return F.cross_entropy(o, t, reduction="sum") + o.pow(2).sum()

    mesh = autopar.MeshSpec((2,))
    for force in FORCE:
        with pytest.raises(ValueError, match=r"microbatches=2: .*cannot read how the loss adds "
                                             r"up the batch's samples from its last op add.Tensor "
                                             r"in the loss function.*loss_reduction=\"sum\""):
            autopar.plan(_mlp(), mesh, (x, y), loss_fn=sums, microbatches=2, force=force)
        for reduction in ("sum", "mean"):
            assert autopar.plan(_mlp(), mesh, (x, y), loss_fn=sums, microbatches=2, force=force,
                                loss_reduction=reduction).accumulation == 2


@pytest.mark.parametrize("force", FORCE)
def test_planner_does_not_accumulate_an_unreadable_loss_by_itself(force):
    """Under a memory budget only microbatches fit, the planner accumulates a loss it reads
    (a sum divided by the batch's size) and one loss_reduction describes, and refuses one it
    cannot read, saying why accumulation cannot help (it chose 2 microbatches and weighted
    them as means)."""
    x = torch.randn(512, 16, dtype=torch.float64)
    y = torch.randint(0, 8, (512,))

    def per_sample(o, t):
        return F.cross_entropy(o, t, reduction="none").sum() / 512

    def sums(o, t):
        return F.cross_entropy(o, t, reduction="sum") / 512 + o.pow(2).sum()

    mesh = autopar.MeshSpec((2,), hardware="cpu")
    options = {"force": force, "recompute": "none", "reshard_after_forward": False}
    whole = autopar.plan(_mlp().double(), mesh, (x, y), loss_fn=sums,
                         memory_budget=float("inf"), **options).cost.memory
    budget = sum(whole.values()) - whole["activations"] / 2  # only microbatches fit
    assert autopar.plan(_mlp().double(), mesh, (x, y), loss_fn=per_sample,
                        memory_budget=budget, **options).accumulation > 1
    assert autopar.plan(_mlp().double(), mesh, (x, y), loss_fn=sums, memory_budget=budget,
                        loss_reduction="sum", **options).accumulation > 1
    with pytest.raises(NoFeasiblePlan, match=r"accumulation would not compute .*cannot read "
                                             r"how the loss adds up .*last op add.Tensor"):
        autopar.plan(_mlp().double(), mesh, (x, y), loss_fn=sums, memory_budget=budget,
                     **options)


@pytest.mark.parametrize("force", FORCE)
def test_losses_divided_by_numbers_accumulate_as_the_batch(world2, force):
    """sum / B (B the batch's size as a Python int) and a token-normalized cross-entropy
    (summed, divided by the whole batch's count as a Python int) with microbatches=2 train
    as the whole batch on one device (they gave half the loss and half the gradients), as
    sum / x.shape[0] and soft labels do."""
    checked = world2.run(loss_reduction_tasks.exact, (2,), force)[0]
    assert checked == ["sum / B", "sum / shape", "tokens / n_tokens", "soft labels"]


@pytest.mark.parametrize("force", FORCE)
def test_ratios_and_unreadable_losses_refused_on_every_rank(world2, force):
    """With microbatches=2, on every rank: a masked mean whose mask the loss captures (it
    failed tracing the microbatch, with torch.export's broadcast error) is refused as a loss
    autopar cannot read, naming its last op and asking for loss_reduction; a masked mean and
    a sum over tokens divided by their count computed from the target are refused as ratios
    of two sums over the batch, pointing to cross_entropy's own mean; a sum of sums is
    refused until loss_reduction="sum" (then it trains as one device)."""
    for errors in world2.run(loss_reduction_tasks.refused, (2,), force):
        unread = r"ValueError: microbatches=2: .*cannot read how the loss adds up the " \
                 r"batch's samples from its last op {} in the loss function.*" \
                 r"loss_reduction=\"sum\" or loss_reduction=\"mean\""
        ratio = r"ValueError: microbatches=2: .*last op div.Tensor in the loss function " \
                r"combines sums or means over the batch .*F.cross_entropy\(\.\.\., " \
                r"ignore_index=-100\)"
        assert re.search(unread.format("div.Tensor"), errors["captured_mask"]), errors
        assert re.search(ratio, errors["target_mask"]), errors
        assert re.search(ratio, errors["token_count"]), errors
        assert re.search(unread.format("add.Tensor"), errors["sums"]), errors


def test_pipeline_weighs_a_loss_divided_by_a_number(world2):
    """A pipeline schedule weights its microbatches as accumulation does: a sum over tokens
    divided by the batch's token count (a Python int) trains as one device."""
    assert world2.run(loss_reduction_tasks.pipelined, 2)[0]
