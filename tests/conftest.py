import pytest
from hypothesis import settings

from tests.world import get_world


@pytest.fixture(scope="session")
def world2():
    return get_world(2)


@pytest.fixture(scope="session")
def world4():
    return get_world(4)


# Files whose tests start processes of their own (worlds, torchrun, the CLI, a browser).
_OWN_PROCESSES = {"test_bad_inputs.py", "test_cli.py", "test_progress.py", "test_report.py",
                  "test_train_example.py", "test_world.py"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick: runs in this process, no gloo world (`pytest -m quick`: the tier to "
        "run before every commit)")


def pytest_collection_modifyitems(config, items):
    """Mark `quick` every test that needs no gloo world and starts no process."""
    for item in items:
        if not {"world2", "world4"} & set(getattr(item, "fixturenames", ())) and \
                item.path.name not in _OWN_PROCESSES:
            item.add_marker(pytest.mark.quick)


# Hypothesis profiles: CI runs a fixed, derandomized budget; `--hypothesis-profile=soak` many more.
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True)
settings.register_profile("soak", max_examples=1000, derandomize=False, print_blob=True)
settings.load_profile("ci")
