"""The core property on real gloo process groups: loss, gradients of every parameter, parameters
and buffers after 2 AdamW steps, and the inference output equal single-device training, for the
solver's plan and for forced data-parallel, tensor-parallel, FSDP and 2-D plans."""

import pytest

from tests import rank_tasks

MODELS = ["mlp", "residual_rms", "gpt", "hf_gpt2", "hf_llama"]
ONE_D = [None, "data", "tensor", "fsdp"]
TWO_D = [None, {"dp": "data", "tp": "tensor"}, {"dp": "fsdp", "tp": "tensor"}, "fsdp"]


def _check_style(plan: dict, force) -> None:
    """The plan is what the style promises."""
    params = plan["parameters"]
    styles = [force] * len(plan["mesh"]["shape"]) if isinstance(force, str) else (
        [force.get(n, "auto") for n in plan["mesh"]["names"]] if force else [])
    for k, style in enumerate(styles):
        per_dim = {name: _placements(p)[k] for name, p in params.items()}
        if style == "data":
            assert all(p == "R" for p in per_dim.values()), per_dim
        elif style == "fsdp":
            assert any(p.startswith("S") for p in per_dim.values()), per_dim
        elif style == "tensor":
            assert any(p.startswith("S") for n, p in per_dim.items() if n.endswith("weight")), \
                per_dim
        elif style in ("zero1", "zero2"):  # parameters replicated, their states sharded
            assert all(p == "R" for p in per_dim.values()), per_dim
            assert set(plan["zero"].values()) == {int(style[-1])}, plan["zero"]
    for k, style in enumerate(styles):
        if style in ("data", "fsdp"):  # compute is split (by batch or sequence) on dimension k
            assert any(o["inputs"] and _placements(o["inputs"][0])[k].startswith("S")
                       for o in plan["ops"]), plan["ops"]


def _placements(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        if text[i] in "RP":
            out.append(text[i])
            i += 1
        else:
            j = text.index(")", i)
            out.append(text[i:j + 1])
            i = j + 1
    return out


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks(world2, model, force):
    plan = world2.run(rank_tasks.train_equivalence, model, (2,), force)[0]
    _check_style(plan, force)


# Four ranks in one dimension: the solver's plan, and the styles whose shards change with the
# degree (data parallelism over four ranks runs the code path of two, tested above and on 2 x 2),
# on the models with attention (the MLP families run random plans on (4,) in test_properties)
@pytest.mark.parametrize("force", [None, "tensor", "fsdp"], ids=lambda f: f or "solver")
@pytest.mark.parametrize("model", [m for m in MODELS if m not in ("mlp", "residual_rms")])
def test_four_ranks(world4, model, force):
    plan = world4.run(rank_tasks.train_equivalence, model, (4,), force)[0]
    _check_style(plan, force)


@pytest.mark.parametrize("force", [None, {"dp": "fsdp", "tp": "tensor"}],
                         ids=["solver", "fsdp-tensor"])
def test_torchtitan_llama3_two_by_two(world4, force):
    """The Llama 3 the torchtitan comparison plans (autopar.zoo.Llama3)."""
    plan = world4.run(rank_tasks.train_equivalence, "llama3", (2, 2), force)[0]
    _check_style(plan, force)


@pytest.mark.parametrize("force", [None, {"dp": "data", "tp": "tensor"}],
                         ids=["solver", "data-tensor"])
def test_bloom_alibi_two_by_two(world4, force):
    """Hugging Face Bloom: ALiBi biases added to the attention scores by baddbmm (sharded
    by its own rule), layer norm after the embedding, eager attention."""
    plan = world4.run(rank_tasks.train_equivalence, "hf_bloom", (2, 2), force)[0]
    _check_style(plan, force)


MOE = ["moe_loop", "moe_grouped", "hf_mixtral", "hf_mixtral_grouped"]
# every 2-D style for the transformers (the MLP families run random 2 x 2 plans in
# test_properties); the solver's plan and FSDP x tensor parallel for Mixtral's two expert
# kernels (batched_mm, grouped_mm). The looped and batched test mixtures run every 1-D style
# on two ranks below, and on 2-D meshes in the property tests.
TWO_BY_TWO = [(m, f) for m in MODELS if m not in ("mlp", "residual_rms") for f in TWO_D] + \
    [(m, f) for m in MOE[2:] for f in (None, {"dp": "fsdp", "tp": "tensor"})]


@pytest.mark.parametrize("model,force", TWO_BY_TWO,
                         ids=[f"{m}-{str(f or 'solver').replace(' ', '')}" for m, f in TWO_BY_TWO])
def test_two_by_two(world4, model, force):
    plan = world4.run(rank_tasks.train_equivalence, model, (2, 2), force)[0]
    _check_style(plan, force)


# A CNN in torchvision's ResNet layout (in float64 on 4 ranks, BatchNorm's running statistics
# among the buffers compared): convolutions by batch or by output channels, BatchNorm in
# training mode by batch with its statistics summed over the ranks (one device's statistics of
# the whole batch), pooling by batch or channels.
RESNET = [((4,), None), ((4,), "data"), ((4,), "fsdp"), ((4,), "zero2"), ((4,), "tensor"),
          ((2, 2), {"dp": "fsdp", "tp": "tensor"})]


@pytest.mark.parametrize("mesh,force", RESNET,
                         ids=[f"{'x'.join(map(str, m))}-{str(f or 'solver').replace(' ', '')}"
                              for m, f in RESNET])
def test_resnet(world4, mesh, force):
    plan = world4.run(rank_tasks.train_equivalence, "resnet", mesh, force)[0]
    _check_style(plan, force)
    if force in ("data", "fsdp", "zero2"):  # every op computes its share of the batch
        whole = [(o["name"], o["replicated"]) for o in plan["ops"] if o["replicated"]]
        assert not whole, whole


@pytest.mark.parametrize("force", [None, "data", "fsdp", "zero1", "tensor"],
                         ids=lambda f: f or "solver")
def test_torch_nn_transformer(world2, force):
    """torch.nn.Transformer (encoder-decoder, causal decoder mask) on 2 ranks: attention
    through nn.MultiheadAttention's own reshapes, layer norms, its feed-forward blocks."""
    plan = world2.run(rank_tasks.train_equivalence, "nn_transformer", (2,), force)[0]
    _check_style(plan, force)


@pytest.mark.parametrize("name,mesh,want", [
    ("resnet_one_image", (4,), "S(2)"), ("resnet_one_image", (2, 2), "S(2)S(3)"),
    ("resnet_one_tall_image", (2, 2), "S(2)S(2)")], ids=["rows", "rows-columns", "rows-2x2"])
def test_resnet_on_one_image_shards_its_rows(world4, name, mesh, want):
    """One image on 4 ranks: the solver shards its rows (256 x 256 on 4; 512 x 64 on 2 x 2,
    both mesh dimensions splitting the rows) or rows and columns (256 x 256 on 2 x 2, the
    halos' corners included), each convolution and max pool exchanging its halo with the
    neighbouring shards and BatchNorm combining its statistics; training equals one device's
    in float64."""
    plan = world4.run(rank_tasks.train_equivalence, name, mesh)[0]
    convs = [o["inputs"][0] for o in plan["ops"] if o["op"].startswith("conv2d")]
    assert convs and all(p == want for p in convs), convs


@pytest.mark.parametrize("force", [None, "data"], ids=lambda f: f or "solver")
def test_state_set_once_for_good(world2, force):
    """Forward sets its window shift from the input's size (Swin's habit; the shift taken at
    the first call is every call's): traced, and trains as on one device."""
    plan = world2.run(rank_tasks.train_equivalence, "shifted_windows", (2,), force)[0]
    _check_style(plan, force)


def test_torch_nn_transformer_accumulates(world2):
    """nn.MultiheadAttention keeps the samples apart (its (L*N, E) projection is traced on
    (L, N, E)): 2 microbatches train as the whole batch."""
    plan = world2.run(rank_tasks.dropout_equivalence, "nn_transformer", (2,), None,
                      options={"microbatches": 2})[0]  # (returns the step's plan)
    assert plan["accumulation"] == 2


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
def test_lora_fine_tuning(world2, force):
    """peft LoRA on a Llama: the frozen base weights stay as they were, the adapters train as
    on one device."""
    world2.run(rank_tasks.train_equivalence, "hf_llama_lora", (2,), force)


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
@pytest.mark.parametrize("model", MOE)
def test_mixture_of_experts_two_ranks(world2, model, force):
    """Token-choice top-k experts (a loop with dense masking, a batched matmul over gathered
    expert weights, Mixtral's batched_mm and grouped_mm), with a shared expert, the
    load-balancing loss or a token-count buffer updated in place."""
    plan = world2.run(rank_tasks.train_equivalence, model, (2,), force)[0]
    _check_style(plan, force)


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
def test_no_grad_region_two_ranks(world2, force):
    """A gate computed under torch.no_grad() in forward passes no gradient back, and its
    weights get none (so AdamW leaves them alone), as on one device."""
    world2.run(rank_tasks.train_equivalence, "no_grad_region", (2,), force)


def test_tensor_parallel_uses_megatron_pairs(world2):
    """Forced tensor parallel on the GPT shards the MLP's first weight by rows (column parallel)
    and its second by columns (row parallel)."""
    plan = world2.run(rank_tasks.train_equivalence, "gpt", (2,), "tensor")[0]
    p = plan["parameters"]
    assert p["h.0.mlp.c_fc.weight"] == "S(0)" and p["h.0.mlp.c_proj.weight"] == "S(1)"


@pytest.mark.parametrize("force", [None, "data", "fsdp", {"dp": "data", "tp": "tensor"}],
                         ids=lambda f: str(f or "solver").replace(" ", ""))
def test_gradient_accumulation(world4, force):
    """step() twice without zero_grad: gradients accumulate exactly as single-device."""
    world4.run(rank_tasks.accumulation_equivalence, "gpt", (2, 2), force)


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
def test_dropout_two_ranks(world2, force):
    """GPT-2 with embedding, residual and attention dropout: every rank draws its block of the
    single-device masks, whatever the plan."""
    plan = world2.run(rank_tasks.dropout_equivalence, "hf_gpt2_dropout", (2,), force)[0]
    _check_style(plan, force)
    assert plan["randomness"] == "eager"  # "auto" for a small model: bit for bit PyTorch


@pytest.mark.parametrize("force", ONE_D, ids=lambda f: f or "solver")
def test_random_ops_two_ranks(world2, force):
    """Noise from rand_like, randn_like and bernoulli, and dropout, in an MLP: drawn as on one
    device."""
    world2.run(rank_tasks.dropout_equivalence, "noisy", (2,), force)


@pytest.mark.parametrize("name,force", [("hf_gpt2_dropout", "data"),
                                        ("hf_gpt2_dropout", "tensor"), ("noisy", "fsdp")])
def test_random_ops_under_gradient_accumulation(world2, name, force):
    """Each microbatch draws what the whole batch draws and keeps its rows (dropout, SDPA's
    dropout, rand_like noise): accumulation over 2 microbatches trains exactly as the whole
    batch on one device, the generator left where one device leaves it."""
    plan = world2.run(rank_tasks.dropout_equivalence, name, (2,), force,
                      options={"microbatches": 2})[0]
    assert plan["accumulation"] == 2


def test_dropout_two_by_two(world4):
    """The same on a 2-D mesh, data parallel by tensor parallel: masks are sliced on both."""
    force = {"dp": "data", "tp": "tensor"}
    plan = world4.run(rank_tasks.dropout_equivalence, "hf_gpt2_dropout", (2, 2), force)[0]
    _check_style(plan, force)
