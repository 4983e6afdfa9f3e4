"""Writes into activations in place, through views (`h[:, :4] *= 2`, `h[:, pad] = -inf`,
`h.narrow(...).mul_(3)`): made functional in the trace (passes/functionalize.py), so every
plan computes what one device computes; a write that cannot be made functional is refused
naming the model line."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.passes.functionalize import written_arg
from autopar.passes.trace import TraceError, trace
from tests import write_tasks


def _traced(model, x):
    return trace(model, (x,), F.mse_loss, torch.randn(x.shape[0], 16))


def test_no_write_into_an_activation_is_left_in_the_program():
    program = _traced(write_tasks.ActivationWrites(), torch.randn(8, 16))
    graph = program.graph_module.graph
    writes = [n for n in graph.nodes if written_arg(n) is not None]
    assert writes == [], [str(n.target) for n in writes]
    targets = {n.target for n in graph.nodes}
    assert torch.ops.aten.slice_scatter.default in targets
    assert torch.ops.aten.select_scatter.default in targets


def _program_output(model, x, y):
    """What the traced program of `model` (with an MSE loss) returns: (output, loss)."""
    program = trace(model, (x,), F.mse_loss, y)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    feeds = []
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in program.params:
            feeds.append(params[program.params[node.name]])
        elif node.name in program.buffers:
            key = program.buffers[node.name]
            feeds.append(program.constants[key] if key.startswith("constant:")
                         else buffers[key])
        else:
            feeds.append(x if node.name == program.inputs[0] else y)
    return program.graph_module(*feeds)


def test_the_traced_program_computes_what_the_model_computes():
    torch.manual_seed(0)
    model = write_tasks.ActivationWrites().double()
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randn(8, 16, dtype=torch.float64)
    out, loss = _program_output(model, x, y)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(loss, F.mse_loss(model(x), y))


class _Copies(nn.Module):
    """Writes into copies: a reshape of a transposed tensor (which copies), a dtype
    conversion; and an in-place sum whose other operand has a wider dtype (the result keeps
    the written tensor's dtype)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        flat = y.t().reshape(-1)  # a copy: y must not see the write
        flat[0] = 5.0
        z = y.to(torch.float32)
        z.mul_(2)
        h = self.b(x).to(torch.float32)
        h.add_(y)  # float32 += float64 stays float32
        return y + flat.view(16, -1).t() + z.double() + h.double()


def test_writes_into_copies_do_not_reach_the_original():
    torch.manual_seed(0)
    model = _Copies().double()
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randn(8, 16, dtype=torch.float64)
    out, _ = _program_output(model, x, y)
    torch.testing.assert_close(out, model(x))


class _DetachedWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        h.detach()[:, 0] = 0.0  # changes h's values, but not its gradient: no functional form
        return self.b(torch.relu(h))


def test_a_write_that_cannot_be_made_functional_is_refused():
    with pytest.raises(TraceError) as e:
        _traced(_DetachedWrite(), torch.randn(8, 16))
    message = str(e.value)
    assert "aten.detach.default" in message
    assert "test_activation_writes.py" in message and "h.detach()[:, 0] = 0.0" in message
    assert "out of place" in message


class _NoGradWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h[:, 0] = 0.0
        return self.b(h * 2)


def test_a_write_under_no_grad_is_refused():
    # one device lets the gradient through the written positions as if unwritten
    with pytest.raises(TraceError, match="inside torch.no_grad"):
        _traced(_NoGradWrite(), torch.randn(8, 16))


@pytest.mark.parametrize("force", ["data", "tensor", "fsdp"])
def test_activation_writes_train_as_on_one_device(world2, force):
    world2.run(write_tasks.train, (2,), force)


def test_activation_writes_train_on_two_dimensions(world4):
    world4.run(write_tasks.train, (2, 2), {"dp": "fsdp", "tp": "tensor"})
