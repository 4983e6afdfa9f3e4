"""Recurrent layers: nn.GRU, nn.LSTM and nn.RNN export as one ATen op each (input, hidden
state(s), the weights as a list, then has_biases, num_layers, dropout, train, bidirectional,
batch_first). Each sample runs its own recurrence, so the batch may be sharded (the input's
dimension 0 with batch_first, else 1; the hidden states' dimension 1) with the weights whole;
the time and feature dimensions stay whole. Dropout between layers in training draws random
numbers inside the op, in an order sharding would change: then it runs whole."""

from __future__ import annotations

from .registry import SAVES_INPUTS, OpCall, R, Rule1D, Shard, aten, facts, register, replicate_all

_GATES = {aten.gru.input: 3, aten.lstm.input: 4, aten.rnn_tanh.input: 1, aten.rnn_relu.input: 1}


def _states(call: OpCall) -> int:
    return 2 if call.target == aten.lstm.input else 1


def _flops(call: OpCall, in_local, out_local) -> float:
    """Two products per gate, layer, direction and step: 2 x batch x steps x gates x hidden x
    (layer input + hidden)."""
    x, h = in_local[0], in_local[1]
    if len(x) != 3:
        return 0.0
    batch_first = bool(call.arg(8, "batch_first", False))
    steps, batch = (x[1], x[0]) if batch_first else (x[0], x[1])
    layers, hidden = int(call.arg(4, "num_layers", 1)), h[-1]
    directions = 2 if call.arg(7, "bidirectional", False) else 1
    inner = x[2] + hidden + (layers - 1) * (hidden * directions + hidden)
    return 2.0 * batch * steps * _GATES[call.target] * hidden * inner * directions


facts(*_GATES, flops=_flops, backward_factor=2.0, saves=SAVES_INPUTS, saves_output=True)


@register(*_GATES)
def recurrent(call: OpCall) -> list[Rule1D]:
    whole = replicate_all(call)
    if call.inputs[0].ndim != 3 or (call.arg(5, "dropout", 0.0) and call.arg(6, "train", False)):
        return whole
    batch = Shard(0 if call.arg(8, "batch_first", False) else 1)
    states = (Shard(1),) * _states(call)
    weights = tuple(R for _ in call.inputs[1 + len(states):])
    return [Rule1D((batch, *states, *weights), (batch, *states)), *whole]
