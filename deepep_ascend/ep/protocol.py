"""The wire protocol of the normal-mode engines: the int64 header every rank stages with chunk 0 of a
call, and the consensus every rank reaches from all headers before moving data.

A header row is ``HEADER_BYTES // 8`` int64 words: the words ``W_*`` below, then from word ``MSG_WORD`` a
UTF-8 message of at most ``MSG_BYTES`` bytes (the reason a rank rejected its arguments). After the first
``READY`` every rank reads every rank's header and runs :func:`consensus_problems`; when it returns a
problem, every rank raises the same :class:`ConsensusError` and the engines stay in step (the Buffer
remains usable). Both :mod:`.intranode` and :mod:`.internode` use this layout (docs/design/data-path.md).
"""

from __future__ import annotations

import zlib

import torch

HEADER_BYTES = 1024
MSG_WORD, MSG_BYTES = 32, 768

OP_DISPATCH, OP_CACHED_DISPATCH, OP_COMBINE = 1, 2, 3
OP_NAMES = {OP_DISPATCH: "dispatch", OP_CACHED_DISPATCH: "cached dispatch", OP_COMBINE: "combine"}
# The kinds a Buffer tags its transport's calls with (Transport.set_call_tag, with the call's op code of its
# mode): one per place a call waits (the normal-mode windows, the low-latency window's call signals, the
# transport's barrier, the low-latency clean slot, the load-balance exchange, the teardown of destroy()). Ranks
# found at the same call number in calls of different kinds made different calls; calls of one kind that differ
# are found by their first round.
CALL_NORMAL, CALL_LOW_LATENCY, CALL_BARRIER, CALL_CLEAN, CALL_LOAD_BALANCE, CALL_DESTROY = 1, 2, 3, 4, 5, 6
# Header words (int64).
(W_MAGIC, W_CALL, W_OP, W_STATUS, W_NTOK, W_XBYTES, W_XDTYPE, W_SBYTES, W_SDTYPE, W_TOPK, W_NEXP, W_HANDLE,
 W_CHANNELS, W_WCOLS, W_LAND_OFF, W_LAND_BYTES, W_LAND_ROWS, W_PREFIX, W_XSEG_OFF,
 W_EP_MAX_TOKENS, W_EP_ALIGNMENT, W_EP_MODE, W_OP_CALL) = range(23)
# W_CALL: the Buffer's normal-mode calls so far, this one included; W_OP_CALL: this rank's calls of the
# same kind (dispatches, cached or not, or combines) so far, this one included. Errors name both.
# W_EP_*: EPBuffer's collective arguments (0 in V1 calls); W_EP_MODE is a bit set of EP_MODE_* flags.
EP_MODE_EXPAND, EP_MODE_CPU_SYNC, EP_MODE_ZERO_PADDING, EP_MODE_WEIGHTS = 1, 2, 4, 8
MAGIC = 0xDEE9A5
CONSENSUS_WORDS = (W_OP, W_XBYTES, W_XDTYPE, W_SBYTES, W_SDTYPE, W_TOPK, W_NEXP, W_HANDLE, W_CHANNELS, W_WCOLS,
                    W_PREFIX, W_EP_MAX_TOKENS, W_EP_ALIGNMENT, W_EP_MODE)
SHARED_WORDS = (W_MAGIC, W_CALL, W_OP, W_STATUS, *CONSENSUS_WORDS)  # what an agreeing call's headers share
WORD_NAMES = {W_OP: "operation", W_XBYTES: "bytes per row of x (hidden * itemsize)", W_XDTYPE: "x dtype",
               W_SBYTES: "bytes per row of the FP8 scales", W_SDTYPE: "scales dtype",
               W_TOPK: "num_topk (-1 = no top-k)", W_NEXP: "num_experts",
               W_HANDLE: "handle (id of the dispatch that made it)", W_CHANNELS: "channels (config.num_sms // 2)",
               W_WCOLS: "topk_weights columns (-1 = none)",
               W_PREFIX: "the handle's rank prefix matrix (CRC-32 of its bytes)",
               W_EP_MAX_TOKENS: "num_max_tokens_per_rank", W_EP_ALIGNMENT: "expert_alignment",
               W_EP_MODE: "the layout flags (1: do_expand, 2: do_cpu_sync, 4: do_zero_padding, 8: topk_weights given)"}

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool]


def dtype_code(dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else 99


def _dtype_name(code: int, scale: bool = False) -> str:
    """A dtype code of the header as torch's name (``"torch.bfloat16"``; ``"none"`` for 0 as a scale code)."""
    if scale and code == 0:
        return "none"
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else f"code {code}"


def prefix_checksum(rank_prefix_matrix: torch.Tensor) -> int:
    """CRC-32 of a handle's ``[R, R]`` rank prefix matrix: a header word every rank must agree on,
    so that handles that differ between ranks are refused on every rank, not on some."""
    if rank_prefix_matrix.dtype == torch.int32 and rank_prefix_matrix.is_contiguous():  # (a checked handle's)
        return zlib.crc32(rank_prefix_matrix.numpy())
    return zlib.crc32(rank_prefix_matrix.to(torch.int32).contiguous().numpy().tobytes())


class ConsensusError(ValueError):
    """Every rank raises this when any rank's arguments were rejected or ranks disagree."""


class CallMismatch(ConsensusError):
    """Ranks made calls no first round can compare (calls that wait in different places: the two modes, a barrier,
    a clean; the ``CALL_*`` kinds): raised on the ranks that find it, the buffer failed
    (docs/semantics/deepep-api.md §8). A rank that was refusing its own arguments in that call raises this rather
    than its refusal."""


def _kind(op: int) -> str:
    return "combine" if op == OP_COMBINE else "dispatch"


class CallCounter:
    """This rank's calls of each kind (dispatches, cached or not; combines): the header's ``W_OP_CALL``."""

    def __init__(self):
        self.counts = {"dispatch": 0, "combine": 0}

    def next(self, op: int) -> int:
        """Count one more call of ``op``'s kind; returns its number (1 for the first)."""
        self.counts[_kind(op)] += 1
        return self.counts[_kind(op)]


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ... ``11th``, ``21st``."""
    n = int(n)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def call_name(op: int, call_id: int, op_call: int = 0) -> str:
    """How errors name a call: ``"dispatch call #5 (its 3rd dispatch)"``; ``call_id`` counts the Buffer's
    normal-mode calls, ``op_call`` (0: unknown, left out) the rank's calls of that kind."""
    name = f"{OP_NAMES.get(int(op), f'operation code {int(op)}')} call #{int(call_id)}"
    return f"{name} (its {ordinal(op_call)} {_kind(int(op))})" if op_call > 0 else name


def header_call_name(h, call_id: int | None = None) -> str:
    """:func:`call_name` of a header row. A header of another call number than ``call_id`` is one the rank
    left there in an earlier call (ranks count calls alike, so it has not written this call's header where
    this operation reads it): said so, with what was found."""
    if h[W_MAGIC] != MAGIC:
        return "no call header found" if call_id is None else f"no header of call #{int(call_id)} found"
    name = call_name(h[W_OP], h[W_CALL], h[W_OP_CALL])
    if call_id is not None and h[W_CALL] != call_id:
        return f"no header of call #{int(call_id)} found (the last one there: {name})"
    return name


def sequence_problem(calls) -> str:
    """The problem of ranks that are in different calls; ``calls``: ``(rank, name of its call)`` for every rank."""
    return ("the ranks are in different calls (every rank must make the same sequence of dispatch and combine "
            "calls on a buffer, a rank with no tokens too; docs/semantics/deepep-api.md §8): "
            + ", ".join(f"rank {p}: {name}" for p, name in calls))


def consensus_problems(headers, op, call_id, ranks=None) -> list:
    """Why the ranks of ``headers`` cannot run this call together (empty list: they can).

    ``headers``: ``[n, 128]`` int64 header words, one row per rank (message from word 32);
    ``ranks``: the world rank of each row (default ``0..n-1``). Ranks in different calls (another
    call number or operation) give one problem naming every rank's call, and their other words
    are not compared (they describe different calls).
    """
    if len(headers):  # the usual verdict in one whole-array comparison; the problems are spelled out below
        words = headers[:, list(SHARED_WORDS)]
        expected = words[0].copy()
        expected[:4] = (MAGIC, call_id, op, 0)
        if (words == expected).all():
            return []
    ranks = list(range(headers.shape[0])) if ranks is None else list(ranks)
    problems = []
    if any(h[W_MAGIC] != MAGIC or h[W_CALL] != call_id or h[W_OP] != op for h in headers):
        problems.append(sequence_problem((p, header_call_name(h, call_id)) for p, h in zip(ranks, headers)))
    for p, h in zip(ranks, headers):
        if h[W_MAGIC] == MAGIC and h[W_CALL] == call_id and h[W_STATUS]:
            msg = h[MSG_WORD:].tobytes().rstrip(b"\0").decode("utf-8", "replace")
            problems.append(f"rank {p} rejected its arguments: {msg}")
    if not problems:
        for w in CONSENSUS_WORDS:
            values = headers[:, w]
            if (values != values[0]).any():
                shown = [_dtype_name(int(v), w == W_SDTYPE) if w in (W_XDTYPE, W_SDTYPE) else int(v) for v in values]
                problems.append(f"ranks disagree on {WORD_NAMES[w]}: " + ", ".join(
                    f"rank {p}: {v}" for p, v in zip(ranks, shown)))
    return problems


def consensus_error(op, problems) -> ConsensusError:
    """The error every rank raises for ``problems`` (from :func:`consensus_problems`) in a call of ``op``."""
    return ConsensusError(f"{OP_NAMES[op]} refused on every rank: " + "; ".join(problems))


def check_consensus(headers, op, call_id) -> None:
    """Raise the same ConsensusError on every rank if any rank rejected its call or ranks disagree."""
    problems = consensus_problems(headers, op, call_id)
    if problems:
        raise consensus_error(op, problems)
