"""Planning without processes: the Plan's table, serialization, meta models, mesh links."""

import json

import pytest
import torch

import autopar
from autopar.passes.placement import fmt
from autopar.passes.trace import trace
from autopar.zoo import GPT, GPTConfig, hf_llama, lm_loss


def gpt_plan(shape=(2, 2), hardware="cpu", **kwargs):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    spec = autopar.MeshSpec(shape, names=("dp", "tp")[:len(shape)], hardware=hardware)
    return autopar.plan(model, spec, (x, x), loss_fn=lm_loss, **kwargs)


def test_print_is_a_table_of_modules_with_layers_folded():
    plan = gpt_plan(force={"dp": "fsdp", "tp": "tensor"})
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("autopar plan  mesh (dp=2,tp=2) on cpu")
    assert any("R replicated, S(d) sharded on tensor dim d, P pending sum" in ln for ln in lines)
    assert max(map(len, lines)) <= 120
    header = next(line for line in lines if line.startswith("module"))
    for col in ("params", "inputs -> output", "ms", "collectives"):
        assert col in header
    # the GPT's two blocks are planned alike: one block shown once
    assert any(ln.startswith("h.0-1  x2") for ln in lines), text
    assert any(ln.startswith("  attn.c_attn ") for ln in lines), text
    assert "collectives per step:" in text and "all_gather" in text
    assert "predicted step" in text and "memory per device" in text
    assert "parameters (storage placement):" in text
    assert {o.module for o in plan.ops} >= {"h.0.attn.c_attn", "h.1.mlp.c_fc"}


def test_replicated_ops_say_why():
    plan = gpt_plan(force={"dp": "fsdp", "tp": "tensor"})
    why = {o.replicated for o in plan.ops}
    assert why <= {"", "replicated is cheaper", "no sharding rule",
                   "no sharded strategy divides its shapes by the mesh",
                   "its rule shards no input for these arguments", "updates state in place"}
    for o in plan.ops:
        shards = any(c in p for p in [*o.inputs, *([o.output] if isinstance(o.output, str)
                                                   else o.output)] for c in "SP")
        assert bool(o.replicated) != shards, o


def test_op_view_keeps_one_row_per_op():
    plan = gpt_plan(force={"dp": "fsdp", "tp": "tensor"})
    text = plan.table(detail="ops")
    assert text.splitlines()[0].startswith("autopar plan  mesh (dp=2,tp=2) on cpu")
    header = next(line for line in text.splitlines() if line.startswith("op group"))
    for col in ("aten op", "inputs", "output", "ms", "collectives"):
        assert col in header
    assert "scaled_dot_product_attention" in text
    assert "collectives per step:" in text and "all_gather" in text
    assert "predicted step" in text and "memory per device" in text
    assert "parameters (storage placement):" in text


def test_plan_fields():
    plan = gpt_plan()
    assert len(plan.inputs) == 1 and len(plan.inputs[0]) == 2  # one input, a 2-D mesh
    names = {n for n, _ in GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                         n_embd=32)).named_parameters()}
    assert set(plan.parameters) == names  # the model's own names; tied weights once
    assert all(o.time >= 0 and o.stage == 0 for o in plan.ops)
    assert plan.cost.step_time == pytest.approx(plan.cost.compute
                                                + plan.cost.communication_total)
    assert set(plan.cost.memory) == {"parameters", "gradients", "optimizer", "activations",
                                     "workspace"}  # a loss: its backward's buffers


def test_save_load_round_trip(tmp_path):
    plan = gpt_plan(force={"dp": "data", "tp": "tensor"})
    path = tmp_path / "plan.json"
    plan.save(str(path))
    json.loads(path.read_text())  # plain JSON
    loaded = autopar.Plan.load(str(path))
    assert loaded.hash() == plan.hash()
    assert loaded.to_dict() == plan.to_dict()
    assert [o.module for o in loaded.ops] == [o.module for o in plan.ops]
    assert str(loaded) == str(plan)
    assert {k: fmt(v) for k, v in loaded.parameters.items()} == \
        {k: fmt(v) for k, v in plan.parameters.items()}


def test_hash_changes_with_the_decision():
    assert gpt_plan(force="data").hash() != gpt_plan(force="fsdp").hash()


def test_meta_device_model_can_be_planned():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16), device="meta")
    plan = autopar.plan(model, autopar.MeshSpec((8,), hardware="h100"), (x, x), loss_fn=lm_loss)
    assert plan.cost.step_time > 0


class _AsksItsDevice(torch.nn.Module):
    """Code that branches on its tensors' device, as torchtitan's router (an autocast region)
    and Hugging Face's grouped experts (histc of floats on cpu, of ints elsewhere) do."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = self.fc(x)
        counts = torch.histc(h.float() if h.device.type == "cpu" else h.int(), bins=4)
        return h + counts.sum()


@pytest.mark.parametrize("on_meta", [False, True])
def test_model_code_sees_the_device_it_runs_on(on_meta):
    """Traced without storage, the model still sees its tensors on cpu (a meta model: cpu,
    where an unplaced model runs by default), so it takes the branch it takes there."""
    with torch.device("meta" if on_meta else "cpu"):
        model = _AsksItsDevice()
    program = trace(model, (torch.randn(4, 8),))
    (histc,) = [n for n in program.graph_module.graph.nodes
                if n.target is torch.ops.aten.histc.default]
    assert histc.args[0].meta["val"].dtype == torch.float32
    assert autopar.plan(model, autopar.MeshSpec((2,), hardware="cpu"), (torch.randn(4, 8),))


def test_llama_on_a_large_simulated_mesh():
    """No processes: a Llama-shaped model on 2 x 4 simulated H100s."""
    torch.manual_seed(0)
    model = hf_llama(num_hidden_layers=2, hidden_size=256, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=512, vocab_size=512,
                     max_position_embeddings=64)
    x = torch.randint(0, 512, (8, 64))
    plan = autopar.plan(model, autopar.MeshSpec((2, 4), names=("dp", "tp")), (x, x),
                        loss_fn=lm_loss)
    assert plan.unsupported_ops == []
    assert plan.cost.step_time == pytest.approx(plan.cost.solver_objective, rel=1e-6)


def test_mesh_links_follow_nodes():
    spec = autopar.MeshSpec((8, 8), names=("dp", "tp"), hardware="h100")
    assert spec.link(1).name == "nvlink4"  # 8 consecutive GPUs: one node
    assert spec.link(0).name == "ib-ndr"   # strided across nodes
    assert autopar.MeshSpec((2, 4)).link(0).name == "nvlink4"
    assert autopar.MeshSpec((16,)).link(0).name == "ib-ndr"


def test_unknown_hardware():
    with pytest.raises(ValueError, match="built-in profiles"):
        autopar.MeshSpec((2,), hardware="tpu-v9")


def test_explain_gives_the_choice_and_the_alternatives(tmp_path):
    plan = gpt_plan(force={"dp": "fsdp"})
    e = plan.explain("h.0.attn.c_attn")  # a module: its ops and parameters
    assert "h.0.attn.c_attn.weight" in e.nodes
    text = str(e)
    assert text.splitlines()[0].startswith("h.0.attn.c_attn: the chosen strategy")
    assert "chosen" in text and "compute" in text and "MiB" in text
    for rows in e.nodes.values():
        assert rows[0]["ruled_out"] == ""  # the chosen strategy first
        assert all(r["ruled_out"] for r in rows[1:])
    # a forced style rules out what it excludes
    reasons = {r["ruled_out"] for rows in e.nodes.values() for r in rows[1:]}
    assert any(r.startswith(("forced style", "worse cost", "memory budget", "tied", "no "))
               for r in reasons)
    op = next(o.name for o in plan.ops if o.op.startswith("linear"))
    assert list(plan.explain(op).nodes) == [op]
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert str(autopar.Plan.load(str(path)).explain(op)) == str(plan.explain(op))
    with pytest.raises(KeyError, match="did you mean"):
        plan.explain("h.0.attn.c_atn")
    # both layers' c_attn, planned alike: one block each for the op, weight and bias
    both = str(plan.explain("attn.c_attn"))
    assert both.count("  chosen ") == 3 and both.count("1 more planned alike") == 3
    assert "h.1.attn.c_attn.weight" in both and set(plan.explain("attn.c_attn").nodes) >= {
        "h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"}


def test_planning_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc
    seen = []
    export = torch.export.export

    def recording_export(*args, **kwargs):  # runs while autopar plans
        seen.append(gc.isenabled())
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", recording_export)
    loss = lm_loss

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    spec = autopar.MeshSpec((2,), names=("dp",))
    assert gc.isenabled()
    autopar.plan(model, spec, (x, x), loss_fn=loss)
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(ValueError):  # an error on the way out restores it too
        autopar.plan(model, spec, (x, x), loss_fn=loss, microbatches=3)
    assert gc.isenabled()
    gc.disable()  # a caller's choice to keep it off stands
    try:
        autopar.plan(model, spec, (x, x), loss_fn=loss)
        assert not gc.isenabled()
    finally:
        gc.enable()
