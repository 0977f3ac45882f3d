"""The caller's inputs of an asynchronous call, guarded by their tensor version counters.

DeepEP's rule (docs/semantics/deepep-api.md §3.3): the inputs of a call made with ``async_finish=True``
(or a receive hook, or ``EPBuffer``'s ``async_with_compute_stream``) stay untouched until its event
completes, because the communication still reads them. Here the Buffer's worker reads them after the
call returns, so an in-place write (``x.zero_()``) would change what the peers receive. Copying them
would cost a pass over every input on every call; a version counter costs nothing: every in-place op
of torch bumps ``t._version`` (shared by all views of a storage), as DeepEP V2.5's ``EPHandle`` checks
``topk_idx``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["InputGuard"]


def _tensors(name: str, value) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(f"{name}[{i}]", v)


class InputGuard:
    """Version counters of the tensors in ``inputs`` (``{argument name: tensor, tuple of tensors or None}``)
    when an asynchronous call ``what`` (e.g. ``"rank 0: dispatch call #3"``) took them."""

    def __init__(self, what: str, inputs: dict):
        self.what = what
        # (an inference tensor keeps no version counter: its writes cannot be seen, so it is not guarded)
        self.entries = [(n, t, t._version) for name, v in inputs.items() for n, t in _tensors(name, v)
                        if not t.is_inference()]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def check(self) -> None:
        """Raise if any input was written in place since the call.

        Raises:
            RuntimeError: naming the arguments and their version counters (at the call, now).
        """
        changed = [f"`{n}` (version {v} at the call, {t._version} now)" for n, t, v in self.entries
                   if t._version != v]
        if changed:
            raise RuntimeError(
                f"{self.what}: {', '.join(changed)} written in place before the call's event completed; "
                f"the inputs of an asynchronous call are read until then and must stay untouched "
                f"(DeepEP's rule, docs/semantics/deepep-api.md §3.3): wait on the event first, or write to a copy")
