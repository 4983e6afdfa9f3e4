"""Bad input a user will hit, on real gloo worlds: every rank raises a clear error (what, where,
what to do) and none hangs (the world answers within its timeout, or the test fails)."""

import pytest

from tests import bad_input_tasks as tasks
from tests.world import World

# kind -> (exception type, words the message must hold)
CASES = {
    "non_tensor_input": ("RankError", ["input", "int, not a tensor"]),
    "shape_differs_across_ranks": ("RankError", ["different shapes", "rank 1", "(6, 16)"]),
    "values_differ_across_ranks": ("RankError", ["different values", "per_rank_inputs"]),
    "per_rank_slices_without_the_option": ("RankError", ["different values",
                                                         "per_rank_inputs"]),
    "new_shape_with_raise": ("RankError", ["on_new_shape", "(4, 16)"]),
    "input_on_another_device": ("RankError", ["meta", "runs on cpu"]),
    "dtype_differs_across_ranks": ("RankError", ["different shapes or dtypes", "float64"]),
    "non_scalar_loss": ("TraceError", ["shape (8,)", "not a scalar", "mean or sum"]),
    "loss_returns_tuple": ("TraceError", ["tuple of 2", "one scalar tensor"]),
    "step_without_a_loss": ("TraceError", ["return its loss", "loss_fn="]),
    "unknown_option": ("TypeError", ["unknown option", "microbatch", "microbatches"]),
    "pipeline_option_without_pp": ("ValueError", ["schedule", '"pp"']),
    "microbatches_not_dividing_the_batch": ("ValueError", ["microbatches=3 must divide",
                                                          "divisor of 8"]),
    "force_dimension_out_of_range": ("ValueError", ["index 5", "dimension 0 ('dp'"]),
    "force_unknown_style": ("ValueError", ["unknown style", "zero9"]),
    "per_rank_unknown_dimension": ("ValueError", ["per_rank_inputs", "'data'", "dp"]),
    "per_rank_batch_indivisible": ("ValueError", ["does not split evenly", "(3, 16)"]),
    "meta_model_without_init": ("ValueError", ["has no reset_parameters()", "init_fn="]),
    "side_effect_in_forward": ("TraceError", ["calls changed from 0 to 1", "side effects"]),
    "data_dependent_routing": ("TraceError", ["data-dependent shape", "counts.tolist()",
                                              "fixed capacity"]),
    "parameter_written_in_forward": ("TraceError", ["updates a parameter in place",
                                                     "clamp_", "optimizer step"]),
    "random_states_differ": ("RankError", ["random", "torch.manual_seed", "dropout"]),
    "requires_grad_changed": ("RankError", ["requires_grad", "before parallelize"]),
    "step_under_no_grad": ("RankError", ["outside torch.no_grad()"]),
    "input_requires_grad": ("RankError", ["input 0 requires grad", "x.detach()"]),
    "backward_hook_on_the_model": ("ValueError", ["module net.0 (Linear) has a backward hook",
                                                  "after step() returns"]),
    "gradient_hook_on_a_parameter": ("RankError", ["has a gradient hook", "never runs"]),
    "hook_on_a_parallelized_module": ("RankError", ["hook was registered on module",
                                                    "before parallelize"]),
    "to_after_parallelize": ("RuntimeError", ["cannot change device or dtype"]),
    "state_before_planning": ("RuntimeError", ["not planned yet"]),
    "plan_for_other_batch": ("ValueError", ["another model, input shape or mesh"]),
    "keyword_batch_to_pipeline": ("RankError", ["positional inputs only"]),
}


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=60.0) as w:
        yield w


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bad_input_raises_on_every_rank(world, kind):
    kind_type, words = CASES[kind]
    messages = world.run(tasks.attempt, kind)
    for m in messages:
        assert m.startswith(kind_type + ":"), m
        for w in words:
            assert w in m, (w, m)


def test_at_least_25_distinct_misuses():
    assert len(CASES) >= 25


@pytest.mark.parametrize("die", [False, True], ids=["raises", "dies"])
def test_failure_mid_step_reaches_every_rank(die):
    """Rank 1 fails inside a step, in its first collective (raises, or its process exits): rank
    0 raises a RankError naming it instead of waiting in a collective forever (the process
    group's timeout bounds the wait; here 6 s)."""
    with World(2, timeout=90.0, error_grace=30.0, pg_timeout=6.0) as w:
        (status0, survivor), (status1, failed) = w.outcomes(tasks.fail_mid_step, 1, die)
    assert status0 == "ok" and survivor.startswith("RankError"), (status0, survivor)
    if die:
        assert "process died" in str(failed), failed
        assert "[1]" in survivor and "did not answer" in survivor, survivor
    else:
        assert failed.startswith("RankError") and "out of memory" in failed, failed
        assert "rank(s) [1] raised" in survivor and "out of memory" in survivor, survivor
