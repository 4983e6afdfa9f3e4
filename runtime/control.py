"""The control plane: small agreements among all ranks, on a CPU (gloo) process group of their
own, before any collective of the model.

Every rank checks what it is about to do (the inputs of a step, a plan, a checkpoint) and
`agree` makes all ranks learn, in one small all-gather, whether every rank passed its check and
whether their signatures match. When something failed anywhere, every rank raises the same
`RankError`, carrying each failing rank's message, instead of some ranks waiting forever in the
model's first collective for a rank that has given up.

It runs on gloo whatever the model's backend, so agreeing never synchronizes a GPU stream, and
under the default process group's timeout (init_process_group's `timeout=`; a new group would
take torch's default, 30 minutes). Each rank notes in the process group's key-value store how
many agreements it has reached (one small write), so that when a rank waits in an agreement
past the timeout, it can name the ranks that never reached it: they are elsewhere (another
call, a collective of their own, or none), and the error says so on the ranks that waited.

When collective work itself fails (`guard`: a step, a forward call), ranks cannot agree by
collectives any more: each rank leaves a message in the process group's key-value store. A rank
whose own code raised reports its error and raises at once; a rank whose collective failed (a
peer died, or timed out after the process group's timeout because a peer gave up) reports that,
waits a bounded time for every rank's message and raises a RankError naming the ranks that
failed (with their errors) and those that never answered (died or blocked). The process group is
unusable afterwards: its collectives are out of step.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import pickle
import time

import torch
import torch.distributed as dist

from autopar.passes import torch_compat

_MASK = (1 << 62) - 1
FAILURE_WAIT = 10.0  # seconds a rank whose collective failed waits for the others' messages
_COLLECTIVE_FAILURES = ("Connection closed", "Connection reset", "Timed out", "timed out",
                        "NCCL", "Gloo", "gloo")
_instances = itertools.count()


class RankError(RuntimeError):
    """Something failed on one or more ranks; raised on every rank, with every failing rank's
    message."""


def agreed(error: BaseException) -> BaseException:
    """Mark `error` as raised on every rank together (after an agreement): `guard` lets it
    through unchanged."""
    error.autopar_agreed = True
    return error


def signature(*parts) -> int:
    """A 62-bit hash of plain data (ints, strings, tuples)."""
    digest = hashlib.sha256(pickle.dumps(parts, protocol=4)).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


_CHUNK = 1 << 20


def content_hash(t: torch.Tensor) -> int:
    """A hash of a tensor's values, equal on every rank that holds equal values: integer
    arithmetic on the raw bits (exact, and independent of summation order, since integer sums
    wrap around the same way in any order)."""
    x = t.detach().reshape(-1).clone()  # contiguous and aligned for the bit view
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    bits = x.view(torch.uint8) if (x.numel() * x.element_size()) % 4 else x.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=x.device) % 65521 + 1
        total += torch.sum(chunk * weights)
    return signature(int(total.item()), tuple(t.shape), str(t.dtype))


_GROUP: list = []  # (the world group it was made in, the gloo group, its agreement counter)
_REACHED = "autopar/agreements/"  # + rank: how many agreements that rank has reached


def control_group():
    """The gloo group agreements run on: one per process and world (every parallelized model
    shares it; a new group would start threads of its own on every rank, for every model),
    with the default group's timeout."""
    world = dist.group.WORLD
    if not _GROUP or _GROUP[0] is not world:
        # a store kept from an earlier world (torchrun's, across restarts) holds its counts
        torch_compat.default_store().set(_REACHED + str(dist.get_rank()), "0")
        group = dist.new_group(backend="gloo", timeout=torch_compat.default_timeout())
        _GROUP[:] = [world, group, itertools.count(1)]
    return _GROUP[1]


class Control:
    """Agreements over every rank of the world, on a gloo group made for them (shared by every
    Control of the process: agreements are collectives every rank runs in the same order)."""

    def __init__(self):
        self.group = control_group()
        self._agreements = _GROUP[2]  # shared: agreements are counted alike on every rank
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._prefix = f"autopar/failure/{next(_instances)}/"

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run collective work; if it raises on this rank, raise a RankError that says what
        happened on every rank (see the module docstring), within FAILURE_WAIT seconds of the
        failure reaching this rank."""
        try:
            yield
        except RankError:
            raise
        except BaseException as e:
            if getattr(e, "autopar_agreed", False):
                raise
            raise self._failed(what, e) from e

    def _failed(self, what: str, error: BaseException) -> RankError:
        text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:400]}"
        collective = any(s in text for s in _COLLECTIVE_FAILURES)
        store = torch_compat.default_store()
        store.set(self._prefix + str(self.rank),
                  ("collective failed: " if collective else "raised ") + text)
        if not collective:
            return RankError(f"{what} failed on rank {self.rank}: {text}\n(the other ranks "
                             "raise too, when their collectives with this rank fail or time "
                             "out; the process group cannot be used afterwards)")
        reports: dict[int, str] = {}
        deadline = time.monotonic() + FAILURE_WAIT
        while len(reports) < self.size and time.monotonic() < deadline:
            for r in range(self.size):
                key = self._prefix + str(r)
                if r not in reports and store.check([key]):
                    reports[r] = store.get(key).decode()
            time.sleep(0.05)
        lines = [f"  rank {r}: {m}" for r, m in sorted(reports.items())]
        silent = [r for r in range(self.size) if r not in reports]
        if silent:
            lines.append(f"  rank(s) {silent} did not answer within {FAILURE_WAIT:g} s: died, "
                         "or blocked in a collective")
        raised = [r for r, m in reports.items() if m.startswith("raised")]
        cause = f"rank(s) {raised} raised" if raised else (
            f"rank(s) {silent} died or stopped answering" if silent else "a collective failed")
        return RankError(f"{what} failed: {cause}; the process group cannot be used "
                         "afterwards.\n" + "\n".join(lines))

    def exchange(self, what: str, error: str | None, values: list[int]) -> list[list[int]]:
        """Every rank passes its own `error` (None when its check passed) and a few integers
        (signatures); returns every rank's integers, on every rank. If any rank failed, every
        rank raises RankError with the failing ranks' messages instead."""
        mine = torch.tensor([1 if error else 0, *values], dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(self.size)]
        self._agree(what, lambda: dist.all_gather(rows, mine, group=self.group))
        failed = [r for r in range(self.size) if rows[r][0].item()]
        if failed:
            messages = self.gather_objects(error)
            text = "\n".join(f"  rank {r}: {messages[r]}" for r in failed)
            raise RankError(f"{what} failed on rank(s) {failed}:\n{text}")
        return [row[1:].tolist() for row in rows]

    def check_same(self, what: str, rows: list[list[int]], column: int, detail: str = "",
                   group_of=None) -> None:
        """Raise on every rank if ranks of one group (`group_of(rank)`; default: all ranks)
        passed different values in `column` of `rows` (from `exchange`); `detail` says in
        words what this rank's value stands for. Every rank sees the same rows, so all take
        the same branch (the error path gathers the details: a collective)."""
        groups: dict = {}
        for r, row in enumerate(rows):
            groups.setdefault(group_of(r) if group_of else 0, set()).add(row[column])
        if all(len(values) == 1 for values in groups.values()):
            return
        details = self.gather_objects(detail)
        by_rank = "\n".join(f"  rank {r}: {details[r] or format(rows[r][column], 'x')}"
                            for r in range(self.size))
        raise RankError(f"{what}:\n{by_rank}")

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, on every rank."""
        out = [None] * self.size
        self._agree("gathering a value from every rank",
                    lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s `obj`, on every rank."""
        box = [obj]
        self._agree(f"receiving a value from rank {src}",
                    lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def _agree(self, what: str, collective) -> None:
        """Run one collective of the control group, noting first that this rank reached it;
        if it times out (or a peer's connection closed), raise a RankError naming the ranks
        that never reached it."""
        count = next(self._agreements)
        store = torch_compat.default_store()
        store.set(_REACHED + str(self.rank), str(count))
        try:
            collective()
        except RuntimeError as e:
            if not any(s in str(e) for s in _COLLECTIVE_FAILURES):
                raise
            raise self._not_reached(what, count, store, e) from e

    def _not_reached(self, what: str, count: int, store, error: RuntimeError) -> RankError:
        try:
            absent = [r for r in range(self.size) if not store.check([_REACHED + str(r)]) or
                      int(store.get(_REACHED + str(r))) < count]
        except RuntimeError:  # the store is gone too (its host died)
            absent = []
        timeout = torch_compat.default_timeout()
        first = (str(error).strip().splitlines() or [""])[0][:400]
        if absent and "imed out" not in first:
            cause = (f"rank(s) {absent} did not reach it, and the connection to them failed "
                     f"({first}): they died or left the process group")
        elif absent:
            cause = (f"rank(s) {absent} did not reach it within the process group's timeout "
                     f"({timeout.total_seconds():g} s): they are elsewhere (in another call, "
                     "a collective of their own, or no call). Every rank must make each call of "
                     "a parallelized model (step, forward, build, state_dict, checkpoints...), "
                     "in the same order")
        else:
            cause = f"every rank reached it, but it failed: {first}"
        # a peer inside the model's collectives (guard) reads this as this rank's report
        with contextlib.suppress(RuntimeError):
            store.set(self._prefix + str(self.rank), f"raised RankError: waited for {absent} "
                      f"in an agreement ({what})")
        return RankError(f"rank {self.rank} waited in an agreement of all ranks ({what}); "
                         f"{cause}. The process group cannot be used afterwards.")
