"""Run a function in a forked child process while this one goes on with other work.

Tracing a deep model checks that its layers are copies of each other by running the whole
model on fake tensors (passes/fold.py), and exports the model cut to two layers; the two do
not depend on each other, so on a machine with a second core the check runs in a child
forked from the tracer (sharing its fake model copy-on-write) while the tracer exports (and,
in `autopar.plan`, plans from the copied layers: the plan is kept only if the check holds).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any


def can_fork() -> bool:
    """Whether this process can fork a child worth forking: os.fork exists, another CPU core
    can run it, and CUDA is not initialized (a forked child cannot use it)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return hasattr(os, "fork") and cores > 1 and not torch.cuda.is_initialized()


class Forked:
    """`fn()` computed in a forked child: `result()` waits for it and returns what it
    returned, or raises what it raised. A child that dies without answering (killed, or an
    answer that does not pickle or unpickle) is not trusted: `result()` then computes `fn()`
    here."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer, then leave without running the parent's exit hooks
            os.close(read)
            try:
                answer = _pickled(fn)
                with os.fdopen(write, "wb") as out:
                    out.write(answer)
            finally:
                os._exit(0)
        os.close(write)
        self.pid, self.read = pid, read

    def result(self) -> Any:
        """What `fn()` returned in the child (raises what it raised)."""
        with os.fdopen(self.read, "rb") as answer:
            data = answer.read()
        os.waitpid(self.pid, 0)
        self.pid = None
        try:
            ok, value = pickle.loads(data)
        except Exception:  # noqa: BLE001 - no answer (b""), or one this process cannot rebuild
            return self.fn()
        if ok:
            return value
        raise value

    def cancel(self) -> None:
        """Stop the child and forget its answer (the caller failed before it needed it)."""
        if self.pid is not None:
            _stop(self.pid, lambda: os.close(self.read))
            self.pid = None


class ForkedStream:
    """The items `items()` yields, computed in a forked child and read here one at a time as
    the child sends them (`next()`): the caller goes on with its own work meanwhile and takes
    each item when it needs it. An item that does not pickle ends the stream, as does an
    exception (the caller computes what it lacks itself)."""

    def __init__(self, items: Callable[[], Iterator[Any]]):
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: send each item, then leave without the parent's exit hooks
            os.close(read)
            try:
                with os.fdopen(write, "wb") as out:
                    _send_all(items, out)
            finally:
                os._exit(0)
        os.close(write)
        self.pid, self.answers = pid, os.fdopen(read, "rb")

    def next(self) -> Any:
        """The child's next item (waiting for it); None when it sends no more."""
        if self.pid is None:
            return None
        head = self.answers.read(8)
        if len(head) == 8:
            data = self.answers.read(struct.unpack("<Q", head)[0])
            try:
                return pickle.loads(data)
            except Exception:  # noqa: BLE001 - cut short (the child was killed): no more
                pass
        self.cancel()
        return None

    def cancel(self) -> None:
        """Stop the child (if still working) and close the stream."""
        if self.pid is not None:
            _stop(self.pid, self.answers.close)
            self.pid = None


def _stop(pid: int, close: Callable[[], None]) -> None:
    """Kill child `pid` (if still running), `close` what this process reads its answer from,
    and reap the child."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    close()
    os.waitpid(pid, 0)


def _send_all(items: Callable[[], Iterator[Any]], out) -> None:
    """Each item pickled and written, length first, as soon as it is computed; the first
    that raises or does not pickle ends the stream."""
    try:
        for item in items():
            data = pickle.dumps(item)
            out.write(struct.pack("<Q", len(data)) + data)
            out.flush()
    except Exception:  # noqa: BLE001 - the parent computes the rest itself
        pass


def _pickled(fn: Callable[[], Any]) -> bytes:
    """(True, fn()) or (False, the exception it raised), pickled; b"" when that does not
    pickle."""
    try:
        answer = (True, fn())
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        answer = (False, e)
    try:
        return pickle.dumps(answer)
    except Exception:  # noqa: BLE001 - the parent computes it itself
        return b""
