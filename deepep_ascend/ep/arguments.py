"""Argument checks of ``Buffer``'s normal-mode calls (DeepEP's checks, and those a CPU port adds).

A collective call validates its arguments before anything shared is touched. A check that fails
raises :class:`Rejected` carrying the exception this rank raises; the Buffer first takes part in
the call's first round with an error status, so that every other rank raises a
:class:`~deepep_ascend.ep.protocol.ConsensusError` naming this one instead of waiting for it.
Calls that do not communicate unwrap :class:`Rejected` and raise its exception at once.

Every message names the argument at fault (`` `x` ``, `` `handle.recv_src_idx` ``, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import is_int, storage_problem
from ..host import physical_memory_bytes
from ..native import dispatch_layout as native_dispatch_layout
from ..rounding import ceil_div
from .config import Config
from .event import EventOverlap
from .handles import InternodeHandle, IntranodeHandle, origin_of
from .layout import dispatch_layout, last_slot_per_rank, tokens_per_node, topk_idx_t

__all__ = ["Rejected", "check", "check_combine_args", "check_config", "check_dispatch_layout_args",
           "check_dispatch_options", "check_handle_rows", "check_internode_handle", "check_intranode_handle",
           "check_stream_args", "check_tensor", "check_topk_idx", "check_worst_tokens_fit", "check_x",
           "checked_dispatch_layout", "context_idx_problem", "is_int", "sl_idx_problem"]


class Rejected(Exception):
    """A failed check: carries the exception to raise on this rank after the consensus round."""

    def __init__(self, exc: Exception):
        super().__init__(str(exc))
        self.exc = exc


def check(cond: bool, exc_type: type[Exception], message) -> None:
    """Raise :class:`Rejected` (``exc_type(message)``) unless ``cond``. ``message``: a string, or a function
    returning it, called only on failure (a call's checks pass far more often than they fail, and formatting
    a message costs microseconds)."""
    if not cond:
        raise Rejected(exc_type(message() if callable(message) else message))


def check_tensor(t, name: str, dtype: torch.dtype | None = None, ndim: int | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
    """``t`` is a dense CPU ``torch.Tensor`` with the given dtype, number of dims and shape (each optional).

    Raises:
        Rejected: ``TypeError`` (not a tensor, dtype) or ``ValueError`` (storage, dims, shape) naming ``name``.
    """
    if (isinstance(t, torch.Tensor) and storage_problem(t) is None and (dtype is None or t.dtype == dtype)
            and (ndim is None or t.dim() == ndim) and (shape is None or tuple(t.shape) == tuple(shape))):
        return  # the usual outcome, decided before any message is made
    check(isinstance(t, torch.Tensor), TypeError, lambda: f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    problem = storage_problem(t)
    check(problem is None, ValueError, lambda: f"`{name}` {problem}")
    if dtype is not None:
        check(t.dtype == dtype, TypeError, lambda: f"`{name}` must have dtype {dtype}, got {t.dtype}")
    if ndim is not None:
        check(t.dim() == ndim, ValueError, lambda: f"`{name}` must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        check(tuple(t.shape) == tuple(shape), ValueError,
              lambda: f"`{name}` must have shape {tuple(shape)}, got {tuple(t.shape)}")


def sl_idx_problem(owner: str, sl_idx) -> TypeError | None:
    """Why ``sl_idx`` is not what DeepEP's binding takes (``Optional[int]``; no meaning on CPU ranks), naming
    ``owner``, or None: a constructor refuses it on every rank (``check_agreed``)."""
    if sl_idx is None or is_int(sl_idx):
        return None
    return TypeError(f"{owner}: sl_idx must be None or an int (DeepEP's RDMA service level), got "
                     f"{type(sl_idx).__name__}")


def context_idx_problem(owner: str, context_idx) -> ValueError | None:
    """Why a one-group buffer's ``barrier(context_idx=)`` cannot take ``context_idx`` (None or 0), or None. The
    barrier raises it after taking part, so that the ranks' barriers stay paired."""
    if context_idx is None or (is_int(context_idx) and context_idx == 0):
        return None
    return ValueError(f"{owner}.barrier: context_idx must be None or 0 (one group), got {context_idx!r}")


def check_writable(t: torch.Tensor, name: str) -> None:
    """``t``, a tensor the call writes in place (a stats tensor, ``out``), may be written now: not an inference
    tensor outside ``torch.inference_mode()``, which torch would refuse only once the data had moved.

    Raises:
        Rejected: ``RuntimeError`` naming ``name``.
    """
    check(not t.is_inference() or torch.is_inference_mode_enabled(), RuntimeError,
          lambda: f"`{name}` is an inference tensor (made under torch.inference_mode()): outside that mode the call "
                  f"cannot write it in place; make it outside inference mode, or make the call inside it")


def check_stream_args(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """DeepEP's stream-argument checks.

    Raises:
        Rejected: ``RuntimeError`` (``allocate_on_comm_stream`` without ``previous_event`` and
            ``async_finish``), ``TypeError`` (``previous_event`` not an :class:`EventOverlap`).
    """
    check(not allocate_on_comm_stream or (previous_event is not None and async_finish), RuntimeError,
          "allocate_on_comm_stream=True requires previous_event and async_finish=True")
    check(previous_event is None or isinstance(previous_event, EventOverlap), TypeError,
          lambda: f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")


def check_topk_idx(topk_idx, num_experts, num_ranks: int, values: bool = True) -> None:
    """``num_experts`` a positive multiple of ``num_ranks``; ``topk_idx`` ``[N, K]`` ``topk_idx_t`` in ``[-1, E)``
    (the values only with ``values``: False when they were checked against the same ``E`` before).

    Raises:
        Rejected: ``ValueError`` (``num_experts``, dims, values) or ``TypeError`` (dtype).
    """
    check(isinstance(num_experts, int) and num_experts > 0 and num_experts % num_ranks == 0, ValueError,
          lambda: f"num_experts must be a positive multiple of the number of ranks ({num_ranks}), got {num_experts!r}")
    check_tensor(topk_idx, "topk_idx", ndim=2)
    check(topk_idx.dtype == topk_idx_t, TypeError, lambda: f"`topk_idx` must have dtype {topk_idx_t} (topk_idx_t), "
          f"got {topk_idx.dtype}")
    if values and topk_idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_idx))  # one pass
        check(lo >= -1 and hi < num_experts, ValueError,
              lambda: f"`topk_idx` values must lie in [-1, {num_experts}), got min {lo}, max {hi}")


def checked_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                            last_slot: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`~.layout.dispatch_layout` of a ``topk_idx`` whose dims and dtype, and ``num_experts``, are checked
    already (:func:`check_topk_idx` with ``values=False``), its ids' range checked on the way: the native
    layout's one pass refuses an id outside ``[-1, num_experts)``, and then (or without the kernel)
    :func:`check_topk_idx` reads the values before the torch layout counts them.

    Returns:
        ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``, and with
        ``last_slot`` a fourth, :func:`~.layout.last_slot_per_rank` (in the same native pass where built).
    Raises:
        Rejected: ``ValueError`` naming the range and the ids' min and max.
    """
    counts = native_dispatch_layout(topk_idx, num_experts, num_ranks, last_slot)
    if counts is None:
        check_topk_idx(topk_idx, num_experts, num_ranks)
        counts = dispatch_layout(topk_idx, num_experts, num_ranks)
        if last_slot:
            counts = (*counts, last_slot_per_rank(topk_idx, num_experts, num_ranks))
    return counts


def check_x(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dispatch's ``x``: a 2-D tensor of any real dtype, or the FP8 pair ``(data, scales)``.

    Returns:
        ``(data [N, H], scales [N, S] | None)``; FP8 scales are float32 ``[N, H/128]`` or int32
        (packed UE8M0) ``[N, ceil(H/512)]``.
    Raises:
        Rejected: ``TypeError`` / ``ValueError`` naming ``x``, ``x[0]`` or ``x[1]``.
    """
    if isinstance(x, tuple):
        check(len(x) == 2, ValueError, lambda: f"FP8 `x` must be a (data, scales) tuple, got {len(x)} items")
        data, scales = x
        check_tensor(data, "x[0] (FP8 data)", ndim=2)
        check(data.element_size() == 1, TypeError,
              lambda: f"`x[0]` (FP8 data) must be a 1-byte dtype (torch.float8_e4m3fn), got {data.dtype}")
        hidden = data.size(1)
        check(hidden % 128 == 0, ValueError,
              lambda: f"FP8 dispatch needs hidden % 128 == 0 (per-128-channel scales), got hidden={hidden}")
        check_tensor(scales, "x[1] (scales)", ndim=2)
        check(scales.dtype in (torch.float32, torch.int32), TypeError,
              lambda: f"`x[1]` (scales) must be float32 (or int32 packed UE8M0), got {scales.dtype}")
        want = hidden // 128 if scales.dtype == torch.float32 else ceil_div(hidden, 512)
        check(tuple(scales.shape) == (data.size(0), want), ValueError,
              lambda: f"`x[1]` (scales) must have shape {(data.size(0), want)} for hidden={hidden} and "
              f"{scales.dtype}, got {tuple(scales.shape)}")
        return data, scales
    check_tensor(x, "x", ndim=2)
    check(x.element_size() > 0 and not x.is_complex(), TypeError, lambda: f"`x` dtype {x.dtype} is not supported")
    check(x.size(1) >= 1, ValueError, lambda: f"`x` must have hidden >= 1, got shape {tuple(x.shape)}")
    return x, None


def check_config(config, default: Callable[[], Config]) -> Config:
    """``config``, or ``default()`` when it is None.

    Raises:
        Rejected: ``TypeError`` (not a :class:`Config`), ``ValueError`` (fewer than one channel).
    """
    if config is None:
        return default()
    if not isinstance(config, Config):
        raise Rejected(TypeError(f"`config` must be a deepep_ascend.Config, got {type(config).__name__}"))
    check(config.num_channels >= 1, ValueError,
          lambda: f"config.num_sms must be >= 2 (one channel per two SMs), got {config.num_sms}")
    return config


# -- non-cached dispatch ------------------------------------------------------------------------------
def check_dispatch_layout_args(num_tokens: int, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert, topk_idx, topk_weights, *, num_ranks: int, num_nodes: int,
                               ranks_per_node: int, from_layout: bool = False) -> int:
    """The layout tensors of a non-cached dispatch of ``num_tokens`` tokens, against each other and ``topk_idx``.

    Args:
        num_tokens_per_rank: ``[R]`` int32; num_tokens_per_rdma_rank: ``[G]`` int32 across nodes,
            ``None`` on one node (``num_nodes == 1``); is_token_in_rank: ``[N, R]`` bool;
            num_tokens_per_expert: ``[E]`` int32; topk_idx / topk_weights: ``[N, K]`` int64 /
            float32, or both ``None``. As :meth:`Buffer.get_dispatch_layout` returns them.
        from_layout: the layout tensors are the ones this Buffer's ``get_dispatch_layout`` returned for this
            very ``topk_idx``, none written since: their values are known to match, only shapes are checked.
    Returns:
        ``E``, the number of experts (``len(num_tokens_per_expert)``).
    Raises:
        Rejected: ``ValueError`` (missing, shapes, values that do not match) or ``TypeError`` (dtypes).
    """
    r = num_ranks
    check(num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None,
          ValueError, "non-cached dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert "
          "(from get_dispatch_layout), or a handle")
    if num_nodes > 1:
        check(num_tokens_per_rdma_rank is not None, ValueError,
              lambda: f"internode dispatch ({num_nodes} nodes) needs num_tokens_per_rdma_rank (from "
                      f"get_dispatch_layout)")
        check_tensor(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", torch.int32, shape=(num_nodes,))
    else:
        check(num_tokens_per_rdma_rank is None, ValueError, "num_tokens_per_rdma_rank must be None on one node")
    check_tensor(num_tokens_per_rank, "num_tokens_per_rank", torch.int32, shape=(r,))
    check_tensor(is_token_in_rank, "is_token_in_rank", torch.bool, ndim=2)
    check(is_token_in_rank.size(0) == num_tokens, ValueError,
          lambda: f"`x` has {num_tokens} tokens but `is_token_in_rank` has {is_token_in_rank.size(0)} rows")
    check_tensor(is_token_in_rank, "is_token_in_rank", torch.bool, shape=(num_tokens, r))
    check_tensor(num_tokens_per_expert, "num_tokens_per_expert", torch.int32, ndim=1)
    num_experts = num_tokens_per_expert.numel()
    check(num_experts > 0 and num_experts % r == 0, ValueError,
          lambda: f"num_experts (len(num_tokens_per_expert)) must be a positive multiple of {r} ranks, got "
                  f"{num_experts}")
    check(from_layout or torch.equal(num_tokens_per_rank, is_token_in_rank.sum(0, dtype=torch.int32)), ValueError,
          "`num_tokens_per_rank` does not equal is_token_in_rank.sum(0)")
    if num_nodes > 1 and not from_layout:
        check(torch.equal(num_tokens_per_rdma_rank, tokens_per_node(is_token_in_rank, num_nodes, ranks_per_node)),
              ValueError, "`num_tokens_per_rdma_rank` does not match is_token_in_rank (tokens with an expert on each "
              "node; use get_dispatch_layout's outputs)")
    check((topk_idx is None) == (topk_weights is None), ValueError,
          "`topk_idx` and `topk_weights` must be given together or not at all")
    if topk_idx is not None:
        if not from_layout:  # get_dispatch_layout checked this topk_idx already
            check_topk_idx(topk_idx, num_experts, r)
        check(topk_idx.size(0) == num_tokens, ValueError, lambda: f"`topk_idx` has {topk_idx.size(0)} rows, x has "
                                                                  f"{num_tokens}")
        check_tensor(topk_weights, "topk_weights", torch.float32, shape=tuple(topk_idx.shape))
    if topk_idx is not None and not from_layout:
        _, ntpe, itr = dispatch_layout(topk_idx, num_experts, r)
        check(torch.equal(itr, is_token_in_rank), ValueError,
              "`is_token_in_rank` does not match `topk_idx` (use get_dispatch_layout's outputs)")
        check(torch.equal(ntpe, num_tokens_per_expert), ValueError,
              "`num_tokens_per_expert` does not match `topk_idx` (use get_dispatch_layout's outputs)")
    elif topk_idx is None:
        check(bool((num_tokens_per_expert >= 0).all()), ValueError, "`num_tokens_per_expert` has negatives")
    return num_experts


#: The largest ``expert_alignment``: a 32-bit int, as DeepEP's kernels take it (larger values would overflow the
#: aligned counts' int32 and int64 arithmetic on one rank instead of being refused on all).
MAX_EXPERT_ALIGNMENT = 2**31 - 1


def expert_alignment_ok(value) -> bool:
    """Whether ``value`` is an int in ``[1, MAX_EXPERT_ALIGNMENT]``."""
    return is_int(value) and 1 <= value <= MAX_EXPERT_ALIGNMENT


def check_dispatch_options(expert_alignment, num_worst_tokens, has_topk: bool) -> None:
    """``expert_alignment`` in ``[1, MAX_EXPERT_ALIGNMENT]``; ``num_worst_tokens >= 0``, and > 0 only with top-k.

    Raises:
        Rejected: ``ValueError`` naming the option.
    """
    check(isinstance(expert_alignment, int) and expert_alignment_ok(expert_alignment), ValueError,
          lambda: f"expert_alignment must be an int in [1, {MAX_EXPERT_ALIGNMENT}], got {expert_alignment!r}")
    check(isinstance(num_worst_tokens, int) and num_worst_tokens >= 0, ValueError,
          lambda: f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
    check(num_worst_tokens == 0 or has_topk, ValueError, "num_worst_tokens > 0 needs topk_idx and topk_weights")


def check_worst_tokens_fit(num_worst_tokens: int, row_bytes: int) -> None:
    """``num_worst_tokens`` outputs of ``row_bytes`` each (rows, scales, top-k ids and weights, source index) fit
    this host's memory: a dispatch allocates them before any count is known, so a size no host could hold is
    refused here, on every rank, instead of failing the allocation on one rank inside the call.

    Raises:
        Rejected: ``ValueError`` naming ``num_worst_tokens``, the bytes asked for and the host's.
    """
    need, have = num_worst_tokens * row_bytes, physical_memory_bytes()
    if have is not None and need > have:
        check(False, ValueError, f"num_worst_tokens={num_worst_tokens} asks for outputs of {need / 2**30:.3g} GiB "
              f"({row_bytes} B per row), more than this host's {have / 2**30:.3g} GiB of memory")


# -- handles ----------------------------------------------------------------------------------------------
def _describe_container(handle) -> str:
    return f"{type(handle).__name__}{'' if not isinstance(handle, (tuple, list)) else f' of {len(handle)} items'}"


def _check_origin(handle, config: Config, num_channels: int, op: str, buffer_id: int) -> int:
    """The handle comes from this Buffer (if from any) with the config's channels;
    returns its dispatch id (-1: unknown)."""
    origin = origin_of(handle)
    check(origin is None or origin.buffer_id == buffer_id, ValueError,
          lambda: f"`handle` was made by another Buffer (#{origin.buffer_id if origin else '?'}), not by this one "
          f"(#{buffer_id})")
    check(num_channels == config.num_channels, ValueError,
          lambda: f"`handle` has {num_channels} channels but {op}'s config has {config.num_channels} (num_sms="
          f"{config.num_sms}); the config's num_sms must match the dispatch that made the handle")
    return origin.dispatch_id if origin is not None else -1


def _check_entries(handle, expected, where: str) -> None:
    for t, name, (dtype, shape) in zip(handle, handle._fields, expected):
        if t.dtype != dtype or tuple(t.shape) != shape:
            check(False, ValueError, f"`handle.{name}` must be {dtype} {shape} for {where}, got {t.dtype} "
                                     f"{tuple(t.shape)}")


def check_intranode_handle(handle, config: Config, op: str, *, rank: int, num_ranks: int,
                           buffer_id: int) -> tuple[IntranodeHandle, int]:
    """A 6-entry intranode handle (docs/semantics/deepep-api.md §4.3) for a call of ``op`` with ``config``.

    Returns:
        ``(handle as an IntranodeHandle, id of the dispatch that made it, -1 if unknown)``.
    Raises:
        Rejected: ``ValueError`` (length, an entry's dtype or shape, another Buffer's handle, another
            channel count, a prefix matrix promising more rows than ``recv_src_idx`` holds) or
            ``TypeError`` / ``ValueError`` of :func:`check_tensor` naming the entry.
    """
    check(isinstance(handle, (tuple, list)) and len(handle) == 6, ValueError,
          lambda: f"`handle` must be the 6-tuple returned by an intranode dispatch, got {_describe_container(handle)}")
    for t, name in zip(handle, IntranodeHandle._fields):
        check_tensor(t, f"handle.{name}")
    handle = IntranodeHandle._make(handle)
    cpm, itr = handle.channel_prefix_matrix, handle.is_token_in_rank
    r, c = num_ranks, cpm.size(1) if cpm.dim() == 2 else -1
    n = itr.size(0) if itr.dim() == 2 else -1
    _check_entries(handle, ((torch.int32, (r, r)), (torch.int32, (r, c)), (torch.int32, (r, c)),
                            (torch.int32, (handle.recv_src_idx.numel(),)), (torch.bool, (n, r)), (torch.int32, (n, r))),
                   f"{r} ranks")
    dispatch_id = _check_origin(handle, config, c, op, buffer_id)
    check_handle_rows(handle, rank)
    return handle, dispatch_id


def check_handle_rows(handle, rank: int) -> None:
    """The value of a well-formed handle (entries of the right dtypes and shapes) that a combine or cached
    dispatch could read past its rows by: the rows its prefix sums promise this rank must lie within
    ``recv_src_idx`` (intranode) or ``recv_src_meta`` (internode). Also checked for a sealed handle
    (``Buffer._check_handle``): writes through ``.numpy()``, ``.data`` or a raw pointer leave no version mark.

    Raises:
        Rejected: ``ValueError`` naming the two entries.
    """
    # (int32 CPU entries, checked or made so: one element read through numpy, not a 0-dim tensor)
    if isinstance(handle, IntranodeHandle):
        check(int(handle.rank_prefix_matrix.numpy()[-1, rank]) <= handle.recv_src_idx.numel(), ValueError,
              "`handle.rank_prefix_matrix` promises more rows than `handle.recv_src_idx` holds")
    else:
        check(int(handle.recv_gbl_rank_prefix_sum.numpy()[-1]) <= handle.recv_src_meta.size(0), ValueError,
              "`handle.recv_gbl_rank_prefix_sum` promises more rows than `handle.recv_src_meta` holds")


def check_internode_handle(handle, config: Config, op: str, *, num_ranks: int, num_nodes: int,
                           buffer_id: int) -> tuple[InternodeHandle, int]:
    """A 10-entry internode handle (docs/semantics/deepep-api.md §5) for a call of ``op`` with ``config``.

    Returns:
        ``(handle as an InternodeHandle, id of the dispatch that made it, -1 if unknown)``.
    Raises:
        Rejected: as :func:`check_intranode_handle` (``recv_gbl_rank_prefix_sum`` against
            ``recv_src_meta``).
    """
    check(isinstance(handle, (tuple, list)) and len(handle) == 10, ValueError,
          lambda: f"`handle` must be the 10-tuple returned by an internode dispatch ({num_nodes} nodes), got "
          f"{_describe_container(handle)}")
    for t, name in zip(handle, InternodeHandle._fields):
        check_tensor(t, f"handle.{name}")
    handle = InternodeHandle._make(handle)
    r, g, p = num_ranks, num_nodes, num_ranks // num_nodes
    rdma_cpm, itr, meta, fwd_prefix = (handle.rdma_channel_prefix_matrix, handle.is_token_in_rank,
                                       handle.recv_src_meta, handle.recv_rdma_rank_prefix_sum)
    c = rdma_cpm.size(1) if rdma_cpm.dim() == 2 else -1
    n = itr.size(0) if itr.dim() == 2 else -1
    rows = meta.size(0) if meta.dim() == 2 else -1
    num_forwarded = int(fwd_prefix[-1]) if fwd_prefix.numel() == g and fwd_prefix.dtype == torch.int32 else -1
    _check_entries(handle, ((torch.bool, (n, r)), (torch.int32, (g, c)), (torch.int32, (r, c)), (torch.int32, (g, c)),
                            (torch.int32, (g,)), (torch.int32, (r, c)), (torch.int32, (r,)), (torch.uint8, (rows, 8)),
                            (torch.int32, (n, g)), (torch.int32, (num_forwarded, p))),
                   f"{r} ranks in {g} nodes")
    dispatch_id = _check_origin(handle, config, c, op, buffer_id)
    check_handle_rows(handle, -1)
    return handle, dispatch_id


# -- combine --------------------------------------------------------------------------------------------------
def check_combine_args(x, topk_weights, bias, *, rows: int, rows_name: str,
                       num_tokens: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, int]:
    """A combine's ``x`` ``[rows, H]`` bf16, ``topk_weights`` ``[rows, K']`` float32 or None, and ``bias``.

    Args:
        rows: rows of the handle's dispatch (``rows_name`` says which entry holds them).
        num_tokens: ``N``, tokens of this rank (rows of ``bias``).
    Returns:
        ``(biases, wcols)``: ``None`` or a pair of ``[N, H]`` bf16 tensors whose first is not None,
        and the columns of ``topk_weights`` (-1: none).
    Raises:
        Rejected: ``TypeError`` / ``ValueError`` naming ``x``, ``topk_weights`` or ``bias[i]``.
    """
    check_tensor(x, "x", torch.bfloat16, ndim=2)
    check(x.size(0) == rows, ValueError, lambda: f"`x` must have one row per received token ({rows}, {rows_name}), "
          f"got {x.size(0)}")
    hidden = x.size(1)
    if topk_weights is not None:
        check_tensor(topk_weights, "topk_weights", torch.float32, ndim=2)
        check(topk_weights.size(0) == rows, ValueError,
              lambda: f"`topk_weights` must have {rows} rows, got {topk_weights.size(0)}")
    biases = bias if isinstance(bias, (tuple, list)) else (bias, None)
    check(len(biases) == 2, ValueError, lambda: f"`bias` must be a tensor or a pair, got {len(biases)} items")
    for i, b in enumerate(biases):
        if b is not None:
            check_tensor(b, f"bias[{i}]", torch.bfloat16, shape=(num_tokens, hidden))
    if biases[0] is None:
        biases = (biases[1], None)
    wcols = topk_weights.size(1) if topk_weights is not None else -1
    return (None if biases[0] is None else biases), wcols
