"""Relaxations worked out beside the planner, in a forked child.

The memory search of one microbatch count (autopar/planner.py `plan_round`) takes its levels
in order, and rules most of them out by their linear relaxations alone: they do not fit, or
cannot beat a plan found. A relaxation does not depend on what came before it (only the
decision taken from it does), so on a machine with a second core a child forked from the
planner works some out while the planner solves the others (passes/forked.py
`ForkedStream`): at the first count the levels between the first two and the last, then
every relaxation of the next count, which the planner would otherwise trace and solve
after the first count's plan. The planner takes each decision from the child's numbers as
it would from its own, and traces the next count itself only when a level is left to solve.
On Llama-3 70B over (8, 8) H100s (bf16-mixed, batch 64 x 4096) the child works out the
selective level at one microbatch and the whole 2-microbatch round (a trace at half the
batch and three relaxations, 6-7 s), which then ends without an integer solve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from autopar.passes.forked import ForkedStream, can_fork

# What a child works out, by (microbatch count, key): for a memory level's key (its
# recomputation, parameters freed after forward) its relaxation's floor in seconds of a step,
# or the reason not even the relaxation fits (a str); for ("floor", mode) the compute floor
# per microbatch of recomputation `mode`.
Foreseen = dict


class Foresight:
    """Relaxations a forked child works out: `start(wanted)` forks one that computes `work(
    wanted)` (yielding ((count, key), value) in the order of `wanted`), `get(count, key)`
    waits for that value (None where no child was asked for it, or it stopped before it:
    the planner then works it out itself), `cancel()` stops the children still working."""

    def __init__(self, work: Callable[[list[tuple]], Iterator[tuple]]):
        self.work = work
        self.children: list[tuple[set, ForkedStream]] = []
        self.answers: Foreseen = {}

    @staticmethod
    def possible() -> bool:
        """Whether this process can fork a child worth forking (passes/forked.py)."""
        return can_fork()

    def start(self, wanted: list[tuple]) -> None:
        """Fork a child working out `wanted` ((count, key) pairs, in that order), less what
        is known or asked of a child already."""
        asked = set(self.answers).union(*(keys for keys, _ in self.children))
        wanted = [k for k in wanted if k not in asked]
        if wanted:
            self.children.append((set(wanted), ForkedStream(lambda: self.work(wanted))))

    def foreseeing(self, m: int) -> bool:
        """Whether a child works on count `m`."""
        return any(k[0] == m for keys, _ in self.children for k in keys)

    def get(self, m: int, key) -> float | str | None:
        """The child's value for `key` at count `m` (waiting for it); None without one."""
        want = (m, key)
        for keys, child in self.children:
            while want in keys and want not in self.answers:
                item = child.next()
                if item is None:
                    keys.clear()  # the child stopped: nothing more from it
                    break
                got, value = item
                self.answers[got] = value
        return self.answers.get(want)

    def known(self, m: int) -> Callable[[tuple], float | str | None] | None:
        """`get` at count `m`, or None where no child works on it."""
        if not self.foreseeing(m) and not any(k[0] == m for k in self.answers):
            return None
        return lambda key: self.get(m, key)

    def cancel(self) -> None:
        """Stop every child still working (planning ended without needing them)."""
        for _, child in self.children:
            child.cancel()
        self.children.clear()
