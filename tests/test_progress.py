"""Planning reports its stages on stderr when asked (or on a terminal), prints nothing on
stdout (no solver banner), and `import autopar` loads neither the solver nor transformers."""

import subprocess
import sys

import torch

import autopar
from autopar.zoo import GPT, GPTConfig, lm_loss


def _plan(**kwargs):
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    spec = autopar.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu")
    return autopar.plan(model, spec, (x, x), loss_fn=lm_loss, **kwargs)


def test_progress_on_stderr_and_nothing_on_stdout(capfd):
    _plan(progress=True)
    out, err = capfd.readouterr()
    assert out == ""  # fd 1: no "Running HiGHS ... Copyright" banner
    assert "tracing the model" in err and "solving:" in err and "solved in" in err


def test_quiet_when_stderr_is_not_a_terminal(capfd):
    _plan()  # pytest's stderr is not a terminal
    out, err = capfd.readouterr()
    assert out == "" and "autopar [" not in err


def test_import_loads_neither_solver_nor_transformers():
    code = ("import sys, autopar; "
            "print(sorted(m for m in ('ortools', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
