"""A persistent pool of CPU rank processes sharing one gloo process group.

Starting a fresh set of processes costs seconds, so the tests share one `World` per world
size and send it small tasks:

    world = get_world(4)
    results = world.run(some_module_level_function, arg, key=value)

`run` calls the function on every rank (it reads its rank through
`torch.distributed.get_rank()`) and returns one result per rank, in rank order.
Arguments and results travel by plain pickle (tensors are copied by value).

If a task fails on any rank, `run` raises `WorkerError` with every failing
rank's traceback. A failure may leave the other ranks blocked in a collective,
or leave the ranks out of step, so after any failure the world is torn down
and a fresh one is started in the background; the next `run` uses it.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WorkerError(RuntimeError):
    """A task failed, crashed or timed out on at least one rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, size: int, port: int, repo_root: str, conn,
                 pg_timeout: float | None = None) -> None:
    """Entry point of one rank process."""
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import datetime

        timeout = datetime.timedelta(seconds=pg_timeout) if pg_timeout else None
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timeout)
    except BaseException:
        _send(conn, ("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        _flush()
        return
    _send(conn, ("ready", None))

    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent went away
            break
        if task is None:  # orderly shutdown
            break
        module_name, qualname, args, kwargs = task
        try:
            result = _resolve(module_name, qualname)(*args, **kwargs)
            reply = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()), pickle.HIGHEST_PROTOCOL)
        _flush()
        try:
            conn.send_bytes(reply)
        except (EOFError, OSError):
            break

    _flush()
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class World:
    """`size` spawned CPU processes in one gloo process group, reused across tasks."""

    def __init__(self, size: int, timeout: float = 120.0, error_grace: float = 3.0,
                 pg_timeout: float | None = None, start_timeout: float = 600.0):
        self.size = size
        self.pg_timeout = pg_timeout  # seconds a collective may wait (None: torch's default)
        self.timeout = timeout  # seconds to wait for all results of one run
        # seconds to wait for the processes to start (importing torch on a loaded machine can
        # take long; a slow start is not what a run's timeout is about)
        self.start_timeout = start_timeout
        self.error_grace = error_grace  # seconds to wait for the others once one rank failed
        self._procs: list = []
        self._conns: list = []
        self._ready = False
        self._atexit_registered = False

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> "World":
        """Start the processes (if not running) and wait until the group is up."""
        if not self._procs:
            self._spawn()
        self._wait_ready()
        return self

    def close(self) -> None:
        """Shut the processes down (orderly if possible). A later `run` restarts them."""
        for conn in self._conns:
            try:
                _send(conn, None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._teardown()

    def __enter__(self) -> "World":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> None:
        ctx = _context()
        port = free_port()
        self._procs, self._conns = [], []
        for rank in range(self.size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.size, port, REPO_ROOT, child_conn, self.pg_timeout),
                name=f"world{self.size}-rank{rank}",
                daemon=False,  # daemonic processes may not have children of their own
            )
            p.start()
            child_conn.close()  # so that the parent sees EOF when the child dies
            self._procs.append(p)
            self._conns.append(parent_conn)
        self._ready = False
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True

    def _teardown(self) -> None:
        """Terminate the processes without asking (they may be stuck in a collective)."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for conn in self._conns:
            conn.close()
        for p in self._procs:
            try:
                p.close()
            except ValueError:
                pass
        self._procs, self._conns = [], []
        self._ready = False

    def _restart(self) -> None:
        """Tear down and start a fresh world in the background (awaited by the next run)."""
        self._teardown()
        self._spawn()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        replies, missing = self._collect(self.start_timeout, error_grace=self.start_timeout)
        errors = {r: payload for r, (status, payload) in replies.items() if status != "ready"}
        if errors or missing:
            self._teardown()
            raise WorkerError(self._describe("world failed to start", errors, missing))
        self._ready = True

    # -- running tasks -----------------------------------------------------------

    def run(self, fn, *args, **kwargs) -> list:
        """Call module-level `fn(*args, **kwargs)` on every rank; return results in rank order."""
        module_name, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname or module_name == "__main__":
            raise ValueError(
                "World.run needs a module-level function importable by name, "
                f"got {module_name}.{qualname}"
            )
        task = pickle.dumps((module_name, qualname, args, kwargs), pickle.HIGHEST_PROTOCOL)
        self.start()
        try:
            for conn in self._conns:
                conn.send_bytes(task)
            replies, missing = self._collect(self.timeout, error_grace=self.error_grace)
        except BaseException:  # e.g. KeyboardInterrupt: the ranks are in an unknown state
            self._teardown()
            raise
        errors = {r: payload for r, (status, payload) in replies.items() if status != "ok"}
        if errors or missing:
            # Ranks may be blocked in a collective or out of step with each other:
            # start over with a fresh world rather than trust this one.
            self._restart()
            what = f"{module_name}.{qualname} failed"
            raise WorkerError(self._describe(what, errors, missing))
        return [replies[r][1] for r in range(self.size)]

    def outcomes(self, fn, *args, **kwargs) -> list[tuple[str, object]]:
        """Like `run`, but returns every rank's (status, payload) instead of raising when some
        rank failed or died ("ok", "error", or "missing" for a rank that did not answer); the
        world is restarted after a failure."""
        task = pickle.dumps((fn.__module__, fn.__qualname__, args, kwargs),
                            pickle.HIGHEST_PROTOCOL)
        self.start()
        for conn in self._conns:
            conn.send_bytes(task)
        replies, missing = self._collect(self.timeout, error_grace=self.error_grace)
        if missing or any(status != "ok" for status, _ in replies.values()):
            self._restart()
        return [replies.get(r, ("missing", None)) for r in range(self.size)]

    def _collect(self, timeout: float, error_grace: float):
        """Wait for one message per rank. Returns ({rank: (status, payload)}, [missing ranks])."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        conn_rank = {conn: r for r, conn in enumerate(self._conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(replies) < self.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = [c for c, r in conn_rank.items() if r not in replies]
            waiting += [s for s, r in sentinel_rank.items() if r not in replies]
            for obj in multiprocessing.connection.wait(waiting, timeout=remaining):
                r = conn_rank.get(obj, sentinel_rank.get(obj))
                if r in replies:
                    continue
                conn = self._conns[r]
                try:
                    # a dead process may still have left its reply in the pipe
                    if obj in conn_rank or conn.poll():
                        replies[r] = pickle.loads(conn.recv_bytes())
                        continue
                except (EOFError, OSError):
                    pass
                except Exception:
                    tb = traceback.format_exc()
                    replies[r] = ("error", f"could not unpickle the reply:\n{tb}")
                    continue
                proc = self._procs[r]
                proc.join(1.0)
                replies[r] = ("error", f"rank {r} process died (exit code {proc.exitcode})")
            if any(status not in ("ok", "ready") for status, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + error_grace)
        missing = [r for r in range(self.size) if r not in replies]
        return replies, missing

    def _describe(self, what: str, errors: dict, missing: list) -> str:
        parts = [f"{what} (world size {self.size})"]
        for r in sorted(errors):
            parts.append(f"--- rank {r} ---\n{errors[r]}")
        if missing:
            parts.append(
                f"ranks {missing} did not answer (timeout {self.timeout:g}s, or blocked after "
                "another rank failed); the world was restarted"
            )
        return "\n".join(parts)


def _context():
    """Rank processes forked from a server process that imported torch, torch.export,
    autopar, transformers and the test models once (multiprocessing's forkserver with a
    preload): a rank starts in a fraction of a second instead of importing them again (8 s of
    CPU each on this machine; the suite starts about 30 ranks). The server starts as a fresh
    process, and imports only. AUTOPAR_TEST_START=spawn spawns each rank fresh instead."""
    if os.environ.get("AUTOPAR_TEST_START") == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


PRELOAD = ["torch", "torch.distributed", "torch.export", "torch._dynamo", "autopar",
           "autopar.api", "autopar.parallelized", "autopar.checkpoint", "autopar.planner",
           "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.mixtral.modeling_mixtral", "tests.models", "tests.rank_tasks"]

_WORLDS: dict[int, World] = {}


def get_world(size: int) -> World:
    """The shared world of `size` ranks for this process (started on first use)."""
    world = _WORLDS.get(size)
    if world is None:
        world = _WORLDS[size] = World(size)
    return world.start()


@atexit.register
def _close_worlds() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()
