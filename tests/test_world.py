import pytest
import torch

from tests import world_tasks as tasks
from tests.world import WorkerError, World


def test_results_in_rank_order(world4):
    assert world4.run(tasks.rank_and_size) == [(r, 4) for r in range(4)]


def test_all_reduce(world4):
    assert world4.run(tasks.all_reduce_rank) == [6.0] * 4


def test_world2(world2):
    assert world2.run(tasks.all_reduce_rank) == [1.0, 1.0]


def test_tensor_args_and_kwargs(world2):
    x = torch.arange(3.0)
    out = world2.run(tasks.scaled_tensor, x, scale=2.0)
    torch.testing.assert_close(out[0], x * 2)
    torch.testing.assert_close(out[1], x * 4)


def test_local_function_rejected(world2):
    def local():
        pass

    with pytest.raises(ValueError, match="module-level"):
        world2.run(local)


@pytest.fixture(scope="module")
def short_world():
    """A world of its own for the tests that fail on purpose: a failure restarts the world,
    and the shared world4 would then import everything (transformers) again."""
    with World(4, timeout=60.0) as w:
        yield w


def test_error_on_one_rank_then_recover(short_world):
    with pytest.raises(WorkerError) as info:
        short_world.run(tasks.fail_on_rank, 2, "boom on rank two")
    msg = str(info.value)
    assert "boom on rank two" in msg and "rank 2" in msg and "ValueError" in msg
    assert short_world.run(tasks.all_reduce_rank) == [6.0] * 4


def test_error_before_collective_names_every_rank(short_world):
    """A rank that fails before a collective leaves the others blocked in it: the error carries
    the failing rank's message and names the blocked ranks (after the error grace period, not
    the run's whole timeout), and the next run gets a fresh, working world."""
    with pytest.raises(WorkerError) as info:
        short_world.run(tasks.fail_before_collective, 1, "rank one gave up")
    msg = str(info.value)
    assert "rank one gave up" in msg and "--- rank 1 ---" in msg
    assert "[0, 2, 3] did not answer" in msg
    assert short_world.run(tasks.all_reduce_rank) == [6.0] * 4


def test_hang_times_out_and_recovers():
    """A rank blocked in a collective its peer skipped does not answer: after the run's timeout
    the error names it, and the world is replaced by fresh processes that work."""
    with World(2, timeout=4.0) as w:
        pids = w.run(tasks.pid)
        with pytest.raises(WorkerError) as info:
            w.run(tasks.skip_collective, 0)
        msg = str(info.value)
        assert "[1] did not answer" in msg and "timeout 4s" in msg
        assert w.run(tasks.all_reduce_rank) == [1.0, 1.0]
        assert set(w.run(tasks.pid)).isdisjoint(pids)  # a fresh set of processes


def test_dead_rank_detected(short_world):
    with pytest.raises(WorkerError, match="rank 3 process died"):
        short_world.run(tasks.die_on_rank, 3)
    assert short_world.run(tasks.rank_and_size) == [(r, 4) for r in range(4)]
