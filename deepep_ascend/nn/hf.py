"""Expert parallelism for Hugging Face ``transformers`` MoE models through :class:`deepep_ascend.Buffer`.

``transformers`` (5.18 or later; ``pip install "deepep_ascend[hf]"``) stores the routed experts of a
MoE block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, DeepSeek-V3's ``DeepseekV3MoE``, Mixtral, Qwen2-MoE
and most others) in one *experts module*: a class decorated with ``use_experts_implementation``
whose parameters are stacked over the experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
and biases where the model has them) and whose ``forward(hidden_states [N, H], top_k_index [N, K],
top_k_weights [N, K])`` returns ``[N, H]``: the weighted sum of each token's chosen experts. The
block around it runs the router (and any shared expert) and calls the experts module.

:func:`expert_parallel` swaps each experts module for an expert-parallel one and leaves the rest
of the block alone, so the router and shared experts stay on every rank, the block's return
value is unchanged and the router logits that ``output_router_logits=True`` records still come
from the same router modules. The expert-parallel module keeps only EP rank ``r``'s experts
``[r·L, (r+1)·L)``, ``L = E / R``: every parameter is sliced along its expert dimension from the
original module, so the model starts identical to the original, and the parameter names (and
``state_dict`` keys) stay those of the original, with ``L`` rows. Its forward is

1. :func:`deepep_ascend.nn.autograd.dispatch` of the rows as bf16, with the router's ``top_k_index``
   (global expert ids) and ``top_k_weights`` (as float32), which computes the layout with
   ``Buffer.get_dispatch_layout``;
2. the original class's own forward on the received rows (whichever ``experts_implementation``
   the config selects: ``grouped_mm``, ``batched_mm``, ``eager``) with local expert ids, and with
   ``L`` — ``transformers``' own expert-parallel "no expert here" id — in the slots whose expert
   lives on another rank (their received weight is 0; the experts module is marked
   ``_is_expert_parallel`` so the implementations skip them);
3. :func:`deepep_ascend.nn.autograd.combine` of the weighted rows as bf16, cast back to
   ``hidden_states``' dtype.

Gradients flow back through the same calls (combine's backward is a cached dispatch, dispatch's
a combine: two collective calls per layer and direction). Numerics: the dispatched rows and each
rank's weighted partial are rounded to bf16, the combine sums the partials in float32 in
ascending rank order and rounds once more; everything else runs in the model's dtype.

Rules of use (the calls are collective over the Buffer's group):

* every rank builds the same model (same config, same weights: seed torch identically, or load
  the same checkpoint) and calls :func:`expert_parallel` with a Buffer over the EP group; each
  rank then feeds its own batch (data parallelism for everything but the experts);
* every rank runs every MoE layer the same number of times in the same order (any number of
  tokens, zero included), forward and backward;
* the non-expert parameters are replicated: sum their gradients over the ranks (the data-parallel
  all-reduce) before the optimizer step; the expert parameters' gradients are complete on their
  owner rank (they already include every rank's tokens);
* ``transformers``' load-balancing loss (``output_router_logits=True`` with labels) is computed
  from each rank's own tokens, as in any data-parallel run.

The Buffer needs a UBMEM window (``num_nvl_bytes``), and a URMA window (``num_rdma_bytes``) when its
group spans nodes; :func:`buffer_sizes` gives both, for which no call streams in rounds, on the
topology the Buffer gets. Low-latency mode and FP8 are not offered here.

Example (every rank, ``mpiexec -n 4``)::

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from deepep_ascend import Buffer
    from deepep_ascend.nn import hf

    torch.manual_seed(0)                      # the same weights on every rank
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, ...))
    buffer = Buffer(None, *hf.buffer_sizes(model, num_max_tokens_per_rank=512, comm=comm), comm=comm)
    hf.expert_parallel(model, buffer)         # in place; rank r keeps experts [2r, 2r + 2)
    loss = model(input_ids=my_batch, labels=my_batch).loss
    loss.backward()                           # then all-reduce the non-expert gradients, step
"""

from __future__ import annotations

import torch
from torch import nn

from ..ep.buffer import Buffer
from ..transports import Topology
from . import autograd as ep_autograd

__all__ = ["ExpertParallelExperts", "buffer_size_hint", "buffer_sizes", "expert_parallel", "find_experts_modules"]

_BF16 = torch.bfloat16
# The first release whose experts implementations honour ``_is_expert_parallel`` (the "no expert here"
# id ``num_experts`` in ``top_k_index``) in grouped_mm and batched_mm, not only in eager.
MIN_TRANSFORMERS = (5, 18)
_EXTRA_HINT = 'pip install "deepep_ascend[hf]"'


def _require_transformers():
    """Import ``transformers`` and check its version; raise ImportError naming the ``hf`` extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"deepep_ascend.nn.hf needs transformers>={MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]}, "
                          f"which is not installed: {_EXTRA_HINT}") from exc
    try:
        version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    except ValueError:  # a development build with an odd version string: let the structural checks decide
        version = MIN_TRANSFORMERS
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"deepep_ascend.nn.hf needs transformers>={MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]} "
                          f"(fused experts modules with expert-parallel ids), found {transformers.__version__}: "
                          f"{_EXTRA_HINT}")
    return transformers


def _is_experts_module(module: nn.Module) -> bool:
    """A ``use_experts_implementation`` experts module: stacked expert parameters and the EP flag."""
    return (hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)
            and hasattr(module, "config"))


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every fused experts module of ``model`` (and of any already swapped).

    A fused experts module is an instance of a class decorated with ``transformers``'
    ``use_experts_implementation`` (it has ``num_experts``, ``config`` and ``_is_expert_parallel``).
    """
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


class ExpertParallelExperts(nn.Module):
    """The expert-parallel form of a ``transformers`` experts module (made by :func:`expert_parallel`).

    Each swapped module's class derives from this one and from its original class, so
    ``isinstance`` against either holds and the original class's forward computes the local
    experts. Attributes: ``buffer`` (the :class:`deepep_ascend.Buffer`), ``num_global_experts``
    (``E``), ``first_expert`` (``r·L``), ``num_experts`` (``L``, the local count the original forward
    reads), ``_is_expert_parallel = True``.

    ``forward(hidden_states [N, H], top_k_index [N, K] int, top_k_weights [N, K] float)`` → ``[N, H]``
    in ``hidden_states``' dtype: ``Σ_k w_k · expert_{idx_k}(x)`` as the original module, with the
    experts of every rank (module docstring). ``top_k_index`` holds global ids in ``[0, E)``.
    Collective over the Buffer's group.
    """

    buffer: Buffer
    num_global_experts: int
    first_expert: int

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(
            self.buffer, hidden_states.to(_BF16), top_k_index.to(torch.int64), top_k_weights.to(torch.float32),
            self.num_global_experts)
        local_idx = recv_idx.masked_fill(recv_idx < 0, self.num_experts)  # transformers' EP "no expert here"
        y = super().forward(recv_x.to(hidden_states.dtype), local_idx, recv_w.to(top_k_weights.dtype))
        if not bool((recv_idx >= 0).any()):
            # No row for this rank's experts: an implementation (eager) may then touch neither the received
            # rows nor the parameters, so this rank would skip dispatch's backward (a collective: the other
            # ranks would wait for it) and leave the parameters' gradients None (an optimizer skips those).
            # Empty slices' sums (exactly 0) keep both in the graph.
            y = y + sum(t.reshape(-1)[:0].sum() for t in (recv_x, recv_w, *self.parameters()))
        out, _ = ep_autograd.combine(self.buffer, y.to(_BF16), handle)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.num_experts}) of {self.num_global_experts}, "
                f"EP rank {self.buffer.rank} of {self.buffer.group_size}")


_EP_CLASSES: dict[type, type] = {}
_UNSET = object()


def _ep_class(cls: type) -> type:
    """The class ``ExpertParallel<cls>`` deriving from :class:`ExpertParallelExperts` and ``cls`` (one per class)."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls),
                                {"__module__": __name__, "__doc__": ExpertParallelExperts.__doc__})
    return _EP_CLASSES[cls]


def expert_parallel(model: nn.Module, buffer: Buffer) -> nn.Module:
    """Make every MoE block of a ``transformers`` model expert-parallel over ``buffer``'s group, in place.

    Each fused experts module (:func:`find_experts_modules`) becomes an :class:`ExpertParallelExperts`
    holding this rank's ``L = E / R`` experts (parameters sliced along the expert dimension, copied,
    same names); routers, shared experts, attention and embeddings are untouched (replicated).
    Mirrors no DeepEP call: the forward is DeepEP's training recipe (dispatch → experts → combine)
    around the model's own experts code. Collective in use (module docstring), local here.

    Args:
        model: a ``transformers`` model (any ``nn.Module`` containing fused experts modules), identical
            on every rank.
        buffer: a normal-mode :class:`deepep_ascend.Buffer` over the EP group (rank ``r`` keeps
            experts ``[r·L, (r+1)·L)``), with ``num_nvl_bytes > 0``, and ``num_rdma_bytes > 0`` when its
            group spans more than one node (see :func:`buffer_sizes`); shared by all layers.
    Returns:
        ``model`` itself.
    Raises:
        ImportError: ``transformers`` missing or older than 5.18 (names the ``hf`` extra).
        TypeError: ``buffer`` is not a :class:`deepep_ascend.Buffer`.
        ValueError: ``buffer`` has no UBMEM window, or spans nodes without a URMA window; no fused experts
            module in ``model``; one is already expert-parallel; a module's ``num_experts`` is not a multiple
            of the EP size; a parameter of an experts module has no leading expert dimension; a module's forward
            fails on the "no expert here" id (GPT-OSS's ``eager`` experts). Raised before any module is changed.
    """
    _require_transformers()
    if not isinstance(buffer, Buffer):
        raise TypeError(f"expert_parallel: `buffer` must be a deepep_ascend.Buffer, got {type(buffer).__name__}")
    if not buffer.num_nvl_bytes:
        raise ValueError("expert_parallel: `buffer` needs a UBMEM window for normal-mode dispatch/combine "
                         "(num_nvl_bytes > 0, e.g. deepep_ascend.nn.hf.buffer_sizes(...)), got num_nvl_bytes=0")
    if buffer.num_nodes > 1 and not buffer.num_rdma_bytes:
        raise ValueError(f"expert_parallel: `buffer` spans {buffer.num_nodes} nodes of {buffer.ranks_per_node} ranks, "
                         f"so dispatch/combine take the internode path, which needs a URMA window too "
                         f"(num_rdma_bytes > 0), got num_rdma_bytes=0; size both windows with "
                         f"deepep_ascend.nn.hf.buffer_sizes(model, num_max_tokens_per_rank, comm)")
    found = find_experts_modules(model)
    if not found:
        raise ValueError(f"expert_parallel: no fused experts module (transformers' use_experts_implementation: "
                         f"num_experts, stacked gate_up_proj/down_proj) in {type(model).__name__}")
    ep_size, ep_rank = buffer.group_size, buffer.rank
    for name, m in found:  # every check before any change
        if isinstance(m, ExpertParallelExperts):
            raise ValueError(f"expert_parallel: {name} is already expert-parallel")
        if m.num_experts % ep_size:
            raise ValueError(f"expert_parallel: {name}.num_experts={m.num_experts} must be a multiple of the EP "
                             f"size {ep_size}")
        for pname, p in m.named_parameters(recurse=False):
            if p.dim() == 0 or p.size(0) != m.num_experts:
                raise ValueError(f"expert_parallel: {name}.{pname} has shape {tuple(p.shape)}, expected a leading "
                                 f"expert dimension of {m.num_experts}")
        _check_takes_the_ep_id(name, m)
    for _, m in found:
        num_local = m.num_experts // ep_size
        first = ep_rank * num_local
        for pname, p in list(m.named_parameters(recurse=False)):
            local = p.detach()[first:first + num_local].clone()
            setattr(m, pname, nn.Parameter(local, requires_grad=p.requires_grad))
        m.__class__ = _ep_class(type(m))
        m.buffer, m.num_global_experts, m.first_expert = buffer, m.num_experts, first
        m.num_experts = num_local
        m._is_expert_parallel = True
    return model


def _check_takes_the_ep_id(name: str, m: nn.Module) -> None:
    """Refuse an experts module whose forward, as its config selects it now, fails on ``transformers``' expert-parallel
    "no expert here" id (``num_experts`` with ``_is_expert_parallel`` set): one token, weight 0, on the module as it
    is (nothing is changed). GPT-OSS's ``eager`` experts, for one, one-hot the ids over ``num_experts`` classes and
    raise at the first forward of every rank.

    Raises:
        ValueError: naming the module, its class, the experts implementation and the module's own error.
    """
    params = list(m.parameters(recurse=False))
    dtype = params[0].dtype if params else torch.float32
    hidden = getattr(getattr(m, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        return  # nothing to probe with: the first forward tells
    had = m.__dict__.get("_is_expert_parallel", _UNSET)
    m._is_expert_parallel = True
    try:
        with torch.no_grad():
            m(torch.zeros(1, hidden, dtype=dtype), torch.full((1, 1), m.num_experts, dtype=torch.int64),
              torch.zeros(1, 1, dtype=dtype))
    except Exception as exc:  # noqa: BLE001 - any failure of the probe refuses the module, naming it
        impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        raise ValueError(f"expert_parallel: {name} ({type(m).__name__}, experts implementation {impl!r}) does not "
                         f"take transformers' expert-parallel 'no expert here' id (num_experts): {type(exc).__name__}: "
                         f"{exc}; choose another experts implementation (e.g. grouped_mm or batched_mm)") from None
    finally:
        if had is _UNSET:
            del m.__dict__["_is_expert_parallel"]
        else:
            m._is_expert_parallel = had


def _shape(model: nn.Module, num_topk: int | None, op: str) -> tuple[int, int, int]:
    """``(H, K, E)`` of the model's MoE layers (:func:`buffer_size_hint`)."""
    found = find_experts_modules(model)
    if not found:
        raise ValueError(f"{op}: no fused experts module in {type(model).__name__}")
    config = found[0][1].config
    k = num_topk if num_topk is not None else getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int):
        raise ValueError(f"{op}: pass num_topk (the config has no integer num_experts_per_tok)")
    e = max(getattr(m, "num_global_experts", m.num_experts) for _, m in found)
    return config.hidden_size, k, e


def buffer_sizes(model: nn.Module, num_max_tokens_per_rank: int, comm, num_topk: int | None = None,
                 ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` of a Buffer over ``comm`` for which the MoE layers of ``model`` never
    stream in rounds, on the topology that Buffer will have: ``Buffer(None, *buffer_sizes(...), comm=comm)``.

    ``Buffer.get_normal_buffer_size_hint`` and ``get_normal_rdma_buffer_size_hint`` with ``H``, ``K``, ``E``
    as :func:`buffer_size_hint` and the ranks per node resolved as the Buffer resolves them
    (``ranks_per_node``, else ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the host's shared-memory domain).
    ``num_rdma_bytes`` is 0 on one node. Bytes, multiples of 128. Collective over ``comm`` (an mpi4py
    communicator): every rank calls it.

    Raises:
        ValueError: as :func:`buffer_size_hint`. ``TransportConfigError``: a ranks per node the Buffer
            would refuse (on every rank).
    """
    hidden, k, e = _shape(model, num_topk, "buffer_sizes")
    rpn = Topology.from_comm(comm, ranks_per_node).ranks_per_node
    num_ranks = comm.Get_size()
    return (Buffer.get_normal_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks, k, e, ranks_per_node=rpn),
            Buffer.get_normal_rdma_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks, rpn, k, e))


def buffer_size_hint(model: nn.Module, num_max_tokens_per_rank: int, num_ranks: int,
                     num_topk: int | None = None) -> int:
    """``num_nvl_bytes`` for which the MoE layers of ``model`` never stream in rounds, on one node
    (across nodes see :func:`buffer_sizes`, which sizes both windows).

    ``Buffer.get_normal_buffer_size_hint(num_max_tokens_per_rank, H, num_ranks, K, E)`` with ``H``
    the config's ``hidden_size``, ``E`` the largest ``num_experts`` of the (not yet swapped or
    swapped) experts modules and ``K`` = ``num_topk`` or the config's ``num_experts_per_tok``.
    Bytes, a multiple of 128. Smaller windows work too (slower).

    Raises:
        ValueError: no fused experts module; ``K`` neither passed nor in the config.
    """
    hidden, k, e = _shape(model, num_topk, "buffer_size_hint")
    return Buffer.get_normal_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks, k, e)
