"""The default random generator of a device, saved and restored around programs that must draw
what one device running the whole batch draws (passes/rules/random.py)."""

from __future__ import annotations

import torch


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of `device`'s default generator."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    """Put `device`'s default generator in `state`."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
