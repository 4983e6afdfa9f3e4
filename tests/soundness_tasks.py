"""Models whose forward does what torch.export would lose (tests/test_soundness.py), and the
tasks the gloo ranks run with them (module level, so that ranks import them)."""

from __future__ import annotations

import copy
import queue
import random
import threading

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import grad

import autopar
from tests.rank_tasks import check_training, mesh_for

# -- a straight-through estimator, as torch.library.custom_op (what autopar runs exactly) ----


@torch.library.custom_op("autopar_tests::quantize_ste", mutates_args=())
def quantize_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to quarters; the gradient passes straight through."""
    return torch.round(x * 4) / 4


@quantize_ste.register_fake
def _(x):
    return torch.empty_like(x)


quantize_ste.register_autograd(lambda ctx, g: g)


class CustomOpSTE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(quantize_ste(torch.tanh(self.fc1(x))))


# -- the same estimator as a custom autograd.Function (kept as one op, its backward run) -------


class STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class FunctionSTE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(STE.apply(torch.tanh(self.fc1(x))))


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class GradientReversal(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.head(_Reverse.apply(self.fc(x)))


class _ScaledGrad(torch.autograd.Function):
    """Forward keeps what backward needs on its context: a saved tensor, an attribute, and a
    non-tensor argument; two outputs."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * 2, torch.sin(x)

    @staticmethod
    def backward(ctx, g_double, g_sin):
        x, = ctx.saved_tensors
        return ctx.scale * g_double + torch.cos(x) * g_sin, None


class SavedContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        a, b = _ScaledGrad.apply(self.fc1(x), 0.25)
        return self.fc2(a + b)


def _local_function_model() -> nn.Module:
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x * 4) / 4

        @staticmethod
        def backward(ctx, g):
            return g

    class LocalSTE(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return Local.apply(self.fc(x))

    return LocalSTE()


LocalFunction = _local_function_model


class _NoisySTE(torch.autograd.Function):
    """A stochastic straight-through estimator: its forward draws."""

    @staticmethod
    def forward(ctx, x):
        return torch.bernoulli(torch.sigmoid(x))

    @staticmethod
    def backward(ctx, g):
        return g


class _Doubles(torch.autograd.Function):
    """Writes into its input (mark_dirty)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class FunctionThat(nn.Module):
    """Calls a Function that cannot be kept as one op: one that draws, or writes its input."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.fn = {"draws": _NoisySTE, "dirty": _Doubles}[kind]

    def forward(self, x):
        return self.fc2(self.fn.apply(self.fc1(x) * 1.0))


# -- Python randomness (refused) ---------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        self.fc, self.p = nn.Linear(16, 16), p

    def forward(self, x):
        if self.training and random.random() < self.p:  # LayerDrop
            return x
        return x + torch.relu(self.fc(x))


class LayerDrop(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(layers))
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Mixup(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        lam = float(np.random.beta(0.4, 0.4))
        return self.fc(lam * x + (1 - lam) * x.flip(0))


class HeldGenerator(nn.Module):
    """Draws from a generator it holds: `random.Random` or a numpy Generator."""

    def __init__(self, numpy: bool):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.rng = np.random.default_rng(0) if numpy else random.Random(0)

    def forward(self, x):
        return self.fc(x) * self.rng.random()


class TorchGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        h = self.fc(x)
        return h + 0.1 * torch.rand(h.shape, generator=self.gen)


class Reseeds(nn.Module):
    """Reseeds torch's generator in forward: to 1234, to the seed the loop set (the same
    initial seed: only the call shows it), or by restoring a saved state."""

    def __init__(self, how: str = "manual_seed"):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.how = how

    def forward(self, x):
        if self.how == "manual_seed":
            torch.manual_seed(1234)
        elif self.how == "same_seed":
            torch.manual_seed(torch.initial_seed())
        else:
            torch.set_rng_state(torch.get_rng_state())
        return F.dropout(self.fc(x), 0.5)


# -- autograd inside forward (refused) ---------------------------------------------------------


class TensorHook(nn.Module):
    def __init__(self, post_accumulate: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.post_accumulate = post_accumulate

    def forward(self, x):
        h = self.fc1(x)
        if self.post_accumulate:
            self.fc1.weight.register_post_accumulate_grad_hook(lambda p: None)
        else:
            h.register_hook(lambda g: g * 0.1)
        return self.fc2(h)


class GradientPenalty(nn.Module):
    """A penalty on the gradient of the output's norm (through `grad` imported by name), or
    a `.backward()` in forward."""

    def __init__(self, backward: bool = False):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.backward_in_forward = backward

    def forward(self, x):
        h = self.fc(x)
        if self.backward_in_forward:
            h.pow(2).sum().backward(retain_graph=True)
            return h
        (g,) = grad(h.pow(2).sum(), self.fc.weight, create_graph=True)
        return h + g.pow(2).sum()


THREAD_GRADS: queue.Queue = queue.Queue()  # what BackwardInAnotherThread's thread computed


class BackwardInAnotherThread(nn.Module):
    """Forward waits for another thread that runs a backward pass of its own (the gate
    refuses only the tracing thread's)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        def train():
            w = torch.ones(3, requires_grad=True)
            (w * 2).sum().backward()
            THREAD_GRADS.put(w.grad)

        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
        return self.fc(x)


# -- global state written in forward (refused) -------------------------------------------------

CALLS = 0
SEEN_SHAPES: list = []


class CountsGlobally(nn.Module):
    def __init__(self, log: bool = False):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.log = log

    def forward(self, x):
        global CALLS
        if self.log:
            SEEN_SHAPES.append(tuple(x.shape))
        else:
            CALLS += 1
        return self.fc(x)


def counting_loss(out, target):
    global CALLS
    CALLS += 1
    return F.cross_entropy(out, target)


# -- captured (exact) --------------------------------------------------------------------------


class NoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.gate, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            g = torch.sigmoid(self.gate(h))
            with torch.enable_grad():
                g = g * 2
        return self.fc2(h * g)


class ItemBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.mean().item() > 0:
            return h * 2
        return h


# -- tasks for gloo ranks ----------------------------------------------------------------------


def _batch():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randint(0, 8, (8,))


def custom_op_trains_exactly(force: str, kind: str = "custom_op") -> None:
    """The custom_op straight-through estimator (or a custom autograd.Function: `kind`)
    under plan `force` trains as one device (float64: loss, gradients, parameters after 3
    steps, inference output)."""
    x, y = _batch()
    model = {"custom_op": CustomOpSTE, "function": FunctionSTE, "reversal": GradientReversal,
             "context": SavedContext}[kind]().double()
    x = x.double()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh_for((2,)), loss_fn=F.cross_entropy,
                             example_inputs=(x, y), force=force)
    check_training(pm, ref, F.cross_entropy, x, y, steps=3)


def refused_at_step(kind: str) -> str:
    """parallelize (no example: traced at the first step) then step: the "Type: message" of
    what this rank raised."""
    x, y = _batch()
    model = {"function": LocalFunction, "layer_drop": LayerDrop}[kind]()
    try:
        pm = autopar.parallelize(model, mesh_for((2,)), loss_fn=F.cross_entropy)
        pm.step(x, y)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e}"
    return f"no error on rank {dist.get_rank()}"
