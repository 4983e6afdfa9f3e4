"""Distributed checkpoints (torch.distributed.checkpoint): saved under one plan and mesh, loaded
under another, training continues exactly; a full state dict for single-device use; a
checkpoint that does not fit is a clear error on every rank; a failed save keeps the old one."""

import pytest

from tests import checkpoint_tasks as tasks

PLANS = [((4,), "data"), ((2, 2), {"dp": "fsdp", "tp": "tensor"}), ((4,), "tensor")]


@pytest.mark.parametrize("first,second", [(PLANS[0], PLANS[1]), (PLANS[1], PLANS[0]),
                                          (PLANS[2], PLANS[1])], ids=["dp-to-fsdpxtp",
                                                                      "fsdpxtp-to-dp",
                                                                      "tp-to-fsdpxtp"])
def test_resume_under_another_plan_and_mesh(world4, tmp_path, first, second):
    diffs = world4.run(tasks.resume_across_plans, str(tmp_path / "ckpt"), first, second)
    assert max(diffs) < 1e-10


@pytest.mark.parametrize("first,second", [
    (((2,), ("dp",), "tensor"), ((2,), ("pp",), None)),
    (((2,), ("pp",), None), ((2,), ("dp",), "fsdp"))], ids=["tensor-to-pp", "pp-to-fsdp"])
def test_resume_into_and_out_of_a_pipeline(world2, tmp_path, first, second):
    """A pp rank holds only its stages' tensors: a checkpoint of the whole model loads into
    it (was refused as naming tensors the model lacks), and a pipeline's checkpoint into a
    plan without stages; BatchNorm's running statistics come back as one device has them."""
    world2.run(tasks.resume_into_and_out_of_a_pipeline, str(tmp_path / "ckpt"), first, second)


@pytest.mark.parametrize("first,second", [
    (((2, 2), ("pp", "dp"), {"dp": "zero1"}), ((4,), ("dp",), "fsdp")),
    (((4,), ("dp",), "zero1"), ((2, 2), ("pp", "dp"), {"dp": "zero2"}))],
    ids=["pp-zero1-to-fsdp", "zero1-to-pp-zero2"])
def test_resume_into_and_out_of_pipelined_zero(world4, tmp_path, first, second):
    """ZeRO inside pipeline stages: the optimizer's sharded state and the stepped shards
    save and load across plans, and training continues as on one device."""
    world4.run(tasks.resume_into_and_out_of_a_pipeline, str(tmp_path / "ckpt"), first, second)


@pytest.mark.parametrize("mesh,force", [((2,), "fsdp"), ((2,), "tensor")], ids=str)
def test_full_state_dict_round_trip(world2, mesh, force):
    world2.run(tasks.full_state_dict_round_trip, mesh, force)


@pytest.mark.parametrize("kind,words", [
    ("other_model", ["does not match the model", "missing from the checkpoint", "h.0.attn",
                     "not in the model", "net.0.weight"]),
    ("other_dtype", ["torch.float32 in the checkpoint", "torch.float64 in the model"]),
    ("no_checkpoint", ["no checkpoint at"]),
    ("state_dict_of_other_shapes", ["wte.weight: shape (10, 32)", "(64, 32)"]),
])
def test_bad_checkpoint_is_a_clear_error_everywhere(world2, tmp_path, kind, words):
    messages = world2.run(tasks.bad_checkpoint, str(tmp_path / "ckpt"), kind)
    for m in messages:
        assert m != "no error", kind
        for w in words:
            assert w in m, (w, m)


def test_failed_save_keeps_the_previous_checkpoint(world2, tmp_path):
    results = world2.run(tasks.failed_save_keeps_the_previous, str(tmp_path / "ckpt"))
    for message, diff in results:
        assert "RankError" in message and "disk full" in message, message
        assert diff == 0.0
