"""Models no rank can hold: built on the meta device, each rank allocates and initializes only
its blocks (module by module, with the model's own init), equal to single-device init."""

import pytest

from tests import state_tasks as tasks


@pytest.mark.parametrize("mesh,force", [((2,), "fsdp"), ((2,), "tensor"), ((2,), "data"),
                                        ((2,), "zero2")], ids=str)
def test_meta_model_is_initialized_shard_by_shard(world2, mesh, force):
    sizes = world2.run(tasks.meta_init, mesh, force)
    if force in ("fsdp", "tensor"):  # sharded storage: each rank holds about half (ZeRO
        # keeps whole parameters, its optimizer's shards are views of them)
        assert all(s["local"] < 0.75 * s["whole"] for s in sizes), sizes


def test_meta_model_on_two_dimensions(world4):
    world4.run(tasks.meta_init, (2, 2), {"dp": "fsdp", "tp": "tensor"})


@pytest.mark.parametrize("kind,words", [
    ("no_init", ["has no reset_parameters()", "init_fn="]),
    ("init_leaves_meta", ["fc.weight is still on the meta device", "in place"]),
    ("init_misses_a_tensor", ["left scale", "uninitialized"]),
])
def test_meta_model_that_cannot_be_initialized(world2, kind, words):
    for m in world2.run(tasks.bad_meta_init, kind):
        assert m != "no error"
        for w in words:
            assert w in m, (w, m)
