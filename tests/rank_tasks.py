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
from tests import models

RTOL, ATOL = 1e-4, 1e-5
_MESHES: dict = {}


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
        model = models.GPT(models.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                            n_embd=32))
    elif name == "hf_gpt2":
        model = models.hf_gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    elif name == "hf_llama":
        model = models.hf_llama(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                max_position_embeddings=16)
    elif name == "odd":  # batch 3, widths 5/6/7: only the hidden width 6 splits over 2 ranks
        return models.MLP([5, 6, 7]), torch.nn.functional.cross_entropy, (
            torch.randn(3, 5), torch.randint(0, 7, (3,)))
    elif name == "unsupported":  # aten.flip has no sharding rule
        return _Flipped(), torch.nn.functional.cross_entropy, (
            torch.randn(4, 8), torch.randint(0, 8, (4,)))
    else:
        raise ValueError(name)
    x = torch.randint(0, 64, (4, 16))
    y = torch.randint(0, 64, (4, 16))
    return model, models.lm_loss, (x, y)


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
                                   activation=cfg["activation"])
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["width"])
        return model, torch.nn.functional.mse_loss, (x, torch.randn_like(x))
    if family == "tiny":
        c = models.TinyConfig(**{k: v for k, v in cfg.items() if k not in ("batch", "seed")})
        x = torch.randint(0, c.vocab, (cfg["batch"], c.seq))
        return models.TinyTransformer(c), models.lm_loss, (x, torch.roll(x, -1, 1))
    raise ValueError(family)


def _check(what: str, got: dict, want: dict) -> None:
    for name in want:
        try:
            torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            raise AssertionError(f"{what} of {name} differs on rank {dist.get_rank()}:\n{e}") \
                from None


def check_training(pm, ref, loss_fn, x, y, steps: int) -> None:
    """Train the parallel model `pm` and the single-device `ref` side by side for `steps`
    AdamW steps: the loss of every step, the gradients of the first, the parameters after the
    last and the inference output must all be equal."""
    # eps 1e-5 rather than 1e-8: some parameters (attention key biases) have an exactly zero
    # true gradient, and AdamW with a tiny eps divides float noise by float noise, turning
    # reassociation differences of 1e-9 into parameter differences of lr.
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        loss = pm.step(x, y)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            _check("gradient", pm.full_grads(), {n: p.grad for n, p in ref_params.items()})
        opt.step()
        ref_opt.step()
    _check("parameter", pm.full_parameters(), {n: p.detach() for n, p in ref_params.items()})
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=RTOL, atol=ATOL)


def train_equivalence(name, mesh_shape: tuple, force=None, steps: int = 3,
                      plan: dict | None = None) -> dict | None:
    """Loss, gradients, parameters after `steps` AdamW steps, and the forward output, all equal
    to single-device training. Runs the solver's plan, or `plan` (as data) when given. Returns
    the plan as data (from rank 0)."""
    model, loss_fn, (x, y) = build(name)
    ref = copy.deepcopy(model)
    mesh = mesh_for(mesh_shape)
    pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, example_inputs=(x, y), force=force,
                             plan=autopar.Plan.from_dict(plan) if plan else None)
    check_training(pm, ref, loss_fn, x, y, steps)
    return pm.plan.to_dict() if dist.get_rank() == 0 else None


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
    _check("accumulated gradient", pm.full_grads(),
           {n: p.grad for n, p in ref.named_parameters()})
