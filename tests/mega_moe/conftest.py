"""The symmetric buffers a MegaMoE test module shares (built on first use, destroyed collectively at its end)."""

import pytest

from tests.support.buffer_helpers import coll
from tests.support.mega_moe import SymmBuffers


@pytest.fixture(scope="module")
def env():
    e = SymmBuffers()
    yield e
    for b in e.bufs.values():
        coll(b.destroy, what="destroy")
