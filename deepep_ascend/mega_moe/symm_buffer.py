"""The symmetric buffer (``deep_gemm.get_symm_buffer_for_mega_moe``): :class:`SymmBuffer`, its views and
backend, and the constructor's argument checks (docs/semantics/mega-moe.md §1.1)."""

from __future__ import annotations

import math
import warnings

import torch

from ..ep.allocator import SharedOnCopy
from ..ep.buffer import Buffer
from ..ep.group import mpi_comm_of
from ..ep.memory import outside_inference_mode
from ..ep.reduce import CombineScratch
from ..rounding import align
from ..settings import MEGA_MOE_BACKEND, SettingError
from ..transports import Topology, quiet_allgather_object
from .consensus import VERDICT_MSG, check_agreement
from .formats import ACTIVATIONS, BF16, FP8, INTERLEAVE, dispatch_row_bytes

_TOKEN_ALIGN = 384  # LCM of upstream's block-M candidates (docs/semantics/mega-moe.md §1.1)
_VIEW_ALIGN = 64
_MAX_WINDOW_BYTES = 256 << 20
_MAX_OUT_BYTES = 256 << 20  # cap of the shm backend's L2 output area per rank (a fuller call takes the Buffer)
_BACKENDS = ("shm", "buffer")


class SymmBuffer(SharedOnCopy):
    """The symmetric buffer of one rank (``deep_gemm.get_symm_buffer_for_mega_moe``'s result).

    Attributes:
        group: the group given to the constructor; ``ep_buffer``: the normal-mode
            :class:`~deepep_ascend.Buffer` (its transport's barrier and deadline; with the ``buffer``
            backend it moves the rows); ``num_ranks``, ``rank``.
        backend: ``'shm'`` (every rank in one UBMEM domain: peers pull inputs from each other's segments
            and read L2 outputs where they lie) or ``'buffer'`` (rows through the ``ep_buffer``).
        num_experts, num_topk, hidden, intermediate_hidden, num_shared_experts, mma_type,
        activation: the constructor's arguments; ``num_local_experts = num_experts // num_ranks``.
        num_max_tokens_per_rank: rounded up to a multiple of 384 (upstream's rule).
        num_ring_tokens: rows of the scratch ``l1_acts``/``l2_acts`` views (free on CPU).
        buffer: flat int8 tensor backing every view: this rank's part of a node-shared segment (``shm``;
            the same segment then holds an output area of ``min(R·Tmax·K, 256 MiB / 2H)`` rows of
            ``H`` bf16) or private memory (``buffer``).
        x: ``[Tmax, H]`` bf16 (``bf16xbf16``) or float8_e4m3fn (``fp8xfp4``).
        x_sf: ``[Tmax, H/128]`` int32, four UE8M0 bytes (one per 32 channels) per int, row-major
            (fp8 only; ``None`` for bf16).
        topk_idx: ``[Tmax, K]`` int64 global expert ids, -1 = masked slot.
        topk_weights: ``[Tmax, K]`` float32 (ignored where ``topk_idx`` is -1).
        l1_acts, l1_acts_sf, l2_acts, l2_acts_sf: scratch for parity (contents unspecified).
        The views above are filled in place; assigning another tensor to one raises ``AttributeError`` (the call
        reads the symmetric memory, not the attribute).
        last_trace: :class:`~.trace.MegaMoETrace` of the last call (``None`` before the first).
    """

    #: The views over the symmetric memory: filled in place by the caller, never rebound (the call reads the memory).
    _VIEWS = ("x", "x_sf", "topk_idx", "topk_weights", "l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf")

    def __setattr__(self, name, value):
        # (the same view again is what an in-place augmented assignment, buf.x *= 2, stores)
        if name in SymmBuffer._VIEWS and self.__dict__.get("_sealed") and value is not self.__dict__.get(name):
            raise AttributeError(f"SymmBuffer.{name} is a view of the symmetric memory the MegaMoE call reads: fill it "
                                 f"in place (buf.{name}[:n].copy_(t)) instead of assigning another tensor")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if name in SymmBuffer._VIEWS and self.__dict__.get("_sealed"):
            raise AttributeError(f"SymmBuffer.{name} is a view of the symmetric memory the MegaMoE call reads; it "
                                 f"cannot be deleted")
        object.__delattr__(self, name)

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, comm, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                 mma_type, activation, num_shared_experts, timeout_s=None, backend=None):
        self.group = group
        self.num_ranks, self.rank = comm.Get_size(), comm.Get_rank()
        self.num_experts, self.num_topk = num_experts, num_topk
        self.hidden, self.intermediate_hidden = hidden, intermediate_hidden
        self.num_local_experts = num_experts // self.num_ranks
        self.num_max_tokens_per_rank = align(max(1, num_max_tokens_per_rank), _TOKEN_ALIGN)
        self.mma_type, self.activation = mma_type, activation
        self.num_shared_experts = num_shared_experts
        self.is_fp8 = mma_type == "fp8xfp4"
        tmax, h, i = self.num_max_tokens_per_rank, hidden, intermediate_hidden
        self.num_ring_tokens = align(min(tmax * num_topk * self.num_ranks, 2 * _TOKEN_ALIGN), _TOKEN_ALIGN)
        ring = self.num_ring_tokens
        act_dtype = FP8 if self.is_fp8 else BF16
        specs = [("x", (tmax, h), act_dtype)]
        if self.is_fp8:
            specs.append(("x_sf", (tmax, h // 128), torch.int32))
        specs += [("topk_idx", (tmax, num_topk), torch.int64), ("topk_weights", (tmax, num_topk), torch.float32),
                  ("l1_acts", (ring, h), act_dtype), ("l2_acts", (ring, i), act_dtype)]
        if self.is_fp8:
            specs += [("l1_acts_sf", (ring, h // 128), torch.int32), ("l2_acts_sf", (ring, i // 128), torch.int32)]
        offsets, total = [], 0
        for _name, shape, dtype in specs:
            offsets.append(total)
            total = align(total + math.prod(shape) * dtype.itemsize, _VIEW_ALIGN)
        # The node layout first (collective; every rank gets the same answer): it decides the backend and
        # which of the Buffer's windows to size.
        topo = Topology.from_comm(comm)
        if backend == "shm" and topo.num_nodes > 1:
            raise ValueError(f"get_symm_buffer_for_mega_moe: backend 'shm' needs every rank in one UBMEM domain "
                             f"(node); these {self.num_ranks} ranks span {topo.num_nodes} nodes: use backend "
                             f"'buffer' (or the default)")
        self.backend = backend or ("shm" if topo.num_nodes == 1 else "buffer")
        # Rows moved per dispatch (Buffer path): one per (token, k) pair of a wave; the windows stream larger
        # waves. One node: the UBMEM window for up to 128 MiB (or 128 pairs); across nodes both windows, for up
        # to 4096 pairs per call.
        elems, isz = dispatch_row_bytes(h, self.is_fp8) // (1 if self.is_fp8 else 2), 1 if self.is_fp8 else 2
        pairs = max(1, tmax * num_topk)
        if topo.num_nodes > 1:
            rpn, rows = topo.ranks_per_node, min(pairs, 4096)
            nvl = Buffer.get_normal_buffer_size_hint(rows, elems, self.num_ranks, 1, num_experts, isz,
                                                     ranks_per_node=rpn)
            rdma = Buffer.get_normal_rdma_buffer_size_hint(rows, elems, self.num_ranks, rpn, 1, num_experts, isz)
            self.ep_buffer = Buffer(None, align(nvl, 128), align(rdma, 128), comm=comm, explicitly_destroy=True,
                                    timeout_s=timeout_s, ranks_per_node=rpn)
        else:
            nbytes = Buffer.get_normal_buffer_size_hint(pairs, elems, self.num_ranks, 1, num_experts, isz)
            per_pair = max(1, nbytes // pairs)
            nbytes = min(nbytes, max(align(_MAX_WINDOW_BYTES // 2, 128), 128 * per_pair))
            nbytes = max(nbytes, Buffer.get_normal_buffer_size_hint(64, elems, self.num_ranks, 1, num_experts, isz))
            self.ep_buffer = Buffer(None, align(nbytes, 128), comm=comm, explicitly_destroy=True,
                                    timeout_s=timeout_s, ranks_per_node=topo.ranks_per_node)
        self._segment, self._peer_views, self._out_rows = None, None, 0
        if self.backend == "shm":
            # Inputs, then the L2 output area (every row a rank receives, up to _MAX_OUT_BYTES), in a segment
            # every rank maps: peers pull inputs and read outputs where they lie.
            self._out_rows = min(self.num_ranks * tmax * num_topk, max(1, _MAX_OUT_BYTES // (2 * h)))
            self._total = total
            self._verdict_bytes = align(8 + 16 * num_experts + VERDICT_MSG, _VIEW_ALIGN)  # counts: ~8 B each
            nbytes = total + self._out_rows * 2 * h + 2 * self._verdict_bytes
            try:
                self._segment = self.ep_buffer.runtime.create_segment("mega_moe", nbytes)
            except BaseException:
                self.ep_buffer.destroy()
                raise
            self._peer_views = [self._views(self._segment.view(p, 0, nbytes), specs, offsets, True)
                                for p in range(self.num_ranks)]
            self._consensus_calls = 0
            self.buffer = self._segment.view(self.rank, 0, total).view(torch.int8)
            views = self._peer_views[self.rank]
        else:
            self.buffer = torch.zeros(total, dtype=torch.int8)
            views = self._views(self.buffer, specs, offsets)
        for name, _shape, _dtype in specs:
            setattr(self, name, views[name])
        if not self.is_fp8:
            self.x_sf = self.l1_acts_sf = self.l2_acts_sf = None
        self.last_trace = None
        self._reduce_scratch = CombineScratch()  # the final sum's float32 blocks without the native kernel
        self._destroyed = False
        self._sealed = True  # the views are fixed from now on (__setattr__)

    def _views(self, flat, specs, offsets, with_out=False) -> dict:
        """Name -> view of ``flat`` (bytes of one rank's views, then, shm backend, its ``out`` area ``[rows, H]``)."""
        flat = flat.view(torch.uint8)
        out = {}
        for (name, shape, dtype), off in zip(specs, offsets):
            n = math.prod(shape) * dtype.itemsize
            view = flat[off:off + n].view(dtype).view(shape)
            if name.endswith("_sf") and name.startswith("l"):  # MN-major scratch scales (parity)
                view = flat[off:off + n].view(dtype).view(shape[::-1]).t()
            out[name] = view
        if with_out:  # the shm backend's: L2 output area, then two verdict slots (consensus, by call parity)
            a, b = self._total, self._total + self._out_rows * 2 * self.hidden
            out["out"] = flat[a:b].view(BF16).view(self._out_rows, self.hidden)
            out["verdict"] = flat[b:b + 2 * self._verdict_bytes].view(2, self._verdict_bytes)
        return out

    def destroy(self) -> None:
        """Collectively free the Buffer (its window and worker) and the views' memory."""
        if self._destroyed:
            return
        self.ep_buffer.destroy()  # may be refused (TransportBusy): then nothing here is torn down either
        self._destroyed = True
        if self._segment is not None:
            self._segment.release()
            self._segment, self._peer_views = None, None
        self.buffer = torch.empty(0, dtype=torch.int8)
        for name in SymmBuffer._VIEWS:
            object.__setattr__(self, name, None)

    def __repr__(self) -> str:
        return (f"SymmBuffer(rank {self.rank}/{self.num_ranks}, {self.mma_type}, E={self.num_experts}, "
                f"Tmax={self.num_max_tokens_per_rank}, K={self.num_topk}, H={self.hidden}, "
                f"I={self.intermediate_hidden}, shared={self.num_shared_experts})")


def _check_symm_args(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                     use_fp8_dispatch, mma_type, activation, num_shared_experts, backend=None) -> None:
    """The checks of docs/semantics/mega-moe.md §1.1 on one rank's arguments (``AssertionError``, as upstream)."""
    assert isinstance(activation, str) and activation in ACTIVATIONS, (
        f"MegaMoE: activation must be one of {ACTIVATIONS}, got {activation!r}")
    assert backend is None or backend in _BACKENDS, (
        f"MegaMoE: backend (keyword, else ${MEGA_MOE_BACKEND.name}) must be one of {_BACKENDS} or unset, "
        f"got {backend!r}")
    assert mma_type in ("fp8xfp4", "bf16xbf16"), f"MegaMoE: mma_type must be 'fp8xfp4' or 'bf16xbf16', got {mma_type!r}"
    if use_fp8_dispatch is not None:
        warnings.warn("get_symm_buffer_for_mega_moe: use_fp8_dispatch is deprecated; use mma_type",
                      DeprecationWarning, stacklevel=3)  # the caller of get_symm_buffer_for_mega_moe
        assert bool(use_fp8_dispatch) == (mma_type == "fp8xfp4"), (
            f"MegaMoE: use_fp8_dispatch={use_fp8_dispatch} disagrees with mma_type={mma_type!r}")
    for name, v in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                    ("num_topk", num_topk), ("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        least = 0 if name == "num_max_tokens_per_rank" else 1  # 0 tokens: one block of 384, as any count up to it
        assert isinstance(v, int) and v >= least, (
            f"MegaMoE: {name} must be an int >= {least}, got {v!r}")
    assert num_topk <= 32, f"MegaMoE: num_topk must be <= 32, got {num_topk}"
    assert isinstance(num_shared_experts, int) and 0 <= num_shared_experts <= 2, (
        f"MegaMoE: num_shared_experts must be 0, 1 or 2, got {num_shared_experts!r}")
    if mma_type == "fp8xfp4":
        assert hidden % 128 == 0 and intermediate_hidden % 128 == 0, (
            f"MegaMoE fp8xfp4: hidden ({hidden}) and intermediate_hidden ({intermediate_hidden}) must be multiples "
            f"of 128")
    else:
        assert intermediate_hidden % INTERLEAVE == 0, (
            f"MegaMoE bf16xbf16: intermediate_hidden ({intermediate_hidden}) must be a multiple of {INTERLEAVE} "
            f"(the L1 gate/up interleave)")
    assert num_experts % num_ranks == 0, (
        f"MegaMoE: num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})")


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, use_fp8_dispatch=None, mma_type: str = "fp8xfp4",
                                 activation: str = "swiglu", *, num_shared_experts: int = 0,
                                 timeout_s: float | None = None, backend: str | None = None) -> SymmBuffer:
    """Collective: the symmetric buffer of MegaMoE (mirrors ``deep_gemm.get_symm_buffer_for_mega_moe``).

    Args:
        group: an mpi4py communicator or a ``torch.distributed`` ProcessGroup (as
            :class:`~deepep_ascend.Buffer`); every rank passes the same other arguments.
        num_experts: ``E``, a multiple of the group size; num_topk: ``K <= 32``.
        num_max_tokens_per_rank: capacity per rank (>= 0), rounded up to a multiple of 384 (0 and 1 give 384).
        hidden, intermediate_hidden: ``H``, ``I``. ``fp8xfp4`` needs ``H % 128 == 0`` and
            ``I % 128 == 0``; ``bf16xbf16`` needs ``I % 8 == 0`` (the L1 interleave).
        use_fp8_dispatch: deprecated alias of ``mma_type == 'fp8xfp4'`` (warns; must agree).
        mma_type: ``'fp8xfp4'`` or ``'bf16xbf16'``; activation: ``'swiglu'`` or ``'swigluoai'`` (the layout is
            the same; each call names its own activation, docs/semantics/mega-moe.md §1.3).
        num_shared_experts: 0-2 shared experts (keyword-only; DeepGEMM-Ascend extension).
        timeout_s: deadline of the Buffer's waits (default ``$DEEPEP_ASCEND_TIMEOUT_S``).
        backend: keyword-only, how rows move (``SymmBuffer.backend``): ``'shm'`` (needs every rank on one
            node) or ``'buffer'``; default ``$DEEPEP_ASCEND_MEGA_MOE_BACKEND``, else ``'shm'`` on one node and
            ``'buffer'`` across nodes. Both give the same ``y`` bit for bit.
    Raises:
        AssertionError: the checks of docs/semantics/mega-moe.md §1.1, on the rank whose arguments fail them (every rank
            when all pass the same); the other ranks raise :class:`~deepep_ascend.ConsensusError` naming it.
        ConsensusError: (a ``ValueError``) on every rank when ranks pass different arguments, naming the
            argument and every rank's value.
        ValueError: bad ``group``; ``backend='shm'`` on ranks that span several nodes (every rank).
    """
    comm = mpi_comm_of(group, owner="get_symm_buffer_for_mega_moe")
    if backend is None:
        try:
            backend = MEGA_MOE_BACKEND.get()
        except SettingError:
            backend = MEGA_MOE_BACKEND.raw()  # refused by the argument checks, collectively
    args = dict(num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                hidden=hidden, intermediate_hidden=intermediate_hidden, mma_type=mma_type, activation=activation,
                num_shared_experts=num_shared_experts, backend=backend)
    err = None
    try:
        _check_symm_args(comm.Get_size(), use_fp8_dispatch=use_fp8_dispatch, **args)
    except AssertionError as exc:
        err = exc
    # Before the Buffer, whose window sizes follow from these: a rank with other arguments would otherwise
    # fail there on a window size, or build a buffer whose first call fails (num_experts), or none at all
    # (intermediate_hidden); a rank whose checks failed would leave the others waiting in it.
    # Plain values, compared for what they mean (True is 1, capacities 8 and 300 are both 384 rows) and always
    # picklable; a rank whose checks failed sends its message only.
    mine = None if err is not None else {k: v if v is None or isinstance(v, str) else int(v) for k, v in args.items()}
    if mine is not None:
        mine["num_max_tokens_per_rank"] = align(max(1, num_max_tokens_per_rank), _TOKEN_ALIGN)
    gathered = quiet_allgather_object(comm, (None if err is None else str(err), mine), timeout_s,
                                      "get_symm_buffer_for_mega_moe: ranks agreeing on its arguments")
    if err is not None:
        raise err
    check_agreement(comm.Get_rank(), "get_symm_buffer_for_mega_moe", gathered)
    return SymmBuffer(group, comm, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      mma_type, activation, num_shared_experts, timeout_s, backend)
