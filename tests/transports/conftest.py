"""Fixtures and helpers shared by the transport-layer tests (``tests/transports``).

Every test that builds a transport uses the ``tp`` fixture (or :func:`make_transport` +
:func:`destroy_quietly`), which creates it on ``MPI.COMM_WORLD`` and destroys it in teardown,
also when the test left it POISONED (a timeout or abort): ``destroy`` then decides collectively
to skip the frees. Tests are collective (``@pytest.mark.mpi``): same calls, same order on every
rank; ``tests/conftest.py`` makes their pass/fail collective.

"""

from __future__ import annotations

import gc

import pytest

from tests.transports.helpers import destroy_quietly, make_transport


@pytest.fixture
def tp():
    """A fresh UBMEM transport on ``MPI.COMM_WORLD`` (one node), destroyed in teardown.

    For tests that poison, abort, destroy or otherwise consume their transport.
    """
    t = make_transport()
    yield t
    destroy_quietly(t)


@pytest.fixture(scope="module")
def shared_tp():
    """One UBMEM transport per test module, for tests that leave it OPEN and hold no views.

    Creating a transport costs ~0.5 s at 8 oversubscribed ranks; sharing it keeps the suite in
    budget. Each test makes its own windows (they are freed with the transport at module end).
    A test that leaves it POISONED makes the module's later tests fail with TransportPoisoned.
    """
    t = make_transport()
    yield t
    destroy_quietly(t)


@pytest.fixture(autouse=True, scope="module")
def _frozen_gc():
    """Freeze the objects that exist when a test module starts (``gc.freeze``), unfreeze after.

    Workaround for a cost in the library, not a correctness device: ``UbmemTransport.destroy``
    calls ``gc.collect()`` once per window (``SymmetricWindow._live_view_count``), ~0.5 s each
    with torch + pytest loaded, i.e. seconds per create/destroy at 8 ranks on 2 cores.
    Frozen objects are skipped by collections, so those calls cost microseconds; objects made
    by the tests (views, cycles holding views) are still collected. See
    ``test_transports_lifecycle.py::test_destroy_collects_garbage_at_most_once``.
    """
    gc.freeze()
    yield
    gc.unfreeze()
