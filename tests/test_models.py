import pytest
import torch

from autopar.zoo import GPT, GPTConfig, Llama3, Llama3Config, hf_gpt2, hf_llama, lm_loss
from tests.models import MLP, ResidualMLP

B, T, V = 2, 16, 128


def _tokens():
    return torch.randint(0, V, (B, T))


CASES = {
    "mlp": (lambda: MLP([16, 32, 32, 8]), lambda: torch.randn(4, 16), (4, 8)),
    "mlp_relu": (lambda: MLP([16, 8], activation="relu"), lambda: torch.randn(4, 16), (4, 8)),
    "residual_layernorm": (lambda: ResidualMLP(16, 3), lambda: torch.randn(4, 16), (4, 16)),
    "residual_rmsnorm": (
        lambda: ResidualMLP(16, 2, norm="rmsnorm", activation="silu"),
        lambda: torch.randn(2, 5, 16),
        (2, 5, 16),
    ),
    "gpt": (lambda: GPT(GPTConfig()), _tokens, (B, T, V)),
    "hf_gpt2": (hf_gpt2, _tokens, (B, T, V)),
    "hf_llama": (hf_llama, _tokens, (B, T, V)),
    "llama3": (lambda: Llama3(Llama3Config()), _tokens, (B, T, V)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_export(name):
    build, make_input, shape = CASES[name]
    torch.manual_seed(0)
    model = build()
    x = make_input()

    out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape == shape
    if out.shape == (B, T, V):
        loss = lm_loss(out, torch.randint(0, V, (B, T)))
    else:
        loss = out.pow(2).mean()
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname

    ep = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(ep.module()(x), out.detach())


def test_gpt_weight_tying_and_causality():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    assert model.lm_head.weight is model.wte.weight
    x = _tokens()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % V
    torch.testing.assert_close(model(x)[:, :-1], model(y)[:, :-1])  # the future does not leak


def test_models_are_seed_deterministic():
    for build in (lambda: GPT(GPTConfig()), hf_gpt2, hf_llama):
        torch.manual_seed(1)
        a = build()
        torch.manual_seed(1)
        b = build()
        for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert na == nb
            torch.testing.assert_close(pa, pb)
