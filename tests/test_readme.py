"""The README's first snippet runs as shown: it plans GPT-2 small for 64 H100s, prints the plan
and explains an attention block."""

import contextlib
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_first_snippet_runs_as_shown():
    with open(os.path.join(ROOT, "README.md")) as f:
        snippet = re.search(r"```python\n(.*?)```", f.read(), re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})
    printed = out.getvalue()
    assert "autopar plan  mesh (dp=8,tp=8) on h100" in printed
    assert "predicted step" in printed and "h.0-11  x12" in printed
    assert "h.0.attn: the chosen strategy" in printed and "  chosen " in printed
