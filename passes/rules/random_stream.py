"""Where the random ops of a rank's programs are in a step: the home of randomness's state.

`STREAM` is the one object the runtime writes and the lowered random ops read (the programs are
plain FX code, which cannot carry an object of its own to each op):

- `microbatch`: the microbatch of the step the programs run now (0 outside gradient
  accumulation and pipelines). A random op whose output carries the batch draws for the whole
  batch and keeps the rows of this microbatch (`shifted`).
- `key`: in the "counter" mode of randomness, the step's key, drawn once a step from the
  default generator of the inputs' device (`step`); each op's numbers are a function of it,
  of the op and of the element's index in the whole tensor (passes/rules/counter_rng.py).

The runtime (runtime/module.py, runtime/pipeline.py) sets them through `step` and
`at_microbatch`; a step that fails leaves them reset.
"""

from __future__ import annotations

import contextlib

import torch

from .counter_rng import op_key

__all__ = ["STREAM", "RandomStream", "draw_step_key"]


def draw_step_key(device: torch.device) -> int:
    """A step's key: 62 random bits from `device`'s default generator (every rank's generator
    is in one state, so every rank draws the same key)."""
    return int(torch.randint(0, 2**62, (1,), device=device).item())


class RandomStream:
    """The microbatch the programs run now and, in the counter mode, the step's key."""

    def __init__(self):
        self.microbatch = 0
        self.key: int | None = None

    @contextlib.contextmanager
    def step(self, device: torch.device, counter: bool):
        """Around one step (or inference call) of a program: `begin`, then (also on failure)
        `end`."""
        self.begin(device, counter)
        try:
            yield self
        finally:
            self.end()

    def begin(self, device: torch.device, counter: bool) -> None:
        """A step begins at microbatch 0; with `counter`, its key is drawn from `device`'s
        default generator."""
        self.key = draw_step_key(device) if counter else None
        self.microbatch = 0

    def end(self) -> None:
        """A step ended: microbatch 0, no key."""
        self.key, self.microbatch = None, 0

    def at_microbatch(self, i: int) -> None:
        """The programs run the step's microbatch `i` next."""
        self.microbatch = i

    @contextlib.contextmanager
    def again_at(self, microbatch: int):
        """Around ops run again in backward (recomputed): they draw for `microbatch`, the one
        they ran for in forward, whatever the schedule runs now (a pipeline runs other
        microbatches' forwards between one's forward and backward)."""
        now, self.microbatch = self.microbatch, microbatch
        try:
            yield
        finally:
            self.microbatch = now

    def op_key(self, name: str, stream: int = 0) -> int:
        """The key of the op named `name` in the traced program, this step."""
        if self.key is None:
            raise RuntimeError(
                f"random op {name} of a program in the counter mode of randomness ran outside "
                "a step: run the program through its autopar module (the step draws the key)")
        return op_key(self.key, name, stream)

    def shifted(self, block: tuple[tuple[int, int], ...], shift: tuple[int, int] | None
                ) -> tuple[tuple[int, int], ...]:
        """`block` within the whole batch's draw: `shift` (dimension, rows of a microbatch)
        moves it, on that dimension, past the rows of the microbatches before this one."""
        if shift is None:
            return block
        d, rows = shift
        return tuple((start + self.microbatch * rows, n) if k == d else (start, n)
                     for k, (start, n) in enumerate(block))


STREAM = RandomStream()
