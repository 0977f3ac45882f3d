"""``--compare-sends``: a round trip timed with a combine's returned rows stored plainly and by streaming stores.

:func:`compare` runs a command's round trip (its timed steps, named ``... dispatch`` and ``... combine``) twice in
every iteration of one run, first with the send side of :func:`deepep_ascend.native.ll_stream_rows` at ``"never"``
(plain stores), then at ``"always"`` (streaming stores of every row of 256 bytes or more), and restores the mode in
force. The two modes take turns inside each iteration, so the host's drift hits both alike: separate runs of one
mode each differ by more than the modes do on a shared host. :func:`line` prints the medians. Each dispatch is
timed after a combine of the other mode (the iteration before, or the first mode's), which is all that can touch it.
docs/design/data-path.md, "Streaming stores of the combine's returned rows", reads these times.
"""
from __future__ import annotations

from collections.abc import Sequence

from bench.timing import time_phases

#: the send side's modes compared, in the order they run within an iteration (the first is the ratios' baseline)
MODES = ("never", "always")


def compare(phases: Sequence, comm, iters: int, warmup: int) -> dict:
    """Time ``phases`` (``[(name or None, fn)]``, one round trip whose timed names end in ``dispatch`` and
    ``combine`` after their last ``.``) under each of :data:`MODES` in turn, ``iters`` iterations after ``warmup``.
    Returns ``{"<dispatch|combine> <mode>": Timing.as_dict()}``. Collective; the native kernels must be loaded.

    Raises:
        RuntimeError: the native kernels are not loaded (nothing to compare).
    """
    from deepep_ascend import native

    before = native.ll_stream_rows(side="send")
    if before is None:
        raise RuntimeError("bench.send_modes.compare: the native kernels are not loaded")
    steps = []
    for mode in MODES:
        steps.append((None, lambda mode=mode: native.ll_stream_rows(mode, side="send")))
        steps += [(None if name is None else f"{name.rsplit('.', 1)[-1]} {mode}", fn) for name, fn in phases]
    try:
        t = time_phases(steps, comm, iters, warmup)
    finally:
        native.ll_stream_rows(before, side="send")
    return {k: v.as_dict() for k, v in t.items()}


def line(tag: str, what: str, cs: dict, tail: str = "") -> str:
    """The ``[sends]`` line (``tag`` its padded label) of :func:`compare`'s result ``cs`` for ``what`` (the rows
    compared), or of ``{"not_compared": why}``: combine medians and their ratio, the dispatches', the round trip's,
    then ``tail``."""
    if "not_compared" in cs:
        return f"{tag}not compared: {cs['not_compared']}"
    ms = {k: v["median_s"] * 1e3 for k, v in cs.items()}
    plain, streamed = MODES
    rt = {m: ms[f"dispatch {m}"] + ms[f"combine {m}"] for m in MODES}
    return (f"{tag}{what} by plain / streaming stores, in turn each iteration, median ms: combine "
            f"{ms[f'combine {plain}']:.3f} / {ms[f'combine {streamed}']:.3f} "
            f"({ms[f'combine {streamed}'] / ms[f'combine {plain}']:.3f}x); the dispatch before each (after the other "
            f"mode's combine) {ms[f'dispatch {plain}']:.3f} / {ms[f'dispatch {streamed}']:.3f}; round trip "
            f"{rt[plain]:.3f} / {rt[streamed]:.3f} ({rt[streamed] / rt[plain]:.3f}x){tail}")
