"""What the pieces that build a parallelized model receive, in place of one class's shared
fields: the rank's setting, fixed at parallelize (`RankSetting`), and the model's build state
(`BuildContext`: its traced copy, what follows the user's model, and, once placed, this rank's
parameters). Building a rank's programs (autopar/programs.py), placing parameters
(autopar/placing.py) and building a pipeline (autopar/pipeline.py) take a BuildContext; the
model users hold (autopar/parallelized.py) keeps one and passes itself (the module tree whose
modes and attributes the programs are traced with) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from autopar.runtime.collectives import MeshComm
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.params import ParameterStore

from .agreements import Agreements
from .guards import ValueGuards
from .mesh import MeshSpec
from .options import PlanOptions
from .originals import Original
from .plan import Plan


@dataclass(frozen=True)
class RankSetting:
    """What every build of one parallelized model reads on this rank, fixed at parallelize:
    the mesh (its spec, the DeviceMesh, this rank's coordinates and collectives), the options,
    the loss function, the plan passed to parallelize (used at the first build), the
    initialization function of a meta model, the compute dtype (mixed precision), the device
    and the control plane's agreements."""

    spec: MeshSpec
    options: PlanOptions
    loss_fn: Callable | None
    given_plan: Plan | None
    init_fn: Callable | None
    compute_dtype: torch.dtype | None
    device: torch.device
    mesh: object  # the torch DeviceMesh
    coords: tuple[int, ...]
    comm: MeshComm
    agree: Agreements


@dataclass
class BuildContext:
    """One parallelized model's build state on this rank: its `setting`; `meta`, the copy of
    the model the programs are traced from; `original`, the user's model followed (its modes,
    attributes and tensors: autopar/originals.py); `guards`, the values the traces read
    (autopar/guards.py); `aliases`, each parameter's tied names; `source`, the user's model
    until its parameters are placed (None after); once placed, `store` (this rank's shards),
    `grad_sync` (None under a pipeline, which syncs its own) and `buffers`, the whole buffers
    the programs read, by name; `last_plan`, the plan that ran (or was built) last."""

    setting: RankSetting
    meta: nn.Module
    original: Original
    aliases: dict[str, list[str]]
    source: nn.Module | None
    guards: ValueGuards
    store: ParameterStore | None = None
    grad_sync: GradSync | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    last_plan: Plan | None = None
