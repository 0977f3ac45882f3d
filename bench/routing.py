"""Routing traces: replay a recorded ``topk_idx`` (``--routing FILE``) and write the one a run used.

Format
------
A ``.npz`` (``numpy.savez``) or ``.pt`` (``torch.save`` of a dict, or of a bare tensor) holding

* ``topk_idx``: integer array ``[T, K]`` or ``[S, T, K]`` (``S`` steps of one run). ``T`` is the
  **global** batch: ``T = num_ranks * tokens_per_rank``, rank ``r`` owns rows
  ``[r*T/R, (r+1)*T/R)`` — so the same trace replays at any rank count dividing ``T``. Values are
  global expert ids in ``[0, E)`` or ``-1`` (slot unused); duplicates within a row are not allowed.
* ``num_experts`` (optional scalar int): ``E``; otherwise the caller's ``num_experts`` is used
  (and must exceed every id).
* ``topk_weights`` (optional float array with ``topk_idx``'s shape): replayed too; otherwise
  weights are random from the workload seed.

:func:`save_routing` writes this format; ``python -m bench normal --save-routing FILE`` dumps the
routing a run used, and ``scripts/train_moe.py --save-trace`` a trained gate's.
"""
from __future__ import annotations

import hashlib
import zipfile

import numpy as np
import torch


def _load_trace_dict(path: str) -> dict:
    if path.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except (ValueError, OSError, zipfile.BadZipFile) as e:  # not an archive of arrays (numpy says "pickled")
            raise ValueError(f"routing trace {path!r}: not a readable .npz archive of arrays ({e})") from None
    if path.endswith(".pt"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        obj = obj if isinstance(obj, dict) else {"topk_idx": obj}
        return {k: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in obj.items()}
    raise ValueError(f"routing trace {path!r}: expected a .npz or .pt file")


def load_routing(path: str, rank: int, num_ranks: int, step: int = 0,
                 num_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
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
    def arr(a):
        return a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)

    d = {"topk_idx": arr(topk_idx).astype(np.int64), "num_experts": np.int64(num_experts)}
    if topk_weights is not None:
        d["topk_weights"] = arr(topk_weights).astype(np.float32)
    if path.endswith(".npz"):
        np.savez(path, **d)
    elif path.endswith(".pt"):
        torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in d.items()}, path)
    else:
        raise ValueError(f"routing trace {path!r}: expected a .npz or .pt file name")

