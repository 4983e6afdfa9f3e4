"""The `autopar` command: `plan` and `calibrate` run as a user runs them, in a process of their
own (`python -m autopar.cli`, torchrun); the other checks call the same entry point,
`autopar.cli.main`, in this process (a process each costs seconds of imports)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from autopar import cli
from autopar.zoo import GPT, GPTConfig, lm_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 32}


def tiny_gpt():
    """What `autopar plan tests.test_cli:tiny_gpt` builds: (model, inputs, loss_fn)."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    return model, (x, x), lm_loss


def autopar(*args, check=True):
    """`autopar ARGS` in a process of its own: returncode, stdout, stderr."""
    done = subprocess.run([sys.executable, "-m", "autopar.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def autopar_here(*args, check=True):
    """`autopar ARGS` through `cli.main` in this process: returncode, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: --help, or arguments it rejects
            code = e.code
    done = SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_plan_from_a_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    done = autopar("plan", str(config), "--mesh", "2x2", "--names", "dp,tp", "--hardware",
                   "cpu", "--batch", "4", "--seq", "16", "--precision", "fp32", "-o", str(out),
                   "--html", str(html))
    assert "model.layers.0-1  x2" in done.stdout and "predicted step" in done.stdout
    assert "Running HiGHS" not in done.stdout
    assert done.stderr.count("autopar [") == 0  # not a terminal: no progress
    saved = json.loads(out.read_text())
    assert saved["mesh"]["shape"] == [2, 2]
    assert 'id="step-time"' in html.read_text() and f"wrote {html}" in done.stdout


def test_show_and_explain_a_saved_plan(tmp_path):
    import autopar as ap

    model, inputs, loss_fn = tiny_gpt()
    plan = ap.plan(model, ap.MeshSpec((2, 2), names=("dp", "tp"), hardware="cpu"), inputs,
                   loss_fn=loss_fn)
    out = tmp_path / "plan.json"
    plan.save(str(out))
    assert autopar_here("show", str(out)).stdout.strip() == str(plan)
    assert "op group" in autopar_here("show", str(out), "--detail", "ops").stdout
    explained = autopar_here("explain", str(out), "h.0.mlp.c_fc").stdout
    assert "chosen" in explained and "h.0.mlp.c_fc.weight" in explained
    missing = autopar_here("explain", str(out), "h.0.mlp.c_f", check=False)
    assert missing.returncode == 2 and "did you mean" in missing.stderr


def test_plan_a_function_for_a_device_count(tmp_path):
    done = autopar_here("plan", "tests.test_cli:tiny_gpt", "--devices", "4", "--hardware",
                        "cpu", "--precision", "fp32", "-q")
    assert "meshes tried" in done.stdout and "h.0-1  x2" in done.stdout


def test_calibrate_under_torchrun_writes_a_profile(tmp_path):
    """A world of one process (links need more ranks to measure; the command is the same)."""
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "1", "-m", "autopar.cli", "calibrate", "--no-compute", "-o",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from autopar.hardware import HardwareProfile

    assert HardwareProfile.load(str(out)).name


def test_calibrate_needs_torchrun():
    assert "--output" in autopar_here("calibrate", "--help").stdout
    done = autopar_here("calibrate", check=False)
    assert done.returncode == 2 and "torchrun" in done.stderr


def test_bad_arguments_are_errors_naming_them():
    done = autopar_here("plan", "gpt2", "--mesh", "8y8", check=False)
    assert done.returncode == 2 and "--mesh '8y8'" in done.stderr


def test_a_preset_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    done = autopar_here("plan", "llama3-8b", "--mesh", "8", "-q", check=False)
    assert done.returncode == 2
    assert "llama3-8b is a Hugging Face model" in done.stderr
    assert "pip install transformers" in done.stderr
