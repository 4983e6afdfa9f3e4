"""Run a benchmark script with autopar imported from another checkout (a git worktree of an
older commit), for baselines measured in the same minutes as the new code:

    git worktree add /tmp/old <commit>
    python benchmarks/at_checkout.py /tmp/old benchmarks/plan_once.py 70b 80
    python benchmarks/at_checkout.py /tmp/old /tmp/old/benchmarks/planning_time.py \
        --search 70b:80:1024

autopar is installed editable from this checkout, with its subpackages mapped from the
top-level passes/, solver/ and runtime/ folders; this points that mapping, and the import
path, at the other checkout. Scripts that start fresh Python processes (planning_time's
--rows) import this checkout's code in them: time those with plan_once.py instead.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parents[1])


def main() -> None:
    root = str(Path(sys.argv[1]).resolve())
    for finder in sys.meta_path:  # setuptools' editable finder keeps a name -> path mapping
        mapping = getattr(importlib.import_module(finder.__module__), "MAPPING", None) \
            if hasattr(finder, "__module__") else None
        if isinstance(mapping, dict):
            for name, path in mapping.items():
                mapping[name] = path.replace(HERE, root)
    sys.path.insert(0, root)
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
