import pytest
from hypothesis import settings

from tests.world import get_world


@pytest.fixture(scope="session")
def world2():
    return get_world(2)


@pytest.fixture(scope="session")
def world4():
    return get_world(4)


# Hypothesis profiles: CI runs a fixed, derandomized budget; `--hypothesis-profile=soak` many more.
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True)
settings.register_profile("soak", max_examples=1000, derandomize=False, print_blob=True)
settings.load_profile("ci")
