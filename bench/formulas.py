"""Byte formulas of the benchmarks (docs/semantics/deepep-api.md §11; 1 GB = 1e9 B),
implemented once for every command and the sweep.

* :func:`logical_bytes`: DeepEP V2's formula, rows a rank receives times what each row carries
  (hidden bytes, FP8-aware, plus top-k metadata), own tokens included;
* :func:`bottleneck_bytes`: DeepEP V1's formula, hidden payload only through the limiting domain;
* :func:`low_latency_bytes`: DeepEP's low-latency formula, per valid ``topk_idx`` selection;
* :func:`mega_moe_pair_bytes`: MegaMoE's per-(token, expert)-pair convention;
* :func:`count_bytes`: DeepEP V2's byte count of the tensors a call returns (its ``tests/ep/test_ep.py``
  divides it by the received rows: bytes per dispatch or combine token), the library's
  ``deepep_ascend.utils.math.count_bytes``;
* :func:`gbps` and :func:`fmt_bytes` to print them.
"""
from __future__ import annotations

from deepep_ascend.utils.math import count_bytes

__all__ = ["FP8_BLOCK", "GB", "bottleneck_bytes", "bytes_per_token", "count_bytes", "fmt_bytes", "gbps",
           "logical_bytes", "low_latency_bytes", "mega_moe_pair_bytes", "topk_bytes_per_token"]

GB = 1e9  #: docs/semantics/deepep-api.md §11: 1 GB = 10^9 bytes
FP8_BLOCK = 128  #: channels per FP8 scale (DeepEP's per-token, per-128-channel recipe)


def bytes_per_token(hidden: int, fp8: bool = False) -> int:
    """Payload bytes of one token's hidden vector, as DeepEP V1's benchmark counts them.

    BF16: ``2 * hidden``. FP8 (e4m3 data plus one float32 scale per 128 channels): the BF16 bytes
    times ``(1 + 4/128) / 2``, i.e. ``hidden + 4 * hidden / 128`` (docs/semantics/deepep-api.md §11). FP8 needs
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
    """**Logical bytes** of one call on one rank (the V2 formula; docs/semantics/deepep-api.md §11).

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
    """**Bottleneck bytes** of one call on one rank (the V1 formula; docs/semantics/deepep-api.md §11).

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
    """Bytes of one low-latency call on one rank, DeepEP's LL formula (docs/semantics/deepep-api.md §11).

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


def mega_moe_pair_bytes(hidden: int, mma: str) -> tuple[int, int]:
    """``(dispatch, combine)`` bytes of one (token, expert) pair of a MegaMoE call (upstream's per-pair
    convention): dispatch ``H * elem`` (e4m3: 1 B, bf16: 2 B) ``+ H/32`` UE8M0 scale bytes (``mma="fp8"``
    only) ``+ 4`` B; combine ``2H`` (the BF16 row back). ``mma`` is ``"fp8"`` (FP8 x FP4) or ``"bf16"``;
    ``ValueError`` otherwise."""
    if mma not in ("fp8", "bf16"):
        raise ValueError(f"mma must be 'fp8' or 'bf16', got {mma!r}")
    fp8 = mma == "fp8"
    return hidden * (1 if fp8 else 2) + (hidden // 32 if fp8 else 0) + 4, 2 * hidden
