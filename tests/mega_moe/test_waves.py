"""MegaMoE's expert waves (``deepep_ascend.mega_moe.waves``): the wave size, the shm backend's fallback to the
Buffer's path, and the trace's overlap arithmetic (``.trace``); the pipeline's structure is checked on real
calls in ``test_api.py``."""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dea
from tests.support.buffer_helpers import all_ranks_ok, coll
from tests.support.mega_moe import (
    BF16,
    E_PER_RANK,
    H_BF16,
    I_BF16,
    TMAX,
    K,
    expert_weights,
    fill,
    gathered_inputs,
    local_weights,
)
from tests.support.reference import mega_calc_diff, ref_mega_moe

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


def test_trace_overlap_arithmetic():
    """``MegaMoETrace.overlap``: worker intervals intersected with compute intervals (hand-computed)."""
    from deepep_ascend.mega_moe.trace import MegaMoETrace

    tr = MegaMoETrace(True, 2, 1, start=0.0, end=10.0)
    tr.compute = [("l1", 0, 1.0, 3.0), ("l2", 0, 4.0, 6.0), ("l1", 1, 5.0, 7.0)]  # union [1,3] + [4,7]
    tr.comm = [["dispatch", 1, 0.5, 0.6, 0.6, 2.0], ["combine", 0, 6.0, 6.1, 6.1, 9.0]]  # busy 1.4 + 2.9
    ov = tr.overlap()
    assert abs(ov["worker_busy"] - 4.3) < 1e-9 and abs(ov["hidden"] - (1.0 + 0.9)) < 1e-9
    assert abs(ov["fraction"] - 1.9 / 4.3) < 1e-9 and abs(ov["compute"] - 5.0) < 1e-9
    assert tr.stage_times()["dispatch"] == pytest.approx(0.1 + 1.4)


def test_default_wave_count_follows_bytes_moved(monkeypatch):
    """Default waves = round(bytes a rank moves / 24 MiB), clamped to [1, min(4, E_l)]; a keyword or the
    environment variable overrides it (checked, naming which). Pure function of the all-gathered counts."""
    from types import SimpleNamespace

    from deepep_ascend.mega_moe import waves

    monkeypatch.delenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", raising=False)

    def epw(pairs_per_rank, hidden, fp8, ranks=4, el=24, override=None):
        sb = SimpleNamespace(num_local_experts=el, num_ranks=ranks, hidden=hidden, is_fp8=fp8)
        counts = torch.zeros(ranks, el * ranks, dtype=torch.int64)
        counts[:, 0] = pairs_per_rank  # only the total matters
        return waves.experts_per_wave(sb, counts, override)

    # fp8, H 1024: (1024 + 32 + 2048) B per pair; 3072 pairs = 9.5 MB -> one wave of all 24 experts
    assert epw(3072, 1024, True) == 24
    # bf16, H 2048: 8192 B per pair; 6144 pairs = 50 MB -> 2.0 -> 2 waves of 12
    assert epw(6144, 2048, False) == 12
    # 11264 pairs = 92 MB -> 3.67 -> 4 waves of 6; 10x more stays at 4
    assert epw(11264, 2048, False) == 6 and epw(112640, 2048, False) == 6
    assert epw(112640, 2048, False, el=2) == 1  # never more waves than local experts
    assert epw(0, 1024, True) == 24
    assert epw(3072, 1024, True, override=5) == 5 and epw(3072, 1024, True, override=99) == 24
    assert waves.wave_override(None, "op") is None and waves.wave_override(4, "op") == 4
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", "3")
    assert waves.wave_override(None, "op") == 3 and waves.wave_override(5, "op") == 5  # the keyword wins
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="num_experts_per_wave must be a positive int"):
            waves.wave_override(bad, "op")
    for env in ("0", "abc", "-2"):
        monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", env)
        with pytest.raises(ValueError, match=r"op: \$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE must be an integer >= 1"):
            waves.wave_override(None, "op")


def test_shm_backend_takes_the_buffer_path_when_its_output_area_is_short(comm, monkeypatch):
    """The shm backend keeps every received row's L2 output in its segment; with the area capped below what a
    rank receives (here 4 rows), the call takes the Buffer's path, alike on every rank, and gives the
    reference's y and the uncapped call's bits."""
    from deepep_ascend.mega_moe import symm_buffer

    rank, size = comm.Get_rank(), comm.Get_size()
    h, i = H_BF16, I_BF16
    w, wref = expert_weights("bf16", E_PER_RANK * size, h, i, seed=21)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights("bf16", w, rank, E_PER_RANK))
    ys = []
    for cap in (None, 4 * 2 * h):
        if cap is not None:
            monkeypatch.setattr(symm_buffer, "_MAX_OUT_BYTES", cap)
        buf = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * size, TMAX, K, h, i, mma_type="bf16xbf16",
                   backend="shm", what="shm symm buffer")
        try:
            t = fill("bf16", buf, seed=8, rank=rank, size=size)
            y = torch.empty(t, h, dtype=BF16)
            coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe")
            xs, sfs, idxs, wts = gathered_inputs(buf, t, False)
            exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
            ok = buf._out_rows == (4 if cap else size * buf.num_max_tokens_per_rank * K)
            ok = ok and buf.last_trace.backend == ("buffer" if cap else "shm")
            ok = ok and mega_calc_diff(y.float(), exp.float()) < 1e-6
            all_ranks_ok(comm, ok, f"cap {cap}: rows {buf._out_rows}, path {buf.last_trace.backend}")
            ys.append(y)
        finally:
            coll(buf.destroy, what="destroy")
    all_ranks_ok(comm, torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "capped == uncapped, bitwise")
