"""The cost model's figures: hardware profiles, flops (Megatron's count), roofline and
alpha-beta pricing, calibration on a real gloo world, measured op times, the printed cost."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.calibrate import fit_link
from autopar.hardware import GB, HardwareProfile, Link
from autopar.measured import SDPA_H100
from autopar.passes import strategies
from autopar.passes.rules import facts_of
from autopar.passes.trace import trace_example
from autopar.profile import OpProfiler
from autopar.solver.cost import ALGO_FACTOR, CostModel
from autopar.solver.efficiency import matmul_efficiency
from autopar.solver.flops import attention_flops, backward_factor, is_view
from autopar.zoo import GPT, CausalSelfAttention, GPTConfig, lm_loss
from tests import cost_tasks
from tests.models import MLP, ResNet

# -- hardware profiles -----------------------------------------------------------------------------


def test_builtin_profiles_match_the_datasheets():
    """Dense peaks, memory and bandwidth of the vendor datasheets; NVLink and InfiniBand links
    below their line rates (per direction: NVLink3 300, NVLink4 450, HDR 25, NDR 50 GB/s)."""
    a100, h100, h200 = autopar.A100, autopar.H100, autopar.H200
    assert a100.flops["float32"] == 19.5e12 and a100.flops["bfloat16"] == 312e12
    assert h100.flops["float32"] == 67e12 and h100.flops["bfloat16"] == 989.4e12
    assert h200.flops == h100.flops
    assert (a100.memory_bandwidth, h100.memory_bandwidth, h200.memory_bandwidth) == \
        (2.039e12, 3.35e12, 4.8e12)
    assert a100.memory == 80 * 2**30 and 79 * 2**30 < h100.memory < 80 * 2**30
    assert 140 * 2**30 < h200.memory < 141 * 2**30
    for hw, nvlink, ib in ((a100, 300, 25), (h100, 450, 50), (h200, 450, 50)):
        assert 0.7 * nvlink * GB <= hw.intra_node.bandwidth < nvlink * GB
        assert 0.8 * ib * GB <= hw.inter_node.bandwidth < ib * GB
        assert hw.devices_per_node == 8
        assert hw.intra_node.alpha < hw.inter_node.alpha
    assert autopar.H100.peak_flops(torch.bfloat16) == 989.4e12
    assert autopar.H100.peak_flops(torch.int64) == 67e12  # float32 for anything else


def test_profile_round_trips_through_json(tmp_path):
    link = Link("measured", 1e-4, 2e9, (("reduce_scatter", 3e-4, 1e9),))
    hw = HardwareProfile("box", {"float32": 1e11}, 1e10, 2**34, 1e-5, link, link, 4,
                         view_launch=2e-6, measured={"note": [1, 2]})
    hw.save(str(tmp_path / "hw.json"))
    assert HardwareProfile.load(str(tmp_path / "hw.json")) == hw
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware=hw)
    assert autopar.MeshSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).profile == hw
    assert link.for_kind("reduce_scatter") == (3e-4, 1e9)
    assert link.for_kind("all_gather") == (1e-4, 2e9)


def test_collectives_follow_alpha_beta():
    """alpha + factor x bytes / bandwidth, with the ring factors, on the mesh dimension's link
    (and a measured kind's own figures)."""
    spec = autopar.MeshSpec((2, 4), hardware="h100", devices_per_node=4)
    cost = CostModel(spec)
    nbytes = 2**26
    for kind in ALGO_FACTOR:
        for dim, link in ((0, autopar.H100.inter_node), (1, autopar.H100.intra_node)):
            n = spec.shape[dim]
            want = link.alpha + ALGO_FACTOR[kind](n) * nbytes / link.bandwidth
            assert cost.collective_time(kind, dim, nbytes) == pytest.approx(want)
    assert ALGO_FACTOR["all_reduce"](4) == 1.5 and ALGO_FACTOR["all_gather"](4) == 0.75
    slow = Link("x", 1e-5, 1e9, (("reduce_scatter", 1e-3, 1e8),))
    hw = HardwareProfile("x", {"float32": 1e12}, 1e11, 2**34, 1e-6, slow, slow, 8)
    cost = CostModel(autopar.MeshSpec((4,), hardware=hw))
    assert cost.collective_time("reduce_scatter", 0, 1e6) == pytest.approx(1e-3 + 0.75e6 / 1e8)
    assert cost.collective_time("all_gather", 0, 1e6) == pytest.approx(1e-5 + 0.75e6 / 1e9)


# -- flops -----------------------------------------------------------------------------------------


def test_attention_flops():
    """QK^T and PV: 4 B H L S E for equal head dims; a causal mask halves it; grouped-query
    attention counts the query heads."""
    q, k = (2, 8, 128, 64), (2, 8, 128, 64)
    assert attention_flops(q, k, k) == 4 * 2 * 8 * 128 * 128 * 64
    assert attention_flops(q, k, k, causal=True) == 2 * 2 * 8 * 128 * 128 * 64
    assert attention_flops((2, 8, 16, 64), (2, 8, 256, 64), (2, 8, 256, 32)) == \
        2 * 2 * 8 * 16 * 256 * (64 + 32)


class _Bidirectional(CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _training_flops(model, batch, seq, vocab, products_only=True) -> float:
    x = torch.randint(0, vocab, (batch, seq), device="meta")
    graph = strategies.build(trace_example(model, (x, x), lm_loss), (1,))
    cost = CostModel(autopar.MeshSpec((1,)), graph=graph)
    total = 0.0
    for v in graph.nodes.values():
        if v.kind != "op" or is_view(v):
            continue
        if products_only and not v.op.startswith(("linear", "scaled_dot_product_attention")):
            continue
        f, b = cost.training_flops(v, v.strategies[0])
        total += f + b
    return total


@pytest.mark.parametrize("B,s,L,h,V", [(2, 128, 2, 256, 1000), (4, 64, 3, 128, 50257)])
def test_megatron_flop_count(B, s, L, h, V):
    """Megatron-LM's count per iteration without recomputation (L layers), 72 B s L h^2
    (1 + s/(6h) + V/(12 h L)), is 3 x the forward flops of the products (QKV, attention scores
    and values, output projection, MLP, logits), backward computing two products per forward
    one. Our model's products sum to exactly that; under a causal mask attention does half the work,
    so the s/(6h) term halves. Norms, softmax, the loss and elementwise ops, which Megatron
    leaves out, add a few percent (the loss over a 50k vocabulary at h = 128 most)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=V, block_size=s, n_layer=L, n_head=4, n_embd=h))
    megatron = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    causal = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * h * L))
    assert _training_flops(model, B, s, V) == pytest.approx(causal, rel=1e-12)
    everything = _training_flops(model, B, s, V, products_only=False)
    assert causal < everything < 1.06 * causal
    for block in model.h:
        block.attn.__class__ = _Bidirectional
    assert _training_flops(model, B, s, V) == pytest.approx(megatron, rel=1e-12)


def test_roofline_prices_backward_by_the_gradients_it_computes():
    """A hidden layer's backward computes two products (2x forward), the first layer's one (its
    input needs no gradient); each op pays the launch floor per kernel. Each product runs at
    the share of peak its own shape reaches (solver/efficiency.py): the weight's gradient
    (1024 x 4096 times 4096 x 1024) is a different GEMM from the forward's."""
    torch.manual_seed(0)
    model = MLP([1024, 1024, 1024])
    x, y = torch.randn(4096, 1024), torch.randint(0, 1024, (4096,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (1,))
    cost = CostModel(autopar.MeshSpec((1,), hardware="h100"), graph=graph)
    first, hidden = [v for v in graph.nodes.values() if v.op.startswith("linear")]
    flops = 2 * 4096 * 1024 * 1024
    bytes_ = (4096 * 1024 * 2 + 1024 * 1024 + 1024) * 4
    moved = bytes_ / (3.35e12 * 0.9)

    def gemm(m, n, k):
        return max(flops / (67e12 * matmul_efficiency(autopar.H100, m, n, k)), moved)

    launch = autopar.H100.launch
    forward, grad_input, grad_weight = gemm(4096, 1024, 1024), gemm(4096, 1024, 1024), \
        gemm(1024, 1024, 4096)
    assert cost.compute_times(first, first.strategies[0]) == pytest.approx(
        (forward + launch, grad_weight + launch))
    assert cost.compute_times(hidden, hidden.strategies[0]) == pytest.approx(
        (forward + launch, grad_input + grad_weight + 2 * launch))
    unbound = CostModel(autopar.MeshSpec((1,), hardware="h100"))  # no graph: assume both
    assert unbound.compute_times(first, first.strategies[0])[1] == pytest.approx(
        grad_input + grad_weight + 2 * launch)


def test_gemm_efficiency_falls_for_small_and_skinny_shapes():
    """Analytically (no measured shapes): the shape the maximum was measured at reaches it
    exactly, nothing exceeds it, and a few rows (a small microbatch), a narrow shard or a
    short reduction reach far less."""
    h100 = dataclasses.replace(autopar.H100, gemm_measured=())
    best = matmul_efficiency(h100, *h100.matmul_best_shape)
    assert best == pytest.approx(792.1 / 989.4)
    large = matmul_efficiency(h100, 8192, 4096, 4096)
    assert 0.95 * best < large <= best
    assert matmul_efficiency(h100, 16, 4096, 4096) < 0.3 * best  # most of each tile idle
    assert matmul_efficiency(h100, 8192, 4096, 128) < 0.5 * best  # pipeline fill dominates
    assert matmul_efficiency(h100, 1024, 1024, 1024) < 0.9 * best  # a short split reduction
    # a small output with a long reduction splits it over the idle SMs (split-K)
    assert matmul_efficiency(h100, 1024, 1024, 65536) == pytest.approx(best, rel=0.01)
    assert matmul_efficiency(autopar.CPU, 64, 8, 8) == 1.0  # CPUs: the plain roofline


def test_gemm_efficiency_follows_measured_shapes():
    """With measured shares (the built-in H100 profile's, measured on an H100): a measured
    shape prices at its measured share (its own weight dominates the interpolation), shapes
    between measured ones between theirs, and no shape above the peak."""
    h100 = autopar.H100
    by_shape = {(m, n, k): share for m, n, k, share in h100.gemm_measured}
    for shape in [(131072, 128, 8192), (16384, 4096, 14336), (4096, 4096, 16384)]:
        assert matmul_efficiency(h100, *shape) == pytest.approx(by_shape[shape], rel=0.03)
    # a 128-wide output (70B's key projection under 8-way tensor parallelism) reaches far
    # less than the analytic model says; a wide one about what it says
    analytic = dataclasses.replace(h100, gemm_measured=())
    assert matmul_efficiency(h100, 131072, 128, 8192) < \
        0.75 * matmul_efficiency(analytic, 131072, 128, 8192)
    between = matmul_efficiency(h100, 16384, 4096, 8192)
    low, high = sorted((by_shape[16384, 4096, 4096], by_shape[16384, 4096, 16384]))
    assert 0.95 * low <= between <= 1.05 * high
    assert all(0 < matmul_efficiency(h100, m, n, k) <= 1.0
               for m in (1, 300, 70000) for n in (7, 5000) for k in (3, 100000))


def test_attention_runs_at_its_fused_kernels_measured_rate():
    """SDPA is priced at the rate the H100 profile records for its kv length (PyTorch 2.11's
    kernel, measured: causal forward, backward at 2.5x forward flops) and slower at short
    sequences (below the first measured length, in proportion)."""
    def priced(seq):
        q = torch.randn(2, 8, seq, 128)
        graph = strategies.build(trace_example(_Attention(), (q, q, q, q), F.mse_loss), (1,))
        cost = CostModel(autopar.MeshSpec((1,), hardware="h100"), graph=graph,
                         precision="bf16-mixed")
        v = next(v for v in graph.nodes.values() if v.op.startswith("scaled_dot"))
        flops = 2 * 2 * 8 * seq * seq * 256 * 0.5
        return cost.compute_times(v, v.strategies[0]), flops

    forward, backward = (dict(SDPA_H100[k]) for k in ("forward_causal", "backward"))
    (fwd, bwd), flops = priced(4096)
    launch = autopar.H100.launch
    assert fwd == pytest.approx(flops / forward[4096] + launch)
    assert bwd == pytest.approx(2.5 * flops / backward[4096] + launch)
    (fwd_short, _), flops_short = priced(512)
    assert flops_short / (fwd_short - launch) == pytest.approx(forward[1024] / 2)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(128))

    def forward(self, q, k, v):
        q, k, v = (t * self.scale for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Dropouts(torch.nn.Module):
    """Dropout of an activation and attention with dropout, in training."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = F.dropout(self.fc(x), 0.1, training=True)
        q = h.view(8, 16, 4, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum(1)


def test_random_ops_draw_whole_and_keep_their_block():
    """A random op draws its whole tensor on every rank whatever its strategy (the draw does not
    shrink with sharding, and backward does not redraw); backward keeps the rank's block of the
    mask. SDPA with dropout draws a mask of its (B, H, L, S) weights."""
    from autopar.solver import memory as mem
    from autopar.solver.flops import drawn_elements

    x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 16)
    graph = strategies.build(trace_example(_Dropouts(), (x, y), F.mse_loss), (4,))
    cost = CostModel(autopar.MeshSpec((4,), hardware="h100"), graph=graph)
    dropout = next(v for v in graph.nodes.values() if v.op.startswith("dropout"))
    sdpa = next(v for v in graph.nodes.values() if v.op.startswith("scaled_dot"))
    assert drawn_elements(dropout) == 8 * 16 * 64 and drawn_elements(sdpa) == 8 * 4 * 16 * 16
    for v in (dropout, sdpa):
        draw = cost.draw_time(v)
        assert draw == pytest.approx(max(drawn_elements(v) * 20 / 67e12,
                                         drawn_elements(v) * 4 / 3.35e12))
        for s in v.strategies:  # forward: the local op plus the whole draw; backward: no draw
            fwd, bwd = cost.compute_times(v, s)
            launch = autopar.H100.launch
            if v is dropout:  # (SDPA's backward runs at its own kernel's rate: tested above)
                assert bwd == pytest.approx(backward_factor(v) * (fwd - draw - launch) + launch)
    whole, block = (next(s for s in dropout.strategies if all(type(p).__name__ == kind
                                                              for p in s.output))
                    for kind in ("Replicate", "Shard"))
    assert mem.extra_saved_bytes(cost, dropout, whole) == 8 * 16 * 64  # a boolean mask
    assert mem.extra_saved_bytes(cost, dropout, block) == 8 * 16 * 64 / 4


# -- calibration -----------------------------------------------------------------------------------


def test_fit_link_recovers_alpha_and_beta():
    alpha, bw = 250e-6, 1.5e9
    points = [(kind, b, alpha + ALGO_FACTOR[kind](4) * b / bw)
              for kind in ALGO_FACTOR for b in (4096, 2**16, 2**20, 2**22)]
    got = fit_link(points, 4)
    assert got == pytest.approx((alpha, bw), rel=1e-9)
    noisy = [(k, b, t * (1.1 if i % 2 else 0.9)) for i, (k, b, t) in enumerate(points)]
    a2, bw2 = fit_link(noisy, 4)
    assert a2 > 0 and bw2 > 0 and math.isclose(bw2, bw, rel_tol=0.3)


def test_probe_factors_are_recovered():
    """The two calibration factors (roofline, fixed per-op cost) come back from steps made with
    them, and neither goes below 1."""
    from autopar.calibrate import fit_factors
    parts = [(1e-4, 9e-4), (8e-3, 1e-3), (6e-2, 1e-3)]  # (roofline, fixed) seconds
    t = [1.3 * r + 2.0 * f for r, f in parts]
    assert fit_factors([(r / s, f / s) for (r, f), s in zip(parts, t)]) == \
        pytest.approx((1.3, 2.0))
    t = [0.5 * r + 3.0 * f for r, f in parts]  # faster arithmetic than the op figures say
    a, b = fit_factors([(r / s, f / s) for (r, f), s in zip(parts, t)])
    assert a == 1.0 and b > 1.0


def test_calibrate_on_a_gloo_world(world4, tmp_path):
    """Every rank gets the same profile: measured links for every mesh dimension (a 2x2 mesh:
    both inside this host), ranks per host, per-rank compute; plan takes it, and it travels in
    the saved plan."""
    profiles = world4.run(cost_tasks.calibrated_profile, (2, 2), sizes=(2**12, 2**16),
                          min_time=0.001, compute_time=0.01)
    assert all(p == profiles[0] for p in profiles)
    hw = HardwareProfile.from_dict(profiles[0])
    assert hw.name == "cpu-calibrated" and hw.devices_per_node == 4
    assert set(hw.measured["links"]) == {"0", "1"}
    assert all(d["link"] == "intra" for d in hw.measured["links"].values())
    assert hw.intra_node.alpha > 0 and hw.intra_node.bandwidth > 0
    assert {k for k, _, _ in hw.intra_node.per_kind} == set(ALGO_FACTOR)
    assert hw.flops["float32"] > 1e8 and hw.memory_bandwidth > 1e8 and hw.launch > 0
    # The op figures are scaled so that the model predicts the probe's measured steps.
    figures = hw.measured["compute"]
    a, b = figures["throughput_factor"], figures["op_cost_factor"]
    assert a >= 1.0 and b >= 1.0
    probes = [v for k, v in figures.items() if k.startswith("probe_")]
    assert len(probes) == 3 and all(p["measured"] > 0 and p["fixed"] > 0 for p in probes)
    assert hw.launch == pytest.approx(figures["launch"] * b)
    assert hw.flops["float32"] == pytest.approx(figures["matmul_float32"] / a)
    torch.manual_seed(0)
    model = MLP([16, 32, 8])
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware=hw)
    plan = autopar.plan(model, spec, (torch.randn(8, 16), torch.randint(0, 8, (8,))),
                        loss_fn=F.cross_entropy)
    plan.save(str(tmp_path / "plan.json"))
    assert autopar.Plan.load(str(tmp_path / "plan.json")).mesh.profile == hw
    assert plan.mesh.link(0).name == "gloo-loopback-measured"


# -- measured op times -----------------------------------------------------------------------------


def test_profiler_measures_once_and_caches_on_disk(tmp_path):
    torch.manual_seed(0)
    model = MLP([16, 32, 8])
    example = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    spec = autopar.MeshSpec((2,), hardware="cpu")
    profiler = OpProfiler("cpu", cache_dir=tmp_path, min_time=1e-4, samples=2)
    generator = torch.get_rng_state()
    plan = autopar.plan(model, spec, example, loss_fn=F.cross_entropy, profile=profiler)
    assert profiler.measured_now > 0
    assert torch.equal(torch.get_rng_state(), generator)  # timing drew nothing from it
    assert profiler.path.parent == tmp_path
    assert profiler.path.name.startswith("cpu-") and torch.__version__ in profiler.path.name
    saved = json.loads(profiler.path.read_text())
    assert saved["torch"] == torch.__version__ and len(saved["times"]) == profiler.measured_now
    assert plan.cost.compute_source == "measured"

    again = OpProfiler("cpu", cache_dir=tmp_path)
    replan = autopar.plan(model, spec, example, loss_fn=F.cross_entropy, profile=again)
    assert again.measured_now == 0  # everything came from the cache
    assert replan.cost.step_time == plan.cost.step_time
    graph = strategies.build(trace_example(model, example, F.cross_entropy), spec.shape)
    cost = CostModel(spec, graph=graph)
    measured = again.measure(graph, cost)
    timed = cost.copy(measured=measured)
    for v in graph.nodes.values():
        if cost.is_measurable(v):
            for s in v.strategies:
                fwd, bwd = measured[cost.op_key(v, s)]
                want = fwd + (bwd if v.requires_grad and v.kind == "op" else 0.0)
                assert timed.compute_time(v, s) == pytest.approx(want)


# -- the printed cost ------------------------------------------------------------------------------


def test_plan_cost_is_split_and_printed():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu")
    plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss,
                        force={"dp": "fsdp", "tp": "tensor"}, memory_budget=2**30)
    cost = plan.cost
    assert cost.step_time == pytest.approx(cost.compute + cost.communication_total)
    assert 0 < cost.compute_forward < cost.compute
    assert set(cost.communication) >= {"all_gather", "reduce_scatter", "all_reduce",
                                       "gradient_sync"}
    assert cost.communication["all_gather"] > 0 and cost.communication["reduce_scatter"] > 0
    assert cost.memory_budget == 2**30
    text = str(plan)
    assert "predicted step" in text and "forward" in text and "backward" in text
    assert "all_gather" in text and "gradient_sync" in text
    memory = next(line for line in text.splitlines() if line.startswith("memory per device"))
    assert "of 1024.0 MiB budget" in memory
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        assert f"{kind} {cost.memory[kind] / 2**20:.1f}" in memory, (kind, memory)
    assert autopar.Plan.from_dict(plan.to_dict()).cost == cost


# -- the benchmark ---------------------------------------------------------------------------------


def test_predicted_vs_measured_benchmark_runs(world4):
    """The mechanics only (timings are never asserted): calibrate, plan, measure and print the
    markdown table with a Spearman correlation, on a tiny model."""
    from benchmarks.predicted_vs_measured import run, spearman
    lines: list[str] = []
    result = run("tiny", 4, rounds=1, steps=1, configs=[((4,), "data"), ((2, 2), "fsdp")],
                 min_time=0.001, sizes=(2**12, 2**16), out=lines.append, world=world4)
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0].startswith("| plan | predicted ms") and len(table) == 4
    assert any("Spearman" in ln for ln in lines)
    assert [r["plan"] for r in result["rows"]] == ["4 data", "2x2 fsdp"]
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in result["rows"])
    assert spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert spearman([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(1.0)


def test_cross_entropy_and_lookups_are_priced_by_the_bytes_they_move():
    """Cross-entropy makes four passes over its logits forward and five backward (as measured
    on an H200: benchmarks/RESULTS.md, "One GPU"); a lookup reads only the rows it gathers
    and its backward writes the whole table's gradient."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=1, n_head=2, n_embd=64))
    ids = torch.randint(0, 4096, (8, 64))
    graph = strategies.build(trace_example(model, (ids, ids), lm_loss), (1,))
    cost = CostModel(autopar.MeshSpec((1,), hardware="h100"), graph=graph)
    hw = autopar.H100
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    loss = next(v for v in graph.nodes.values() if v.op.startswith("cross_entropy"))
    logits = 8 * 64 * 4096 * 4
    fwd, bwd = cost.compute_times(loss, loss.strategies[0])
    assert fwd == pytest.approx(4 * logits / bandwidth + hw.launch)
    assert bwd == pytest.approx(5 * logits / bandwidth + hw.launch)
    lookup = next(v for v in graph.nodes.values()
                  if v.op.startswith("embedding") and v.in_shapes[0][0] == 4096)
    fwd, bwd = cost.compute_times(lookup, lookup.strategies[0])
    rows = 8 * 64 * 64 * 4
    assert fwd == pytest.approx((2 * rows + 8 * 64 * 8) / bandwidth + hw.launch)
    assert bwd == pytest.approx((4 * 4096 * 64 * 4 + rows) / bandwidth + hw.launch)


class _GatedBlock(torch.nn.Module):
    """A norm read by two products, SiLU, a product of two activations, a residual sum, and a
    cast to a wider float type."""

    def __init__(self, dim: int):
        super().__init__()
        self.embed = torch.nn.Linear(dim, dim, bias=False)
        self.norm = torch.nn.RMSNorm(dim)
        self.gate = torch.nn.Linear(dim, dim, bias=False)
        self.up = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        x = self.embed(x)
        h = self.norm(x)
        return (x + F.silu(self.gate(h)) * self.up(h)).to(torch.float64)


def test_elementwise_backward_runs_the_kernels_autograd_runs():
    """Backward moves what autograd's kernels move (solver/traffic.py), in units of one
    activation T: SiLU reads the gradient and its input and writes the input's gradient (3T,
    against 2T forward); a product of two activations runs one such kernel per operand (6T
    against 3T); a sum hands the gradient on (no bytes); a fused norm writes the input's
    gradient (3T) and reduces its weight's (2T); the norm's output, read by two products,
    gets their gradients summed (3T). A cast to a wider float type runs at the profile's
    widening share, and its backward (a narrowing cast) at full bandwidth."""
    dim, n = 256, 64 * 64
    model = _GatedBlock(dim)
    x, y = torch.randn(n, dim), torch.randn(n, dim, dtype=torch.float64)
    graph = strategies.build(trace_example(model, (x, y), F.mse_loss), (1,))
    hw = autopar.H100
    cost = CostModel(autopar.MeshSpec((1,), hardware=hw), graph=graph)
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    t, w = n * dim * 4 / bandwidth, dim * 4 / bandwidth
    launch = hw.launch
    ops = {v.op.split(".")[0]: v for v in graph.nodes.values() if v.kind == "op"
           and v.op != "linear.default"}

    def times(op):
        v = ops[op]
        return cost.compute_times(v, v.strategies[0])

    assert times("silu") == pytest.approx((2 * t + launch, 3 * t + launch))
    assert times("mul") == pytest.approx((3 * t + launch, 6 * t + launch))
    assert times("add") == pytest.approx((3 * t + launch, launch))
    norm_fwd, norm_bwd = times("rms_norm")
    assert norm_fwd == pytest.approx(2 * t + w + launch, rel=1e-3)  # + its flops at peak
    assert norm_bwd == pytest.approx(5 * t + 3 * w + launch + 3 * t + launch, rel=1e-3)
    cast = 3 * t  # float32 read, float64 written
    assert times("to") == pytest.approx((cast / hw.widening_efficiency + launch,
                                         cast + launch))
    assert hw.widening_efficiency == pytest.approx(0.506, abs=1e-3)  # measured (autopar.measured)


def test_mixed_precision_prices_the_master_weights_casts():
    """Under bf16-mixed every rank casts its block of each float32 master weight to bf16 once
    per step and autograd casts the gradient back (a widening cast): priced on the block the
    rank stores, so sharding the storage over 2 ranks halves it; none without a master."""
    model = MLP([512, 512, 512])
    x, y = torch.randn(64, 512), torch.randint(0, 512, (64,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (2,))
    hw = autopar.H100
    mesh = autopar.MeshSpec((2,), hardware=hw)
    cost = CostModel(mesh, graph=graph, precision="bf16-mixed")
    weight = next(v for v in graph.nodes.values() if v.kind == "param"
                  and v.out_shapes[0] == (512, 512))
    whole = next(s for s in weight.strategies if all(p.is_replicate() for p in s.output))
    half = next(s for s in weight.strategies if s.output[0].is_shard())
    moved = 512 * 512 * (4 + 2) / (hw.memory_bandwidth * hw.memory_efficiency)
    assert cost.compute_times(weight, whole) == pytest.approx(
        (moved + hw.launch, moved / hw.widening_efficiency + hw.launch))
    assert cost.compute_times(weight, half) == pytest.approx(
        (moved / 2 + hw.launch, moved / 2 / hw.widening_efficiency + hw.launch))
    assert CostModel(mesh, graph=graph).compute_times(weight, whole) == (0.0, 0.0)


def test_accumulation_prices_adding_each_microbatchs_gradient():
    """A step over m microbatches adds m - 1 microbatches' gradients into the one it keeps
    (read both, write one, on the gradient as the rank keeps it: float32 under bf16-mixed,
    the ZeRO-2 shard); a step prices m microbatches as m times one, so each pays (m - 1) / m
    of it. One microbatch adds nothing."""
    model = MLP([512, 512, 512])
    x, y = torch.randn(64, 512), torch.randint(0, 512, (64,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (2,), zero=True)
    hw = autopar.H100
    mesh = autopar.MeshSpec((2,), hardware=hw)
    weight = next(v for v in graph.nodes.values() if v.kind == "param"
                  and v.out_shapes[0] == (512, 512))
    whole = next(s for s in weight.strategies if all(p.is_replicate() for p in s.output)
                 and not s.zero)
    zero2 = next(s for s in weight.strategies if s.zero == 2)
    add = 3 * 512 * 512 * 4 / (hw.memory_bandwidth * hw.memory_efficiency)

    def backward(m, strategy, precision="fp32"):
        return CostModel(mesh, graph=graph, precision=precision,
                         accumulation=m).compute_times(weight, strategy)[1]
    assert backward(1, whole) == 0.0
    assert backward(4, whole) == pytest.approx(3 / 4 * (add + hw.launch))
    assert backward(4, zero2) == pytest.approx(3 / 4 * (add / 2 + hw.launch))
    assert backward(2, whole, "bf16-mixed") - backward(1, whole, "bf16-mixed") == \
        pytest.approx(1 / 2 * (add + hw.launch))


def _weight_and_consumer(graph):
    """The MLP's first 512 x 512 weight, and the (op, input slot) that uses it."""
    weight = next(v for v in graph.nodes.values() if v.kind == "param"
                  and v.out_shapes[0] == (512, 512))
    use = next((v, slot) for v in graph.nodes.values()
               for slot, (u, _) in enumerate(v.inputs) if u == weight.name)
    return weight, use


def test_gradients_are_synchronized_in_the_master_dtype():
    """Under bf16-mixed the runtime keeps float32 gradients on the float32 master and
    reduce-scatters FSDP gradients in float32 (FSDP2's reduce_dtype), so DDP's all-reduce,
    ZeRO's reduce-scatter and all-gather of the stepped shards, and FSDP's reduce-scatter
    move float32 bytes; only FSDP's all-gather of the cast shards moves bfloat16. Under fp32
    every collective moves float32."""
    model = MLP([512, 512, 512])
    x, y = torch.randn(64, 512), torch.randint(0, 512, (64,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (2,), zero=True)
    mesh = autopar.MeshSpec((2,), hardware=autopar.H100)
    weight, (use, slot) = _weight_and_consumer(graph)
    whole = next(s for s in weight.strategies if all(p.is_replicate() for p in s.output)
                 and not s.zero)
    zero2 = next(s for s in weight.strategies if s.zero == 2)
    sharded = next(s for s in weight.strategies if s.output[0].is_shard() and not s.zero)
    gathered = next(s.inputs[slot] for s in use.strategies
                    if all(p.is_replicate() for p in s.inputs[slot]))
    n = 512 * 512
    for precision, compute in (("bf16-mixed", 2), ("fp32", 4)):
        cost = CostModel(mesh, graph=graph, precision=precision)
        assert [(k, b) for k, _, b, _ in cost.grad_sync_steps(weight, whole.output)] == \
            [("all_reduce", 4 * n)]
        assert [(k, b) for k, _, b, _ in cost.grad_sync_steps(weight, zero2.output, 2)] == \
            [("reduce_scatter", 4 * n), ("all_gather", 4 * n)]
        fsdp = cost.edge_collectives(graph, use, slot, sharded.output, gathered)
        assert [(k, b, phase) for k, _, b, _, phase in fsdp] == \
            [("all_gather", compute * n, "forward"), ("reduce_scatter", 4 * n, "backward")]


def test_profiler_times_ops_that_exchange_inside_themselves():
    """A convolution's halo and BatchNorm's statistics are exchanged inside the op: the
    profiler runs them on the shapes they will have (the exchange priced apart), instead of
    leaving them at the roofline."""
    x, y = torch.randn(1, 3, 32, 32), torch.randint(0, 10, (1,))
    spec = autopar.MeshSpec((2,), hardware="cpu")
    graph = strategies.build(trace_example(ResNet(), (x, y), F.cross_entropy), spec.shape)
    cost = CostModel(spec, graph=graph)
    profiler = OpProfiler("cpu", cache_dir=False, min_time=1e-5, samples=1)
    timed = set()
    for v in graph.nodes.values():
        facts = facts_of(v.call.target) if v.call is not None else None
        for s in v.strategies:
            if facts is not None and facts.exchanges is not None and facts.exchanges(
                    v.call, s.inputs, spec.shape, lambda dt: dt.itemsize):
                assert profiler.time_op(v, s, cost) is not None, (v.name, s)
                timed.add(str(v.call.target))
    assert {"aten.conv2d.default", "aten.batch_norm.default",
            "aten.max_pool2d.default"} <= timed
