"""Workloads: one rank's inputs, deterministic in ``(seed, rank)``, and what makes runs comparable.

* :func:`make_workload` (DeepEP-test-like random routing, or a replayed trace from
  :mod:`bench.routing`), :class:`Workload`;
* :func:`workload_digest` / :func:`fingerprint` / :func:`comm_fingerprint`: a short hash of the
  shape parameters, seed, routing source and every rank's data (equal fingerprints = the same
  inputs bit for bit);
* FP8 casts and :func:`calc_diff` as in DeepEP's ``tests/utils.py`` (docs/semantics/deepep-api.md §4.8),
  :func:`tensor_digest` (bitwise digest of a tensor);
* :func:`reference_layout`: ``get_dispatch_layout`` in pure torch (the peer pipelines' layout), and
  :func:`num_recv_tokens_of` (the rows a rank receives, from it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np
import torch

from bench.formulas import FP8_BLOCK

FP8_MAX = 448.0  #: largest finite e4m3 value


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


def tensor_digest(t: torch.Tensor | None, h: hashlib._Hash | None = None) -> str:
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
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None
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
                  routing: torch.Tensor | None = None,
                  routing_weights: torch.Tensor | None = None,
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


def reference_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Pure-torch ``get_dispatch_layout`` (docs/semantics/deepep-api.md §4.1) for one node (``num_tokens_per_rdma_rank``
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


def num_recv_tokens_of(topk_idx: torch.Tensor, num_experts: int, comm) -> int:
    """This rank's ``N_recv`` (rows it receives in dispatch, a token once per destination rank, own tokens
    included) from :func:`reference_layout` and one ``Alltoall`` of the counts (collective)."""
    itir = reference_layout(topk_idx, num_experts, comm.Get_size())[3]
    counts = itir.sum(0).numpy().astype(np.int64)
    recv = np.empty_like(counts)
    comm.Alltoall(counts, recv)
    return int(recv.sum())
