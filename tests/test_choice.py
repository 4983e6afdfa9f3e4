"""A plan's strategies reach the build by stable id (autopar/choice.py): each node's chosen
candidate by its index, looked up in the strategy graph built afresh from the same trace; the
ids stay out of the plan's hash, and a plan whose ids index other candidate lists is refused."""

import dataclasses

import pytest
import torch

import autopar
from autopar.choice import candidates_fingerprint, choice_from_plan
from autopar.passes import strategies
from autopar.passes.placement import fmt
from autopar.passes.trace import trace
from autopar.planner import input_placement
from autopar.zoo import GPT, GPTConfig, lm_loss


@pytest.fixture(scope="module")
def planned():
    """A GPT's plan on (2, 2) and the strategy graph of its program, built afresh."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu")
    plan = autopar.plan(model, spec, (x, x), loss_fn=lm_loss, force={"tp": "tensor"})
    program = trace(model, (x,), lm_loss, x)
    graph = strategies.build(program, spec.shape, input_placement(spec, plan.options),
                             zero=True)
    return plan, graph


def test_the_ids_name_the_strategies_the_plan_describes(planned):
    plan, graph = planned
    choice = choice_from_plan(plan, graph)
    assert set(choice) == set(graph.nodes) == set(plan.choice)
    for name, s in choice.items():
        assert s is graph.nodes[name].strategies[plan.choice[name]]
        if name in plan.strategies:  # (constants are not described)
            inputs, output = plan.strategies[name]
            shown = [fmt(o) for o in s.output] if graph.nodes[name].multi_output \
                else fmt(s.output)
            assert ([fmt(p) for p in s.inputs], shown) == (inputs, output)
        if graph.nodes[name].param_name in plan.zero:
            assert s.zero == plan.zero[graph.nodes[name].param_name]


def test_the_ids_survive_saving_and_stay_out_of_the_hash(planned):
    plan, graph = planned
    loaded = autopar.Plan.from_dict(plan.to_dict())
    assert loaded.choice == plan.choice and loaded.candidates == plan.candidates
    assert choice_from_plan(loaded, graph) == choice_from_plan(plan, graph)
    renumbered = dataclasses.replace(plan, choice={n: 0 for n in plan.choice}, candidates="")
    assert renumbered.hash() == plan.hash()


def test_ids_of_other_candidate_lists_are_refused(planned):
    plan, graph = planned
    assert plan.candidates == candidates_fingerprint(graph)
    other = dataclasses.replace(plan, candidates="0" * 16)
    with pytest.raises(ValueError, match="other candidates than this autopar offers"):
        choice_from_plan(other, graph)
    old = plan.to_dict() | {"version": 2}
    with pytest.raises(ValueError, match="plan format version 2 is not 3"):
        autopar.Plan.from_dict(old)
