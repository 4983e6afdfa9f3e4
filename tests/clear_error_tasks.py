"""What the gloo ranks run for tests/test_clear_errors.py: models and misuses that used to fail
with an error from deep inside torch (or hang), run on every rank; a misuse returns the error
the rank raised ("Type: message"), so the test sees that every rank raised and what it said."""

from __future__ import annotations

import copy
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests.rank_tasks import build, check_training, in_float64, mesh_for


class Recurrent(nn.Module):
    """A GRU or LSTM over a sequence and a linear head on its last step."""

    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, num_layers=2, batch_first=True, dropout=dropout)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def rnn_equivalence(kind: str, force: str, microbatches: int = 1, dropout: float = 0.0) -> None:
    """An nn.GRU / nn.LSTM model trains as on one device (float64, 2 AdamW steps), its
    recurrent op sharded by the batch (it has a sharding rule: no warning); with dropout
    between its layers, it runs whole on every rank, drawing what one device draws."""
    torch.manual_seed(0)
    model, (x, y) = in_float64(Recurrent(kind, dropout),
                               (torch.randn(4, 5, 8), torch.randn(4, 4)))
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, mesh_for((dist.get_world_size(),)), loss_fn=F.mse_loss,
                                 example_inputs=(x, y), force={"dp": force},
                                 microbatches=microbatches)
    unsharded = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not unsharded, unsharded
    check_training(pm, ref, F.mse_loss, x, y, steps=2)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def hf_gpt2_default_config() -> tuple[str, float]:
    """transformers' GPT2LMHeadModel as its config makes it (use_cache=True), trained on the
    loss it computes from labels: what step() raised, then the loss of a step with
    `model.config.use_cache = False`, as the error says."""
    import transformers

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8,
            bos_token_id=None, eos_token_id=None))

    x = torch.randint(0, 64, (4, 8))
    mesh = mesh_for((dist.get_world_size(),))
    message = _error(lambda: autopar.parallelize(gpt2(), mesh).step(input_ids=x, labels=x))
    model = gpt2()
    model.config.use_cache = False
    return message, float(autopar.parallelize(model, mesh).step(input_ids=x, labels=x))


_PMODEL = None  # a parallelized model, as a training script's global


def _penalized_loss(out, target):
    return F.cross_entropy(out, target) + 1e-3 * _PMODEL.net[0].weight.pow(2).sum()


def loss_fn_reads_pmodel(how: str) -> str:
    """A loss_fn that reads the parallelized model for a weight penalty: `pmodel` in its
    closure ("closure") or as a global ("global")."""
    global _PMODEL
    model, _, (x, y) = build("mlp")
    mesh = mesh_for((dist.get_world_size(),))
    if how == "global":
        _PMODEL = pm = autopar.parallelize(model, mesh, loss_fn=_penalized_loss)
    else:
        pm = autopar.parallelize(model, mesh, loss_fn=lambda out, t: F.cross_entropy(out, t) +
                                 1e-3 * pm.net[0].weight.pow(2).sum())
    try:
        return _error(lambda: pm.step(x, y))
    finally:
        _PMODEL = None


def group_timeouts() -> dict:
    """Seconds of the default group's timeout as torch_compat reads it, and those of the groups
    autopar makes: the control plane's and a mesh's it builds from a plan (its dp dimension
    spans the world: the default group; tp, of one rank each: new groups)."""
    from types import SimpleNamespace

    from autopar.api import mesh_of
    from autopar.passes import torch_compat
    from autopar.runtime.control import control_group

    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    n = dist.get_world_size()
    plan = SimpleNamespace(mesh=SimpleNamespace(size=n, shape=(n, 1), names=("dp", "tp")))
    mesh = mesh_of(plan)
    return {"default": torch_compat.default_timeout().total_seconds(),
            "control": seconds(control_group()),
            "mesh": [seconds(mesh.get_group(k)) for k in range(mesh.ndim)]}


def step_while_peer_elsewhere(peer: str) -> tuple[str, float]:
    """Rank 0 calls step() while rank 1 waits in a collective of its own ("barrier") or makes
    no call ("none"); returns what this rank raised and after how many seconds."""
    model, loss_fn, (x, y) = build("mlp")
    pm = autopar.parallelize(model, mesh_for((dist.get_world_size(),)), loss_fn=loss_fn,
                             example_inputs=(x, y))
    start = time.monotonic()
    if dist.get_rank() == 0:
        message = _error(lambda: pm.step(x, y))
    elif peer == "barrier":
        message = _error(dist.barrier)
    else:
        time.sleep(1.0)
        message = "no call"
    return message, time.monotonic() - start
