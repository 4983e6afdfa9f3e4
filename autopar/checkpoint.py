"""Checkpoints of a parallelized model and its optimizer, through torch.distributed.checkpoint.

    autopar.checkpoint.save("ckpt/step-100", pmodel, optimizer, extra={"step": 100})
    extra = autopar.checkpoint.load("ckpt/step-100", pmodel, optimizer)

The state is the model's own (`torch.distributed.checkpoint.state_dict.get_state_dict`: the
model's parameter names, DTensor shards with the plan's placements, the optimizer's state by
parameter name), so every rank writes only its shards, in parallel, and a checkpoint saved
under one plan and mesh loads under another (DCP reshards DTensors to whatever placements the
loading plan has). Loading checks the checkpoint against the model first (names, shapes,
dtypes) and raises on every rank, naming the tensors, before anything is read. Saving writes
into a new folder and moves it into place only once every rank has written its part, so a
failed save leaves the previous checkpoint as it was. The path must be on a filesystem every
rank sees (as DCP's FileSystemWriter needs).
"""

from __future__ import annotations

import os
import shutil
import uuid

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autopar.runtime.control import RankError, agreed

from .originals import parallelized_of
from .parallelized import Parallelized

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model (or cannot be written); raised on every
    rank."""


def _state(model: Parallelized, optimizer) -> dict:
    if optimizer is None:
        return {"model": model.state_dict()}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save(path: str, model: Parallelized, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None) -> None:
    """Write the model's (and the optimizer's) state to the folder `path`, every rank its
    shards (a collective). `extra` holds small picklable values (the step, the data loader's
    position) returned by `load`. `model` is the parallelized model, or the model passed to
    parallelize (which became it)."""
    model = parallelized_of(model)
    control = model.control
    token = control.broadcast_object(uuid.uuid4().hex[:12] if control.rank == 0 else None)
    partial = f"{path}.partial-{token}"
    state = _state(model, optimizer)
    state["extra"] = dict(extra or {})
    error = None
    try:
        dcp.save(state, checkpoint_id=partial)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn
        error = f"{type(e).__name__}: {_first_lines(e)}"
    try:
        control.exchange(f"saving the checkpoint {path}", error, [])
    except RankError:
        if control.rank == 0:  # nothing written half-way stays behind
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if control.rank == 0:
        old = f"{path}.old-{token}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    control.exchange(f"saving the checkpoint {path}", None, [])


def load(path: str, model: Parallelized, optimizer: torch.optim.Optimizer | None = None
         ) -> dict:
    """Load the state `save` wrote into the model (and the optimizer) in place, whatever plan
    and mesh it was saved under; returns the `extra` values saved with it. A checkpoint of
    another model (missing or extra names, other shapes or dtypes) raises CheckpointError on
    every rank, naming the tensors, before anything is loaded."""
    model = parallelized_of(model)
    state = _state(model, optimizer)
    error = None
    try:  # (a pp rank's state holds its stages' tensors; the model's names are every stage's)
        stored = check(path, state["model"], set(model.model_state_names()))
    except (CheckpointError, OSError, ValueError) as e:
        error = str(e)
    model.control.exchange(f"loading the checkpoint {path}", error, [])
    state["extra"] = {k.removeprefix("extra."): None for k in stored if k.startswith("extra.")}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # DCP raised it on every rank
        raise agreed(CheckpointError(f"loading the checkpoint {path} failed: "
                                     f"{_first_lines(e)}")) from e
    if optimizer is not None:  # the model's tensors were loaded in place
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return state["extra"]


def check(path: str, model_state: dict, model_names: set[str] | None = None) -> dict:
    """Raise CheckpointError unless the checkpoint at `path` holds every tensor of
    `model_state` (this rank's state dict) under the same name, global shape and dtype, and
    no tensor outside `model_names` (the whole model's state names, every rank's together:
    a pipeline stage's rank holds its own; default: those of `model_state`); returns what the
    checkpoint holds (DCP's metadata by key)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}")
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): v for k, v in stored.items() if k.startswith("model.")
             and isinstance(v, TensorStorageMetadata)}
    want = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    problems = []
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - (set(want) if model_names is None else set(model_names)))
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the model: {_names(extra)}")
    for name in sorted(set(want) & set(saved)):
        t, meta = want[name], saved[name]
        if tuple(meta.size) != tuple(t.shape):
            problems.append(f"{name}: shape {tuple(meta.size)} in the checkpoint, "
                            f"{tuple(t.shape)} in the model")
        elif meta.properties.dtype != t.dtype:
            problems.append(f"{name}: {meta.properties.dtype} in the checkpoint, {t.dtype} in "
                            "the model (convert the model, or the checkpoint, first)")
    if problems:
        raise CheckpointError(f"the checkpoint at {path} does not match the model:\n  " +
                              "\n  ".join(problems))
    return stored


def _first_lines(error: BaseException) -> str:
    """What DCP's error says, without its tracebacks (their last lines name the cause)."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    causes = [ln.strip() for ln in lines if not ln.startswith((" ", "Traceback"))]
    return "; ".join(dict.fromkeys(causes[-3:] or lines[:1]))


def _names(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
