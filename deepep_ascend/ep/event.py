"""Events and the communication worker: the CPU analogue of CUDA events and DeepEP's comm stream.

Each :class:`~deepep_ascend.Buffer` owns one worker thread (a single-thread executor, FIFO
like a stream). ``async_finish=True`` calls queue their data movement there and return at
once; torch releases the GIL inside its copy kernels, so the caller's compute really runs
while tokens move. An :class:`EventHandle` is a point on that worker (a future) or, from
:meth:`Buffer.capture`, a point on the caller's own thread, which on a CPU is complete by
the time it is recorded.
"""

from __future__ import annotations

import functools
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch


def _is_torch_stream(obj) -> bool:
    return isinstance(obj, tuple(t for t in (getattr(torch, "Stream", None), getattr(torch.cpu, "Stream", None))
                                 if isinstance(t, type)))


def _is_torch_event(obj) -> bool:
    return isinstance(obj, tuple(t for t in (getattr(torch, "Event", None), getattr(torch.cpu, "Event", None))
                                 if isinstance(t, type)))


class EventHandle:
    """Mirror of ``deep_ep.EventHandle``: records "now" on the calling thread.

    Args:
        future: internal; the completion of a task on a Buffer's worker.
        check: internal; run once after the first successful wait (the async call's input guard).
    """

    def __init__(self, future: Future | None = None, check=None):
        self._future = future
        self._check = check

    def is_done(self) -> bool:
        return self._future is None or self._future.done()

    def current_stream_wait(self) -> None:
        """Block the caller until the event completed; re-raises the task's exception, if any, or the error of
        an input written in place before the wait (docs/semantics/deepep-api.md §3.3)."""
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:
                self = None  # the exception keeps this frame, which must not keep this handle (a cycle via its future)
                raise
        if self._check is not None:
            check, self._check = self._check, None
            check()

    def query(self) -> bool:
        """``torch.Event.query``: True once the event completed (alias of :meth:`is_done`)."""
        return self.is_done()

    def synchronize(self) -> None:
        """``torch.Event.synchronize``: block until the event completed (:meth:`current_stream_wait`)."""
        self.current_stream_wait()

    def exception(self) -> BaseException | None:
        """The task's exception once it finished with one, else ``None`` (still running, or succeeded; not in
        DeepEP): lets a caller that failed because of it report it as the cause."""
        f = self._future
        return f.exception() if f is not None and f.done() and not f.cancelled() else None


class EventOverlap:
    """Mirror of ``deep_ep.EventOverlap``: an optional event plus tensors kept alive until the wait.

    Returned by every ``Buffer`` call; it holds an event only for ``async_finish=True`` calls.
    Usable as ``with event: ...`` (waits on exit only if it holds an event) and as
    ``with event(release_handle=True): ...``.

    Args:
        event: an :class:`EventHandle` or ``None``.
        extra_tensors: tensors (inputs/outputs of the async call) kept alive until the wait.
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._hook = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False):
        """Wait for the event, run the hook set by :meth:`register_hook_after_wait` (once: it is cleared
        before it runs, even if it raises) and return its result (``None`` without a hook), as
        DeepEP V2.5's ``EventOverlap`` does: ``EPBuffer``'s deferred epilogues return their outputs here.

        Raises:
            AssertionError: the overlap holds no event (as in DeepEP).
            Exception: whatever the asynchronous call raised on the worker.
        """
        assert self.event is not None, "EventOverlap.current_stream_wait: no event to wait for"
        try:
            self.event.current_stream_wait()
        except BaseException:
            # The call failed: its tensors are the caller's alone now, and the exception, which keeps this frame,
            # must not keep this overlap (its outputs, or a landing range, would outlive the caller's references).
            self.extra_tensors = None
            self = None
            raise
        self.extra_tensors = None
        result = None
        if self._hook is not None:
            hook, self._hook = self._hook, None
            result = hook()
        if release_handle:
            self.event = None
        return result

    @property
    def hook_after_wait(self):
        """The hook the next wait runs (DeepEP-Ascend's public attribute), or None."""
        return self._hook

    @hook_after_wait.setter
    def hook_after_wait(self, hook) -> None:
        self._hook = hook

    def wait(self):
        """Alias of :meth:`current_stream_wait` (DeepEP V2.5): returns the hook's result."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook) -> None:
        """Run ``hook()`` once after the next successful wait (one hook at a time); the wait returns its result."""
        assert self._hook is None, "EventOverlap: a hook is already registered"
        self._hook = hook

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)


def _frames_cleared(fn, *args):
    """``fn(*args)``; an exception it raises keeps no locals of the frames it passed through. The future holds the
    exception until the event's wait (and the Buffer the future, until a later call): the task's locals, which
    hold the call's outputs (a ``recv_x`` in the landing segment among them), must not outlive the call."""
    try:
        return fn(*args)
    except BaseException as exc:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__.tb_next)  # (this frame still runs; the task's frames ended)
        del exc
        fn = args = None  # this frame stays in the traceback too
        raise


class Worker:
    """A FIFO single-thread executor: the Buffer's "communication stream".

    ``Buffer.get_comm_stream()`` returns it; besides ``submit`` / ``drain`` it has the methods of the
    ``torch.Stream`` DeepEP returns there, with the same meaning on a CPU thread: :meth:`query`,
    :meth:`synchronize`, :meth:`wait_event`, :meth:`wait_stream`, :meth:`record_event`.
    """

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._last: Future | None = None

    def submit(self, fn, *args) -> Future:
        """Queue ``fn(*args)``. It runs in the submitting thread's ``torch.inference_mode`` (a per-thread mode): a
        call made under it made its outputs as inference tensors, which only that mode may write in place."""
        if torch.is_inference_mode_enabled():
            fn = functools.partial(_in_inference_mode, fn)
        self._last = self._pool.submit(_frames_cleared, fn, *args)
        return self._last

    def drain(self) -> None:
        """Wait for every queued task. A task's exception belongs to its event (raised by
        ``current_stream_wait``), so it is not raised again here: a failure that leaves the
        Buffer unusable poisons its transport, and the next call says so."""
        last, self._last = self._last, None
        if last is not None:
            wait([last])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    # -- torch.Stream's methods (what DeepEP's get_comm_stream() returns) ------------------------------
    def query(self) -> bool:
        """True when every task queued so far has finished."""
        return self._last is None or self._last.done()

    def synchronize(self) -> None:
        """Block until every queued task finished; re-raises the last task's exception, if any."""
        last = self._last
        if last is not None:
            last.result()

    def wait_event(self, event: EventHandle) -> None:
        """Tasks queued after this call start once ``event`` completed (its exception, if any, is raised
        by the waiting task, i.e. at the next wait on the stream). A torch event (``torch.Event``, recorded
        on the caller's CPU stream) is complete once recorded: nothing to wait for.

        Raises:
            TypeError: ``event`` is neither an :class:`EventHandle` nor a torch event.
        """
        if isinstance(event, EventHandle):
            self.submit(event.current_stream_wait)
        elif not _is_torch_event(event):
            raise TypeError(f"wait_event: event must be a deepep_ascend EventHandle or a torch.Event, got "
                            f"{type(event).__name__}")

    def wait_stream(self, stream) -> None:
        """Tasks queued after this call start once every task queued on ``stream`` so far finished. The
        caller's own stream (``torch.cpu.current_stream()``, any ``torch.Stream`` / ``torch.cpu.Stream``)
        runs its work synchronously on the calling thread, so it has nothing pending: a no-op, as
        DeepEP's ``comm_stream.wait_stream(torch.cuda.current_stream())`` ports.

        Raises:
            TypeError: ``stream`` is neither a :class:`Worker` nor a torch stream.
        """
        if isinstance(stream, Worker):
            if stream is not self:
                self.wait_event(stream.record_event())
        elif not _is_torch_stream(stream):
            raise TypeError(f"wait_stream: stream must be a Buffer's comm stream (get_comm_stream()) or a torch "
                            f"stream such as torch.cpu.current_stream(), got {type(stream).__name__}")

    def record_event(self, event: EventHandle | None = None) -> EventHandle:
        """An event that completes once every task queued so far finished (``event`` is ignored: a CPU
        event is recorded afresh)."""
        return EventHandle(self.submit(lambda: None))
