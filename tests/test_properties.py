"""Property-based equivalence: any model from the families, any mesh, any valid plan.

Hypothesis draws a model (MLP stacks, residual MLPs with LayerNorm/RMSNorm, small transformers
with grouped-query attention and tied or untied heads, the same with mixture-of-experts MLPs of
any expert count and top-k, with or without a shared expert, experts looped or batched, a
load-balancing loss or an in-place token-count buffer; odd sizes included; with or without
dropout), a mesh, and a random valid plan (a strategy drawn for every node, including ones the
solver would never choose), with no, selective or full recomputation of the layer blocks, in
float64.
The rewritten program on real gloo ranks must match the single-device model: loss, gradients,
parameters after 2 AdamW steps and the forward output (float64: to 1e-6, with the dropout masks
drawn from the same seed). (bf16-mixed is not run on random plans yet: see the test.)
FSDP-gathered parameters are freed after forward or kept gathered, drawn per parameter, and
parameters stored replicated may be drawn as ZeRO-1 or ZeRO-2 (optimizer state, and gradients,
sharded over their data-parallel ranks). On
failure hypothesis shrinks to a small model and the failing plan is printed.

CI runs the derandomized "ci" profile; `--hypothesis-profile=soak` runs many more examples.
"""

import math

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import autopar
from tests import rank_tasks

MESHES = [(2,), (4,), (2, 2), (1, 4), (4, 1)]
ACT = st.sampled_from(["gelu", "relu", "silu", "tanh"])


@st.composite
def model_specs(draw):
    """(family, config) for rank_tasks.build."""
    kind = draw(st.sampled_from(["mlp", "residual", "tiny", "moe"]))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.25]))
    if kind == "mlp":
        depth = draw(st.integers(1, 3))
        widths = draw(st.lists(st.sampled_from([2, 3, 4, 5, 6, 8]), min_size=depth + 1,
                               max_size=depth + 1))
        return kind, {"widths": widths, "batch": draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
                      "activation": draw(ACT)}
    if kind == "residual":
        return kind, {"width": draw(st.sampled_from([4, 6, 8])), "depth": draw(st.integers(1, 3)),
                      "norm": draw(st.sampled_from(["layernorm", "rmsnorm"])),
                      "activation": draw(ACT), "batch": draw(st.integers(1, 4)),
                      "seq": draw(st.integers(1, 4)), "dropout": dropout}
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    # head_dim 3 or 4, so hidden >= 3: LayerNorm over 2 features always outputs (-1, 1), its
    # true gradient is float noise, and AdamW would divide that noise by noise.
    head_dim = draw(st.sampled_from([3, 4]))
    cfg = {"vocab": draw(st.integers(5, 16)), "hidden": heads * head_dim,
           "heads": heads, "kv_heads": kv_heads, "depth": draw(st.integers(1, 2)),
           "seq": draw(st.integers(2, 6)), "tied": draw(st.booleans()),
           "norm": draw(st.sampled_from(["layernorm", "rmsnorm"])),
           "batch": draw(st.integers(1, 4)), "dropout": dropout}
    if kind == "moe":
        experts = draw(st.integers(2, 5))
        cfg.update(experts=experts, top_k=draw(st.integers(1, experts)),
                   ffn=draw(st.sampled_from([2, 3, 4, 6])), shared_expert=draw(st.booleans()),
                   grouped=draw(st.booleans()), balance=draw(st.sampled_from(["loss", "count"])))
    return kind, cfg


# bf16-mixed is not drawn: random plans differ from the single-device bfloat16 reference by
# more than any tolerance justified so far. Pending sums of activations are reduced in bfloat16
# over up to 4 ranks (a rounding per rank, where one device rounds once), and the tiny drawn
# models are ill-conditioned: the soak found a 1-layer transformer on (4,) whose loss was 12x
# bfloat16's own error (the reference against float32 training) away from the reference, and
# tiny transformers with dropout 3x. Fixed models check bf16-mixed on every plan style
# (tests/test_mixed_precision.py; rank_tasks.mixed_precision_errors also returns that floor).
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])
@given(spec=model_specs(), mesh=st.sampled_from(MESHES), seed=st.integers(0, 2**20),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_random_plan_matches_single_device(world2, world4, spec, mesh, seed, recompute):
    model, loss_fn, example = rank_tasks.build(spec)
    spec_mesh = autopar.MeshSpec(mesh, names=rank_tasks.mesh_names(mesh), hardware="cpu")
    plan = autopar.plan(model, spec_mesh, example, loss_fn=loss_fn, solver="random", seed=seed,
                        recompute=recompute)
    note(f"model {spec}\nmesh {mesh}\n{plan}")
    event(f"family {spec[0]}")  # --hypothesis-show-statistics: how often each family ran
    event(f"recompute {plan.recompute.mode}")
    event(f"dropout {spec[1].get('dropout', 0.0) > 0}")
    event(f"freed after forward {bool(plan.resharded)}")
    event(f"ZeRO stages {sorted(set(plan.zero.values()))}")
    world = world2 if math.prod(mesh) == 2 else world4
    world.run(rank_tasks.train_equivalence, spec, mesh, None, 2, plan.to_dict())
