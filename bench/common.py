"""Shared helpers for the ``bench`` entry points (and the sweep scripts that reuse them).

Contents, each usable on its own:

* **Byte formulas** (spec §11; 1 GB = 1e9 B): :func:`bytes_per_token`, :func:`logical_bytes`,
  :func:`bottleneck_bytes`, :func:`gbps`.
* **Workload**: :func:`make_workload` (DeepEP-test-like random routing or a replayed trace),
  :func:`workload_digest` / :func:`fingerprint` (a short hash that makes runs comparable),
  :func:`load_routing` / :func:`save_routing` (routing-trace files, format below),
  :func:`reference_layout` (``get_dispatch_layout`` in pure torch), FP8 casts and
  :func:`calc_diff` as in DeepEP's ``utils.py``.
* **Timing**: :func:`time_phases` / :func:`time_collective` — barrier before each timed op,
  ``time.perf_counter`` around it, the max over ranks per iteration (one ``Allreduce(MAX)`` at the
  end), median/min/max over iterations.
* **Systems**: the same dispatch → identity experts → combine round trip run by
  :class:`BufferSystem` (any DeepEP-V1-like ``Buffer``), and by the baselines a user would pick
  instead, :class:`PeerPipeline` over MPI ``Alltoallv`` (:func:`mpi_alltoallv_roundtrip`) or torch
  gloo ``all_to_all_single`` (:func:`gloo_all_to_all_roundtrip`); :func:`run_round_trip` times any
  of them; :func:`compare_outputs` checks they agree bit for bit; :func:`memcpy_roofline` times one
  ``copy_`` of the same bytes.
* **Process helpers**: :func:`init_gloo` (torch.distributed from an mpiexec launch),
  :func:`memory_snapshot` / :class:`MemorySampler`, :func:`finish` (the exit path).

Routing-trace format (``--routing FILE``)
-----------------------------------------
A ``.npz`` (``numpy.savez``) or ``.pt`` (``torch.save`` of a dict, or of a bare tensor) holding

* ``topk_idx``: integer array ``[T, K]`` or ``[S, T, K]`` (``S`` steps of one run). ``T`` is the
  **global** batch: ``T = num_ranks * tokens_per_rank``, rank ``r`` owns rows
  ``[r*T/R, (r+1)*T/R)`` — so the same trace replays at any rank count dividing ``T``. Values are
  global expert ids in ``[0, E)`` or ``-1`` (slot unused); duplicates within a row are not allowed.
* ``num_experts`` (optional scalar int): ``E``; otherwise the caller's ``num_experts`` is used
  (and must exceed every id).
* ``topk_weights`` (optional float array with ``topk_idx``'s shape): replayed too; otherwise
  weights are random from the workload seed.

:func:`save_routing` writes this format; ``bench.normal --save-routing FILE`` dumps the routing a
run used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import platform
import resource
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

GB = 1e9  #: spec §11: 1 GB = 10^9 bytes
FP8_BLOCK = 128  #: channels per FP8 scale (DeepEP's per-token, per-128-channel recipe)
FP8_MAX = 448.0  #: largest finite e4m3 value

# ---------------------------------------------------------------------------------------------
# Byte formulas
# ---------------------------------------------------------------------------------------------


def bytes_per_token(hidden: int, fp8: bool = False) -> int:
    """Payload bytes of one token's hidden vector, as DeepEP V1's benchmark counts them.

    BF16: ``2 * hidden``. FP8 (e4m3 data plus one float32 scale per 128 channels): the BF16 bytes
    times ``(1 + 4/128) / 2``, i.e. ``hidden + 4 * hidden / 128`` (spec §11). FP8 needs
    ``hidden % 128 == 0`` (``ValueError`` otherwise), which keeps the result an exact integer.
    """
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    if not fp8:
        return 2 * hidden
    if hidden % FP8_BLOCK:
        raise ValueError(f"FP8 needs hidden % {FP8_BLOCK} == 0, got hidden={hidden}")
    return hidden + 4 * (hidden // FP8_BLOCK)


def topk_bytes_per_token(num_topk: int, with_idx: bool = True) -> int:
    """Bytes of one token's top-k metadata: ``int64`` indices (if ``with_idx``) + ``float32`` weights."""
    return num_topk * ((8 if with_idx else 0) + 4)


def logical_bytes(num_recv_tokens: int, hidden: int, num_topk: int = 0, fp8: bool = False,
                  phase: str = "dispatch") -> int:
    """**Logical bytes** of one call on one rank (the V2 formula; spec §11).

    ``num_recv_tokens`` is ``N_recv``, the rows this rank receives in dispatch (= the rows it
    sends back in combine): a token counts once per destination rank, **the rank's own tokens
    included** (local traffic counts). Per-token bytes are what the call returns per row:

    * ``phase="dispatch"``: ``recv_x`` (:func:`bytes_per_token`, FP8-aware) + ``recv_topk_idx``
      (``int64``) + ``recv_topk_weights`` (``float32``) — ``hidden_bytes + 12 * num_topk``;
    * ``phase="combine"``: the BF16 row + the combined ``float32`` weights —
      ``2 * hidden + 4 * num_topk`` (combine is BF16 only; ``fp8`` is ignored).

    ``num_topk=0`` gives the payload alone. Divide by the time for GB/s per rank (:func:`gbps`).
    """
    if phase == "dispatch":
        per = bytes_per_token(hidden, fp8) + topk_bytes_per_token(num_topk)
    elif phase == "combine":
        per = bytes_per_token(hidden, False) + topk_bytes_per_token(num_topk, with_idx=False)
    else:
        raise ValueError(f"phase must be 'dispatch' or 'combine', got {phase!r}")
    return int(num_recv_tokens) * per


def bottleneck_bytes(num_tokens: int, hidden: int, fp8: bool = False) -> int:
    """**Bottleneck bytes** of one call on one rank (the V1 formula; spec §11).

    Hidden payload only (no top-k metadata) through the limiting domain, each token counted once
    per destination it crosses into: ``num_tokens * bytes_per_token(hidden, fp8)``.
    What to pass as ``num_tokens``:

    * intranode (one UBMEM domain, DeepEP's NVL column): ``N_recv`` of this rank — DeepEP's
      ``recv_x.numel() * 2`` (received bytes, own tokens included); combine sends the same rows
      back, so the same number serves both phases (combine with ``fp8=False``);
    * internode (DeepEP's RDMA column): ``num_tokens_per_rdma_rank.sum()`` — tokens counted once
      per distinct target node, own node included.

    The benchmark's "bottleneck GB/s" is the maximum over ranks of these bytes divided by the
    (max-over-ranks) time, i.e. the busiest receiver.
    """
    return int(num_tokens) * bytes_per_token(hidden, fp8)


def low_latency_bytes(num_selections: int, hidden: int, fp8: bool = True, phase: str = "dispatch",
                      logfmt: bool = False) -> int:
    """Bytes of one low-latency call on one rank, DeepEP's LL formula (spec §11).

    ``num_selections``: this rank's valid ``topk_idx`` entries (a token counts once per selected
    expert). Per selection: dispatch ``H + H/32 + 16`` (FP8: e4m3 row, float32 scale per 128
    channels, 16 B of source info) or ``2H + 16`` (BF16); combine ``2H`` (BF16 rows back) or,
    with ``logfmt``, ``1.25H + H/32`` (LogFMT-10; groups that fall back to BF16 cost more on
    the wire, which the traffic counters show).
    """
    if phase == "dispatch":
        per = (hidden + hidden // 32 + 16) if fp8 else (2 * hidden + 16)
    elif phase == "combine":
        per = (hidden * 5 // 4 + hidden // 32) if logfmt else 2 * hidden
    else:
        raise ValueError(f"phase must be 'dispatch' or 'combine', got {phase!r}")
    return int(num_selections) * per


def gbps(nbytes: float, seconds: float) -> float:
    """GB/s with GB = 1e9 B; ``nan`` for a non-positive time."""
    return nbytes / GB / seconds if seconds > 0 else float("nan")


def fmt_bytes(n: float) -> str:
    """Human-readable decimal bytes (1 MB = 1e6 B, 1 GB = 1e9 B)."""
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# FP8 and accuracy helpers (DeepEP's tests/utils.py recipe, spec §4.8)
# ---------------------------------------------------------------------------------------------


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, H]`` (``H % 128 == 0``) → ``(data [N, H] float8_e4m3fn, scales [N, H/128] float32)``.

    Per token and 128-channel group: ``amax = max(max|x|, 1e-4)``, ``data = e4m3(x * 448/amax)``,
    ``scale = amax / 448``.
    """
    if x.dim() != 2 or x.size(1) % FP8_BLOCK:
        raise ValueError(f"x must be [N, H] with H % {FP8_BLOCK} == 0, got {tuple(x.shape)}")
    m, n = x.shape
    xv = x.view(m, n // FP8_BLOCK, FP8_BLOCK)
    amax = xv.abs().float().amax(dim=2).clamp(min=1e-4)
    data = (xv * (FP8_MAX / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    return data, (amax / FP8_MAX).view(m, n // FP8_BLOCK).contiguous()


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8`, to BF16 ``[N, H]``."""
    m, n = data.shape
    x = data.float().view(m, n // FP8_BLOCK, FP8_BLOCK) * scales.float().view(m, n // FP8_BLOCK, 1)
    return x.view(data.shape).to(torch.bfloat16)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's ``calc_diff``: ``1 - 2·Σ(x+1)(y+1) / Σ[(x+1)² + (y+1)²]`` in float64 (0 = equal)."""
    x, y = x.double() + 1, y.double() + 1
    denom = (x * x + y * y).sum()
    return float((1 - 2 * (x * y).sum() / denom).item()) if denom > 0 else 0.0


def tensor_digest(t: Optional[torch.Tensor], h: Optional["hashlib._Hash"] = None) -> str:
    """Hex BLAKE2b-128 of a tensor's dtype, shape and raw bytes (``None`` hashes as such).

    Bitwise: ``-0.0`` and ``+0.0`` differ, NaNs with equal bits match. Pass ``h`` to chain.
    """
    h = h or hashlib.blake2b(digest_size=16)
    if t is None:
        h.update(b"None")
        return h.hexdigest()
    t = t.detach().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


def rank_seed(seed: int, rank: int) -> int:
    """The per-rank generator seed: ``seed * 65536 + rank`` (distinct for ranks < 65536)."""
    return int(seed) * 65536 + int(rank)


def random_routing(num_tokens: int, num_experts: int, num_topk: int,
                   generator: torch.Generator) -> torch.Tensor:
    """DeepEP-test routing: ``scores = randn(N, E).abs() + 1``; ``topk_idx = scores.topk(K).indices``.

    Returns ``[N, K] int64``, distinct experts per row, no ``-1``.
    """
    scores = torch.randn(num_tokens, num_experts, generator=generator).abs() + 1
    return scores.topk(num_topk, dim=-1, largest=True, sorted=False).indices.to(torch.int64)


@dataclasses.dataclass
class Workload:
    """One rank's inputs. ``x [N, H] bf16``; ``x_fp8`` the FP8 tuple of ``x`` (or ``None``);
    ``topk_idx [N, K] int64`` (global ids, ``-1`` allowed); ``topk_weights [N, K] float32``;
    ``params``: the shape parameters, seed and routing source, identical on all ranks."""

    x: torch.Tensor
    x_fp8: Optional[tuple[torch.Tensor, torch.Tensor]]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    params: dict

    @property
    def dispatch_x(self):
        """What dispatch transports: the FP8 tuple if present, else BF16 ``x``."""
        return self.x_fp8 if self.x_fp8 is not None else self.x

    @property
    def num_tokens(self) -> int:
        return self.x.size(0)


def make_workload(num_tokens: int, hidden: int, num_topk: int, num_experts: int, rank: int,
                  num_ranks: int, seed: int = 0, fp8: bool = False,
                  routing: Optional[torch.Tensor] = None,
                  routing_weights: Optional[torch.Tensor] = None,
                  routing_source: str = "random") -> Workload:
    """Build this rank's inputs, deterministic in ``(seed, rank)`` and the shape.

    ``x = randn(N, H)`` in BF16 and, unless ``routing`` (this rank's ``[N, K]`` slice of a trace)
    is given, :func:`random_routing`; ``topk_weights = randn(N, K).abs()`` float32 unless
    ``routing_weights`` is given. With ``fp8`` also the FP8 tuple of ``x``
    (:func:`per_token_cast_to_fp8`). ``num_experts % num_ranks == 0`` is required.
    """
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    if not 0 < num_topk <= num_experts:
        raise ValueError(f"num_topk={num_topk} must be in [1, num_experts={num_experts}]")
    g = torch.Generator().manual_seed(rank_seed(seed, rank))
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float32).to(torch.bfloat16)
    if routing is None:
        topk_idx = random_routing(num_tokens, num_experts, num_topk, g)
    else:
        topk_idx = routing.to(torch.int64).contiguous()
        if tuple(topk_idx.shape) != (num_tokens, num_topk):
            raise ValueError(f"routing shape {tuple(topk_idx.shape)} != ({num_tokens}, {num_topk})")
    if routing_weights is None:
        topk_weights = torch.randn(num_tokens, num_topk, generator=g).abs()
    else:
        topk_weights = routing_weights.to(torch.float32).contiguous()
    x_fp8 = per_token_cast_to_fp8(x) if fp8 else None
    params = dict(num_ranks=num_ranks, num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                  num_experts=num_experts, fp8=bool(fp8), seed=int(seed), routing=routing_source)
    return Workload(x, x_fp8, topk_idx, topk_weights, params)


def workload_digest(wl: Workload) -> str:
    """This rank's digest of ``x``, ``topk_idx`` and ``topk_weights`` (for :func:`fingerprint`)."""
    h = hashlib.blake2b(digest_size=16)
    for t in (wl.x, wl.topk_idx, wl.topk_weights):
        tensor_digest(t, h)
    return h.hexdigest()


def fingerprint(params: dict, rank_digests: Sequence[str], length: int = 12) -> str:
    """Short hex hash of the shape parameters, seed, routing source and every rank's data digest
    (in rank order). Equal fingerprints ⇒ the same inputs bit for bit, so results are comparable."""
    blob = json.dumps(params, sort_keys=True) + "|" + "|".join(rank_digests)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()[:length]


def comm_fingerprint(wl: Workload, comm) -> str:
    """:func:`fingerprint` of a workload spread over ``comm`` (collective; same value on all ranks)."""
    return fingerprint(wl.params, comm.allgather(workload_digest(wl)))


def _load_trace_dict(path: str) -> dict:
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    if path.endswith(".pt"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        obj = obj if isinstance(obj, dict) else {"topk_idx": obj}
        return {k: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in obj.items()}
    raise ValueError(f"routing trace {path!r}: expected a .npz or .pt file")


def load_routing(path: str, rank: int, num_ranks: int, step: int = 0,
                 num_experts: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    """Load rank ``rank``'s slice of a routing trace (format in the module docstring).

    Returns ``(topk_idx [T/R, K] int64, topk_weights [T/R, K] float32 or None, meta)``, ``meta``
    = ``{num_experts, num_topk, tokens_per_rank, num_steps, step, digest}`` (``digest``: hash of
    the whole step, identical on all ranks). Raises ``ValueError`` for a malformed trace: wrong
    rank, ``T % num_ranks != 0``, ids outside ``[-1, E)``, duplicate ids in a row, or a
    ``num_experts`` that disagrees with the file's.
    """
    d = _load_trace_dict(path)
    if "topk_idx" not in d:
        raise ValueError(f"routing trace {path!r} has no 'topk_idx' (keys: {sorted(d)})")
    idx = np.asarray(d["topk_idx"])
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"routing trace {path!r}: topk_idx must be integer, got {idx.dtype}")
    if idx.ndim == 2:
        idx = idx[None]
    if idx.ndim != 3:
        raise ValueError(f"routing trace {path!r}: topk_idx must be [T, K] or [S, T, K], got {idx.shape}")
    num_steps, total, k = idx.shape
    if not 0 <= step < num_steps:
        raise ValueError(f"routing trace {path!r}: row {step} (--routing-step) outside [0, {num_steps}) "
                         f"(a [S, T, K] trace's rows; train_moe writes one per (step, layer))")
    if total % num_ranks:
        raise ValueError(f"routing trace {path!r}: {total} tokens do not split over {num_ranks} ranks")
    file_e = int(np.asarray(d["num_experts"])) if "num_experts" in d else None
    if file_e is not None and num_experts is not None and file_e != num_experts:
        raise ValueError(f"routing trace {path!r} is for {file_e} experts, not {num_experts}")
    e = file_e if file_e is not None else num_experts
    full = idx[step].astype(np.int64)
    if e is None:
        e = int(full.max()) + 1
    if full.size and (full.min() < -1 or full.max() >= e):
        raise ValueError(f"routing trace {path!r}: ids outside [-1, {e}): min {full.min()}, max {full.max()}")
    srt = np.sort(full, axis=1)
    if k > 1 and np.any((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)):
        raise ValueError(f"routing trace {path!r}: a row routes to the same expert twice")
    n = total // num_ranks
    mine = torch.from_numpy(np.ascontiguousarray(full[rank * n:(rank + 1) * n]))
    w = None
    if "topk_weights" in d:
        wa = np.asarray(d["topk_weights"], dtype=np.float32)
        wa = wa[None] if wa.ndim == 2 else wa
        if wa.shape != idx.shape:
            raise ValueError(f"routing trace {path!r}: topk_weights {wa.shape} != topk_idx {idx.shape}")
        w = torch.from_numpy(np.ascontiguousarray(wa[step, rank * n:(rank + 1) * n]))
    h = hashlib.blake2b(full.tobytes(), digest_size=8)
    meta = dict(num_experts=e, num_topk=k, tokens_per_rank=n, num_steps=num_steps, step=step,
                digest=h.hexdigest())
    return mine, w, meta


def save_routing(path: str, topk_idx: torch.Tensor | np.ndarray, num_experts: int,
                 topk_weights: torch.Tensor | np.ndarray | None = None) -> None:
    """Write a routing trace: ``topk_idx`` global ``[T, K]`` or ``[S, T, K]`` (rank-major rows)."""
    arr = lambda a: a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    d = {"topk_idx": arr(topk_idx).astype(np.int64), "num_experts": np.int64(num_experts)}
    if topk_weights is not None:
        d["topk_weights"] = arr(topk_weights).astype(np.float32)
    if path.endswith(".npz"):
        np.savez(path, **d)
    elif path.endswith(".pt"):
        torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in d.items()}, path)
    else:
        raise ValueError(f"routing trace {path!r}: expected a .npz or .pt file name")


def reference_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Pure-torch ``get_dispatch_layout`` (spec §4.1) for one node (``num_tokens_per_rdma_rank``
    is ``None``). Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)``."""
    n = topk_idx.size(0)
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // local, num_ranks)
    mask = torch.zeros(n, num_ranks + 1, dtype=torch.bool)
    mask.scatter_(1, dest, True)
    is_token_in_rank = mask[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Per-iteration times in seconds (each the max over ranks) and their summary."""

    times: list

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def min(self) -> float:
        return min(self.times) if self.times else float("nan")

    @property
    def max(self) -> float:
        return max(self.times) if self.times else float("nan")

    def __add__(self, other: "Timing") -> "Timing":
        """Iteration-wise sum (e.g. dispatch + combine = round trip)."""
        return Timing([a + b for a, b in zip(self.times, other.times)])

    def as_dict(self) -> dict:
        return dict(median_s=self.median, min_s=self.min, max_s=self.max, times_s=list(self.times))

    def fmt(self, unit: str = "ms") -> str:
        s = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        return f"{self.median * s:9.3f} {unit} (min {self.min * s:.3f}, max {self.max * s:.3f})"


Phase = tuple  # (name or None, fn): None = untimed step (no barrier), e.g. bookkeeping


@contextlib.contextmanager
def gc_paused():
    """Collect once, then keep Python's cyclic garbage collector off inside the block (restored after).

    A full collection walks every tracked object, some 170,000 after ``import torch``; timed by the
    ``[gc]`` line of ``bench.mega_moe``. Inside a collective call it stalls every rank, so a timed
    iteration that holds one measures the collector rather than the system."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def full_gc_seconds() -> tuple[float, int]:
    """``(seconds, objects)``: the time of one full ``gc.collect()`` in this process, and how many objects
    the collector tracks (what a full collection walks)."""
    objects = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0, objects


def time_phases(phases: Sequence[Phase], comm, iters: int, warmup: int,
                progress: Optional[Callable[[int], None]] = None) -> dict[str, Timing]:
    """Run ``phases`` in order ``warmup + iters`` times; time the named ones.

    Each named phase: ``comm.Barrier()``, then ``fn()`` between two ``time.perf_counter()`` calls.
    Unnamed phases (name ``None``) run untimed, without a barrier. After the loop one
    ``Allreduce(MAX)`` turns each rank's times into the per-iteration maximum over ranks, so the
    slowest rank defines every iteration. Collective: all ranks must pass the same phase list.
    The Python GC is paused during the loop. ``progress(i)`` is called after each iteration.
    """
    from mpi4py import MPI

    names = [p[0] for p in phases if p[0] is not None]
    local = np.zeros((len(names), iters), dtype=np.float64)
    with gc_paused():
        for it in range(warmup + iters):
            j = 0
            for name, fn in phases:
                if name is None:
                    fn()
                    continue
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if it >= warmup:
                    local[j, it - warmup] = t1 - t0
                j += 1
            if progress is not None:
                progress(it)
    glob = np.empty_like(local)
    comm.Allreduce(local, glob, op=MPI.MAX)
    return {n: Timing(glob[i].tolist()) for i, n in enumerate(names)}


def time_collective(fn: Callable[[], Any], comm, iters: int, warmup: int) -> Timing:
    """Time one collective operation: :func:`time_phases` with the single phase ``fn``."""
    return time_phases([("op", fn)], comm, iters, warmup)["op"]


# ---------------------------------------------------------------------------------------------
# Round-trip systems
# ---------------------------------------------------------------------------------------------


def _split(x):
    """dispatch input → (payload [N, H] tensor, fp8 scales or None)."""
    if isinstance(x, tuple):
        return x[0], x[1]
    return x, None


class BufferSystem:
    """A DeepEP-V1-like ``Buffer`` (normal mode) as a round-trip system.

    Calls exactly the public API: ``get_dispatch_layout``, ``dispatch`` (non-cached, with top-k),
    ``combine`` (with the received weights); ``traffic()`` is ``buf.get_traffic(lifetime=False)``
    when the buffer has it (bytes sent by this rank during the last call, by channel kind).
    """

    def __init__(self, buf, name: str = "deepep_ascend"):
        self.buf, self.name = buf, name

    def layout(self, topk_idx, num_experts):
        return self.buf.get_dispatch_layout(topk_idx, num_experts)[:4]

    def dispatch(self, x, layout, topk_idx, topk_weights):
        ntpr, ntprr, ntpe, itir = layout
        kw = {} if ntprr is None else {"num_tokens_per_rdma_rank": ntprr}
        out = self.buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                                num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                topk_weights=topk_weights, **kw)
        return out[:5]

    def combine(self, y, handle, topk_weights):
        combined_x, combined_w, _ = self.buf.combine(y, handle, topk_weights=topk_weights)
        return combined_x, combined_w

    def traffic(self) -> Optional[dict]:
        get = getattr(self.buf, "get_traffic", None)
        return dict(get(lifetime=False)) if get is not None else None

    def link_stats(self) -> Optional[dict]:
        """``Buffer.get_link_stats()`` (per peer and channel kind, bytes and messages of the last
        call), or ``None`` for a Buffer without link counters."""
        get = getattr(self.buf, "get_link_stats", None)
        return get() if get is not None else None


def _as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[n, ...]`` → ``[n, row_bytes]`` uint8 view (also for ``n == 0``)."""
    row = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
    return t.view(torch.uint8).view(t.size(0), row)


class _MpiExchange:
    """Row exchange over ``MPI_Alltoallv`` with one contiguous datatype per row size."""

    name = "mpi_alltoallv"

    def __init__(self, comm):
        self.comm = comm
        self._types: dict[int, Any] = {}

    def _rowtype(self, row_bytes: int):
        from mpi4py import MPI
        t = self._types.get(row_bytes)
        if t is None:
            t = self._types[row_bytes] = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        return t

    def counts(self, send_counts: np.ndarray) -> np.ndarray:
        recv = np.empty_like(send_counts)
        self.comm.Alltoall(send_counts, recv)
        return recv

    def rows(self, send: torch.Tensor, out: torch.Tensor, send_counts, recv_counts) -> None:
        """``send [n_send, ...]`` (rows grouped by destination) → ``out [n_recv, ...]`` (by source)."""
        sb, rb = _as_byte_rows(send), _as_byte_rows(out)
        row = sb.size(1)
        if row == 0:
            return
        t = self._rowtype(row)
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
        self.comm.Alltoallv([sb.numpy(), (send_counts, sd), t], [rb.numpy(), (recv_counts, rd), t])

    def close(self):
        for t in self._types.values():
            t.Free()
        self._types.clear()


class _GlooExchange:
    """Row exchange over ``torch.distributed.all_to_all_single`` (gloo), rows as raw bytes."""

    name = "gloo_all_to_all"

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group

    def counts(self, send_counts: np.ndarray) -> np.ndarray:
        s = torch.from_numpy(np.ascontiguousarray(send_counts, dtype=np.int64))
        r = torch.empty_like(s)
        self.dist.all_to_all_single(r, s, group=self.group)
        return r.numpy()

    def rows(self, send: torch.Tensor, out: torch.Tensor, send_counts, recv_counts) -> None:
        sb, rb = _as_byte_rows(send), _as_byte_rows(out)
        if sb.size(1) == 0:
            return
        self.dist.all_to_all_single(rb, sb, output_split_sizes=[int(c) for c in recv_counts],
                                    input_split_sizes=[int(c) for c in send_counts], group=self.group)

    def close(self):
        pass


class Workspace:
    """Named scratch buffers reused across calls (grown when too small), the CPU stand-in for a
    GPU caching allocator: on this VM first-touch page faults cost ~5x a copy of the same bytes
    (211 MB: ~160 ms to fault in, ~27 ms to copy), so a pipeline that allocates its
    intermediates afresh every call would measure the kernel's page-fault path, not its design."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``[*shape]`` tensor of ``dtype`` backed by buffer ``name`` (contents stale)."""
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        b = self._bufs.get(name)
        if b is None or b.numel() < n:
            b = self._bufs[name] = torch.empty(max(n, 1), dtype=torch.uint8)
        return b[:n].view(dtype).view(tuple(shape))

    def clear(self):
        self._bufs.clear()


class PeerPipeline:
    """The pipeline a user would write with a generic all-to-all (MPI ``Alltoallv`` or gloo
    ``all_to_all_single``), producing DeepEP-V1 results bit for bit.

    * layout: :func:`reference_layout` (pure torch);
    * dispatch: order tokens by destination rank (``is_token_in_rank.T.nonzero()`` → sorted by
      destination, then token), ``index_select`` the payload and a packed metadata row (``int64``
      top-k ids, ``float32`` weights, FP8 scales), all-to-all the counts, then the payload and the
      metadata; the receiver turns global expert ids into local ones (``-1`` elsewhere, weight
      ``0.0``) — the rows arrive grouped by source rank ascending, then source token ascending,
      which is DeepEP's order;
    * combine: all-to-all the (identity-expert) rows and weights back, then, per destination rank
      **ascending**, widen to float32 and ``index_add_`` into a float32 accumulator that starts at
      ``0.0``, and one cast to BF16 — the same float32 additions in the same order as DeepEP's.

    Returned tensors are fresh (as DeepEP's); intermediates (send rows, rows coming back, the
    float32 accumulator and widening scratch) live in a :class:`Workspace` reused across calls.
    """

    def __init__(self, exchange, rank: int, num_ranks: int, num_experts: int):
        self.ex, self.rank, self.num_ranks, self.num_experts = exchange, rank, num_ranks, num_experts
        self.name = exchange.name
        self.local_experts = num_experts // num_ranks
        self.ws = Workspace()
        self._traffic: Optional[dict] = None

    def layout(self, topk_idx, num_experts):
        return reference_layout(topk_idx, num_experts, self.num_ranks)

    def _count_traffic(self, send_counts, row_bytes):
        """Bytes this rank sent, SELF vs peers (one shared-memory node: peers are UBMEM)."""
        own = int(send_counts[self.rank]) * row_bytes
        self._traffic = {"SELF": own, "UBMEM": int(send_counts.sum()) * row_bytes - own, "URMA": 0}

    def dispatch(self, x, layout, topk_idx, topk_weights):
        payload, scales = _split(x)
        is_token_in_rank = layout[3]
        dst, tok = is_token_in_rank.t().nonzero(as_tuple=True)
        send_counts = is_token_in_rank.sum(0).numpy().astype(np.int64)
        recv_counts = self.ex.counts(send_counts)
        n_send, n_recv = int(send_counts.sum()), int(recv_counts.sum())
        # payload
        send_x = self.ws.get("send_x", (n_send,) + tuple(payload.shape[1:]), payload.dtype)
        torch.index_select(payload, 0, tok, out=send_x)
        recv_x = torch.empty((n_recv,) + tuple(payload.shape[1:]), dtype=payload.dtype)
        self.ex.rows(send_x, recv_x, send_counts, recv_counts)
        # metadata: [topk_idx int64 | topk_weights f32 | scales f32]
        parts = [topk_idx.view(torch.uint8), topk_weights.view(torch.uint8)]
        if scales is not None:
            parts.append(scales.contiguous().view(torch.uint8))
        meta_all = torch.cat(parts, dim=1)
        meta = self.ws.get("send_meta", (n_send, meta_all.size(1)), torch.uint8)
        torch.index_select(meta_all, 0, tok, out=meta)
        recv_meta = self.ws.get("recv_meta", (n_recv, meta.size(1)), torch.uint8)
        self.ex.rows(meta, recv_meta, send_counts, recv_counts)
        k = topk_idx.size(1)
        ridx = recv_meta[:, :8 * k].contiguous().view(torch.int64)
        rw = recv_meta[:, 8 * k:12 * k].contiguous().view(torch.float32)
        lo = self.rank * self.local_experts
        mine = (ridx >= lo) & (ridx < lo + self.local_experts)
        recv_topk_idx = torch.where(mine, ridx - lo, -1)
        recv_topk_weights = torch.where(mine, rw, 0.0)
        counts = torch.bincount(recv_topk_idx[mine], minlength=self.local_experts).tolist()
        if scales is not None:
            recv_x = (recv_x, recv_meta[:, 12 * k:].contiguous().view(torch.float32))
        self._count_traffic(send_counts, _as_byte_rows(payload).size(1) + meta.size(1))
        handle = (tok, send_counts, recv_counts, topk_idx.size(0))
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle

    def combine(self, y, handle, topk_weights):
        tok, send_counts, recv_counts, n = handle
        n_send, h = int(send_counts.sum()), y.size(1)
        back = self.ws.get("back", (n_send, h), y.dtype)
        self.ex.rows(y.contiguous(), back, recv_counts, send_counts)
        back_w = acc_w = None
        if topk_weights is not None:
            back_w = self.ws.get("back_w", (n_send, topk_weights.size(1)), torch.float32)
            self.ex.rows(topk_weights.contiguous(), back_w, recv_counts, send_counts)
            acc_w = torch.zeros((n, topk_weights.size(1)), dtype=torch.float32)
        acc = self.ws.get("acc", (n, h), torch.float32).zero_()
        widened = self.ws.get("widen", (int(send_counts.max(initial=0)), h), torch.float32)
        start = 0
        for c in send_counts.tolist():  # ascending destination rank = ascending contributor
            if c:
                idx = tok[start:start + c]
                w = widened[:c]
                w.copy_(back[start:start + c])
                acc.index_add_(0, idx, w)
                if acc_w is not None:
                    acc_w.index_add_(0, idx, back_w[start:start + c])
            start += c
        row_bytes = h * y.element_size() + (4 * topk_weights.size(1) if topk_weights is not None else 0)
        self._count_traffic(recv_counts, row_bytes)
        return acc.to(torch.bfloat16), acc_w

    def traffic(self) -> Optional[dict]:
        return self._traffic

    def close(self):
        self.ex.close()
        self.ws.clear()


def _peer_roundtrip(exchange, wl: Workload, comm, iters: int, warmup: int, **kw):
    system = PeerPipeline(exchange, comm.Get_rank(), comm.Get_size(), wl.params["num_experts"])
    try:
        return run_round_trip(system, wl, comm, iters, warmup, **kw)
    finally:
        system.close()


def mpi_alltoallv_roundtrip(wl: Workload, comm, iters: int, warmup: int, **kw) -> "RoundTripResult":
    """Baseline (a): :class:`PeerPipeline` over MPI ``Alltoall`` (counts) + ``Alltoallv`` (rows)."""
    return _peer_roundtrip(_MpiExchange(comm), wl, comm, iters, warmup, **kw)


def gloo_all_to_all_roundtrip(wl: Workload, comm, iters: int, warmup: int, group=None,
                              **kw) -> "RoundTripResult":
    """Baseline (b): :class:`PeerPipeline` over torch gloo ``all_to_all_single`` (needs
    :func:`init_gloo` first; ``group`` defaults to the world group)."""
    return _peer_roundtrip(_GlooExchange(group), wl, comm, iters, warmup, **kw)


def identity_experts(recv_x):
    """The "experts" of the benchmark: identity, as a BF16 combine input ``[N_recv, H]``
    (an FP8 tuple is cast back with :func:`per_token_cast_back`)."""
    if isinstance(recv_x, tuple):
        return per_token_cast_back(*recv_x)
    return recv_x


def copy_experts(recv_x):
    """Experts whose output is a new tensor (a copy of the received rows, as BF16): what a real expert
    hands to combine, which then stages it (:func:`identity_experts` hands ``recv_x`` itself back,
    which a Buffer's combine reads in place where it lies in the landing segment)."""
    return identity_experts(recv_x).clone()


EXPERTS = {"identity": identity_experts, "copy": copy_experts}


@dataclasses.dataclass
class RoundTripResult:
    """One system's timings and the last iteration's outputs on this rank."""

    name: str
    timings: dict  # 'layout', 'dispatch', 'combine', 'round_trip' → Timing (max over ranks)
    num_recv_tokens: int
    dispatch_digests: dict  # component → tensor_digest
    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]
    traffic: dict  # 'dispatch' / 'combine' → {kind: bytes sent by this rank} or None
    layout_digest: str
    link_stats: Optional[dict] = None  # 'dispatch' / 'combine' → Buffer.get_link_stats() of the last call


def dispatch_digests(out) -> dict:
    """Digests of a dispatch's user-visible results (``recv_x`` [+ scales], top-k, counts list)."""
    recv_x, ridx, rw, counts = out[:4]
    data, scales = _split(recv_x)
    return {"recv_x": tensor_digest(data), "recv_scales": tensor_digest(scales),
            "recv_topk_idx": tensor_digest(ridx), "recv_topk_weights": tensor_digest(rw),
            "num_recv_tokens_per_expert_list": hashlib.blake2b(
                json.dumps([int(c) for c in counts]).encode(), digest_size=16).hexdigest()}


def layout_digest(layout) -> str:
    """Digest of ``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)``; the per-node
    count (``layout[1]``, internode only) is left out so that one-node pipelines compare."""
    h = hashlib.blake2b(digest_size=16)
    for t in (layout[0], layout[2], layout[3]):
        tensor_digest(t if t is None else t.to(torch.int64 if t.dtype != torch.bool else torch.bool), h)
    return h.hexdigest()


def run_round_trip(system, wl: Workload, comm, iters: int, warmup: int,
                   experts: Callable = identity_experts,
                   progress: Optional[Callable[[int], None]] = None) -> RoundTripResult:
    """Time layout, dispatch and combine of ``system`` on ``wl`` (collective).

    Per iteration: drop the previous outputs (untimed), ``layout`` (timed), ``dispatch`` (timed),
    read traffic and run ``experts`` on the received rows (untimed), ``combine`` with the received
    weights (timed), read traffic (untimed). ``round_trip`` = dispatch + combine per iteration
    (layout excluded, as DeepEP times it apart).
    """
    st: dict = {}
    x, ne = wl.dispatch_x, wl.params["num_experts"]

    def reset():
        st.clear()

    def layout():
        st["layout"] = system.layout(wl.topk_idx, ne)

    def dispatch():
        st["d"] = system.dispatch(x, st["layout"], wl.topk_idx, wl.topk_weights)

    link_stats = getattr(system, "link_stats", lambda: None)

    def after_dispatch():
        st["t_d"], st["s_d"] = system.traffic(), link_stats()
        st["y"] = experts(st["d"][0])

    def combine():
        st["c"] = system.combine(st["y"], st["d"][4], st["d"][2])

    def after_combine():
        st["t_c"], st["s_c"] = system.traffic(), link_stats()

    phases = [(None, reset), ("layout", layout), ("dispatch", dispatch), (None, after_dispatch),
              ("combine", combine), (None, after_combine)]
    t = time_phases(phases, comm, iters, warmup, progress)
    t["round_trip"] = t["dispatch"] + t["combine"]
    d = st["d"]
    res = RoundTripResult(
        name=system.name, timings=t, num_recv_tokens=_split(d[0])[0].size(0),
        dispatch_digests=dispatch_digests(d), combined_x=st["c"][0].clone(),  # may alias a buffer
        combined_topk_weights=None if st["c"][1] is None else st["c"][1].clone(), traffic={"dispatch": st["t_d"], "combine": st["t_c"]},
        layout_digest=layout_digest(st["layout"]),
        link_stats=None if st["s_d"] is None else {"dispatch": st["s_d"], "combine": st["s_c"]})
    st.clear()
    return res


def compare_outputs(ref: RoundTripResult, other: RoundTripResult, comm, two_roundings: bool = False) -> dict:
    """Check ``other`` against ``ref`` on every rank (collective; same answer on all ranks).

    Returns ``{layout, dispatch: {component: bool}, combined_x_bitwise, combined_x_equal_values,
    combined_topk_weights_bitwise, combined_x_calc_diff, combined_topk_weights_calc_diff}``;
    booleans are ANDed over ranks, ``calc_diff`` values are the maximum over ranks (0 = equal).
    ``two_roundings``: ``other`` is DeepEP's internode combine, which rounds each node's partial
    sum to BF16 before the final sum (spec §5) while ``ref`` rounds once, so ``combined_x`` may
    differ in the last bits by design: it is then accepted when ``calc_diff < 1e-4``
    (``combined_x_two_roundings``) — the test suite checks that path bit for bit against a
    two-rounding reference.
    """
    from mpi4py import MPI

    flags = {"layout": ref.layout_digest == other.layout_digest}
    for k, v in ref.dispatch_digests.items():
        flags["dispatch." + k] = v == other.dispatch_digests.get(k)
    a, b = ref.combined_x, other.combined_x
    same_shape = a.shape == b.shape and a.dtype == b.dtype
    flags["combined_x_bitwise"] = same_shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
    flags["combined_x_equal_values"] = same_shape and torch.equal(a, b)
    wa, wb = ref.combined_topk_weights, other.combined_topk_weights
    w_same = wa is not None and wb is not None and wa.shape == wb.shape
    flags["combined_topk_weights_bitwise"] = w_same and torch.equal(wa.view(torch.int32), wb.view(torch.int32))
    diffs = {"combined_x_calc_diff": calc_diff(a.float(), b.float()) if same_shape else float("inf"),
             "combined_topk_weights_calc_diff": calc_diff(wa, wb) if w_same else float("inf")}
    names = sorted(flags)
    ok = np.array([1 if flags[n] else 0 for n in names], dtype=np.int32)
    ok_all = np.empty_like(ok)
    comm.Allreduce(ok, ok_all, op=MPI.MIN)
    dv = np.array([diffs[n] for n in sorted(diffs)], dtype=np.float64)
    dv_all = np.empty_like(dv)
    comm.Allreduce(dv, dv_all, op=MPI.MAX)
    out = {n: bool(v) for n, v in zip(names, ok_all)}
    out.update({n: float(v) for n, v in zip(sorted(diffs), dv_all)})
    if two_roundings:
        out["combined_x_two_roundings"] = out["combined_x_calc_diff"] < 1e-4
        out["combined_x_bitwise"] = out["combined_x_equal_values"] = None  # not expected: reported apart
    return out


def memcpy_roofline(comm, dispatch_bytes: int, combine_bytes: int, iters: int, warmup: int,
                    fresh_dst: bool = False) -> dict:
    """Baseline (c): the single-copy memory roofline (collective).

    Every rank, concurrently and barrier-synchronised like the systems, copies its own dispatch
    bytes once (one ``uint8`` ``copy_`` of ``dispatch_bytes``) and then its combine bytes once.
    Returns ``{'dispatch', 'combine', 'round_trip'}`` → :class:`Timing` (max over ranks per
    iteration). A one-copy transport cannot beat ``round_trip``; ``system / roofline`` says how
    many copies' worth of time a system spends.

    ``fresh_dst=True`` copies into a newly allocated tensor each time (``clone``) instead of a
    preallocated one: the floor for an API that returns fresh tensors on a CPU without a caching
    allocator, where first-touch page faults can cost several times the copy itself.
    """
    src_d = torch.ones(max(int(dispatch_bytes), 1), dtype=torch.uint8)
    src_c = torch.ones(max(int(combine_bytes), 1), dtype=torch.uint8)
    if fresh_dst:
        phases = [("dispatch", lambda: src_d.clone()), ("combine", lambda: src_c.clone())]
    else:
        dst_d, dst_c = torch.empty_like(src_d), torch.empty_like(src_c)
        phases = [("dispatch", lambda: dst_d.copy_(src_d)), ("combine", lambda: dst_c.copy_(src_c))]
    t = time_phases(phases, comm, iters, warmup)
    t["round_trip"] = t["dispatch"] + t["combine"]
    return t


# ---------------------------------------------------------------------------------------------
# Process helpers
# ---------------------------------------------------------------------------------------------


def init_gloo(comm, timeout_s: float = 600.0):
    """Initialise ``torch.distributed`` (gloo) from an mpiexec launch (collective).

    Rank and size come from ``comm``; rank 0 picks a free TCP port and broadcasts it. On one host
    the rendezvous is ``127.0.0.1`` and gloo is bound to the loopback interface (unless
    ``GLOO_SOCKET_IFNAME`` is set); across hosts, rank 0's address. Returns the world group
    (an existing default group is reused).
    """
    import datetime
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    port = None
    if comm.Get_rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1" if one_host else "", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    addr = "127.0.0.1" if one_host else socket.gethostbyname(hosts[0])
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and torch's vector capability, e.g.
    ``"Intel(R) Xeon(R) Processor (torch AVX512)"``: the development VM's host changes, and with it what is fast."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cap = "?"
    return f"{name or platform.processor() or 'unknown CPU'} (torch {cap})"


def memory_snapshot() -> dict:
    """This process's memory and the machine's, in bytes: ``rss``, ``peak_rss`` (includes touched
    shared-memory pages), ``shm_used`` (``/dev/shm``), ``mem_total``, ``mem_available``."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    try:
        st = os.statvfs("/dev/shm")
        shm = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        shm = 0
    mi = _meminfo()
    return dict(rss=rss, peak_rss=peak, shm_used=shm, mem_total=mi.get("MemTotal", 0),
                mem_available=mi.get("MemAvailable", 0))


class MemorySampler:
    """Background thread (use on one rank) recording the minimum ``MemAvailable`` and maximum
    ``/dev/shm`` use every ``interval`` seconds; ``peak_used`` = ``MemTotal - min MemAvailable``
    (the whole machine, other tenants included)."""

    def __init__(self, interval: float = 0.25):
        self.interval, self._stop = interval, threading.Event()
        s = memory_snapshot()
        self.start_available, self.min_available, self.max_shm = s["mem_available"], s["mem_available"], s["shm_used"]
        self.mem_total = s["mem_total"]
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval):
            s = memory_snapshot()
            self.min_available = min(self.min_available, s["mem_available"])
            self.max_shm = max(self.max_shm, s["shm_used"])

    def start(self) -> "MemorySampler":
        self._t.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return dict(mem_total=self.mem_total, start_used=self.mem_total - self.start_available,
                    peak_used=self.mem_total - self.min_available, peak_shm=self.max_shm)


# -- link model: emulation and projection (transports.link_model) ------------------------------

def add_link_args(p) -> None:
    """``--link-profile``, ``--link-emulation``, ``--link-scale`` (checked by :func:`link_setup`)."""
    g = p.add_argument_group("link model (transports.link_model; README 'Link model')")
    g.add_argument("--link-profile", default="ascend950", metavar="NAME|SPEC",
                   help="profile of the projection and of the emulation: ascend950 (default), ascend950_scaleout, "
                        "none (no projection), or explicit 'UBMEM=GBPS:US,URMA=GBPS:US[,SELF=GBPS:US]'")
    g.add_argument("--link-emulation", choices=("none", "delay"), default="none",
                   help="delay: slow deepep_ascend's UBMEM/URMA transfers to the profile x --link-scale "
                        "(SIMULATION, labelled in every output; the MPI/gloo peers are not slowed)")
    g.add_argument("--link-scale", type=float, default=1e-3,
                   help="time scale of --link-emulation delay (default 1e-3: bandwidths x 1e-3, latencies x 1e3); "
                        "unused without it")


def link_setup(p, args):
    """``(profile, emulator or None)`` from :func:`add_link_args`' options; ``p.error`` on bad values."""
    from deepep_ascend.transports import LinkEmulator, get_profile

    try:
        profile = get_profile(args.link_profile)
        emulator = None
        if args.link_emulation == "delay":
            if not profile.links:
                raise ValueError("--link-emulation delay needs a --link-profile with links (not 'none')")
            emulator = LinkEmulator(profile, args.link_scale)
    except ValueError as exc:
        p.error(f"--link-profile/--link-scale: {exc}")
    return profile, emulator


def use_link_emulator(runtime, emulator):
    """Install ``emulator`` (from :func:`link_setup`; ``None`` = leave as is) on a Buffer's
    ``runtime`` and return the emulator that runtime now uses: ``emulator``, or the one
    ``$DEEPEP_ASCEND_LINK_EMULATION`` installed, or ``None`` (links not emulated)."""
    if emulator is not None:
        runtime.set_link_emulator(emulator)
    return runtime.stats.emulator


def link_model_doc(profile, emulator) -> dict:
    """The ``link_model`` entry of a benchmark's JSON: what was emulated (if anything) and projected."""
    return dict(emulation="none" if emulator is None else "delay", profile=profile.name,
                scale=None if emulator is None else emulator.scale,
                label="measured on this host, links not emulated" if emulator is None else emulator.label,
                profile_links=profile.as_dict()["links"])


def project_phases(link_stats: Optional[dict], comm, profile, formula_bytes: dict) -> Optional[dict]:
    """Collective: :func:`transports.project` of each phase's gathered counters on ``profile``.

    ``link_stats``: phase → this rank's ``Buffer.get_link_stats()`` of one call (``None`` on
    every rank: no projection). ``formula_bytes``: phase → this rank's bytes under the
    benchmark's byte formula; ``formula_GBps`` = their max over ranks / the projected time,
    comparable with the measured GB/s of the same formula. ``None`` for a profile without links.
    """
    from deepep_ascend.transports import gather_link_stats, project

    if link_stats is None or not profile.links:
        return None
    from mpi4py import MPI

    out = dict(profile=profile.name, links={k: dict(GBps=v.GBps, latency_us=v.latency_us)
                                            for k, v in profile.links.items()})
    for phase, snap in link_stats.items():
        p = project(gather_link_stats(snap, comm), profile)
        fb = comm.allreduce(int(formula_bytes[phase]), op=MPI.MAX)
        p["formula_bytes"] = fb
        p["formula_GBps"] = gbps(fb, p["time_s"])
        out[phase] = p
    out["round_trip_s"] = sum(out[ph]["time_s"] for ph in link_stats)
    return out


def projection_lines(proj: Optional[dict], measured: dict, formula: str, emulator=None) -> list:
    """``[project]`` lines: per phase the projected time, bottleneck port and formula GB/s next to
    ``measured`` (phase → ``(median_s, GB/s by the same formula)``); under emulation, also the
    projected time dilated by ``1 / scale``, what the emulated links alone model (see
    :class:`transports.LinkEmulator`)."""
    if proj is None:
        return []
    lines = []
    for phase, (t_meas, gb_meas) in measured.items():
        p = proj[phase]
        b = p["bottleneck"]
        where = "nothing sent" if b is None else (
            f"bottleneck rank {b['rank']} {b['kind']} {b['direction']} {fmt_bytes(b['bytes'])} "
            f"({p['bottleneck_GBps']:.1f} GB/s)")
        lines.append(f"[project]  {phase:<8} on {proj['profile']} (model of the counted traffic, not measured): "
                     f"{p['time_s'] * 1e6:.1f} us, {where} | {formula} {p['formula_GBps']:.1f} GB/s projected "
                     f"vs {gb_meas:.2f} GB/s measured{' on EMULATED links' if emulator is not None else ''} "
                     f"({t_meas * 1e3:.3f} ms)")
        if emulator is not None and emulator.profile.name == proj["profile"]:
            lines[-1] += f" | projected / link scale: {p['time_s'] / emulator.scale * 1e3:.3f} ms"
    return lines


def int_at_least(lo: int):
    """argparse ``type=``: an int >= ``lo``, else argparse's usage error (exit 2) on every rank."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"int >= {lo}"
    return parse


def finish(comm, code: int = 0) -> None:
    """The benchmark exit path (``transports.process.exit_job``): flush, final barrier,
    ``MPI_Finalize``, the C library's ``exit(code)``. Not ``os._exit``, which skips MPICH's PMI
    finalize hook and lets mpiexec kill late ranks (see ``transports.process``).
    Destroy Buffers and process groups before calling this (Python atexit handlers do not run).
    """
    from deepep_ascend.transports.process import exit_job

    exit_job(code, comm)


def run_main(main: Callable[[], int]) -> None:
    """Entry point of a benchmark under ``mpiexec``: run ``main()`` and leave by :func:`finish`.

    A ``SystemExit`` becomes the exit code; any other exception prints its traceback and aborts
    the job (``MPI_Abort``), so a rank that dies never leaves its peers hanging in a collective.
    """
    from mpi4py import MPI

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 2)
    except BaseException as e:
        import traceback
        # One write (the first peer's Abort may kill this rank mid-print), the error line first.
        sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] {type(e).__name__}: {e}\n{traceback.format_exc()}")
        from deepep_ascend.transports.process import abort_job

        abort_job(MPI.COMM_WORLD, 1)  # never falls through to finish()
    finish(MPI.COMM_WORLD, code)
