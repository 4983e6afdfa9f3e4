"""What torch.export would lose of forward is refused, naming the construct, the module and the
line, and what to do instead (passes/soundness.py); what it keeps trains exactly."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autopar.passes.trace import TraceError, trace
from tests import soundness_tasks as m


def _trace(model, batch: int = 8):
    x = torch.randn(batch, 16)
    return trace(model, (x,), F.cross_entropy, torch.randint(0, 8, (batch,)))


def _refused(model, *words):
    with pytest.raises(TraceError) as e:
        _trace(model)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


# -- custom autograd.Function -----------------------------------------------------------------

@pytest.mark.parametrize("model", [m.FunctionSTE, m.GradientReversal, m.SavedContext],
                         ids=["ste", "reversal", "context"])
def test_autograd_function_is_kept_as_one_op(model):
    program = _trace(model())
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "autopar.autograd_function.default" in ops, ops
    inlined = {m.FunctionSTE: "aten.round.default", m.GradientReversal: "aten.view_as.default",
               m.SavedContext: "aten.sin.default"}[model]
    assert inlined not in ops  # the Function's forward is not inlined into the graph


def test_autograd_function_runs_its_own_backward_on_one_device():
    """The traced program's gradient is the Function's backward's, not autograd's of its
    forward (a straight-through estimator: the identity, where round's would be zero)."""
    torch.manual_seed(0)
    model = m.FunctionSTE().double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 8, (8,))
    program = trace(model, (x,), F.cross_entropy, y)
    params = dict(model.named_parameters())
    feeds = [params[program.params[n.name]] if n.name in program.params
             else (x if n.name == program.inputs[0] else y)
             for n in program.graph.nodes if n.op == "placeholder"]
    _, loss = program.graph_module(*feeds)
    got = torch.autograd.grad(loss, list(params.values()))
    want = torch.autograd.grad(F.cross_entropy(model(x), y), list(params.values()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[0].abs().sum() > 0


@pytest.mark.parametrize("kind,word", [("draws", "draws random numbers"),
                                       ("dirty", "writes into an input")])
def test_a_function_that_draws_or_writes_its_input_is_refused(kind, word):
    _refused(m.FunctionThat(kind), "custom autograd.Function", word)


def test_a_function_defined_inside_a_function_is_refused():
    _refused(m.LocalFunction(), "custom autograd.Function", "Local", "inside a function",
             "define it at module level", "backward would never run",
             "torch.library.custom_op", "register_autograd")


def test_custom_op_with_register_autograd_is_kept_as_one_op():
    program = _trace(m.CustomOpSTE())
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "autopar_tests.quantize_ste.default" in ops, ops


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_custom_op_straight_through_trains_exactly(world2, force):
    world2.run(m.custom_op_trains_exactly, force)


@pytest.mark.parametrize("kind,force", [("function", "data"), ("function", "tensor"),
                                        ("reversal", "fsdp"), ("context", "tensor")])
def test_autograd_functions_train_exactly(world2, kind, force):
    world2.run(m.custom_op_trains_exactly, force, kind)


# -- Python randomness ------------------------------------------------------------------------

def test_python_random_is_refused_naming_the_innermost_module():
    _refused(m.LayerDrop(), "Python's random module", "module model.blocks.0 (_Block)",
             "soundness_tasks.py", "reuse that one draw", "torch ops",
             "pass the value in as a tensor input")


def test_python_random_in_a_folded_stack_is_refused():
    """A stack of identical layers is traced as two layers and copied (passes/fold.py): the
    draw is refused there too."""
    _refused(m.LayerDrop(layers=6), "Python's random module", "module model.blocks.")


def test_numpy_global_random_is_refused():
    _refused(m.Mixup(), "numpy.random (its global generator)", "module model (Mixup)")


@pytest.mark.parametrize("numpy", [False, True], ids=["random.Random", "numpy.Generator"])
def test_generator_held_by_a_module_is_refused(numpy):
    _refused(m.HeldGenerator(numpy), "from model.rng", "module model (HeldGenerator)")


def test_torch_generator_of_its_own_is_refused():
    _refused(m.TorchGenerator(), "torch.Generator of its own", "generator=self.gen",
             "torch's default generator")


def test_torch_generator_passed_in_is_refused():
    """Inputs are tensors (passes/trace.py refuses anything else, a generator included)."""
    with pytest.raises(TraceError, match="is a Generator, not a tensor"):
        trace(m.TorchGenerator(), (torch.randn(8, 16),), kwargs={"gen": torch.Generator()})


@pytest.mark.parametrize("how,word", [("manual_seed", "torch.manual_seed"),
                                      ("same_seed", "torch.manual_seed"),
                                      ("set_rng_state", "torch.set_rng_state")])
def test_reseeding_in_forward_is_refused(how, word):
    _refused(m.Reseeds(how), word, "Seed in the training loop")


def test_python_random_outside_forward_is_left_alone():
    """Drawing in the training loop, between traces, is the user's business."""
    random.random()
    np.random.rand()
    _trace(m.NoGradRegion())


# -- hooks and backward in forward ------------------------------------------------------------

def test_tensor_hook_in_forward_is_refused():
    _refused(m.TensorHook(), "Tensor.register_hook", "module model (TensorHook)",
             "h.register_hook(", "after step() returns")


def test_post_accumulate_grad_hook_in_forward_is_refused():
    _refused(m.TensorHook(post_accumulate=True), "register_post_accumulate_grad_hook")


def test_autograd_grad_in_forward_is_refused():
    """`grad` imported by name (bound before tracing) is refused all the same."""
    _refused(m.GradientPenalty(), "backward pass", "module model (GradientPenalty)",
             "grad(h.pow(2).sum()", "not supported")


def test_backward_in_forward_is_refused():
    _refused(m.GradientPenalty(backward=True), "backward pass", ".backward(retain_graph=True)")


def test_backward_in_another_thread_is_left_alone():
    _trace(m.BackwardInAnotherThread())
    assert m.THREAD_GRADS.get_nowait().tolist() == [2.0, 2.0, 2.0]


# -- global state -----------------------------------------------------------------------------

@pytest.mark.parametrize("log", [False, True], ids=["counter", "list"])
def test_global_written_in_forward_is_refused(log):
    name = "SEEN_SHAPES" if log else "CALLS"
    _refused(m.CountsGlobally(log), f"global tests.soundness_tasks.{name}",
             "does not repeat Python side effects")


def test_global_written_in_the_loss_function_is_refused():
    with pytest.raises(TraceError, match="global tests.soundness_tasks.CALLS"):
        trace(m.NoGradRegion(), (torch.randn(8, 16),), m.counting_loss,
              torch.randint(0, 8, (8,)))


# -- captured, or refused before -------------------------------------------------------------

def test_no_grad_region_traces_detached():
    """no_grad / enable_grad regions are kept (their exactness on ranks:
    tests/test_equivalence.py::test_no_grad_region_two_ranks)."""
    program = _trace(m.NoGradRegion())
    assert any(n.target is torch.ops.aten.detach.default for n in program.graph.nodes)


def test_item_branch_is_refused_as_data_dependent():
    _refused(m.ItemBranch(), "data-dependent control flow", "h.mean().item() > 0")


def test_the_gate_puts_torch_back():
    """After a refusal, torch's functions are torch's again (autograd.Function and hooks work
    as before in the user's own code)."""
    apply = torch.autograd.Function.__dict__["apply"]
    hook = torch.Tensor.register_hook
    engine = torch.autograd._engine_run_backward
    _refused(m.LocalFunction(), "autograd.Function")
    _refused(m.GradientPenalty(), "backward pass")
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert torch.Tensor.register_hook is hook
    assert torch.autograd._engine_run_backward is engine
    x = torch.randn(4, requires_grad=True)
    y = m.STE.apply(x * 1.3)
    y.register_hook(lambda g: g * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.6))


# -- on ranks: the same error everywhere ------------------------------------------------------

@pytest.mark.parametrize("kind", ["function", "layer_drop"])
def test_refused_on_every_rank_at_step(world2, kind):
    messages = world2.run(m.refused_at_step, kind)
    word = {"function": "autograd.Function", "layer_drop": "Python's random module"}[kind]
    for msg in messages:
        assert msg.startswith("TraceError:") and word in msg, msg
    assert messages[0] == messages[1], messages
