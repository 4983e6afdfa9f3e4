"""When sharding an image's rows pays: ResNet-18 planned for few, large images on H100 meshes.

    python -m benchmarks.spatial_plans

For each (images, resolution, mesh), the free plan against, in the same run, the free plan
without spatial shards (the convolution and pooling rules' strategies that split an image's
rows or columns left out: what the planner had before them) and the forced `tensor` style
(output channels with the filters). Printed: each predicted step, the ratio of the plan
without spatial shards to the free plan, and how the free plan splits its convolutions'
inputs (S(2) / S(3): the image's rows / columns, with halo exchanges; S(0): the batch).
Planning only (meta device, no processes); a markdown table.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import torch
import torch.nn.functional as F

import autopar
from autopar.passes.rules import registry
from autopar.passes.rules.registry import Shard
from tests.models import ResNet

CASES = [(1, 1024, (4,)), (1, 1024, (2, 2)), (2, 512, (4,)), (2, 512, (8,)), (8, 224, (8,)),
         (64, 224, (4,))]


def step_ms(model, example, mesh: tuple, force) -> tuple[float | None, autopar.Plan | None]:
    """The predicted step (ms) and the plan, or (None, None) where the style cannot plan."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = autopar.plan(model, autopar.MeshSpec(mesh, hardware="h100"), example,
                                loss_fn=F.cross_entropy, force=force)
        except (ValueError, autopar.NoFeasiblePlan):
            return None, None
    return plan.cost.step_time * 1e3, plan


@contextlib.contextmanager
def without_spatial_shards():
    """The convolution and pooling rules without their strategies that shard an input's
    spatial dimension (any dimension after the channels)."""
    ops = [op for op in registry.RULES if "conv" in str(op) or "pool" in str(op)]
    saved = {op: registry.RULES[op] for op in ops}

    def drop(rule_fn):
        def rules(call):
            first = 2 if call.inputs[0].ndim > 2 else 1
            return [r for r in rule_fn(call) if not (isinstance(r.inputs[0], Shard)
                                                     and r.inputs[0].dim >= first)]
        return rules

    registry.RULES.update({op: drop(fn) for op, fn in saved.items()})
    try:
        yield
    finally:
        registry.RULES.update(saved)


def main() -> None:
    with torch.device("meta"):
        model = ResNet(width=64, blocks=(2, 2, 2, 2), classes=1000)
    print("| images x resolution | mesh | free ms | without spatial shards ms | tensor ms | "
          "without / free | free plan's convolution inputs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for images, size, mesh in CASES:
        example = (torch.empty(images, 3, size, size, device="meta"),
                   torch.zeros(images, dtype=torch.long, device="meta"))
        free, plan = step_ms(model, example, mesh, None)
        with without_spatial_shards():
            before = step_ms(model, example, mesh, None)[0]
        tensor = step_ms(model, example, mesh, "tensor")[0]
        convs = Counter(o.inputs[0] for o in plan.ops if o.op.startswith("conv"))
        shown = ", ".join(f"{p} x{n}" for p, n in convs.most_common())
        cells = [f"{t:.2f}" if t is not None else "does not plan" for t in (free, before, tensor)]
        print(f"| {images} x {size}^2 | {mesh} | {' | '.join(cells)} | {before / free:.2f} | "
              f"{shown} |", flush=True)


if __name__ == "__main__":
    main()
