"""The kernels' ``METH_FASTCALL`` bindings (``deepep_ascend.native._fastcall``) against the ctypes calls they replace:
the generated source is the signature table's, the loader uses them where they were built, each converts its
arguments as ctypes does (numpy integers, bools, None and buffers for pointers) and refuses what ctypes refuses with
a ``TypeError`` naming the function, the calls release the GIL, and the data paths give the same bits either way.

Run: ``python -m pytest -q tests/native/test_bindings.py`` (and under ``mpiexec -n 2 ... --with-mpi`` for the
two-rank round trips).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time

import numpy as np
import pytest
import torch

from deepep_ascend import native
from deepep_ascend.native import bindings, loader
from tests.support.buffer_helpers import bits, coll
from tests.support.mpi_utils import world

pytestmark = pytest.mark.skipif(loader.kernels.zero_rows is None, reason="native kernels not built")

_BUILT = importlib.util.find_spec("deepep_ascend.native._fastcall") is not None


def _table(source) -> dict:
    return {name: getattr(source, name) for name in loader.SIGNATURES}


def _use(table: dict) -> None:
    for name, fn in table.items():
        setattr(loader.kernels, name, fn)


@pytest.fixture
def both():
    """``(fastcall table, ctypes table)``; the loader's table is restored afterwards."""
    if loader.bindings() != "fastcall":
        pytest.skip("the METH_FASTCALL bindings were not built")
    fast = _table(loader.kernels)
    yield fast, _table(loader.ctypes_kernels())
    _use(fast)


def test_generated_source_is_the_signature_tables():
    """``csrc/bindings.c`` is what ``python -m deepep_ascend.native.bindings`` makes of ``loader.SIGNATURES``: edit
    the table, then regenerate (the ctypes types and the bindings cannot drift apart)."""
    with open(bindings.PATH) as f:
        assert f.read() == bindings.bindings_source(), "run `python -m deepep_ascend.native.bindings`"
    assert bindings.main(["--check"]) == 0


@pytest.mark.skipif(not _BUILT, reason="the METH_FASTCALL bindings were not built (no Python headers)")
def test_the_loader_calls_through_the_bindings_where_built():
    from deepep_ascend.native import _fastcall

    assert loader.bindings() == "fastcall"
    assert dict(_fastcall.names()) == loader.signature_codes()
    assert all(getattr(loader.kernels, name) is getattr(_fastcall, name) for name in loader.SIGNATURES)
    assert all(isinstance(getattr(loader.ctypes_kernels(), name), ctypes._CFuncPtr) for name in loader.SIGNATURES)


def test_arguments_convert_as_ctypes_converts_them(both):
    """Calls through both tables: ints, numpy integers and bools for ``int64_t``; an int address and a ctypes array
    for a pointer (the bindings take any buffer, a numpy array too); a numpy float and an int for a ``float``: the
    same results."""
    fast, slow = both
    got = {}
    for name, table in (("fastcall", fast), ("ctypes", slow)):
        out = [(ctypes.c_int64 * 1)(), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)]
        table["ll_stream_rows"](np.int64(1), -1, -1, out[0])  # the send side's threshold, into a ctypes array
        table["ll_stream_rows"](True, -1, -1, out[1] if name == "fastcall" else out[1].ctypes.data)  # a bool; a
        # numpy array (any buffer) for the bindings, its address for ctypes (which takes no numpy array)
        table["ll_stream_rows"](0, -1, -1, out[2].ctypes.data)  # the receive side's, through an int address
        h = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        t = torch.zeros(2, 4, dtype=torch.float32)
        table["swiglu_gate_bf16"](2, 4, h.data_ptr(), np.int32(8), 1, np.float32(0.25), 2, t.data_ptr())
        got[name] = (out[0][0], int(out[1][0]), int(out[2][0]), table["ll_streams"](np.int32(1 << 30), 0),
                     table["amx_packed_elems"](np.int64(40), 33), table["amx_fp4_packed_bytes"](64, np.int16(64)),
                     bits(t).reshape(-1).tolist())
    assert got["fastcall"] == got["ctypes"]
    assert got["fastcall"][0] == got["fastcall"][1] > 0 and any(v != 0 for v in got["fastcall"][6])


def test_bad_arguments_raise_type_errors_naming_the_function(both):
    fast, slow = both
    out = (ctypes.c_int64 * 1)()
    with pytest.raises(TypeError, match=r"deepep_ll_stream_rows takes 4 arguments, got 3"):
        fast["ll_stream_rows"](0, -1, -1)
    with pytest.raises(TypeError, match=r"deepep_ll_stream_rows: argument 0 must be an integer, got float"):
        fast["ll_stream_rows"](0.5, -1, -1, out)
    with pytest.raises(TypeError, match=r"deepep_ll_stream_rows: argument 3 must be an address .*got str"):
        fast["ll_stream_rows"](0, -1, -1, "out")
    with pytest.raises(ctypes.ArgumentError):  # what the ctypes call refuses alike
        slow["ll_stream_rows"](0.5, -1, -1, out)
    with pytest.raises(OverflowError):  # ctypes would silently keep the low 16 bits
        fast["sum_rows_bf16"](*([0] * 15), 1 << 16)


def test_a_call_releases_the_gil(both):
    """A native wait on another thread (``deepep_in_poll``: a word polled a bounded number of rounds) sees the store
    this thread makes while it waits: the bindings release the GIL during the call, as ctypes does (the Buffer's
    worker waits and sums while the caller computes). Holding it, the store could only come after the poll ran
    out (-1)."""
    fast, _ = both
    word, srcs = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    status = []
    waiter = threading.Thread(target=lambda: status.append(
        fast["in_poll"](word.ctypes.data, 1, srcs.ctypes.data, None, 1, 50_000_000)))
    waiter.start()
    time.sleep(0.02)  # (the waiter is polling by now, or about to)
    word[0] = 1
    waiter.join()
    assert status == [0]


def _round_trips(comm):
    """A low-latency and a normal-mode round trip (1 and 8 tokens per rank, hidden 7168, top-8 of 256 experts)."""
    from deepep_ascend import Buffer

    R, r = comm.Get_size(), comm.Get_rank()
    H, E, K = 7168, 256, 8
    ll = coll(lambda: Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(8, H, R, E), low_latency_mode=True,
                             num_qps_per_rank=E // R, comm=comm, explicitly_destroy=True))
    nb = coll(lambda: Buffer(None, Buffer.get_normal_buffer_size_hint(8, H, R, K, E), comm=comm,
                             explicitly_destroy=True))
    try:
        got = []
        for t in (1, 8):
            gen = torch.Generator().manual_seed(100 * t + r)
            x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
            w = torch.rand(t, K, generator=gen)
            for fp8 in (False, True):
                recv, count, handle, _, _ = coll(lambda: ll.low_latency_dispatch(x, idx, 8, E, use_fp8=fp8))
                got += [bits(recv[0] if fp8 else recv).clone(), count.clone()]
                y = recv[0].float().to(torch.bfloat16) if fp8 else recv
                got.append(coll(lambda: ll.low_latency_combine(y, idx, w, handle)[0]))
            ntpr, _, ntpe, itr, _ = nb.get_dispatch_layout(idx, E)
            recv_x, _, recv_w, _, handle, _ = coll(lambda: nb.dispatch(
                x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx,
                topk_weights=w))
            got += [bits(recv_x).clone(), coll(lambda: nb.combine(recv_x, handle, topk_weights=recv_w)[0])]
        return got
    finally:
        coll(ll.destroy)
        coll(nb.destroy)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() > 2, reason="the same calls at 1 and 2 ranks are enough")
def test_round_trips_give_the_same_bits_through_either_way_of_calling(comm, both):
    fast, slow = both
    _use(slow)
    want = _round_trips(comm)
    _use(fast)
    got = _round_trips(comm)
    assert len(got) == len(want) and all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


def test_bindings_of_another_table_are_refused_with_a_warning(monkeypatch):
    """A ``_fastcall`` built from another signature table (an older checkout's) is not used: the loader warns and
    keeps the ctypes calls, whose argument types are this table's."""
    import sys
    import types

    stale = types.ModuleType("deepep_ascend.native._fastcall")
    stale.names = lambda: tuple(list(loader.signature_codes().items())[:-1])  # one function fewer
    monkeypatch.setitem(sys.modules, "deepep_ascend.native._fastcall", stale)
    monkeypatch.delattr(native, "_fastcall", raising=False)  # (the submodule attribute, once imported)
    with pytest.warns(RuntimeWarning, match="built from another signature table; using ctypes calls"):
        assert loader._fastcall_module("the library") is None


def test_without_the_bindings_the_kernels_are_ctypes_calls(tmp_path):
    """Where ``_fastcall`` was not built, the same library is called through ctypes (a process whose package has
    no ``_fastcall`` next to ``_native``)."""
    import os
    import shutil
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    pkg = tmp_path / "deepep_ascend"
    shutil.copytree(os.path.join(REPO_ROOT, "deepep_ascend"), pkg, symlinks=False,
                    ignore=shutil.ignore_patterns("_fastcall*", "__pycache__", "transports"))
    shutil.copytree(os.path.join(REPO_ROOT, "transports"), pkg / "transports",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from deepep_ascend.native import loader; import torch; from deepep_ascend import native; "
            "x = torch.ones(4, 8, dtype=torch.bfloat16); ok = native.zero_rows(x, torch.tensor([1, 2])); "
            "print(loader.bindings(), ok, x.sum(1).tolist())")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ctypes", "True", "[8.0,", "0.0,", "0.0,", "8.0]"], out.stdout
