import os
import sys

# The suite starts a few hundred Python processes (gloo ranks, torchrun, the command line),
# each importing autopar: where the environment says not to write bytecode
# (PYTHONDONTWRITEBYTECODE), each would compile autopar's modules again (1.3 s of a 4 s
# import on a 2-core machine). Let the first write it and the others read it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.world import get_world  # noqa: E402


@pytest.fixture(scope="session")
def world2():
    return get_world(2)


@pytest.fixture(scope="session")
def world4():
    return get_world(4)


# Files whose tests start processes of their own (worlds, torchrun, the CLI, a browser).
_OWN_PROCESSES = {"test_bad_inputs.py", "test_clear_errors.py", "test_cli.py",
                  "test_progress.py", "test_report.py", "test_train_example.py", "test_world.py"}
# Single-process tests of 8 s or more on a 2-core machine (solver properties at scale, the
# mesh search's worker processes): in the full run only.
_SLOW = {"test_memory_budget_holds_at_gpu_scale", "test_backends_agree",
         "test_the_solvers_bound_is_below_every_plan_whatever_the_budget",
         "test_relaxed_bound_is_below_every_plan_that_fits",
         "test_candidates_are_planned_a_microbatch_count_at_a_time",
         "test_worker_processes_find_the_plan_one_process_finds"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick: runs in this process, no gloo world (`pytest -m quick`: the tier to "
        "run before every commit)")


def pytest_collection_modifyitems(config, items):
    """Mark `quick` every test that needs no gloo world, starts no process and is not one of
    the few slow ones."""
    for item in items:
        if not {"world2", "world4"} & set(getattr(item, "fixturenames", ())) and \
                item.path.name not in _OWN_PROCESSES and item.originalname not in _SLOW:
            item.add_marker(pytest.mark.quick)


# Hypothesis profiles: CI runs a fixed, derandomized budget; `--hypothesis-profile=soak` many more.
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True)
settings.register_profile("soak", max_examples=1000, derandomize=False, print_blob=True)
settings.load_profile("ci")
