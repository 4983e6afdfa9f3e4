"""bf16-mixed training runs: float32 master weights (what the optimizer steps), compute in
bfloat16 (parameters cast once per step, or per gather under FSDP), float32 loss and gradient
reduction; equal, within bfloat16 rounding, to a single-device reference that casts at the same
points (tests.rank_tasks.MixedReference).

Tolerance policy, the same for every plan: the loss within 1e-3 relative; each gradient and
each parameter update (SGD) within 4% of that tensor's largest value (bfloat16 keeps 8
significant bits, 0.4%, and a sharded plan adds up its bfloat16 pieces in another order). That
the run really computes in bfloat16 is checked by its memory (tests/test_memory.py: the
activations autograd keeps are bfloat16)."""

import pytest

from tests import rank_tasks


def _check(errors: dict) -> None:
    assert errors["loss"] < 1e-3, errors
    assert errors["gradient"] < 0.04 and errors["update"] < 0.04, errors


@pytest.mark.parametrize("force", [None, "data", "fsdp", "tensor"], ids=lambda f: f or "solver")
@pytest.mark.parametrize("model", ["gpt", "hf_llama"])
def test_bf16_mixed_equals_the_reference(world2, model, force):
    for errors in world2.run(rank_tasks.mixed_precision_errors, model, (2,), force):
        _check(errors)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_bf16_mixed_with_recomputation(world2, recompute):
    """Recomputed blocks run again in bfloat16 from the same casts: the same tolerance."""
    for errors in world2.run(rank_tasks.mixed_precision_errors, "hf_llama", (2,), "tensor",
                             recompute=recompute):
        _check(errors)


def test_bf16_mixed_on_two_dimensions(world4):
    for errors in world4.run(rank_tasks.mixed_precision_errors, "gpt", (2, 2),
                             {"dp": "fsdp", "tp": "tensor"}):
        _check(errors)


def test_bf16_mixed_pipeline(world2):
    from tests import pipeline_tasks
    for errors in world2.run(pipeline_tasks.mixed_precision_errors, (2,), ("pp",),
                             microbatches=2):
        assert errors["loss"] < 1e-3 and errors["gradient"] < 0.04, errors


def test_a_pipeline_casts_each_weight_once_a_step(world2):
    """GPipe holds all 4 microbatches in flight: they share one bfloat16 copy of each weight
    (runtime/pipeline.py StepCasts), as the planner prices it, not one copy each."""
    from tests import pipeline_tasks
    for got in world2.run(pipeline_tasks.cast_copies_kept, (2,), ("pp",), microbatches=4,
                          schedule="gpipe"):
        assert got == {"copies": [1], "microbatches": 4}, got
