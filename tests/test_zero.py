"""ZeRO-1 and ZeRO-2: parameters replicated for compute whose optimizer state (and ZeRO-2's
gradients) are sharded over the data-parallel ranks. Priced by the ILP among the other
storages; trained exactly as on one device (alone, with tensor parallelism, with gradient
accumulation, in bf16-mixed, with gradient clipping); checkpoints move to and from other
plans; the bytes each rank holds are what the memory model and the ZeRO formulas say."""

import pytest
from torch.distributed.tensor import Shard

import autopar
from autopar.solver.memory import zero_memory
from tests import checkpoint_tasks, cost_tasks, loop_tasks, rank_tasks
from tests.rank_tasks import build

SPEC = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")


def _plan(force, name="gpt", **options):
    model, loss_fn, example = build(name)
    return autopar.plan(model, SPEC, example, loss_fn=loss_fn, force=force, **options)


def test_zero_stages_price_sharded_state_against_one_more_collective():
    """Against DDP, ZeRO-1 halves the optimizer state on 2 ranks, ZeRO-2 the gradients as
    well; each pays a reduce-scatter and an all-gather of the parameter where DDP pays an
    all-reduce (one more collective's latency); with accumulation ZeRO-2 reduce-scatters
    every microbatch and ZeRO-1 whole gradients are held."""
    data, z1, z2 = _plan("data"), _plan("zero1"), _plan("zero2")
    assert not data.zero and set(z1.zero.values()) == {1} and set(z2.zero.values()) == {2}
    assert set(z2.zero) == set(z2.parameters)  # every parameter of the GPT can take it
    m = {p.options.force: p.cost.memory for p in (data, z1, z2)}
    scalars = 4 * len(data.parameters)  # AdamW's step, on every rank
    assert m["zero1"]["optimizer"] - scalars == pytest.approx(
        (m["data"]["optimizer"] - scalars) / 2)
    assert m["zero1"]["gradients"] == m["zero2"]["gradients"] == m["data"]["gradients"] / 2
    assert m["zero2"]["parameters"] == m["data"]["parameters"]
    kinds = {c.kind for c in z2.collectives if c.phase == "gradient sync"}
    assert kinds == {"reduce_scatter", "all_gather"}
    assert z2.cost.step_time > data.cost.step_time
    acc1, acc2 = _plan("zero1", microbatches=2), _plan("zero2", microbatches=2)
    assert acc1.cost.memory["gradients"] == 2 * acc2.cost.memory["gradients"]
    assert acc2.cost.communication["gradient_sync"] > acc1.cost.communication["gradient_sync"]
    assert "ZeRO-2: 28 replicated parameters" in str(z2)


def test_zero_plan_round_trips_and_hashes_apart():
    z2 = _plan("zero2")
    again = autopar.Plan.from_dict(z2.to_dict())
    assert again.zero == z2.zero and again.hash() == z2.hash()
    assert z2.hash() != _plan("data").hash() != _plan("zero1").hash()


def test_planner_shards_state_when_memory_binds():
    """With a budget between DDP's peak and ZeRO-2's, the solver's plan fits by sharding
    some parameters' state: ZeRO or FSDP or tensor parallel, whichever is faster."""
    data, z2 = _plan("data"), _plan("zero2")
    budget = (data.cost.peak_memory + z2.cost.peak_memory) / 2
    plan = _plan(None, memory_budget=budget, microbatches=1, recompute="none",
                 reshard_after_forward=False)
    assert plan.cost.peak_memory <= budget
    assert plan.zero or any(isinstance(q, Shard) for p in plan.parameters.values() for q in p)


@pytest.mark.parametrize("model,force", [("mlp", "zero1"), ("gpt", "zero2")], ids=str)
def test_zero_trains_as_on_one_device(world2, model, force):
    plan = world2.run(rank_tasks.train_equivalence, model, (2,), force)[0]
    assert set(plan["zero"].values()) == {int(force[-1])}


def test_zero_with_tensor_parallel(world4):
    plan = world4.run(rank_tasks.train_equivalence, "hf_llama", (2, 2),
                      {"dp": "zero2", "tp": "tensor"}, 2)[0]
    assert plan["zero"]


@pytest.mark.parametrize("force", ["zero1", "zero2"])
def test_zero_with_gradient_accumulation(world2, force):
    """Microbatches within a step (ZeRO-1 reduce-scatters once, ZeRO-2 each microbatch), and
    steps without zero_grad in between."""
    world2.run(rank_tasks.train_equivalence, "gpt", (2,), force, 2, None, {"microbatches": 2})
    world2.run(rank_tasks.accumulation_equivalence, "gpt", (2,), force)


def test_zero_in_mixed_precision(world2):
    for errors in world2.run(rank_tasks.mixed_precision_errors, "gpt", (2,), "zero2"):
        assert errors["loss"] < 1e-3, errors
        assert errors["gradient"] < 0.04 and errors["update"] < 0.04, errors


def test_clip_grad_norm_under_zero(world2):
    norms = world2.run(loop_tasks.clip_equivalence, "gpt", (2,), "zero2")
    assert len(set(norms)) == 1


@pytest.mark.parametrize("first,second", [
    (((4,), "zero2"), ((2, 2), {"dp": "fsdp", "tp": "tensor"})),
    (((2, 2), {"dp": "zero1", "tp": "tensor"}), ((4,), "data"))], ids=["zero2-to-fsdpxtp",
                                                                      "zero1xtp-to-dp"])
def test_checkpoint_moves_to_and_from_zero(world4, tmp_path, first, second):
    diffs = world4.run(checkpoint_tasks.resume_across_plans, str(tmp_path / "ckpt"), first,
                       second)
    assert max(diffs) < 1e-10


STORAGES = [((2,), "data", {}), ((2,), "zero1", {}), ((2,), "zero2", {}),
            ((2,), "fsdp", {"reshard_after_forward": False}),
            ((2,), "fsdp", {"reshard_after_forward": True})]


@pytest.mark.parametrize("mesh,force,options", STORAGES, ids=str)
def test_measured_state_bytes_equal_the_model_and_the_zero_formulas(world2, mesh, force,
                                                                    options):
    """Per rank, the bytes of parameters, gradients and AdamW state the rank holds after a
    step equal the memory model's, and ZeRO's formulas (4, 4 and 8 bytes per parameter in
    fp32, the sharded ones divided by the ranks) for every standard setup. (ZeRO-1 with one
    microbatch frees each whole gradient once reduce-scattered, as ZeRO-2; its formula's whole
    gradients are what it holds when it accumulates microbatches.)"""
    # ZeRO-1 with one microbatch holds what ZeRO-2 does (see above)
    setup = {"data": "ddp", "zero1": "zero2", "zero2": "zero2", "fsdp": "fsdp"}[force]
    for got in world2.run(cost_tasks.storage_bytes, "gpt", mesh, force, options):
        assert got["measured"] == {k: int(v) for k, v in got["predicted"].items()}, got
        formula = zero_memory(got["params"], 2, setup, precision="fp32",
                              tensors=got["tensors"])
        assert got["measured"] == {k: int(v) for k, v in formula.items()}, (formula, got)


def test_measured_state_bytes_fsdp_by_tensor_parallel(world4):
    for got in world4.run(cost_tasks.storage_bytes, "hf_llama", (2, 2),
                          {"dp": "fsdp", "tp": "tensor"}):
        assert got["measured"] == {k: int(v) for k, v in got["predicted"].items()}, got
