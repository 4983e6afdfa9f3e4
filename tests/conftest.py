import pytest

from tests.world import get_world


@pytest.fixture(scope="session")
def world2():
    return get_world(2)


@pytest.fixture(scope="session")
def world4():
    return get_world(4)
