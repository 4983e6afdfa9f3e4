"""Errors that used to come from deep inside torch, or never (a hang), on real gloo worlds:
every rank raises a clear error before any collective of the model, or the model trains as on
one device (tests/clear_error_tasks.py)."""

import pytest

from tests import clear_error_tasks as tasks
from tests.world import World

PG_TIMEOUT = 5.0  # seconds: the process group's timeout in the world of the "elsewhere" tests


@pytest.mark.parametrize("peer", ["barrier", "none"])
def test_a_call_on_one_rank_ends_within_the_process_groups_timeout(peer):
    """Rank 0 calls step() while rank 1 waits in a collective of its own, or makes no call:
    rank 0 raises within about the process group's timeout (the control plane's group took
    torch's default, 30 minutes), naming rank 1 as the rank that never reached the call's
    agreement."""
    with World(2, timeout=60.0, error_grace=30.0, pg_timeout=PG_TIMEOUT) as w:
        for timeouts in w.run(tasks.group_timeouts):
            assert timeouts == {"default": PG_TIMEOUT, "control": PG_TIMEOUT,
                                "mesh": [PG_TIMEOUT, PG_TIMEOUT]}, timeouts
        (status0, (message0, took0)), (status1, (message1, took1)) = \
            w.outcomes(tasks.step_while_peer_elsewhere, peer)
    assert status0 == status1 == "ok", (message0, message1)
    assert message0.startswith("RankError:") and "rank(s) [1] did not reach it" in message0 \
        and "elsewhere" in message0 and "5 s" in message0, message0
    assert took0 < PG_TIMEOUT + 5, (took0, message0)
    if peer == "barrier":  # rank 1's own collective times out too, with torch's error
        assert "Timed out" in message1 and took1 < PG_TIMEOUT + 5, (took1, message1)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("force,microbatches", [("data", 1), ("fsdp", 1), ("data", 2)])
def test_recurrent_layers_train_as_on_one_device(world2, kind, force, microbatches):
    """nn.GRU and nn.LSTM rebuild their `_flat_weights` list when export swaps their
    parameters: not a side effect (it was refused as one); they train exactly (float64),
    sharded by the batch (passes/rules/recurrent.py), with gradient accumulation too."""
    world2.run(tasks.rnn_equivalence, kind, force, microbatches)


def test_recurrent_dropout_draws_as_one_device(world2):
    """An LSTM with dropout between its layers draws inside the op: it runs whole on every rank
    (each draws what one device draws from the same generator), and trains exactly."""
    world2.run(tasks.rnn_equivalence, "LSTM", "data", 1, 0.3)


def test_hugging_face_cache_is_named_with_what_to_do(world2):
    """A Hugging Face GPT-2 as its config makes it (use_cache=True) returns a DynamicCache,
    which export cannot take apart (was a pytree error): every rank says to set
    `model.config.use_cache = False`, and with it the model trains."""
    for message, loss in world2.run(tasks.hf_gpt2_default_config):
        assert message.startswith("TraceError:") and "key/value cache" in message and \
            "DynamicCache" in message and "model.config.use_cache = False" in message, message
        assert loss == loss and loss > 0, loss


@pytest.mark.parametrize("how", ["closure", "global"])
def test_loss_fn_reading_the_parallelized_model_is_refused(world2, how):
    """A loss_fn with a weight penalty through `pmodel` (was an AttributeError from inside
    torch.export): every rank raises before tracing, naming what the loss read and what to
    read instead."""
    where = "loss_fn.<closure pm>" if how == "closure" else "_PMODEL"
    for message in world2.run(tasks.loss_fn_reads_pmodel, how):
        assert message.startswith("RankError:") and "rank(s) [0, 1]" in message, message
        assert "reads the parallelized model" in message and where in message and \
            "the model you passed to parallelize" in message, message


def test_reads_object_finds_what_a_loss_reads_through_partials_methods_and_calls():
    """The search behind the pmodel check: a closure variable, a partial's argument, a bound
    method's object and a function the loss calls, each found by its label."""
    import functools

    from autopar.passes.trace_values import reads_object

    target = object()

    def inner(out):
        return out, target

    def calls(out):
        return inner(out)

    class Holder:
        def loss(self, out):
            return out

    def wanted(value):
        return value is target

    assert reads_object(lambda out: (out, target), wanted) == "loss_fn.<closure target>"
    assert reads_object(functools.partial(max, target), wanted) == "loss_fn.args[0]"
    assert reads_object(calls, wanted) == "loss_fn.<closure inner>.<closure target>"
    assert reads_object(Holder.loss.__get__(target), wanted) == "loss_fn.__self__"
    assert reads_object(lambda out: out, wanted) is None
