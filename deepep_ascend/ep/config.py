"""``Config``: DeepEP's per-call tuning record, its tables and its buffer-size hints
(docs/semantics/deepep-api.md §3.2).

In ``deepep_ascend`` a config never changes results (as in DeepEP). ``num_sms`` fixes the
number of *channels* ``C = num_sms // 2``: each rank's tokens are split into ``C`` contiguous
ranges, and the handle's channel prefix matrices and ``send_head`` are computed over them
exactly as DeepEP does, so handles keep DeepEP's shapes and meaning. Data itself moves in
rounds sized by the Buffer's UBMEM window (see :mod:`deepep_ascend.ep.intranode`), not by the
``*_chunked_*_tokens`` fields, which are validated and kept for compatibility.
"""

from __future__ import annotations

from ..checks import as_int
from ..rounding import align

_NVL_TABLE = {  # num_ranks: (dispatch (send, recv), combine (send, recv)) for the NVL ring,
    # docs/semantics/deepep-api.md §3.1
    2: ((24, 256), (10, 256)), 4: ((6, 256), (9, 256)), 8: ((6, 256), (4, 256)),
    16: ((36, 288), (4, 288)), 24: ((32, 288), (1, 288)), 32: ((32, 288), (1, 288)),
    48: ((32, 288), (1, 288)), 64: ((32, 288), (1, 288)), 96: ((20, 480), (1, 480)),
    128: ((20, 560), (1, 560)), 144: ((32, 720), (2, 720)), 160: ((28, 720), (2, 720)),
}
_RDMA_TABLE = {  # num_ranks: (dispatch (send, recv), combine (send, recv)) for the RDMA ring
    2: ((6, 128), (6, 128)), 4: ((6, 128), (6, 128)), 8: ((6, 128), (6, 128)),
    16: ((20, 128), (12, 128)), 24: ((8, 128), (8, 128)), 32: ((8, 128), (8, 128)),
    48: ((8, 128), (8, 128)), 64: ((8, 128), (8, 128)), 96: ((12, 128), (8, 128)),
    128: ((12, 128), (8, 128)), 144: ((12, 128), (8, 128)), 160: ((12, 128), (8, 128)),
}


class Config:
    """Mirror of ``deep_ep.Config``.

    Args:
        num_sms: even number of SMs in DeepEP; here it sets ``C = num_sms // 2`` channels.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: NVL (UBMEM) ring
            granularity and capacity in tokens, as in DeepEP (validated, not used for chunking).
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: same for RDMA (URMA).
    Raises:
        RuntimeError: DeepEP's checks: ``num_sms >= 0``; NVL send, recv > 0 and send < recv;
            RDMA send, recv > 0; RDMA recv rounded up to a multiple of send, then send < recv
            and send <= recv / 2.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        vals = tuple(map(as_int, (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                                  num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)))
        (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
         num_max_rdma_chunked_recv_tokens) = vals
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            raise RuntimeError(f"Config: every field must be an int, got {vals}")
        if num_sms < 0:
            raise RuntimeError(f"Config: num_sms must be >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise RuntimeError(
                f"Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, got "
                f"{num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise RuntimeError(
                f"Config: RDMA chunk sizes must be > 0, got send {num_max_rdma_chunked_send_tokens}, "
                f"recv {num_max_rdma_chunked_recv_tokens}")
        num_max_rdma_chunked_recv_tokens = align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if not (num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens
                and num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2):
            raise RuntimeError(
                f"Config: need num_max_rdma_chunked_send_tokens ({num_max_rdma_chunked_send_tokens}) < recv "
                f"({num_max_rdma_chunked_recv_tokens}, rounded up to a multiple of send) and <= recv / 2")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    @property
    def num_channels(self) -> int:
        """``C = num_sms // 2``: channels partitioning each rank's tokens in handles."""
        return self.num_sms // 2

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVL buffer hint in bytes (docs/semantics/deepep-api.md §3.2), rounded up to 128.

        ``C·Rn·(2·Rr + 3)·4 + C·Rn·T_nvl·(hidden_bytes + 2056)`` with ``Rn = min(R, 8)``,
        ``Rr = max(R / 8, 1)``. A Buffer of this size streams any payload (see
        :meth:`deepep_ascend.Buffer.get_normal_buffer_size_hint` for the size that avoids chunking).
        Raises:
            AssertionError: ``num_ranks >= 8`` and not a multiple of 8, or odd ``num_sms`` with > 8 ranks.
        """
        hidden_bytes, num_ranks = as_int(hidden_bytes), as_int(num_ranks)
        assert num_ranks < 8 or num_ranks % 8 == 0, f"num_ranks={num_ranks}: need < 8 or a multiple of 8"
        assert num_ranks <= 8 or self.num_sms % 2 == 0, "num_sms must be even with more than 8 ranks"
        c, rn, rr = self.num_channels, min(num_ranks, 8), max(num_ranks // 8, 1)
        size = c * rn * (2 * rr + 3) * 4 + c * rn * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 2056)
        return align(size, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer hint in bytes: 0 up to 8 ranks, else
        ``C·Rr·144 + 2·C·Rr·T_rdma·(hidden_bytes + 2072)`` rounded up to 128."""
        hidden_bytes, num_ranks = as_int(hidden_bytes), as_int(num_ranks)
        if num_ranks <= 8:
            return 0
        c, rr = self.num_channels, max(num_ranks // 8, 1)
        size = c * rr * 144 + 2 * c * rr * self.num_max_rdma_chunked_recv_tokens * (hidden_bytes + 2072)
        return align(size, 128)


def _table_config(num_sms: int, num_ranks: int, which: int) -> Config:
    assert num_ranks in _NVL_TABLE, f"Unsupported number of EP ranks: {num_ranks}"
    nvl, rdma = _NVL_TABLE[num_ranks][which], _RDMA_TABLE[num_ranks][which]
    return Config(num_sms, nvl[0], nvl[1], rdma[0], rdma[1])


def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's tuned dispatch config for ``num_ranks`` (AssertionError for other counts)."""
    return _table_config(num_sms, num_ranks, 0)


def combine_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's tuned combine config for ``num_ranks`` (AssertionError for other counts)."""
    return _table_config(num_sms, num_ranks, 1)
