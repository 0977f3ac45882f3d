"""Which test files one process of a split job runs (``DEEPEP_ASCEND_TEST_SHARD``, read by
``tests/conftest.py``; ``scripts/test.sh`` splits its 1-rank job this way)."""

from __future__ import annotations

from collections.abc import Iterable

from deepep_ascend import settings


def parse_shard(raw: str | None) -> tuple[int, int] | None:
    """``(i, n)`` from ``"i/n"`` (``0 <= i < n``), ``None`` for ``None``.

    Raises:
        ValueError: ``raw`` is not of that form, naming the variable and the value.
    """
    if raw is None:
        return None
    i, _, n = raw.strip().partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise ValueError(f"{settings.TEST_SHARD.name}: expected i/n with 0 <= i < n, got {raw!r}")
    return int(i), int(n)


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id (``"tests/x.py::test_y[z]"`` -> ``"tests/x.py"``; a file's own id as is)."""
    return nodeid.split("::", 1)[0]


def shard_files(files: Iterable[str], i: int, n: int) -> list[str]:
    """The files at positions ``i, i + n, i + 2n, ...`` of ``files`` in first-seen order (repeats count
    once): whole files, so that a module's fixtures (a launched job, a built Buffer) are made once."""
    return list(dict.fromkeys(files))[i::n]


def merge_lastfailed(on_disk: dict, this_run: dict, mine: set[str], collected: set[str]) -> dict:
    """pytest's ``cache/lastfailed`` (``{node id: True}``, what ``--lf`` runs again) after one shard of a split job:
    ``this_run``'s entries for the shard's own files (``mine``) and for every file no shard runs (one with a
    collection error, one outside this run: every shard saw those alike), ``on_disk``'s for the files the other
    shards run (``collected - mine``: they may have written theirs meanwhile)."""
    theirs = collected - mine
    merged = {k: v for k, v in on_disk.items() if file_of(k) in theirs}
    merged.update((k, v) for k, v in this_run.items() if file_of(k) not in theirs)
    return merged
