"""One table of op facts, next to the sharding rules: every op with a rule has its facts, and
the facts the cost and memory models once guessed from name prefixes are now right."""

import torch

from autopar.passes.rules import FACTS, RULES, facts_of
from autopar.passes.rules.registry import (
    SAVES_INPUTS,
    SAVES_NOTHING,
    SAVES_OPERANDS,
    SAVES_OUTPUT,
    UNKNOWN,
)

aten = torch.ops.aten


def test_every_op_with_a_rule_has_its_facts():
    missing = sorted(str(op) for op in RULES if facts_of(op) is UNKNOWN)
    assert not missing, missing


def test_facts_are_keyed_by_op_not_by_name_prefix():
    """addcmul and addcdiv keep their inputs for backward (a prefix table once took them for
    "add", which keeps nothing); addmm is a product; slice_scatter is no view."""
    assert facts_of(aten.addcmul.default).saves == SAVES_INPUTS
    assert facts_of(aten.addcdiv.default).saves == SAVES_INPUTS
    assert facts_of(aten.add.Tensor).saves == SAVES_NOTHING
    assert facts_of(aten.addmm.default).product == (1, 2)
    assert facts_of(aten.addmm.default).saves == SAVES_OPERANDS
    assert not facts_of(aten.slice_scatter.default).view
    assert facts_of(aten.slice.Tensor).view


def test_facts_by_overload_packet_cover_every_overload():
    """Facts stated for one overload are found for it; an op nobody described is UNKNOWN
    (priced as keeping all its inputs)."""
    assert facts_of(aten.relu.default).saves == SAVES_OUTPUT
    assert facts_of(aten.flip.default) is UNKNOWN
    assert UNKNOWN.saves == SAVES_INPUTS
    assert all(str(op).startswith("aten.") for op in FACTS)
