"""examples/train_llama.py run as a user runs it: under torchrun, 2 gloo ranks, checkpointed,
then resumed; the resumed run must continue exactly where the uninterrupted one went."""

import os
import re
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq", "16",
        "--batch", "4", "--log-every", "1"]


def train(*args: str) -> str:
    """Run the example on 2 ranks under torchrun; returns what rank 0 printed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), "examples/train_llama.py", *TINY, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # torch's, on every rank
    return done.stdout


def losses(out: str) -> dict[int, float]:
    """step -> loss, from the progress lines."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step +(\d+) +loss (\S+) ", out, re.MULTILINE)}


def test_train_checkpoint_and_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # Uninterrupted: 6 steps, a checkpoint after step 4 (only: 6 is no multiple of 4).
    whole = train("--steps", "6", "--checkpoint-dir", ckpt, "--checkpoint-every", "4")
    assert "autopar plan" in whole and "predicted" in whole
    assert sorted(losses(whole)) == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(ckpt)) == ["step-4"]

    # Resumed from step 4: steps 5 and 6 see the same parameters (step 5's loss), the same
    # optimizer state (step 6's loss) and the same batches as the uninterrupted run.
    resumed = train("--steps", "6", "--checkpoint-dir", ckpt, "--checkpoint-every", "4",
                    "--resume")
    assert "resumed from step 4" in resumed
    after = losses(resumed)
    assert sorted(after) == [5, 6]
    assert after == {k: losses(whole)[k] for k in (5, 6)}, (whole, resumed)
