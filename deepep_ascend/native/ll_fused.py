"""A low-latency call on one node in two native calls, issue and finish (``csrc/ll_fused.c``).

The steps are :mod:`.ll`'s (route, stage, send, publish, await, receive), with the same bytes; what differs is
who holds the fixed operands. A :class:`LLPlan` holds everything fixed for one buffer and one call shape: every
rank's window address, the layout's offsets, each half's header slots, signal words and stamps, the
destinations and this rank's traffic counters. It is checked once, when it is built; a call then passes only
its half, its number and its own tensors. At a decode step's few tokens a call's time is its count of Python
steps, and a step's wrapper checks cost as much as its kernel.

The plan covers the common case only: every rank mapped (one node with ``allow_ubmem``), signals by stores,
no rank masked, no wait-time statistics, no link emulation. The low-latency engine takes the step-by-step
path otherwise (:mod:`deepep_ascend.ep.low_latency`).

The methods take the engine's own tensors (its window views and pooled outputs) and the caller's tensors its
argument checks passed: they read shapes the plan fixed and check nothing again; each returns the C status
the engine explains (the functions' comments in ``csrc/ll_fused.c``). None of them is a DeepEP call: they are
the inside of DeepEP's low-latency kernels.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from .loader import kernels
from .rows import NAN_BITS

__all__ = ["LLPlan", "fused_available"]

# Plan words (csrc/ll_fused.c: PLAN_*, HALF_*)
(_R, _L, _M, _H, _ME, _BASES, _ORDER, _NORDER, _RECV_OFF, _SEND_OFF, _PULL_OFF, _HDR_WORDS, _CNT_BYTES, _CNT_PUTS,
 _CNT_SIGNALS, _HALF) = range(16)
_HALF_WORDS = 6  # base, stamps, header slots out, signal words out, own signal words, own header rows


def fused_available() -> bool:
    """Whether the four functions of ``csrc/ll_fused.c`` are loaded."""
    k = kernels
    return not (k.ll_dispatch_issue is None or k.ll_dispatch_finish is None or k.ll_combine_issue is None
                or k.ll_combine_finish is None)


def _addresses(name: str, values, num_ranks: int) -> np.ndarray:
    """``values`` as an int64 array of ``num_ranks`` nonzero addresses (ValueError naming ``name`` otherwise)."""
    a = np.asarray(values, dtype=np.int64)
    if a.shape != (num_ranks,) or not a.all():
        raise ValueError(f"deepep_ascend.native.LLPlan: {name} must hold {num_ranks} nonzero addresses, got {values!r}")
    return a


class LLPlan:
    """The fixed operands of low-latency calls of one shape on one buffer (``csrc/ll_fused.c``'s plan words).

    Args:
        num_ranks, num_local, m, hidden, me: ``R``, ``L``, ``M``, ``H`` and this rank.
        bases: each rank's window data-region address (all mapped).
        order: the destinations in publishing order (ranks, each once).
        recv_off, send_off, pull_off: the layout's receive region, send region and zero-copy ``layout_range``
            offsets from a half's start (bytes).
        hdr_words: int64 words from one source's header to the next in the control window.
        counters: ``(bytes_put, puts, signals)``, each ``R`` addresses of this rank's int64 counter of that
            peer (``Transport.traffic_counter_addresses``).
        halves: for half 0 and 1, ``(offset in the window, stamp word of each source, this rank's header slot
            at each destination, its signal word at each destination, address of its own signal words, address
            of its own header rows)``.
    Raises:
        ValueError: a count or rank out of range, an address of zero, a destination listed twice.
    """

    def __init__(self, *, num_ranks: int, num_local: int, m: int, hidden: int, me: int, bases, order,
                 recv_off: int, send_off: int, pull_off: int, hdr_words: int, counters, halves):
        R = num_ranks
        if not (R >= 1 and num_local >= 1 and m >= 1 and hidden >= 1 and 0 <= me < R and hdr_words >= 3
                and min(recv_off, send_off, pull_off) >= 0):
            raise ValueError(f"deepep_ascend.native.LLPlan: R={R}, L={num_local}, M={m}, H={hidden}, me={me}, "
                             f"hdr_words={hdr_words}, offsets {recv_off}/{send_off}/{pull_off} out of range")
        order = list(order)
        if len(set(order)) != len(order) or not all(0 <= d < R for d in order):
            raise ValueError(f"deepep_ascend.native.LLPlan: order must list ranks of [0, {R}) once each, got {order}")
        if len(halves) != 2:
            raise ValueError(f"deepep_ascend.native.LLPlan: halves must describe 2 halves, got {len(halves)}")
        # every array the words point to lives as long as the plan
        self._keep = [_addresses("bases", bases, R), np.asarray(order, dtype=np.int64)]
        self._keep += [_addresses(f"counters[{i}]", c, R) for i, c in enumerate(counters)]
        words = [R, num_local, m, hidden, me, self._keep[0].ctypes.data, self._keep[1].ctypes.data, len(order),
                 recv_off, send_off, pull_off, hdr_words] + [a.ctypes.data for a in self._keep[2:5]]
        for h, (offset, stamps, hdr_out, sig_out, sig_in, hdr_in) in enumerate(halves):
            arrays = [_addresses(f"halves[{h}].{n}", v, R) for n, v in
                      (("stamps", stamps), ("hdr_out", hdr_out), ("sig_out", sig_out))]
            if offset < 0 or not sig_in or not hdr_in:
                raise ValueError(f"deepep_ascend.native.LLPlan: halves[{h}] needs an offset >= 0 and its own signal "
                                 f"words and header rows, got {offset}, {sig_in:#x}, {hdr_in:#x}")
            self._keep += arrays
            words += [offset] + [a.ctypes.data for a in arrays] + [sig_in, hdr_in]
        self.words = np.asarray(words, dtype=np.int64)
        self.address = self.words.ctypes.data
        self.num_ranks, self.num_local, self.m, self.hidden = R, num_local, m, hidden
        self._bad = (ctypes.c_int64 * 3)()
        self._ns = (ctypes.c_int64 * 2)()
        self._stale = (ctypes.c_void_p * 3)()
        self._own_ld = np.zeros(2, dtype=np.int64)
        self._own_ld_p = self._own_ld.ctypes.data  # (each .ctypes access builds an object: about 1 µs)

    @property
    def bad(self) -> list[int]:
        """The ``bad`` words of the last finish that reported a problem."""
        return list(self._bad)

    @property
    def ns(self) -> list[int]:
        """Nanoseconds of the last ``timed`` call's timed steps: an issue's ``[staging, publishing]`` (a combine
        stages nothing: 0), a finish's ``[wait, 0]`` (its bounded wait and the headers' check)."""
        return list(self._ns)

    def dispatch_issue(self, h: int, route_slots: torch.Tensor, counts: torch.Tensor, sent: torch.Tensor, stage: int,
                       x: torch.Tensor | None, round_scale: bool, ue8m0: bool, mb: int, hdr: torch.Tensor,
                       value: int, timed: bool = False) -> int:
        """``deepep_ll_dispatch_issue``: stage ``x`` (1: BF16 payload copy, 2: FP8 messages), the route's index
        words and counts, the header ``hdr`` (bytes) and signal ``value``, the traffic. ``route_slots`` ``[n, k]``
        int64 and ``counts`` ``[E]`` int32 from :func:`~deepep_ascend.native.ll_route`; ``sent`` ``[R]`` int64.
        ``timed``: time the steps (:attr:`ns`)."""
        n, k = route_slots.shape
        return kernels.ll_dispatch_issue(self.address, h, n, k, route_slots.data_ptr(), counts.data_ptr(),
                                         sent.data_ptr(), stage, 0 if x is None else x.data_ptr(),
                                         0 if x is None else x.stride(0), int(round_scale), int(ue8m0), mb,
                                         hdr.data_ptr(), hdr.numel() * hdr.element_size() // 8, value,
                                         self._ns if timed else None)

    def dispatch_finish(self, h: int, seq: int, polls: int, mb: int, recv_x: torch.Tensor,
                        scales: torch.Tensor | None, src_info: torch.Tensor, recv_count: torch.Tensor,
                        layout_range: torch.Tensor, stale: tuple, timed: bool = False) -> int:
        """``deepep_ll_dispatch_finish``: -1 a source is late, -2 the headers disagree (nothing written); else
        :func:`~deepep_ascend.native.ll_dispatch_recv`'s status (its ``bad`` in :attr:`bad`). ``recv_x`` is the
        ``[L, R·M, H]`` output (its bytes), ``stale`` as that function takes it."""
        st = self._stale
        for i, c in enumerate(stale):
            st[i] = None if c is None else c.data_ptr()
        xb = recv_x.size(2) * recv_x.element_size()
        return kernels.ll_dispatch_finish(self.address, h, seq, polls, mb, xb,
                                          0 if scales is None else scales.size(2), recv_x.data_ptr(),
                                          0 if scales is None else scales.data_ptr(), src_info.data_ptr(),
                                          recv_count.data_ptr(), layout_range.data_ptr(), st, self._bad,
                                          self._ns if timed else None)

    def combine_issue(self, h: int, layout_range: torch.Tensor, src: torch.Tensor, keep: int, pull: bool,
                      sent: torch.Tensor, hdr: torch.Tensor, value: int, timed: bool = False) -> int:
        """``deepep_ll_combine_issue``: ``src`` ``[L, R·M, H]`` bf16 rows (unit last stride), ``layout_range``
        ``[L, R]`` contiguous int64, ``keep`` 0 / 1 / 2 (:func:`~deepep_ascend.native.ll_combine_send`'s
        ``"none"`` / ``"own"`` / ``"all"``); ``pull`` publishes ``layout_range`` for the receivers."""
        e = src.element_size()
        s0, s1 = src.stride()[:2]
        return kernels.ll_combine_issue(self.address, h, layout_range.data_ptr(), src.data_ptr(), s0 * e, s1 * e,
                                        src.size(2) * e, keep, int(pull), sent.data_ptr(), hdr.data_ptr(),
                                        hdr.numel() * hdr.element_size() // 8, value, self._ns if timed else None)

    def combine_finish(self, h: int, seq: int, polls: int, slots: torch.Tensor, weights: torch.Tensor,
                       expected: torch.Tensor, out: torch.Tensor, own: torch.Tensor | None,
                       own_layout_range: torch.Tensor | None, timed: bool = False) -> int:
        """``deepep_ll_combine_finish``: -1 a source is late, -2 the headers disagree (nothing written); else 0
        done, 1 a slot or run out of range, 2 a count differs, 3 a pulled source's stamp moved, 4 no memory
        (:attr:`bad` as the C comment says). ``own`` ``[L, R·M, H]`` bf16 with ``own_layout_range`` ``[L, R]``
        contiguous int64 (this rank's rows where they lie, and the layout that places them) or None; ``out``
        ``[n, H]`` bf16 with unit column stride."""
        n, k = slots.shape
        if own is None:
            own_p = ld_p = begin_p = 0
        else:
            self._own_ld[0], self._own_ld[1] = own.stride()[:2]
            own_p, ld_p, begin_p = own.data_ptr(), self._own_ld_p, own_layout_range.data_ptr()
        return kernels.ll_combine_finish(self.address, h, seq, polls, n, k, slots.data_ptr(), weights.data_ptr(),
                                         expected.data_ptr(), out.data_ptr(), out.stride(0), NAN_BITS, own_p, ld_p,
                                         begin_p, self._bad, self._ns if timed else None)
