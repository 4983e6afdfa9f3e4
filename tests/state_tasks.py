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


class PeakSampler:
    """The highest `heap_bytes()` seen while it runs (a thread reading it every ~0.5 ms), and
    the process's peak resident set (VmHWM, reset at start where Linux allows)."""

    def __init__(self):
        import threading

        from tests.cost_tasks import heap_bytes
        self._read, self.peak = heap_bytes, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read() or 0)
            time.sleep(0.0005)

    def __enter__(self) -> PeakSampler:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
        except OSError:
            pass
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read() or 0)

    @staticmethod
    def resident(field: str = "VmRSS") -> int:
        """Bytes of this process's `field` from /proc/self/status (VmRSS, VmHWM)."""
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {field} in /proc/self/status")


def mmap_large_blocks(threshold: int = 1 << 20) -> None:
    """Have glibc malloc map every block of at least `threshold` bytes on its own and unmap it
    when freed (M_MMAP_THRESHOLD, fixed): large tensors then leave the resident set when they
    are freed, rather than staying as free heap (glibc's default raises the threshold as
    large blocks are freed, up to 32 MiB, so a training step's 25 MiB buckets come to live in
    the heap and its fragments), so the resident set follows the live tensors."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def train_beyond_one_rank(width: int, depth: int, batch: int, steps: int = 3,
                          share: float = 1 / 3, bucket_bytes: int = 25 * 2**20,
                          margin: float = 0.95) -> dict:
    """An MLP of `depth` layers of `width` built on the meta device, whose whole fp32 training
    state (parameters, gradients, AdamW's two states: 16 bytes a parameter) is 1/`share` times
    the memory cap of each rank, planned with FSDP on the world within `margin` of the cap
    (collectives in buckets of `bucket_bytes`) and trained `steps` AdamW steps. Returns this
    rank's figures: the cap, the plan's predicted peak and split, and the peak measured over
    the training steps, as the malloc heap (`heap`) and as the resident set (`rss`, with large
    blocks mapped on their own: `mmap_large_blocks`), each above its level after the build
    plus the bytes of this rank's parameter shards (which the build allocated): what the
    training state needs, without the planner's own Python objects."""
    from tests.cost_tasks import heap_bytes
    from tests.models import MLP

    mmap_large_blocks()
    with torch.device("meta"):
        model = MLP([width] * (depth + 1), activation="relu")
    numel = sum(p.numel() for p in model.parameters())
    cap = 16 * numel * share
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, width, (batch,), generator=g)
    torch.manual_seed(0)
    pm = autopar.parallelize(model, mesh_for((dist.get_world_size(),)),
                             loss_fn=nn.functional.cross_entropy, example_inputs=(x, y),
                             force="fsdp", memory_budget=margin * cap, bucket_bytes=bucket_bytes)
    del model
    shards = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = []
    heap0, rss0 = heap_bytes(), PeakSampler.resident()
    with PeakSampler() as peak:
        for _ in range(steps):
            opt.zero_grad()
            losses.append(float(pm.step(x, y)))
            opt.step()
    return {"cap": cap, "whole_state": 16 * numel, "predicted": pm.plan.cost.peak_memory,
            "split": dict(pm.plan.cost.memory), "heap": peak.peak - heap0 + shards,
            "rss": PeakSampler.resident("VmHWM") - rss0 + shards, "losses": losses,
            "freed": len(pm.plan.resharded), "parameters": len(pm.plan.parameters)}
