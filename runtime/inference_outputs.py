"""The outputs of a parallelized model's inference call, made safe to differentiate by mistake.

`pmodel(*inputs)` runs the programs without autograd; its parameters get gradients only from
`pmodel.step(...)`. The training loop of DistributedDataParallel (`loss_fn(model(x),
y).backward()`) would then fail with torch's "does not require grad", or, when the loss also
adds a term that reaches the parameters directly (a weight penalty over
`pmodel.parameters()`), run and train on that term alone: a wrong step, silently. So while
autograd records (as on one device, where such an output requires grad), each floating-point
output is returned through `InferenceOnly`, whose backward raises, naming what to call instead.
"""

from __future__ import annotations

import torch

from autopar.passes.torch_compat import tree_map

BACKWARD_ERROR = (
    "backward reached the output of an inference call of a parallelized model "
    "(pmodel(...)): autopar computes gradients only in pmodel.step(*inputs, target) (with "
    "parallelize(..., loss_fn=...)) or pmodel.step(**batch) for a model that returns its loss, "
    "so the parameters would get no gradient through this output. Train with pmodel.step(...) "
    "instead of calling backward on a loss of pmodel(...)'s output; wrap inference in "
    "torch.no_grad() to return plain tensors")


class InferenceOnly(torch.autograd.Function):
    """Identity on `tensor` in forward (a view: no copy); backward raises `BACKWARD_ERROR`.
    `anchor`, a leaf that requires grad, makes autograd record the call (the programs'
    outputs require none)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The tensor itself, as a view autograd can record."""
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Refuses: no gradient flows into a parallelized model through inference."""
        raise RuntimeError(BACKWARD_ERROR)


def guard_outputs(outputs, trainable: bool):
    """`outputs` (any pytree of tensors) with each floating-point tensor returned through
    `InferenceOnly` when autograd is recording and the model has parameters that train;
    unchanged otherwise (under torch.no_grad() or torch.inference_mode())."""
    if not (trainable and torch.is_grad_enabled()):
        return outputs

    anchor = torch.zeros((), requires_grad=True)

    def guard(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() \
                and not value.requires_grad:
            return InferenceOnly.apply(value, anchor)
        return value

    return tree_map(guard, outputs)
