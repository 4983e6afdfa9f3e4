"""The planner chooses the mesh: given a device count (autopar.Cluster) it plans every
candidate shape, keeps fast-link dimensions inside a node, and returns the fastest plan with
the ranking of what it tried."""

import dataclasses

import pytest
import torch

import autopar
from autopar.search import candidate_meshes
from autopar.zoo import GPT, GPTConfig, lm_loss
from tests import loop_tasks


def _gpt(batch=8):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    x = torch.randint(0, 128, (batch, 32))
    return model, (x, torch.roll(x, -1, 1))


def test_candidates_keep_tensor_parallelism_inside_a_node():
    cluster = autopar.Cluster(16, hardware="h100", devices_per_node=4, pipeline=True)
    meshes = candidate_meshes(cluster)
    shapes = {(m.shape, m.names) for m in meshes}
    assert ((16,), ("dp",)) in shapes and ((4, 4), ("dp", "tp")) in shapes
    assert ((2, 2, 4), ("pp", "dp", "tp")) in shapes
    for m in meshes:
        assert m.size == 16
        if "tp" in m.names:
            k = m.names.index("tp")
            assert m.shape[k] <= 4 and m.link(k) == m.profile.intra_node


def test_pipelined_candidates_by_default_where_the_layers_can_be_cut():
    """By default a search tries pp where the model's layers can be cut (pp a divisor of
    their count), and not where none were found; pipeline=False never, True always."""
    def pps(cluster, layers):
        return sorted({m.shape[0] for m in candidate_meshes(cluster, layers)
                       if m.pipeline_dim is not None})

    default = autopar.Cluster(16, hardware="h100", devices_per_node=4)
    assert default.pipeline is None
    assert pps(default, 12) == [2, 4] and pps(default, 3) == [] and pps(default, None) == []
    assert pps(default, 1) == []
    assert pps(dataclasses.replace(default, pipeline=False), 12) == []
    assert pps(dataclasses.replace(default, pipeline=True), None) == [2, 4, 8, 16]


def test_a_pipeline_the_options_cannot_have_is_a_row_not_a_failed_search():
    """Per-rank inputs, which pipelines do not take yet: by default the search tries no
    pipelined mesh; asked to, each says why on its row and the search returns the best of
    the others."""
    model, example = _gpt()
    default = autopar.plan(model, autopar.Cluster(4, hardware="h100"), example,
                           loss_fn=lm_loss, per_rank_inputs=("dp",), search_workers=1)
    assert not any("pp" in r["names"] for r in default.mesh_search)
    asked = autopar.plan(model, autopar.Cluster(4, hardware="h100", pipeline=True), example,
                         loss_fn=lm_loss, per_rank_inputs=("dp",), search_workers=1)
    piped = [r for r in asked.mesh_search if "pp" in r["names"]]
    assert piped and asked.mesh.pipeline_dim is None and asked.hash() == default.hash()
    for r in piped:
        assert r["step_time"] is None and r["why"].startswith(
            "ValueError: per-rank inputs are not supported with a pp mesh dimension"), r


@pytest.mark.parametrize("devices,hardware", [(6, "cpu"), (3, "h100"), (7, "h100")])
def test_part_of_one_node_is_a_cluster(devices, hardware):
    """Fewer devices than a node holds (6 gloo processes on a 64-core machine, 3 GPUs of
    8) are part of one node, whatever the count: every candidate's links are the node's."""
    cluster = autopar.Cluster(devices, hardware=hardware)
    assert cluster.per_node == devices
    meshes = candidate_meshes(cluster)
    assert ((devices,), ("dp",)) in {(m.shape, m.names) for m in meshes}
    for m in meshes:
        assert m.size == devices
        assert all(m.link(k) == m.profile.intra_node for k in range(len(m.shape)))


def test_the_fastest_mesh_is_returned_with_the_ranking():
    model, example = _gpt()
    plan = autopar.plan(model, autopar.Cluster(8, hardware="h100"), example, loss_fn=lm_loss)
    tried = plan.mesh_search
    # (pipelined meshes among them by default: the model's 2 layers cut into 2 stages)
    assert len(tried) == len(candidate_meshes(autopar.Cluster(8, hardware="h100"), 2))
    assert any("pp" in r["names"] for r in tried)
    times = [r["step_time"] for r in tried if r["step_time"] is not None]
    assert times == sorted(times) and plan.cost.step_time == pytest.approx(times[0])
    assert list(plan.mesh.shape) == tried[0]["shape"] and plan.mesh.size == 8
    loaded = autopar.Plan.from_dict(plan.to_dict())
    assert loaded.mesh_search == tried
    assert "meshes tried" in str(plan)


def test_worker_processes_find_the_plan_one_process_finds():
    """Candidates planned in forked workers: the same plan and ranking (ties broken in
    candidate order, not by which finished first), each candidate's seconds its own."""
    model, example = _gpt()
    # (4 devices: pipelined candidates among the rest, each planned under every stage style)
    cluster = autopar.Cluster(4, hardware="h100", pipeline=True)
    alone = autopar.plan(model, cluster, example, loss_fn=lm_loss, search_workers=1)
    forked = autopar.plan(model, cluster, example, loss_fn=lm_loss, search_workers=3)
    assert forked.hash() == alone.hash() and forked.mesh == alone.mesh
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in alone.mesh_search]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in forked.mesh_search] == strip
    assert all(r["seconds"] > 0 for r in forked.mesh_search)
    assert autopar.search.workers(autopar.PlanOptions(search_workers=3), 1) == 1
    assert autopar.search.workers(autopar.PlanOptions(search_workers=3), 9) == 3
    with pytest.raises(ValueError, match="search_workers"):
        autopar.PlanOptions(search_workers=0)


def test_pipelined_candidates_are_bounded_by_the_fastest_plan_without_stages():
    """A pipelined candidate whose relaxed pipeline (blocks at their fastest, no budget)
    cannot step faster than the best mesh without stages is not planned further; planned
    alone, each such mesh is indeed slower."""
    model, example = _gpt()
    cluster = autopar.Cluster(4, hardware="h100", pipeline=True)
    plan = autopar.plan(model, cluster, example, loss_fn=lm_loss, search_workers=1)
    bounded = [r for r in plan.mesh_search if r["why"].startswith("bounded")]
    assert bounded and plan.mesh.pipeline_dim is None
    for r in bounded:
        assert r["step_time"] is None and "relaxed pipeline" in r["why"]
        mesh = autopar.MeshSpec(tuple(r["shape"]), names=tuple(r["names"]), hardware="h100")
        alone = autopar.plan(model, mesh, example, loss_fn=lm_loss)
        assert alone.cost.step_time > plan.cost.step_time


def test_candidates_are_planned_a_microbatch_count_at_a_time(monkeypatch):
    """Under a budget the whole batch does not fit (4.5 MiB per device: 6.7 MiB without
    recomputation, 5.0 with full; 4.2 in two microbatches without), every candidate is planned
    in two steps, one per microbatch count, which forked workers take as they come free; they
    find what one process finds: two microbatches, nothing recomputed."""
    model, example = _gpt(batch=64)
    cluster = autopar.Cluster(4, hardware="cpu", devices_per_node=4, pipeline=False)
    steps, real = [], autopar.search._plan_one

    def counted(i, state=None, progress=None, beat=None):
        steps.append(i)
        return real(i, state, progress, beat)

    monkeypatch.setattr(autopar.search, "_plan_one", counted)
    alone = autopar.plan(model, cluster, example, loss_fn=lm_loss, memory_budget=4.5 * 2**20,
                         search_workers=1)
    assert sorted(steps) == sorted(list(range(len(alone.mesh_search))) * 2)
    assert alone.accumulation == 2 and alone.recompute.mode == "none"
    monkeypatch.undo()  # (workers are sent the function by name)
    forked = autopar.plan(model, cluster, example, loss_fn=lm_loss, memory_budget=4.5 * 2**20,
                          search_workers=2)
    assert forked.hash() == alone.hash() and forked.mesh == alone.mesh
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in alone.mesh_search]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in forked.mesh_search] == strip


def test_a_mesh_that_does_not_fit_is_ranked_with_its_reason():
    """A budget between the smallest peaks of the candidates: the ones above it are ranked
    last, with the reason."""
    from autopar.passes import strategies
    from autopar.passes.trace import trace_example
    from autopar.solver.cost import CostModel
    from autopar.solver.diagnose import min_memory

    model, example = _gpt(batch=64)
    cluster = autopar.Cluster(4, hardware="cpu", devices_per_node=4, pipeline=False)
    program = trace_example(model, example, lm_loss)
    peaks = []
    for mesh in candidate_meshes(cluster):
        graph = strategies.build(program, mesh.shape, zero=True)
        # every FSDP-gathered parameter freed after forward (the planner's last resort)
        freed = frozenset(n for n, v in graph.nodes.items() if v.kind == "param")
        peaks.append(min_memory(graph, CostModel(mesh, graph=graph, reshard=freed))[0])
    assert min(peaks) < max(peaks)
    plan = autopar.plan(model, cluster, example, loss_fn=lm_loss, microbatches=1,
                        recompute="none", memory_budget=(min(peaks) + max(peaks)) / 2)
    last = plan.mesh_search[-1]
    assert last["step_time"] is None and "no plan fits" in last["why"]
    assert plan.cost.peak_memory <= (min(peaks) + max(peaks)) / 2


@pytest.mark.parametrize("kwargs,words", [
    ({"devices": 12, "devices_per_node": 8}, ["12 devices do not fill nodes of 8"]),
    ({"devices": 0}, ["positive number of devices"]),
    ({"devices": 8, "devices_per_node": 0}, ["devices_per_node must be a positive integer",
                                             "the hardware's, 8"]),
])
def test_bad_cluster(kwargs, words):
    with pytest.raises(ValueError) as info:
        autopar.Cluster(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_mesh_with_zero_devices_per_node():
    """0 is not "the hardware's default" (None is): refused, not read as the default."""
    with pytest.raises(ValueError, match="devices_per_node must be a positive integer"):
        autopar.MeshSpec((2, 4), devices_per_node=0)


def test_hardware_profile_with_missing_fields():
    d = autopar.H100.to_dict()
    del d["memory"], d["intra_node"]
    with pytest.raises(ValueError, match="lacks memory, intra_node"):
        autopar.HardwareProfile.from_dict(d)


@pytest.mark.parametrize("change,words", [
    ({"flops": {"bfloat16": 989e12}}, ["flops needs a positive 'float32' peak"]),
    ({"flops": {"float32": 67e12, "bfloat16": 0}}, ["every flops figure must be positive"]),
    ({"memory": 0}, ["memory must be positive (bytes)"]),
    ({"memory_bandwidth": -1.0}, ["memory_bandwidth must be positive (bytes/s)"]),
    ({"intra_node": {"name": "nvlink", "alpha": 1e-6, "bandwidth": 4e11}},
     ["intra_node must be an autopar.Link", "from_dict"]),
    ({"inter_node": autopar.Link("ib", 1e-5, 0.0)}, ["inter_node needs a positive bandwidth"]),
    ({"devices_per_node": 0}, ["devices_per_node must be a positive integer"]),
    ({"memory_reserve": 1.5}, ["memory_reserve is a share of memory in [0, 1)"]),
])
def test_bad_hardware_profile_names_the_field(change, words):
    """A profile built by hand with a field that cannot price a plan fails when it is made,
    naming the field and what it needs (not a KeyError or a division by zero mid-plan)."""
    with pytest.raises(ValueError) as info:
        dataclasses.replace(autopar.H100, **change)
    assert "hardware profile 'h100'" in str(info.value)
    for w in words:
        assert w in str(info.value)


def test_hardware_as_a_dict_of_fields():
    """A profile's fields as a dict (a JSON file read by the caller) serve as `hardware`
    wherever a name does; a dict lacking fields, or another type, is refused naming what to
    pass."""
    d = autopar.H100.to_dict()
    d["name"] = "my-h100"
    assert autopar.MeshSpec((2, 8), hardware=d).profile == autopar.HardwareProfile.from_dict(d)
    assert autopar.Cluster(16, hardware=d).per_node == 8
    with pytest.raises(ValueError, match="'x' lacks flops"):
        autopar.Cluster(8, hardware={"name": "x"})
    with pytest.raises(TypeError, match="built-in profile's name .* or a dict of its fields"):
        autopar.MeshSpec((8,), hardware=8)


def test_parallelize_builds_the_mesh_the_plan_chose(world4):
    shapes = world4.run(loop_tasks.plan_chooses_the_mesh)
    assert len({tuple(s) for s in shapes}) == 1
