"""Python's cyclic garbage collector paused while autopar plans.

Planning builds millions of small objects that live until the plan is returned (fake tensors,
FX nodes, strategies, solver rows), and each automatic collection walks all of them: on this
2-core machine, 2 of the 12 seconds of planning Llama-3 70B on an (8, 8) mesh. Paused, what
planning drops is freed by reference counting as before, and the few reference cycles it
leaves are collected when the collector runs next (the planner's peak memory grows by about
a tenth: 314 -> 343 MiB for that 70B plan). In the forked workers of a mesh search the
paused collector also leaves the pages they share with the parent unwritten (no
copy-on-write of every object it would visit).
"""

from __future__ import annotations

import contextlib
import functools
import gc


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off meanwhile; as it was (on or off) afterwards. Nests."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def planning(fn):
    """`fn` run with the cyclic garbage collector paused (collector_paused)."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with collector_paused():
            return fn(*args, **kwargs)
    return paused
