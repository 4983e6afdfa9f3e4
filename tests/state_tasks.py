"""What the gloo ranks run for tests/test_sharded_state.py: models built on the meta device,
initialized shard by shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar import zoo
from tests.models import ScaledLinear
from tests.rank_tasks import check_equal, check_training, mesh_for

CONFIG = zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _init_fn(model: zoo.GPT):
    """The GPT's own per-module init (norms keep theirs)."""
    def init(module):
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        else:
            model._init_weights(module)
    return init


def module_by_module(model: zoo.GPT, init) -> None:
    """Single-device reference of what parallelize does to a meta model: materialize it and
    initialize module by module, in `model.modules()` order, each parameter once."""
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty unties; the GPT ties them
    seen = set()
    for module in model.modules():
        own = [id(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]]
        if own and not set(own) <= seen:
            init(module)
        seen.update(own)


def meta_init(mesh_shape, force, seed: int = 123) -> dict:
    """A GPT built on the meta device and parallelized: each rank initializes only its blocks,
    and the model equals the single-device model initialized module by module from the same
    random state (exactly), then trains like it. Returns this rank's local parameter bytes and
    the whole model's."""
    with torch.device("meta"):
        model = zoo.GPT(CONFIG).double()
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    torch.manual_seed(seed)
    pm = autopar.parallelize(model, mesh_for(mesh_shape), loss_fn=zoo.lm_loss,
                             example_inputs=(x, y), force=force, init_fn=_init_fn(model))
    with torch.device("meta"):
        ref = zoo.GPT(CONFIG).double()
    torch.manual_seed(seed)
    module_by_module(ref, _init_fn(ref))
    check_equal("initialized parameter", pm.full_parameters(), dict(ref.named_parameters()))
    local = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    whole = sum(p.numel() * p.element_size() for p in ref.parameters())
    check_training(pm, ref, zoo.lm_loss, x, y, 2)
    return {"local": local, "whole": whole}


def bad_meta_init(kind: str) -> str:
    """A meta model that cannot be initialized; returns "Type: message" of what was raised."""
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    mesh = mesh_for((dist.get_world_size(),))
    try:
        with torch.device("meta"):
            model = ScaledLinear()
        if kind == "no_init":
            autopar.parallelize(model, mesh, loss_fn=nn.functional.cross_entropy,
                                example_inputs=(x, y))
        elif kind == "init_leaves_meta":
            def init(m):
                if isinstance(m, nn.Linear):
                    m.weight = nn.Parameter(torch.empty(8, 16, device="meta"))
                    nn.init.zeros_(m.bias)
                else:
                    nn.init.ones_(m.scale)
            autopar.parallelize(model, mesh, loss_fn=nn.functional.cross_entropy,
                                example_inputs=(x, y), init_fn=init)
        elif kind == "init_misses_a_tensor":
            autopar.parallelize(model, mesh, loss_fn=nn.functional.cross_entropy,
                                example_inputs=(x, y),
                                init_fn=lambda m: m.reset_parameters()
                                if isinstance(m, nn.Linear) else None)
        else:
            raise ValueError(kind)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"
