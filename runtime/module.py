"""ParallelModule: runs one plan's local programs on one rank.

It feeds the local programs this rank's parameter shards (the leaves of a `ParameterStore`),
constants and inputs, seeds the backward pass according to where the loss lives, and has the
gradients of replicated parameters synchronized. Several ParallelModules (one per traced
program: train and eval mode, input shapes) share one store and one gradient synchronization.
"""

from __future__ import annotations

import contextlib

import torch

from autopar.passes.emitted import META_KEY
from autopar.passes.rewrite import LocalPrograms
from autopar.passes.rules.random_stream import STREAM
from autopar.passes.torch_compat import tree_unflatten

from .collectives import MeshComm
from .generator import generator_state, set_generator_state
from .grad_sync import GradSync, PendingSum
from .loss import loss_seeding
from .params import ParameterStore
from .regather import resharding


def placeholders(gm: torch.fx.GraphModule) -> list[str]:
    """The names of a program's inputs, in call order, as the traced program names them
    (the rewrite records each one's origin: FX renames a placeholder whose name is a Python
    builtin, such as nn.Sequential's `input`)."""
    return [getattr(n.meta.get(META_KEY), "origin", None) or n.name
            for n in gm.graph.nodes if n.op == "placeholder"]


class ParallelModule:
    """One plan's programs on one rank: `step(tensors)` trains, `infer(tensors)` infers."""

    def __init__(self, plan, programs: LocalPrograms, param_of: dict[str, str],
                 store: ParameterStore, constants: dict[str, torch.Tensor],
                 input_names: list[str], comm: MeshComm, grad_sync: GradSync | None, out_spec,
                 compute_dtype: torch.dtype | None = None, target: str | None = None):
        """`param_of` maps the programs' parameter placeholders to parameter names,
        `constants` their constant placeholders to tensors, `input_names` are the user-input
        placeholders in the order calls pass tensors (see autopar.inputs.Call.tensors), and
        `target` the one among them a training call passes the target in (an inference call
        passes none)."""
        self.plan = plan
        self._programs = programs
        self._param_of = param_of
        self._store = store
        self._constants = constants
        self._input_names = input_names
        self._target = target
        self._inference_names = [n for n in input_names if n != target]
        self._comm = comm
        self._grad_sync = grad_sync
        self._out_spec = out_spec
        self._compute_dtype = compute_dtype  # mixed precision: programs compute in it
        self._train_inputs = placeholders(programs.train) if programs.train is not None else []
        self._infer_inputs = placeholders(programs.infer)
        self._loss = loss_seeding(programs.loss_placement, plan.mesh.shape)
        # counter randomness: a step draws its key (passes/rules/random_stream.py)
        self._counter = plan.randomness == "counter"

    @property
    def trains(self) -> bool:
        """Whether this program computes a loss (step() can run it)."""
        return self._programs.train is not None

    def _feed(self, names: list[str], tensors: list[torch.Tensor], inference: bool = False
              ) -> list:
        given = dict(zip(self._inference_names if inference else self._input_names, tensors))
        args = []
        for name in names:
            if name in self._param_of:
                args.append(self._store.compute(self._param_of[name], self._compute_dtype))
            elif name in self._constants:
                args.append(self._constants[name])
            elif inference and name == self._target:
                args.append(None)  # a training program's target: its inference never reads it
            else:
                args.append(given[name])
        return args

    def step(self, microbatches: list[list[torch.Tensor]], weights: list[float]
             ) -> torch.Tensor:
        """Forward and backward of each microbatch (gradient accumulation when there are
        several: the gradients add up locally and are synchronized once, overlapped with the
        last microbatch's backward); returns the loss (the same on every rank): the sum of
        the microbatches' losses, each times its weight (`weights`, passes/loss_weights.py:
        the whole batch's loss). Gradients of the local shards are complete when this
        returns."""
        self._store.refresh()  # ZeRO shards stepped since the last program ran
        self._store.pull_grads()
        m = len(microbatches)
        device = _device(microbatches[0])
        # Eager randomness: each microbatch draws what the whole batch draws and keeps its
        # rows (random ops, passes/rules/random.py): from where the step started, leaving the
        # generator where one device's whole batch leaves it. Counter randomness: one key a
        # step, whatever the microbatches.
        rng = _Generator(device) if m > 1 and not self._counter else None
        start = rng.start if rng is not None else \
            generator_state(device) if self._counter else None
        try:
            with STREAM.step(device, self._counter):
                return self._step(microbatches, weights, rng)
        except BaseException:
            if start is not None:  # a failed step leaves the generator where it began
                set_generator_state(device, start)
            raise

    def _step(self, microbatches, weights, rng) -> torch.Tensor:
        m = len(microbatches)
        total = None
        for i, tensors in enumerate(microbatches):
            STREAM.at_microbatch(i)
            if rng is not None:
                rng.at_microbatch(i)
            # FSDP parameters the plan reshards after forward are gathered again in backward
            with resharding(self._comm) if self.plan.resharded else contextlib.nullcontext():
                (loss,) = self._programs.train(*self._feed(self._train_inputs, tensors))
            # (exact for one microbatch: times 1.0). A microbatch of weight 0 (all its
            # targets ignored: its mean is 0 / 0) adds nothing, as in the whole batch's mean.
            part = loss.detach() * weights[i] if weights[i] else torch.zeros_like(loss.detach())
            total = part if total is None else total + part
            last = i == m - 1
            # the loss value is summed for reporting while the last backward runs (in a
            # gradient bucket)
            report = PendingSum(total, self._comm.groups,
                                self._loss.pending_dims) if last else None
            if i == 0:
                self._grad_sync.begin(report, hold=not last)
            elif last:
                self._grad_sync.release(report)
            loss.backward(torch.full_like(loss, self._loss.seed * weights[i]))
            if not last:
                self._grad_sync.microbatch_done()
        if rng is not None:
            rng.finish()
        self._grad_sync.finish()
        self._store.push_grads()
        return report.wait()

    def infer(self, tensors: list[torch.Tensor]):
        """Inference: returns what the original model returns, whole. Runs without autograd;
        train through `step`, which seeds the backward pass correctly."""
        self._store.refresh()
        with torch.no_grad(), STREAM.step(_device(tensors), self._counter):
            flat = self._programs.infer(*self._feed(self._infer_inputs, tensors, True))
        return tree_unflatten(list(flat), self._out_spec)


def _device(tensors: list) -> torch.device:
    """The device of a call's first tensor (whose default generator random ops draw from)."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)),
                torch.device("cpu"))


class _Generator:
    """The default generator of a step's device across its microbatches: each starts where
    the step did (`at_microbatch`), and after the last it is where the first left it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = generator_state(self.device)
        self.end = None

    def at_microbatch(self, i: int) -> None:
        """Before microbatch i's forward: the generator where the step started (where the
        first microbatch left it is kept for `finish`; a recomputation in its backward
        restores the generator itself)."""
        if i == 1:
            self.end = generator_state(self.device)
        if i:
            set_generator_state(self.device, self.start)

    def finish(self) -> None:
        """After the last microbatch: the generator where one device's whole batch leaves it."""
        set_generator_state(self.device, self.end)
