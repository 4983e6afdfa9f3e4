"""The memory model: ZeRO's arithmetic, the bytes ranks really hold after a step, the budget
moving the solver from DDP to sharded plans, and the message when nothing fits."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes import strategies
from autopar.passes.placement import fmt
from autopar.passes.trace import trace, trace_example
from autopar.solver.cost import CostModel
from autopar.solver.diagnose import min_memory
from autopar.solver.ilp import NoFeasiblePlan, plan_time, solve
from autopar.solver.memory import plan_memory, zero_memory
from autopar.zoo import GPT, GPTConfig, Llama3, Llama3Config, lm_loss
from tests import cost_tasks

PSI = 1_000_003  # parameters (odd on purpose: no rounding hides in the formulas)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_zero_arithmetic(n):
    """Mixed-precision AdamW: ZeRO's 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N."""
    want = {"ddp": 16 * PSI, "zero1": 4 * PSI + 12 * PSI / n, "zero2": 2 * PSI + 14 * PSI / n,
            "zero3": 16 * PSI / n, "fsdp": 16 * PSI / n}
    for setup, total in want.items():
        got = zero_memory(PSI, n, setup, precision="bf16-mixed", optimizer="adamw")
        assert sum(got.values()) == pytest.approx(total, rel=1e-12), setup
    ddp = zero_memory(PSI, n, "ddp")
    assert ddp == {"parameters": 2 * PSI, "gradients": 2 * PSI, "optimizer": 12 * PSI}


def test_zero_arithmetic_other_optimizers():
    """fp32 AdamW: 16 bytes per parameter (4 + 4 + 8); SGD with momentum 12; plain SGD 8; with
    AdamW's step scalar (4 bytes) per tensor."""
    assert sum(zero_memory(PSI, 4, "ddp", "fp32", "adamw", tensors=10).values()) == \
        16 * PSI + 40
    assert sum(zero_memory(PSI, 4, "ddp", "fp32", "sgd-momentum").values()) == 12 * PSI
    assert sum(zero_memory(PSI, 4, "fsdp", "fp32", "sgd").values()) == 8 * PSI / 4
    assert sum(zero_memory(PSI, 4, "ddp", "bf16-mixed", "sgd-momentum").values()) == 12 * PSI


def gpt(n_layer=2, n_embd=64, vocab=128, seq=32, batch=8):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=4,
                          n_embd=n_embd))
    x = torch.randint(0, vocab, (batch, seq))
    return model, (x, x)


@pytest.mark.parametrize("precision,optimizer,per_param", [
    ("bf16-mixed", "adamw", 16), ("fp32", "adamw", 16), ("fp32", "sgd-momentum", 12),
    ("bf16-mixed", "sgd", 8)])
def test_plans_price_the_standard_setups(precision, optimizer, per_param):
    """A real model's DDP and FSDP plans cost Psi x bytes per parameter replicated, / N sharded
    (every GPT tensor splits evenly over 4), plus AdamW's step scalar per tensor: in float32
    what ZeRO's arithmetic says; under mixed precision what autopar keeps (as FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does): the float32 master (4),
    a float32 gradient (4) and float32 optimizer state (8), where ZeRO's accounting has
    bfloat16 parameters and gradients (2 + 2) and a master copy inside the optimizer's 12
    (the bfloat16 casts autopar computes with are priced where autograd keeps them)."""
    model, example = gpt()
    psi = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    scalars = 4 * tensors if optimizer == "adamw" else 0
    n = 4
    for force, setup in (("data", "ddp"), ("fsdp", "fsdp")):
        plan = autopar.plan(model, autopar.MeshSpec((n,), hardware="cpu"), example,
                            loss_fn=lm_loss, force=force, precision=precision,
                            optimizer=optimizer)
        # what the parameters hold (activations, FSDP gathers in flight and the loss's
        # backward buffers are per step)
        held = {k: v for k, v in plan.cost.memory.items()
                if k not in ("activations", "gathered", "workspace")}
        if precision == "fp32":
            want = zero_memory(psi, n, setup, precision, optimizer, tensors)
            assert held == pytest.approx(want), (force, held, want)
        replicated = setup == "ddp"
        assert sum(held.values()) == pytest.approx(
            per_param * psi / (1 if replicated else n) + scalars)
        assert plan.cost.precision == precision and plan.cost.optimizer == optimizer
    if precision != "fp32":
        return
    # ZeRO-1 holds whole gradients when it accumulates microbatches (with one it frees each
    # once reduce-scattered, as ZeRO-2)
    for force, micro in (("zero1", 2), ("zero2", 1)):
        plan = autopar.plan(model, autopar.MeshSpec((n,), hardware="cpu"), example,
                            loss_fn=lm_loss, force=force, precision=precision,
                            optimizer=optimizer, microbatches=micro)
        held = {k: v for k, v in plan.cost.memory.items()
                if k not in ("activations", "gathered", "workspace")}
        assert held == pytest.approx(zero_memory(psi, n, force, precision, optimizer, tensors))


def test_mixed_precision_halves_activations_and_traffic():
    model, example = gpt()
    spec = autopar.MeshSpec((4,), hardware="h100")
    full = autopar.plan(model, spec, example, loss_fn=lm_loss, force="fsdp")
    half = autopar.plan(model, spec, example, loss_fn=lm_loss, force="fsdp",
                        precision="bf16-mixed")
    assert half.cost.memory["activations"] == pytest.approx(
        full.cost.memory["activations"] / 2, rel=0.05)  # float32 statistics stay float32
    gathered = [c.bytes for c in full.collectives if c.kind == "all_gather"]
    assert [c.bytes for c in half.collectives if c.kind == "all_gather"] == \
        [b // 2 for b in gathered]


def test_bf16_plans_trace_in_bfloat16():
    """A bf16-mixed plan is made for the program that runs: its parameters and activations
    are bfloat16, its loss float32; an unknown precision is an error."""
    model, example = gpt()
    plan = autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example,
                        loss_fn=lm_loss, precision="bf16-mixed")
    fp32 = autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example,
                        loss_fn=lm_loss)
    assert plan.graph_fingerprint != fp32.graph_fingerprint or plan.hash() != fp32.hash()
    assert plan.cost.precision == "bf16-mixed"
    with pytest.raises(ValueError, match="precision must be one of|unknown precision"):
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example, loss_fn=lm_loss,
                     precision="fp8")


def test_plan_memory_is_what_the_ilp_constrains():
    """plan.cost.memory is the quantity the ILP's memory constraint bounds: a budget at the
    fastest plan's peak keeps a plan as fast; a budget just below it forces a slower plan whose
    reported peak is within it."""
    model, example = gpt()
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu")
    fastest = autopar.plan(model, spec, example, loss_fn=lm_loss, memory_budget=float("inf"))
    peak = fastest.cost.peak_memory
    at = autopar.plan(model, spec, example, loss_fn=lm_loss, memory_budget=peak * (1 + 1e-9))
    assert at.cost.peak_memory <= peak * (1 + 1e-9)
    assert at.cost.step_time == pytest.approx(fastest.cost.step_time, rel=1e-6)
    below = autopar.plan(model, spec, example, loss_fn=lm_loss, memory_budget=peak * 0.9)
    assert below.cost.peak_memory <= peak * 0.9 * (1 + 1e-9)
    assert below.cost.step_time > fastest.cost.step_time


class Wide(nn.Module):
    """Two big layers on a small batch: parameters and optimizer state dominate memory."""

    def __init__(self, width=512):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _sharded(plan) -> float:
    """Share of parameters whose state is sharded: stored sharded, or under ZeRO."""
    return sum(1 for n, p in plan.parameters.items() if "S" in fmt(p) or n in plan.zero) / \
        len(plan.parameters)


def _weight_uses(plan) -> list[str]:
    """How each linear uses its weight: sharded (tensor parallel) or whole."""
    return ["sharded" if "S" in o.inputs[1] else "whole" for o in plan.ops
            if o.op.startswith("linear")]


@pytest.mark.parametrize("batch,then", [(4096, "fsdp"), (512, "tensor")])
def test_shrinking_budget_moves_from_ddp_to_sharded_plans(batch, then):
    """With room to spare the solver picks DDP (no communication but the gradient all-reduce);
    as the budget shrinks it shards optimizer state and parameters, paying more time for less
    memory: weights used whole (ZeRO, or FSDP: stored sharded, gathered for use) when the
    batch is large and activations are expensive to move, tensor parallel (used where stored)
    when it is small. Below the
    smallest peak any plan reaches, the error says what that peak is."""
    torch.manual_seed(0)
    model = Wide(256)
    x, y = torch.randn(batch, 256), torch.randint(0, 256, (batch,))
    spec = autopar.MeshSpec((4,), hardware="cpu")
    free = autopar.plan(model, spec, (x, y), loss_fn=F.cross_entropy)
    assert {fmt(p) for p in free.parameters.values()} == {"R"}  # DDP
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), spec.shape,
                             zero=True)
    smallest, _ = min_memory(graph, CostModel(spec, graph=graph))
    times, peaks, sharded, uses = [], [], [], []
    # (the loss's backward buffers, a sixth of the peak here, shrink with no plan: 0.85 of
    # the peak is already a tight budget for the rest)
    for budget in [free.cost.peak_memory * f for f in (1.0, 0.9, 0.85)] + [smallest * 1.001]:
        plan = autopar.plan(model, spec, (x, y), loss_fn=F.cross_entropy, memory_budget=budget)
        assert plan.cost.peak_memory <= budget * (1 + 1e-9)
        times.append(plan.cost.step_time)
        peaks.append(plan.cost.peak_memory)
        sharded.append(_sharded(plan))
        uses.append(_weight_uses(plan))
    assert times == sorted(times) and times[-1] > times[0]
    assert peaks == sorted(peaks, reverse=True)
    assert sharded[0] == 0 and sharded[2] > 0
    assert uses[0] == ["whole", "whole"]
    if then == "fsdp":
        assert uses[2] == ["whole", "whole"]
    else:
        assert "sharded" in uses[2]
    with pytest.raises(NoFeasiblePlan) as info:  # the whole batch at once: no plan fits
        autopar.plan(model, spec, (x, y), loss_fn=F.cross_entropy,
                     memory_budget=smallest * 0.9, microbatches=1, recompute="none")
    text = str(info.value)
    assert f"smallest peak any plan reaches is {smallest / 2**20:.3f} MiB" in text
    assert "dominated by" in text
    if info.value.dominant == "activations":  # left to itself, the planner accumulates
        plan = autopar.plan(model, spec, (x, y), loss_fn=F.cross_entropy,
                            memory_budget=smallest * 0.9, recompute="none")
        assert plan.accumulation > 1 and plan.cost.peak_memory <= smallest * 0.9


def test_no_feasible_plan_names_what_dominates():
    """Activations dominate a long batch: the message says so and suggests what helps."""
    model, example = gpt(batch=64)
    with pytest.raises(NoFeasiblePlan, match=r"dominated by activations.*smaller batch"):
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example, loss_fn=lm_loss,
                     memory_budget=1e6, microbatches=1)
    # Left to itself the planner recomputes and accumulates gradients while fewer activations
    # alone could make a plan fit, and says what it tried and what dominates then.
    # (1e6 bytes fits with full recomputation over 64 microbatches: 0.9e6 does not.)
    with pytest.raises(NoFeasiblePlan, match=r"dominated by optimizer.*tried recomputation "
                                             r"\(none, selective, full\) and gradient "
                                             r"accumulation up to \d+ microbatches"):
        autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), example, loss_fn=lm_loss,
                     memory_budget=0.9e6)


def test_min_memory_is_a_lower_bound_the_solver_reaches():
    model, example = gpt(n_layer=1)
    spec = autopar.MeshSpec((4,), hardware="cpu")
    graph = strategies.build(trace_example(model, example, lm_loss), spec.shape)
    cost = CostModel(spec, graph=graph)
    smallest, choice = min_memory(graph, cost)
    assert plan_memory(graph, cost, choice) == pytest.approx(smallest)
    sol = solve(graph, cost, memory_budget=smallest * 1.0001)
    assert plan_memory(graph, cost, sol.choice) <= smallest * 1.0001
    assert sol.objective == pytest.approx(plan_time(graph, cost, sol.choice), rel=1e-6)
    with pytest.raises(NoFeasiblePlan):
        solve(graph, cost, memory_budget=smallest * 0.999)


# -- what ranks really hold ----------------------------------------------------------------------

CASES = [("gpt", (4,), "data"), ("gpt", (4,), "fsdp"), ("gpt", (4,), "tensor"),
         ("gpt", (2, 2), {"dp": "fsdp", "tp": "tensor"}), ("hf_llama", (4,), "tensor"),
         ("hf_llama_lora", (4,), "fsdp"), ("gpt", (4,), "data", "bf16-mixed"),
         ("gpt", (4,), "fsdp", "bf16-mixed"), ("gpt", (4,), "tensor", "bf16-mixed"),
         # one image, its rows and columns split (S(2)S(3)): each convolution and max pool
         # keeps its shard extended by the halo
         ("resnet_one_image", (2, 2), None),
         # BatchNorm's statistics combined over the batch's ranks, max pools' indices
         ("resnet", (4,), "data"), ("resnet", (4,), "fsdp")]


@pytest.mark.parametrize("case", CASES, ids=lambda s: "-".join(map(str, s)).replace(" ", ""))
def test_measured_memory_equals_prediction(world4, case):
    """After a step, the bytes of parameters, gradients and AdamW state (its state dict) each
    rank holds equal the plan's prediction exactly; the tensors autograd saved for backward
    (distinct storages, parameters and inputs excluded) are within 10% of it."""
    model, shape, force, *precision = case
    results = world4.run(cost_tasks.measured_memory, model, shape, force, "adamw",
                         *precision)
    predicted = results[0]["predicted"]
    for r in results:
        got = r["measured"]
        for kind in ("parameters", "gradients", "optimizer"):
            assert got[kind] == predicted[kind], (kind, got, predicted)
        assert got["activations"] == pytest.approx(predicted["activations"], rel=0.10)


def test_frozen_parameters_cost_only_their_storage():
    """A LoRA fine-tuning plan prices gradients, optimizer state and gradient sync of the
    adapters alone; the frozen base weights cost their storage."""
    model, loss_fn, example = cost_tasks.build("hf_llama_lora")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    plan = autopar.plan(model, autopar.MeshSpec((2,), names=("dp",), hardware="cpu"), example,
                        loss_fn=loss_fn, force="data")
    mem = plan.cost.memory
    assert mem["parameters"] == 4 * total
    assert mem["gradients"] == 4 * trainable
    adapters = sum(1 for p in model.parameters() if p.requires_grad)
    assert mem["optimizer"] == 2 * 4 * trainable + 4 * adapters  # AdamW: two states, a step
    synced = {c.at for c in plan.collectives if c.phase == "gradient sync"}
    assert synced and all("lora" in name for name in synced)


def test_measured_memory_sgd_momentum(world2):
    """SGD with momentum keeps one buffer per parameter and no scalars: what a plan made for it
    predicts."""
    got = world2.run(cost_tasks.measured_memory, "mlp", (2,), "fsdp",
                     optimizer="sgd-momentum")[0]["measured"]
    model, loss_fn, example = cost_tasks.build("mlp")
    plan = autopar.plan(model, autopar.MeshSpec((2,), names=("dp",), hardware="cpu"), example,
                        loss_fn=loss_fn, force="fsdp", optimizer="sgd-momentum")
    assert got["optimizer"] == plan.cost.memory["optimizer"] == got["parameters"]


class _MaskedAttention(nn.Module):
    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = self.mask.expand(b, 1, t, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _attention_node_bytes(mask: torch.Tensor) -> tuple[float, dict]:
    """(the model's bytes kept for the attention node, the storages autograd really saved)."""
    model, x = _MaskedAttention(mask), torch.randn(5, 6, 8)
    saved = cost_tasks.SavedTensors(list(model.parameters()) + [x])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        model(x)
    program = trace(model, (x,), output_loss=True)  # trained on the scalar it returns
    graph = strategies.build(program, (1,))
    cost = CostModel(autopar.MeshSpec((1,), hardware="cpu"), graph=graph)
    attn = next(v for v in graph.nodes.values() if v.op.startswith("scaled_dot_product"))
    return cost.activation_memory(attn, attn.strategies[0]), saved.shapes


def test_boolean_attention_mask_is_kept_as_a_float_mask():
    """SDPA keeps a boolean mask as the additive float mask it makes of it, at the broadcast
    shape (5 x 1 x 6 x 6 floats here), and a float mask as the tensor it was given: the model
    charges the attention node exactly that difference."""
    causal = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with_bool, saved = _attention_node_bytes(causal)
    with_float, _ = _attention_node_bytes(torch.zeros(1, 1, 6, 6).masked_fill(~causal, -1e9))
    made = 5 * 1 * 6 * 6 * 4
    assert any(shape == [((5, 1, 6, 6), "torch.float32")] for shape in saved.values())
    assert with_bool - with_float == pytest.approx(made)


def _llama_example(vocab=512, batch=4, seq=32):
    torch.manual_seed(0)
    model = Llama3(Llama3Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                                ffn_dim=128))
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids, ids), batch * seq * vocab


def test_mixed_precision_prices_the_float32_the_program_computes():
    """Under bf16-mixed the planner traces in bf16, so a float32 tensor of its graph is one
    the program computes in float32 (here the logits cast for the loss) and is priced at 4
    bytes; on a graph traced in float32 every float32 tensor takes the compute dtype."""
    model, example, logits = _llama_example()
    spec = autopar.MeshSpec((1,), hardware="h100")
    sizes = {}
    for traced in (torch.bfloat16, None):
        program = trace(model, example[:1], lm_loss, example[1], compute_dtype=traced)
        graph = strategies.build(program, spec.shape)
        cost = CostModel(spec, graph=graph, precision="bf16-mixed")
        loss = next(v for v in graph.nodes.values() if v.op.startswith("cross_entropy"))
        assert loss.in_shapes[0] == (logits // 512, 512)
        sizes[traced] = cost.nbytes(loss.in_shapes[0], loss.call.inputs[0].dtype)
    assert sizes == {torch.bfloat16: 4 * logits, None: 2 * logits}


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_loss_backward_buffers_are_part_of_the_peak(precision):
    """Cross-entropy's backward holds two logits-sized gradients (float32 either way: the loss
    is computed on float32 logits) while everything saved is alive: a memory kind of its own,
    following the logits' sharding (half per rank when the batch is split over 2)."""
    model, example, logits = _llama_example()
    for shape, force, share in (((1,), None, 1), ((2,), "data", 2)):
        plan = autopar.plan(model, autopar.MeshSpec(shape, hardware="h100"), example,
                            loss_fn=lm_loss, precision=precision, force=force,
                            memory_budget=float("inf"))
        assert plan.cost.memory["workspace"] == 2 * 4 * logits / share
        assert plan.cost.peak_memory == pytest.approx(sum(plan.cost.memory.values()))


def test_a_peak_the_loss_dominates_is_reported_as_activations():
    """With a large vocabulary and a short model the loss's backward buffers are the largest
    kind of memory: the error names activations (what the batch sets) and the loss."""
    torch.manual_seed(0)
    model = Llama3(Llama3Config(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8192,
                                ffn_dim=32))
    ids = torch.randint(0, 8192, (8, 64))
    spec = autopar.MeshSpec((1,), hardware="h100")
    free = autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss)
    split = free.cost.memory
    assert split["workspace"] == max(split.values())
    with pytest.raises(NoFeasiblePlan) as info:
        autopar.plan(model, spec, (ids, ids), loss_fn=lm_loss, microbatches=1,
                     recompute="none", memory_budget=free.cost.peak_memory * 0.5)
    message = str(info.value)
    assert "dominated by activations" in message and "cross_entropy_loss" in message
    assert "workspace" in message


def test_twins_alike_are_counted_once_to_the_same_bytes():
    """The memory of a plan with identical layers (folded, their nodes twins) counted once per
    twin alike, as the ILP counts it, is the memory counted node by node: for plans whose
    twins choose alike (as the solver's do), without recomputation, selective and full, some
    parameters freed after forward and some not (twins that differ there are not alike)."""
    import random

    from autopar import planner
    from autopar.options import PlanOptions
    from autopar.solver.ilp import random_choice
    from autopar.solver.memory import memory_split
    from tests.rank_tasks import build

    model, loss_fn, example = build("hf_llama_deep")
    program = trace(model, example[:-1], loss_fn, example[-1])
    assert program.folded
    spec = autopar.MeshSpec((2, 2), hardware="cpu")
    rng = random.Random(0)
    for recompute in ("none", "selective", "full"):
        graph, cost = planner.priced_level(program, spec, PlanOptions(), recompute, True)
        twin = planner.clustered(program, graph).twin
        assert twin
        for _ in range(3):
            drawn = random_choice(graph, cost, rng)
            choice = {n: graph.nodes[n].strategies[drawn[twin.get(n, n)]] for n in drawn}
            freed = cost.copy(reshard=frozenset(p for p in sorted(cost.reshard)
                                                if rng.random() < 0.5))
            each = memory_split(graph, freed, choice)
            once = memory_split(graph, freed, choice, twin)
            assert each.keys() == once.keys()
            assert all(once[k] == pytest.approx(each[k], rel=1e-12) for k in each)


class _AllocatedBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the new storages ops allocate meanwhile (outputs that are neither views nor
    written in place)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and func not in _VIEWS:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t._base is None:
                    self.total += t.untyped_storage().nbytes()
        return out


_VIEWS = (torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor,
          torch.ops.aten.alias.default)


def test_the_largest_random_draw_is_part_of_the_peak():
    """A random op draws its whole tensor, and under gradient accumulation the whole batch's,
    whatever its sharding, and holds that draw while it runs: the plan's memory has the
    largest as "draws" (m times the microbatch's elements at 2 x itemsize + 1 bytes each, the
    GPU's stand-in, output and boolean mask), and the ILP keeps the rest of the plan within
    the budget less it. Measured on the lowering itself (CPU: a stand-in of the whole batch,
    then the rank's block), what a microbatch's dropout allocates beyond its result is the
    whole batch's draw."""
    from autopar.passes.rules.random import dropout_block
    from autopar.passes.rules.random_stream import STREAM
    from autopar.solver.memory import KINDS, draw_bytes, memory_split

    model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.1), nn.Linear(256, 8))
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    graph = strategies.build(trace_example(model, (x[:8], y[:8]), F.mse_loss), (2,))
    for m in (1, 4):
        cost = CostModel(autopar.MeshSpec((2,), hardware="h100"), graph=graph, accumulation=m)
        assert draw_bytes(graph, cost) == 8 * 256 * m * (2 * 4 + 1)
        choice = {n: v.strategies[0] for n, v in graph.nodes.items()}
        split = memory_split(graph, cost, choice)
        assert split["draws"] == draw_bytes(graph, cost) and set(split) <= set(KINDS)
    predicted = split["draws"]  # at m = 4
    plain = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8))
    graph = strategies.build(trace_example(plain, (x, y), F.mse_loss), (2,))
    cost = CostModel(autopar.MeshSpec((2,), hardware="h100"), graph=graph)
    assert "draws" not in memory_split(graph, cost, {n: v.strategies[0]
                                                      for n, v in graph.nodes.items()})
    # The ILP: within a budget, the plan's peak, draws included, fits it.
    spec = autopar.MeshSpec((2,), names=("dp",), hardware="cpu")
    free = autopar.plan(model, spec, (x, y), loss_fn=F.mse_loss, microbatches=4,
                        memory_budget=float("inf"))
    assert free.cost.memory["draws"] == 32 * 256 * (2 * 4 + 1)
    tight = autopar.plan(model, spec, (x, y), loss_fn=F.mse_loss, microbatches=4,
                         memory_budget=free.cost.peak_memory * 0.95)
    assert tight.cost.peak_memory <= free.cost.peak_memory * 0.95
    # The lowering under accumulation over 4 microbatches of 8 rows, rank 1 of 2 (rows 4-7).
    h = torch.randn(4, 256)
    STREAM.at_microbatch(2)
    try:
        with _AllocatedBytes() as counted:
            out = dropout_block(h, 0.1, (32, 256), (256, 1), ((4, 4), (0, 256)), (0, 8))
    finally:
        STREAM.end()
    assert out.shape == h.shape
    beyond = counted.total - 2 * out.untyped_storage().nbytes()  # the block and the result
    assert beyond == 32 * 256 * 4  # the whole batch's stand-in, drawn into in place
    assert beyond <= predicted  # the model's bound holds the CPU's draw
