"""Progress of long work (planning, calibration) on stderr: one line per stage, with counts.

Shown when stderr is a terminal, or as `PlanOptions.progress` says (True: always, False:
never); nothing goes to stdout, which belongs to the user's program.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """Writes "autopar: <stage>" lines to stderr, with the seconds since it started."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        """Report that a stage begins (or ended): `message` says which, with its counts."""
        if self.enabled:
            print(f"autopar [{time.perf_counter() - self.start:6.1f} s] {message}",
                  file=sys.stderr, flush=True)
