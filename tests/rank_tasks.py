"""Functions the gloo ranks run for the equivalence tests (module level, so ranks import them).

Each task trains the parallelized model and a single-device copy side by side on every rank and
raises (with the largest differences) when they disagree; the test sees the traceback.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar import zoo
from tests import models

RTOL, ATOL = 1e-4, 1e-5
_MESHES: dict = {}
# Models compared in float32: torch's grouped_mm has no float64 kernel on cpu, and Hugging
# Face's grouped_mm experts call it in eager mode (the traced program calls its fallback).
FLOAT32_ONLY = ("hf_mixtral_grouped",)


def mesh_for(shape: tuple[int, ...]):
    """One DeviceMesh per shape per process (creating one is a collective)."""
    shape = tuple(shape)
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=mesh_names(shape))
    return _MESHES[shape]


def mesh_names(shape) -> tuple[str, ...]:
    """The dimension names the tests use: dp, tp (and pp first for 3-D meshes)."""
    return {1: ("dp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}[len(shape)]


def build(name):
    """A model, its loss and a batch, identical on every rank. `name` is a fixed model's name or
    a (family, config dict) pair drawn by the property tests."""
    torch.manual_seed(0)
    if isinstance(name, (tuple, list)):
        return build_family(*name)
    if name == "mlp":
        model = models.MLP([16, 32, 32, 8])
        x = torch.randn(8, 16)
        y = torch.randint(0, 8, (8,))
        return model, torch.nn.functional.cross_entropy, (x, y)
    if name == "residual_rms":
        model = models.ResidualMLP(16, 2, norm="rmsnorm", activation="silu")
        x = torch.randn(4, 6, 16)
        y = torch.randn(4, 6, 16)
        return model, torch.nn.functional.mse_loss, (x, y)
    if name == "gpt":
        model = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                      n_embd=32))
    elif name == "gpt_padded":  # targets padded with ignore_index, unevenly over the batch
        # (in 4 microbatches of 2 rows: 19, 21, 0 and 5 targets; the third's mean is 0 / 0)
        model = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                      n_embd=32))
        x = torch.randint(0, 64, (8, 16))
        y = torch.randint(0, 64, (8, 16))
        for row, kept in enumerate((3, 16, 9, 12, 0, 0, 5, 0)):
            y[row, kept:] = -100
        return model, zoo.lm_loss, (x, y)
    elif name == "gpt_deep":  # 4 identical blocks: traced once and copied (passes/fold.py)
        model = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4,
                                      n_embd=32))
    elif name == "hf_llama_deep":
        model = zoo.hf_llama(num_hidden_layers=5, hidden_size=32, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                             max_position_embeddings=16)
    elif name == "hf_gpt2":
        model = zoo.hf_gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    elif name == "hf_gpt2_dropout":  # embedding, residual and attention (SDPA) dropout
        model = zoo.hf_gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                            dropout=0.2)
    elif name == "hf_bloom":  # ALiBi attention scores through baddbmm, eager attention
        model = zoo.hf_causal_lm("Bloom", n_layer=2, hidden_size=32, n_head=4, vocab_size=64,
                                 attn_implementation="eager")
    elif name == "llama3":  # torchtitan's Llama 3: causal SDPA, rotary positions, GQA
        model = zoo.Llama3(zoo.Llama3Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                            vocab_size=64, ffn_dim=64))
    elif name == "hf_llama":
        model = zoo.hf_llama(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                             max_position_embeddings=16)
    elif name == "hf_llama_checkpointed":  # Hugging Face gradient checkpointing, non-reentrant
        model = zoo.hf_llama(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                             max_position_embeddings=16)
        enable = getattr(model.model, "activation_checkpointing_enable", None) or \
            model.model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    elif name == "hf_llama_lora":  # fine-tuning: only the LoRA adapters train
        model = models.hf_llama_lora(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=16)
    elif name in ("hf_mixtral", "hf_mixtral_grouped"):  # experts as batched_mm or grouped_mm
        model = models.hf_mixtral("grouped_mm" if name.endswith("grouped") else "batched_mm")
    elif name in ("moe_loop", "moe_grouped"):
        # A loop over experts with a shared expert and the load-balancing loss; a batched
        # matmul over the chosen experts' weights with a token-count buffer.
        loop = name == "moe_loop"
        c = models.MoEConfig(vocab=64, hidden=32, heads=4, kv_heads=2, depth=2, seq=16,
                             tied=False, experts=4, top_k=2, ffn=16, shared_expert=loop,
                             grouped=not loop, balance="loss" if loop else "count")
        x = torch.randint(0, 64, (4, 16))
        return models.MoETransformer(c), models.moe_loss if loop else zoo.lm_loss, (
            x, torch.roll(x, -1, 1))
    elif name == "odd":  # batch 3, widths 5/6/7: only the hidden width 6 splits over 2 ranks
        return models.MLP([5, 6, 7]), torch.nn.functional.cross_entropy, (
            torch.randn(3, 5), torch.randint(0, 7, (3,)))
    elif name == "noisy":  # rand_like, randn_like, bernoulli.p and dropout in one MLP
        return _Noisy(), torch.nn.functional.cross_entropy, (
            torch.randn(8, 16), torch.randint(0, 8, (8,)))
    elif name == "no_grad_region":  # a gate computed under torch.no_grad() in forward
        return _NoGradGate(), torch.nn.functional.cross_entropy, (
            torch.randn(8, 16), torch.randint(0, 8, (8,)))
    elif name in ("batchnorm_blocks", "offset_blocks"):  # layer blocks that update a buffer
        return models.StatefulMLP(8, 16, 4, 3, name.partition("_")[0]), \
            torch.nn.functional.cross_entropy, (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    elif name == "resnet":  # convolutions, BatchNorm in training mode, pooling
        return models.ResNet(), torch.nn.functional.cross_entropy, (
            torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,)))
    elif name in ("resnet_one_image", "resnet_one_tall_image"):  # spatial shards, halos
        size = (256, 256) if name == "resnet_one_image" else (512, 64)
        return models.ResNet(), torch.nn.functional.cross_entropy, (
            torch.randn(1, 3, *size), torch.randint(0, 10, (1,)))
    elif name == "shifted_windows":  # forward sets its shift once for good (Swin)
        return models.ShiftedWindows(), torch.nn.functional.cross_entropy, (
            torch.randn(8, 6, 6, 8), torch.randint(0, 4, (8,)))
    elif name == "nn_transformer":  # torch.nn.Transformer: MultiheadAttention's code path
        model = models.TorchTransformerLM()
    elif name == "unsupported":  # aten.flip has no sharding rule
        return _Flipped(), torch.nn.functional.cross_entropy, (
            torch.randn(4, 8), torch.randint(0, 8, (4,)))
    else:
        raise ValueError(name)
    x = torch.randint(0, 64, (4, 16))
    y = torch.randint(0, 64, (4, 16))
    return model, zoo.lm_loss, (x, y)


def in_float64(model, example):
    """The model and its example batch in float64. Equivalence is checked in float64 so that
    the tolerance sits far above reassociation noise: in float32, AdamW turns the rounding of a
    gradient near eps into parameter differences of 1e-5 after three steps, on one device too
    (float32 against float64 single-device training differs that much)."""
    return model.double(), tuple(t.double() if t.is_floating_point() else t for t in example)


def build_family(family: str, cfg: dict):
    """A model from a drawn configuration (see tests/test_properties.py)."""
    torch.manual_seed(cfg.get("seed", 0))
    if family == "mlp":
        model = models.MLP(cfg["widths"], activation=cfg["activation"])
        x = torch.randn(cfg["batch"], cfg["widths"][0])
        y = torch.randint(0, cfg["widths"][-1], (cfg["batch"],))
        return model, torch.nn.functional.cross_entropy, (x, y)
    if family == "residual":
        model = models.ResidualMLP(cfg["width"], cfg["depth"], norm=cfg["norm"],
                                   activation=cfg["activation"], dropout=cfg.get("dropout", 0.0))
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["width"])
        return model, torch.nn.functional.mse_loss, (x, torch.randn_like(x))
    if family == "tiny":
        c = models.TinyConfig(**{k: v for k, v in cfg.items() if k not in ("batch", "seed")})
        x = torch.randint(0, c.vocab, (cfg["batch"], c.seq))
        return models.TinyTransformer(c), zoo.lm_loss, (x, torch.roll(x, -1, 1))
    if family == "moe":
        c = models.MoEConfig(**{k: v for k, v in cfg.items() if k not in ("batch", "seed")})
        x = torch.randint(0, c.vocab, (cfg["batch"], c.seq))
        loss = models.moe_loss if c.balance == "loss" else zoo.lm_loss
        return models.MoETransformer(c), loss, (x, torch.roll(x, -1, 1))
    if family == "hf":  # a Hugging Face causal LM by its transformers prefix and config fields
        model = zoo.hf_causal_lm(cfg["kind"], **cfg["fields"])
        x = torch.randint(0, cfg["fields"]["vocab_size"], (cfg["batch"], cfg["seq"]))
        return model, zoo.lm_loss, (x, torch.roll(x, -1, 1))
    raise ValueError(family)


def check_equal(what: str, got: dict, want: dict) -> None:
    for name in want:
        try:
            torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            raise AssertionError(f"{what} of {name} differs on rank {dist.get_rank()}:\n{e}") \
                from None


def grads_of(params: dict) -> dict:
    """Each parameter's gradient, zeros for one without (a frozen parameter), as
    pmodel.full_grads() gives them."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}


def check_training(pm, ref, loss_fn, x, y, steps: int) -> None:
    """Train the parallel model `pm` and the single-device `ref` side by side for `steps`
    AdamW steps: the loss of every step, the gradients of the first, the parameters and buffers
    after the last and the inference output must all be equal. The random generator is seeded
    alike before each step on every rank and before the single-device step, so a model with
    dropout draws the same masks (each rank its block of them)."""
    # eps 1e-5 rather than 1e-8: some parameters (attention key biases) have an exactly zero
    # true gradient, and AdamW with a tiny eps divides float noise by float noise, turning
    # reassociation differences of 1e-9 into parameter differences of lr.
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(100 + step)
        loss = pm.step(x, y)
        after = torch.get_rng_state()
        ref_opt.zero_grad()
        torch.manual_seed(100 + step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        assert torch.equal(after, torch.get_rng_state()), "the generator is not left as one " \
            "device leaves it"
        if step == 0:
            check_equal("gradient", pm.full_grads(), grads_of(ref_params))
        opt.step()
        ref_opt.step()
    check_equal("parameter", pm.full_parameters(), {n: p.detach() for n, p in ref_params.items()})
    state = pm.state_dict()  # buffers come whole: those updated in forward took every update
    check_equal("buffer", state, {n: b for n, b in ref.named_buffers() if n in state})
    with torch.no_grad():
        torch.manual_seed(99)
        got = pm(x)
        torch.manual_seed(99)
        torch.testing.assert_close(got, ref(x), rtol=RTOL, atol=ATOL)


def train_equivalence(name, mesh_shape: tuple, force=None, steps: int = 2,
                      plan: dict | None = None, options: dict | None = None) -> dict | None:
    """Loss, gradients, parameters after `steps` AdamW steps, and the forward output, all equal
    to single-device training. Runs the solver's plan (with PlanOptions fields `options`), or
    `plan` (as data) when given. Returns the plan as data (from rank 0)."""
    model, loss_fn, (x, y) = build(name)
    if name not in FLOAT32_ONLY:
        model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    mesh = mesh_for(mesh_shape)
    pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, example_inputs=(x, y), force=force,
                             plan=autopar.Plan.from_dict(plan) if plan else None,
                             **(options or {}))
    check_training(pm, ref, loss_fn, x, y, steps)
    return pm.plan.to_dict() if dist.get_rank() == 0 else None


class _Noisy(torch.nn.Module):
    """An MLP with noise injection, a random gate and dropout."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.fc1(x)
        h = h + 0.1 * torch.randn_like(h) * torch.rand_like(h)
        h = torch.relu(h) * h.detach().bernoulli(0.8)
        return self.fc2(torch.nn.functional.dropout(h, 0.3, training=True))


class _NoGradGate(torch.nn.Module):
    """An MLP scaled by a gate that gets no gradient (its weights get none at all)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.gate, self.fc2 = (torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                         torch.nn.Linear(32, 8))

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            g = torch.sigmoid(self.gate(h))
        return self.fc2(h * g)


class _Flipped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.flip(self.fc(x), dims=[-1])


def expect_error(kind: str) -> str:
    """Run one misuse on every rank; return the message of the error it raised."""
    model, loss_fn, (x, y) = build("mlp")
    try:
        if kind == "mesh_smaller_than_world":
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh("cpu", torch.arange(2))
            autopar.parallelize(model, mesh, loss_fn=loss_fn, example_inputs=(x, y))
        elif kind == "plan_for_other_mesh":
            plan = autopar.plan(model, autopar.MeshSpec((4,), hardware="cpu"), (x, y),
                                loss_fn=loss_fn)
            autopar.parallelize(model, mesh_for((2, 2)), loss_fn=loss_fn, plan=plan)
        elif kind == "plans_differ_across_ranks":
            style = "data" if dist.get_rank() == 0 else "tensor"
            plan = autopar.plan(model, autopar.MeshSpec((dist.get_world_size(),),
                                                        hardware="cpu"),
                                (x, y), loss_fn=loss_fn, force=style)
            autopar.parallelize(model, mesh_for((dist.get_world_size(),)), loss_fn=loss_fn,
                                example_inputs=(x, y), plan=plan)
        elif kind == "plan_for_other_model":
            other, _, _ = build("residual_rms")
            plan = autopar.plan(model, autopar.MeshSpec((dist.get_world_size(),),
                                                        hardware="cpu"), (x, y), loss_fn=loss_fn)
            xo, yo = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
            autopar.parallelize(other, mesh_for((dist.get_world_size(),)),
                                loss_fn=torch.nn.functional.mse_loss, example_inputs=(xo, yo),
                                plan=plan)
        elif kind == "parameters_before_planning":
            pm = autopar.parallelize(model, mesh_for((dist.get_world_size(),)),
                                     loss_fn=loss_fn)
            pm.parameters()
        else:
            raise ValueError(kind)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def accumulation_equivalence(name, mesh_shape: tuple, force=None) -> None:
    """Two step() calls without zero_grad accumulate the same gradients as two backward passes
    of the single-device model."""
    model, loss_fn, (x, y) = build(name)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                             example_inputs=(x, y), force=force)
    for _ in range(2):
        pm.step(x, y)
        loss_fn(ref(x), y).backward()
    check_equal("accumulated gradient", pm.full_grads(),
           {n: p.grad for n, p in ref.named_parameters()})


def dropout_equivalence(name, mesh_shape: tuple, force=None, steps: int = 2,
                        options: dict | None = None) -> dict | None:
    """With dropout: seeded alike before every step on every rank and before the single-device
    step, the loss and the gradients (and the parameters after `steps` AdamW steps) equal
    single-device training, so each rank drew the block of the single-device masks. `options`:
    PlanOptions fields."""
    model, loss_fn, (x, y) = build(name)
    model, (x, y) = in_float64(model, (x, y))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn, example_inputs=(x, y),
                             force=force, **(options or {}))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(100 + step)
        loss = pm.step(x, y)
        after = torch.get_rng_state()
        ref_opt.zero_grad()
        torch.manual_seed(100 + step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        assert torch.equal(after, torch.get_rng_state()), "the generator is not left as one " \
            "device leaves it"
        check_equal("gradient", pm.full_grads(), {n: p.grad for n, p in ref_params.items()})
        opt.step()
        ref_opt.step()
    check_equal("parameter", pm.full_parameters(), {n: p.detach() for n, p in ref_params.items()})
    return pm.plan.to_dict() if dist.get_rank() == 0 else None


class MixedReference:
    """Single-device bf16-mixed training as autopar does it (FSDP2's MixedPrecisionPolicy
    with param_dtype=bfloat16, reduce_dtype=float32): the float32 model is the master that
    the optimizer steps; each step computes on its bfloat16 cast, with floating inputs cast to
    bfloat16 and outputs back to float32 (the loss in float32); gradients reach the master in
    float32."""

    def __init__(self, model: torch.nn.Module):
        self.master = model
        self.compute = copy.deepcopy(model).to(torch.bfloat16)

    def step(self, loss_fn, x, y) -> torch.Tensor:
        with torch.no_grad():
            for c, m in zip(self.compute.parameters(), self.master.parameters()):
                c.copy_(m)
        self.compute.zero_grad()
        xs = x.to(torch.bfloat16) if x.is_floating_point() else x
        out = torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            self.compute(xs))
        loss = loss_fn(out, y)
        loss.backward()
        for c, m in zip(self.compute.parameters(), self.master.parameters()):
            if c.grad is None:  # used under no_grad only: none, as on any device
                continue
            g = c.grad.float()
            m.grad = g if m.grad is None else m.grad + g
        return loss.detach()


def mixed_precision_errors(name, mesh_shape: tuple, force=None, steps: int = 2,
                           recompute: str | None = None, plan: dict | None = None,
                           options: dict | None = None) -> dict:
    """bf16-mixed training of `name` against MixedReference, as relative errors: the loss of
    every step; the gradients of the first (per tensor: max |difference| / max |reference|);
    the total update of the parameters after `steps` SGD steps (same measure: SGD, since
    Adam's normalization turns bfloat16 noise on near-zero gradients into whole steps, on one
    device too). The master parameters stay float32. `recompute`: PlanOptions.recompute;
    `plan` (as data, made with precision="bf16-mixed"): run it rather than the solver's;
    `options`: more PlanOptions fields.

    The same three measures of MixedReference against float32 training come back as
    "<measure>_floor": the rounding error bfloat16 itself makes on this model, which an
    ill-conditioned model (a gradient that is a small difference of large terms) makes large
    for any order of computing it. "gradient_global" and "update_global" (and their floors)
    divide each tensor's largest difference by the largest reference value over all tensors
    instead of its own: a tensor whose true gradient is zero (an attention key bias) gets
    rounding noise of the size of the terms that cancel, not of its own (zero) size."""
    model, loss_fn, (x, y) = build(name)
    ref = MixedReference(copy.deepcopy(model))
    exact = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if plan is not None:
        pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                                 example_inputs=(x, y), plan=autopar.Plan.from_dict(plan))
    else:
        pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=loss_fn,
                                 example_inputs=(x, y), force=force, precision="bf16-mixed",
                                 recompute=recompute, **(options or {}))
    opts = [torch.optim.SGD(m, lr=0.1) for m in (pm.parameters(), ref.master.parameters(),
                                                  exact.parameters())]
    errors = dict.fromkeys(("loss", "gradient", "update", "loss_floor", "gradient_floor",
                            "update_floor", "gradient_global", "gradient_global_floor",
                            "update_global", "update_global_floor"), 0.0)

    def globally(key: str, got: dict, want: dict, exact: dict) -> None:
        diff = max(float((got[n] - want[n]).abs().max()) for n in want)
        floor = max(float((want[n] - exact[n]).abs().max()) for n in want)
        scale = max(float(want[n].abs().max()) for n in want)
        errors[key] = diff / max(scale, 1e-12)
        errors[key + "_floor"] = floor / max(scale, 1e-12)

    def worse(key: str, value: float) -> None:
        errors[key] = max(errors[key], value)

    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        losses = []
        for run in (lambda: pm.step(x, y), lambda: ref.step(loss_fn, x, y),
                    lambda: _backward(loss_fn(exact(x), y))):
            torch.manual_seed(100 + step)  # a model with dropout draws the same masks
            losses.append(run())
        loss, ref_loss, exact_loss = (float(v) for v in losses)
        # relative to the larger of the two references: a loss bfloat16 rounds to 0 (a
        # logsumexp minus an equal logit) is compared with the float32 loss's size
        scale = max(abs(ref_loss), abs(exact_loss), 1e-12)
        worse("loss", abs(loss - ref_loss) / scale)
        worse("loss_floor", abs(ref_loss - exact_loss) / scale)
        if step == 0:
            got, exact_grads = pm.full_grads(), dict(exact.named_parameters())
            for n, p in ref.master.named_parameters():
                worse("gradient", relative_error(got[n], p.grad))
                worse("gradient_floor", relative_error(p.grad, exact_grads[n].grad))
            zero = {n: torch.zeros_like(p) for n, p in ref.master.named_parameters()}
            want = {n: p.grad if p.grad is not None else zero[n]
                    for n, p in ref.master.named_parameters()}
            globally("gradient_global", got, want,
                     {n: p.grad if p.grad is not None else zero[n]
                      for n, p in exact_grads.items()})
        for opt in opts:
            opt.step()
    got, exact_params = pm.full_parameters(), dict(exact.named_parameters())
    for n, p in ref.master.named_parameters():
        assert got[n].dtype == torch.float32, (n, got[n].dtype)  # the master stays float32
        worse("update", relative_error(got[n] - start[n], p.detach() - start[n]))
        worse("update_floor", relative_error(p.detach() - start[n],
                                             exact_params[n].detach() - start[n]))
    ref_params = dict(ref.master.named_parameters())
    globally("update_global", {n: got[n] - start[n] for n in ref_params},
             {n: p.detach() - start[n] for n, p in ref_params.items()},
             {n: exact_params[n].detach() - start[n] for n in ref_params})
    return errors


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = float(want.detach().abs().max())
    diff = float((got.detach() - want.detach()).abs().max())
    return 0.0 if scale == 0.0 and diff == 0.0 else diff / max(scale, 1e-12)
