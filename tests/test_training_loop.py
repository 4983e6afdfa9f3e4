"""The calls a training loop makes on a parallelized model give the numbers they give on one
device, under every kind of plan: gradient clipping, parameter groups by name, state_dict,
ranks that built different models, a new batch size, per-rank batches, keyword batches of a
model that computes its own loss, train and eval modes, backward through an inference call
(refused), optimizers that step below autograd, gradient accumulation weighting each
microbatch as the batch weighs it."""

import pytest
import torch
import torch.nn.functional as F

from autopar.passes.loss_weights import microbatch_weights, of_program
from autopar.passes.trace import trace
from tests import loop_tasks

STYLES = [None, "data", "tensor", "fsdp"]
TWO_D = [{"dp": "data", "tp": "tensor"}, {"dp": "fsdp", "tp": "tensor"}]


@pytest.mark.parametrize("force", STYLES, ids=lambda f: f or "solver")
def test_clip_grad_norm_is_global(world2, force):
    norms = world2.run(loop_tasks.clip_equivalence, "gpt", (2,), force)
    assert len(set(norms)) == 1


@pytest.mark.parametrize("force", TWO_D, ids=str)
def test_clip_grad_norm_on_two_dimensions(world4, force):
    world4.run(loop_tasks.clip_equivalence, "hf_llama", (2, 2), force)
    world4.run(loop_tasks.clip_equivalence, "gpt", (2, 2), force, True)


@pytest.mark.parametrize("force", ["zero1", "zero2", "fsdp"])
def test_optimizers_that_update_below_autograd(world2, force):
    world2.run(loop_tasks.optimizer_kernels, (2,), force)


@pytest.mark.parametrize("force", ["data", "fsdp"])
def test_backward_through_inference_is_refused(world2, force):
    for errors in world2.run(loop_tasks.backward_through_inference, (2,), force):
        assert "pmodel.step" in errors[0]
        # beside a penalty over the DTensor parameters, torch's loss backward fails first
        assert "pmodel.step" in errors[1] or "mixed torch.Tensor and DTensor" in errors[1]


def test_an_optimizer_over_the_models_replaced_parameters_is_refused(world2):
    for errors in world2.run(loop_tasks.optimizer_over_the_model, (2,), "fsdp"):
        assert len(errors) == 1, errors
        assert "SGD.step() would step parameter net.0.weight" in errors[0]
        assert "before the build" in errors[0] and "over model.parameters()" in errors[0]


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_changes_on_the_model_passed_to_parallelize(world2, force):
    for error in world2.run(loop_tasks.original_model_changes, (2,), force):
        assert "inp.weight of the model passed to autopar.parallelize was assigned anew" \
            in error
        assert "model.load_state_dict" in error


@pytest.mark.parametrize("force", [None, "zero1"])
def test_accumulation_weights_microbatches_as_the_batch(world2, force):
    for error in world2.run(loop_tasks.accumulation_weights, (2,), force):
        assert "BatchNorm in training mode" in error and "microbatches=1" in error


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_submodules_keep_their_own_modes(world2, force):
    world2.run(loop_tasks.submodule_modes, (2,), force)


@pytest.mark.parametrize("force", [None, "tensor"])
def test_a_scalar_input_beside_the_batch(world2, force):
    world2.run(loop_tasks.scalar_input, (2,), force)


@pytest.mark.parametrize("force", ["tensor", "fsdp"])
def test_parameter_groups_by_name(world2, force):
    names = world2.run(loop_tasks.param_groups_by_name, "gpt", (2,), force)[0]
    assert "h.0.attn.c_attn.weight" in names and not any("shards" in n for n in names)


def test_state_dict_speaks_the_models_names(world4):
    keys, model_keys, types = world4.run(loop_tasks.state_dict_keys, "hf_llama", (2, 2),
                                         {"dp": "fsdp", "tp": "tensor"})[0]
    assert keys == model_keys
    assert "DTensor" in types


@pytest.mark.parametrize("force", ["fsdp", "tensor"])
def test_a_state_dict_saved_by_one_rank_is_refused(world2, force, tmp_path):
    for error in world2.run(loop_tasks.state_saved_by_one_rank, (2,), force,
                            str(tmp_path / "rank0.pt")):
        assert "same blocks of its sharded tensors on every rank" in error
        assert "autopar.checkpoint.save" in error


@pytest.mark.parametrize("force", ["data", "fsdp"])
def test_weights_averaged_by_the_recipe_the_copy_error_gives(world2, force):
    for error in world2.run(loop_tasks.weight_average, (2,), force):
        assert "cannot be copied" in error and "lerp_" in error


def test_a_call_on_rank0_alone_is_named(world2):
    errors = world2.run(loop_tasks.rank0_alone_evaluates, (2,), "fsdp")
    assert all("ranks are in different calls" in e and "rank 0: the forward call" in e and
               "rank 1: step()" in e for e in errors), errors


def test_module_tree_keeps_the_models_containers(world2):
    names = world2.run(loop_tasks.module_tree, (2,), "fsdp")[0]
    assert names and all(n.startswith(("ln_", "attn.", "mlp.")) for n in names)


@pytest.mark.parametrize("force", ["data", "fsdp", "tensor"])
def test_ranks_that_built_different_models_train_rank0s(world2, force):
    world2.run(loop_tasks.ranks_build_different_models, (2,), force)


@pytest.mark.parametrize("force", [None, "fsdp", "zero2"], ids=lambda f: f or "solver")
def test_new_batch_size_is_planned_again(world2, force):
    built = world2.run(loop_tasks.new_batch_replans, "gpt", (2,), force)[0]
    assert built == 2  # the first shape's program is reused when it comes back


@pytest.mark.parametrize("mesh,per_rank,force", [
    ((2,), ("dp",), None), ((2,), ("dp",), "fsdp"), ((2, 2), ("dp",), {"tp": "tensor"}),
    ((2, 2), ("dp", "tp"), None)], ids=str)
def test_per_rank_batches(world2, world4, mesh, per_rank, force):
    world = world2 if len(mesh) == 1 else world4
    world.run(loop_tasks.per_rank_batches, "gpt", mesh, per_rank, force)


@pytest.mark.parametrize("force", [None, "tensor"], ids=lambda f: f or "solver")
def test_hugging_face_keyword_batch_with_labels(world2, force):
    world2.run(loop_tasks.hf_keyword_batch, (2,), force)


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_train_and_eval_modes(world2, force):
    world2.run(loop_tasks.train_and_eval_modes, (2,), force)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("force", ["data", None], ids=lambda f: f or "solver")
def test_batchnorm(world2, force, training):
    world2.run(loop_tasks.batchnorm, (2,), force, training)


@pytest.mark.parametrize("force", STYLES, ids=lambda f: f or "solver")
def test_gradient_accumulation_over_microbatches(world2, force):
    assert world2.run(loop_tasks.accumulation_equivalence, (2,), force, 4)[0] == 4


def test_planner_accumulates_when_the_batch_does_not_fit(world2):
    assert world2.run(loop_tasks.accumulation_equivalence, (2,), None, None, True)[0] == 2


def test_gradient_accumulation_on_two_dimensions(world4):
    world4.run(loop_tasks.accumulation_equivalence, (2, 2), {"dp": "fsdp", "tp": "tensor"}, 2)


def test_loss_weights_read_from_the_loss():
    """What the traced loss's last op says about its microbatches: a cross-entropy's mean
    over the targets it counts (counted from the inputs, through the labels' shift, as a
    Hugging Face causal LM makes them), a sum, a mean, a composite loss left to
    loss_reduction, and BatchNorm in training mode (not in eval mode) coupling the batch."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    x, y = torch.randn(6, 8), torch.tensor([0, -100, 2, -100, -100, 1])
    ce = of_program(trace(mlp, (x,), F.cross_entropy, y))
    assert ce.kind == "targets" and not ce.exact()
    assert int(ce.counter(x, y)) == 3
    assert microbatch_weights(ce, [1, 2], 2, True) == [1 / 3, 2 / 3]
    assert of_program(trace(mlp, (x,), lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                            y)).kind == "sum"
    assert of_program(trace(mlp, (x,), lambda o, t: (o - t).pow(2).mean(),
                            torch.randn(6, 4))).kind == "mean"
    both = of_program(trace(mlp, (x,), lambda o, t: F.cross_entropy(o, t) + o.pow(2).mean(), y))
    assert both.kind == "" and microbatch_weights(both, None, 2, False) == [1.0, 1.0]
    assert of_program(trace(mlp, (x,), F.cross_entropy, y), per_rank_inputs=True).refused

    shifted = lambda o, t: F.cross_entropy(o[:-1], t[1:])  # noqa: E731
    lm = of_program(trace(mlp, (x,), shifted, y))
    assert int(lm.counter(x, y)) == 2  # y[1:] has 2 targets that count

    bn = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    coupled = of_program(trace(bn, (x,), lambda o, t: o.pow(2).mean(), torch.randn(6, 8)))
    assert "BatchNorm in training mode" in coupled.exact() and "module 1" in coupled.exact()
    bn.eval()
    assert not of_program(trace(bn, (x,), lambda o, t: o.pow(2).mean(), torch.randn(6, 8),
                                )).exact()


@pytest.mark.parametrize("track", [True, False], ids=["running", "batch_only"])
def test_batch_norm_shards_the_batch_but_microbatches_refuse_it(track):
    """BatchNorm in training mode shards the batch over ranks by summing its statistics over
    them (one device's statistics of the whole batch), but microbatches would each be
    normalized by their own: accumulation and pipelines refuse it, with running statistics
    or without (no buffer written then)."""
    from autopar.passes import strategies
    from autopar.passes.batch_local import split_problem

    bn = torch.nn.Sequential(torch.nn.Linear(8, 8),
                             torch.nn.BatchNorm1d(8, track_running_stats=track))
    program = trace(bn, (torch.randn(6, 8),), lambda o, t: o.pow(2).mean(), torch.randn(6, 8))
    graph = strategies.build(program, (2,))
    norm = next(v for v in graph.nodes.values() if v.name.startswith("batch_norm"))
    assert any(str(s.output) == "(Shard(dim=0),)" for s in norm.strategies), norm.strategies
    assert "BatchNorm in training mode" in split_problem(program, 2)


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_values_read_at_trace_time_follow_changes(world2, force):
    world2.run(loop_tasks.traced_values, (2,), force)


@pytest.mark.parametrize("force", ["data", "tensor"])
def test_parametrized_weights(world2, force):
    world2.run(loop_tasks.parametrized_weights, (2,), force)


@pytest.mark.parametrize("force", ["data", "tensor", "fsdp"])
def test_state_reassigned_between_steps(world2, force):
    world2.run(loop_tasks.reassigned_state, (2,), force)


@pytest.mark.parametrize("force", ["zero1", "zero2"])
def test_state_snapshot_restores(world2, force):
    world2.run(loop_tasks.state_snapshot, (2,), force)


class _Encoder(torch.nn.Module):
    def __init__(self, center: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)
        self.center = center

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.center:
            h = h - h.mean(0, keepdim=True)  # centred on the batch's mean: mixes samples
        return self.b(h)


def _info_nce(z, positives):  # every sample against every other: mixes samples
    logits = F.normalize(z, dim=-1) @ F.normalize(positives, dim=-1).t() / 0.1
    return F.cross_entropy(logits, torch.arange(z.shape[0]))


def _normalized_mse(z, y):  # per-sample: microbatches add up
    return F.mse_loss(F.normalize(z, dim=-1), y)


@pytest.mark.parametrize("model,loss_fn,where", [
    (_Encoder(), _info_nce, "op matmul.default in the loss function"),
    (_Encoder(center=True), F.mse_loss, r"op sub.Tensor \(File .*h.mean\(0"),
    (_Encoder(), lambda z, y: F.mse_loss(z[:, :1], y[:, 0]), "op broadcast_tensors"),
], ids=["contrastive", "batch_centred", "broadcast"])
def test_accumulation_refused_where_samples_mix(model, loss_fn, where):
    """Ops that mix the samples of the batch make microbatches that do not add up to it: an
    explicit microbatches= is refused naming the op, and the planner never accumulates."""
    import autopar
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    mesh = autopar.MeshSpec((2,))
    with pytest.raises(ValueError, match=rf"microbatches=2: .*{where}.*mixes the samples"):
        autopar.plan(model, mesh, (x, y), loss_fn=loss_fn, microbatches=2)
    per_sample = autopar.plan(_Encoder(), mesh, (x, y), loss_fn=_normalized_mse,
                              microbatches=2)
    assert per_sample.accumulation == 2


class _SelfAttention(torch.nn.Module):
    """nn.MultiheadAttention, batch first, returning its head-averaged weights or not."""

    def __init__(self, need_weights: bool):
        super().__init__()
        self.need_weights = need_weights
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=self.need_weights)
        return out if weights is None else out + weights.mean(-1, keepdim=True)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_keeps_the_samples_apart(need_weights):
    """nn.MultiheadAttention flattens (L, N, E) to (L*N, E) for its output projection, rows
    interleaving the samples: the trace projects (L, N, E) instead, so microbatches add up
    (they were refused) and the batch stays sharded through the projection."""
    import autopar
    x, y = torch.randn(8, 6, 16), torch.randn(8, 6, 16)
    program = trace(_SelfAttention(need_weights), (x,), F.mse_loss, y)
    flat = [n for n in program.graph.nodes if n.target == torch.ops.aten.linear.default
            and n.args[0].meta["val"].shape == (6 * 8, 16)]
    assert not flat
    plan = autopar.plan(_SelfAttention(need_weights), autopar.MeshSpec((2,)), (x, y),
                        loss_fn=F.mse_loss, microbatches=2, force={0: "data"})
    assert plan.accumulation == 2
    assert not [c for c in plan.collectives if c.phase != "gradient sync"]


class _RowBias(torch.nn.Module):
    """A linear over flattened rows whose bias has a row of its own per row."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(
            torch.randn(6, 3))

    def forward(self, x):  # (6, 1, 4)
        return F.linear(x.reshape(6, 4), self.w, self.b).view(6, 1, 3)


def test_a_bias_with_rows_keeps_its_flattened_linear():
    """The rewrite is for linears whose weight and bias carry no rows: a (rows, out) bias
    would broadcast against the unflattened rows."""
    from autopar.passes.row_reshape import unflatten_row_chains
    model, x = _RowBias(), torch.randn(6, 1, 4)
    gm = torch.export.export(model, (x,), strict=False).graph_module
    assert unflatten_row_chains(gm) == 0
    torch.testing.assert_close(gm(model.w, model.b, x)[0], model(x))


class _Noised(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x):  # noise of a shape of its own: not drawn as the whole batch's
        return self.a(x) + 0.1 * torch.randn(x.shape[0], 16)


def test_accumulation_refused_where_noise_has_a_shape_of_its_own():
    import autopar
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"microbatches=2: .*randn.default \(File .*torch.randn"
                                         r"\(x.shape\[0\].* draws random numbers in a shape of "
                                         "its own"):
        autopar.plan(_Noised(), autopar.MeshSpec((2,)), (x, y), loss_fn=F.mse_loss,
                     microbatches=2)


class _Gated(_Noised):
    def forward(self, x):  # a gate per sample, drawn on a tensor of its own
        return self.a(x) * torch.zeros(x.shape[0], 1).bernoulli(0.9)


def test_microbatches_refuse_draws_they_cannot_relate_to_the_batch():
    from autopar.passes.batch_local import batch_dims
    from autopar.passes.trace import trace
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    whole, half = (trace(_Gated(), (x[:n],), F.mse_loss, y[:n]) for n in (8, 4))
    with pytest.raises(ValueError, match=r"bernoulli.p \(File .*bernoulli\(0.9\)\) draws random "
                                         "numbers over the batch"):
        batch_dims(whole, 2, half)


def test_microbatches_need_a_batch_in_every_input():
    from autopar.inputs import Call, microbatch
    call = Call((torch.randn(4, 8, 16), torch.randn(8, 8)), (), torch.randint(0, 4, (4,)))
    with pytest.raises(ValueError, match=r"2 microbatches split every input .* shapes are "
                                         r"\(4, 8, 16\), \(8, 8\), \(4,\)"):
        microbatch(call, 2)
    assert microbatch(call, 1) is call
    whole = Call((torch.randn(8, 16),), (), torch.randint(0, 4, (8,)))
    with pytest.raises(ValueError, match="microbatches=3 must divide the batch .* 8.*: 1, 2, 4, 8"):
        microbatch(whole, 3)


def _mean_then_sum(z, y):  # the batch averaged first: the last op's sum is not the weight
    return F.mse_loss(z, y, reduction="none").mean(0).sum()


def _masked_mean(z, y):  # a ratio of two sums over the batch
    mask = (y[:, 0] > 0).to(z.dtype)
    return (F.mse_loss(z, y, reduction="none").mean(-1) * mask).sum() / mask.sum()


def _regularised(z, y):  # a mean plus a term the batch does not reach
    return F.mse_loss(z, y) + 1.0


def _sums(z, y):  # a sum of sums over the batch: loss_reduction says which they are
    return F.mse_loss(z, y, reduction="sum") + z.abs().sum()


@pytest.mark.parametrize("loss_fn,where", [
    (_mean_then_sum, r"reduces the batch's samples in the loss function \(mean.dim\) before "
                     r"its last op sum.default"),
    (lambda z, y: F.mse_loss(z, y, reduction="none").sum(0).mean(),
     r"\(sum.dim_IntList\) before its last op mean.default"),
    (_masked_mean, r"last op div.Tensor in the loss function combines sums or means over the "
                   r"batch in a way that is not their sum"),
], ids=["mean_then_sum", "sum_then_mean", "masked_mean"])
def test_accumulation_refused_where_the_loss_reduces_the_batch_before_its_last_op(loss_fn,
                                                                                   where):
    """Microbatches' losses are weighted by the reduction of the loss's last op: a loss that
    averaged (or summed) the batch before it, or divides two sums over the batch, would have
    been weighted m times too much or too little. microbatches= is refused naming the op, and
    the planner never accumulates such a loss (it once chose to and reported twice the
    loss); a sum of sums still accumulates, weighted as loss_reduction says."""
    import autopar
    from autopar.solver.ilp import NoFeasiblePlan
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    mesh = autopar.MeshSpec((2,))
    with pytest.raises(ValueError, match=rf"microbatches=2: .*{where}"):
        autopar.plan(_Encoder(), mesh, (x, y), loss_fn=loss_fn, microbatches=2)
    assert autopar.plan(_Encoder(), mesh, (x, y), loss_fn=_sums, microbatches=2,
                        loss_reduction="sum").accumulation == 2
    # A term the batch does not reach (a regulariser) added to a mean adds up under
    # loss_reduction="mean" (weights 1/m), not under loss_reduction="sum" (m times).
    assert autopar.plan(_Encoder(), mesh, (x, y), loss_fn=_regularised, microbatches=2,
                        loss_reduction="mean").accumulation == 2
    with pytest.raises(ValueError, match="adds a term the batch does not reach"):
        autopar.plan(_Encoder(), mesh, (x, y), loss_fn=_regularised, microbatches=2,
                     loss_reduction="sum")
    x, y = torch.randn(512, 16, dtype=torch.float64), torch.randn(512, 16, dtype=torch.float64)
    mesh = autopar.MeshSpec((2,), hardware="cpu")
    whole = autopar.plan(_Encoder().double(), mesh, (x, y), loss_fn=_sums,
                         memory_budget=float("inf")).cost.memory
    budget = sum(whole.values()) - whole["activations"] / 2  # only microbatches fit
    assert autopar.plan(_Encoder().double(), mesh, (x, y), loss_fn=_sums,
                        memory_budget=budget, loss_reduction="sum").accumulation > 1
    with pytest.raises(NoFeasiblePlan, match=rf"accumulation would not compute .*{where}"):
        autopar.plan(_Encoder().double(), mesh, (x, y), loss_fn=loss_fn, memory_budget=budget)


class _Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):  # a step counter: written once per call
        self.calls.add_(1)
        return self.a(x) * (1 + 0.1 * self.calls)


@pytest.mark.parametrize("force,microbatches,placement", [("data", 2, "S(0)"),
                                                          ("tensor", 1, "S(1)")])
def test_frozen_batch_norm_shards_and_accumulates(world2, force, microbatches, placement):
    """A BatchNorm in eval mode inside a training model (frozen for fine-tuning) normalizes
    each sample by its running statistics: it runs sharded by the batch (data parallel,
    gradient accumulation allowed) or by its channels (tensor parallel), as one device
    computes (it had no sharding rule: every rank ran it whole, and microbatches were
    refused)."""
    placements = world2.run(loop_tasks.frozen_batch_norm, force, microbatches)[0]
    assert placements and all(p == placement for p in placements), placements


def test_accumulation_refused_where_forward_writes_a_buffer():
    """A buffer forward writes (a step counter) would be written once per microbatch, where
    the whole batch writes it once: microbatches= above 1 is refused naming it, for gradient
    accumulation and for a pipeline."""
    import autopar
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"microbatches=2: .*add_.Tensor \(File .*"
                                         r"self.calls.add_\(1\).* writes the model's buffer "
                                         r"calls in forward, once per call: 2 microbatches "
                                         r"would write it 2 times"):
        autopar.plan(_Counted(), autopar.MeshSpec((2,)), (x, y), loss_fn=F.mse_loss,
                     microbatches=2)
    assert autopar.plan(_Counted(), autopar.MeshSpec((2,)), (x, y), loss_fn=F.mse_loss,
                        microbatches=1).accumulation == 1


def test_planner_never_accumulates_a_loss_that_mixes_samples():
    """Under a budget the whole batch does not fit, the planner would accumulate; a loss
    comparing every sample with every other makes it say why it cannot instead."""
    import autopar
    from autopar.solver.ilp import NoFeasiblePlan
    x, y = torch.randn(512, 16, dtype=torch.float64), torch.randn(512, 16, dtype=torch.float64)
    with pytest.raises(NoFeasiblePlan, match=r"accumulation would not compute what the whole "
                                             r"batch does: op matmul.default.*mixes the samples"):
        autopar.plan(_Encoder().double(), autopar.MeshSpec((2,), hardware="cpu"), (x, y),
                     loss_fn=_info_nce, memory_budget=2e6)
