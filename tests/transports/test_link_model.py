"""Link model (docs/design/transports.md §5): profiles, the projection against hand-computed examples, and the
emulation slowing transfers by the configured amount (generous bounds: never a tight timing
assertion on a shared 2-core machine)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from deepep_ascend.transports import (
    PROFILES,
    ChannelKind,
    LinkEmulator,
    LinkStats,
    emulator_from_env,
    gather_link_stats,
    get_profile,
    project,
)

SLACK_S = 10.0  # upper bounds only catch "not slowed by orders of magnitude", never jitter


def test_profiles_by_name_and_explicit():
    p = get_profile("ascend950")
    assert p.link(ChannelKind.UBMEM).GBps == 400 and p.link(ChannelKind.URMA).latency_us == 2
    assert get_profile("ascend950_scaleout").link(ChannelKind.URMA).GBps == 50
    assert all(spec.basis for prof in PROFILES.values() for spec in prof.links.values())  # every number sourced
    assert not get_profile(None).links and get_profile("none") is PROFILES["none"]
    e = get_profile("ubmem=2.5:3,URMA=1:0:4096")
    assert e.link(ChannelKind.UBMEM).GBps == 2.5 and e.link(ChannelKind.UBMEM).latency_us == 3
    assert e.link(ChannelKind.URMA).burst_bytes == 4096 and e.link(ChannelKind.SELF) is None


@pytest.mark.parametrize("bad, what", [("ascend951", "expected one of"), ("NVL=1:1", "unknown channel kind"),
                                       ("UBMEM=0:1", "GBPS > 0"), ("UBMEM=1", "UBMEM=GBPS:LATENCY_US"),
                                       ("UBMEM=1:-1", ">= 0"), ("UBMEM=x:1", "UBMEM=GBPS"),
                                       ("UBMEM=inf:1", "GBPS > 0")])
def test_bad_profiles_are_refused(bad, what):
    with pytest.raises(ValueError, match=what):
        get_profile(bad)


def _matrices(world: int, ops) -> dict:
    """Counters of ``ops`` = (issuer, op, kind, peer, nbytes), gathered as ``[world, kind, world]``."""
    stats = [LinkStats(world) for _ in range(world)]
    for issuer, op, kind, peer, nbytes in ops:
        {"put": lambda s: s.record_put(kind, peer, nbytes), "get": lambda s: s.record_fetch(kind, peer, nbytes),
         "signal": lambda s: s.record_signal(kind, peer)}[op](stats[issuer])
    return {f: np.stack([s.snapshot()[f] for s in stats]) for f in stats[0].snapshot()}


def test_projection_hand_computed():
    """Rank 0 stores 1 MB into rank 1 (UBMEM), rank 2 loads 2 MB from rank 0 (URMA), rank 1
    signals rank 0 (URMA). Links: UBMEM 100 GB/s + 1 us, URMA 10 GB/s + 5 us. By hand:
    UBMEM rank 0: 1e6/100e9 + 1 msg x 1 us = 11 us; rank 1: 10 us.
    URMA rank 0 sends 2e6: 200 us (issues none); rank 2 receives 2e6 and issued the load: 205 us;
    rank 1: 5 us. Bottleneck rank 2, URMA, received, 2e6 B, 205 us -> 9.756 GB/s."""
    U, R = ChannelKind.UBMEM, ChannelKind.URMA
    m = _matrices(3, [(0, "put", U, 1, 10**6), (2, "get", R, 0, 2 * 10**6), (1, "signal", R, 0, 0)])
    p = project(m, "UBMEM=100:1,URMA=10:5")
    assert p["time_s"] == pytest.approx(205e-6, rel=1e-12)
    assert p["bottleneck"] == dict(rank=2, kind="URMA", direction="received", bytes=2 * 10**6)
    assert p["bottleneck_GBps"] == pytest.approx(2e6 / 205e-6 / 1e9, rel=1e-12)
    assert p["ports"]["UBMEM"]["time_s"] == pytest.approx([11e-6, 10e-6, 0.0], rel=1e-12)
    assert p["ports"]["URMA"]["time_s"] == pytest.approx([200e-6, 5e-6, 205e-6], rel=1e-12)
    assert p["ports"]["URMA"]["messages"] == [0, 1, 1] and "SELF" not in p["ports"]
    # Sent and received on one port overlap (max, not sum): 3 MB out + 1 MB in at 1 GB/s = 3 ms.
    m2 = _matrices(2, [(0, "put", U, 1, 3 * 10**6), (1, "get", U, 0, 0), (0, "get", U, 1, 10**6)])
    p2 = project(m2, "UBMEM=1:0")
    assert p2["time_s"] == pytest.approx(3e-3, rel=1e-12) and p2["bottleneck"]["direction"] == "sent"
    # Nothing sent: zero time, no bottleneck; a profile without links cannot project.
    assert project(_matrices(2, []), "ascend950")["bottleneck"] is None
    with pytest.raises(ValueError, match="models no link"):
        project(m, "none")


def test_emulator_token_bucket_and_latency():
    em = LinkEmulator("UBMEM=0.01:0,URMA=1000:20000")  # UBMEM 10 MB/s; URMA 20 ms per message
    t0 = time.perf_counter()
    em.charge(ChannelKind.UBMEM, 10**6)
    em.charge(ChannelKind.UBMEM, 10**6)  # queued behind the first: 0.2 s in all
    t_bw = time.perf_counter() - t0
    assert 0.19 <= t_bw < 0.2 + SLACK_S, t_bw
    t0 = time.perf_counter()
    for _ in range(5):
        em.charge(ChannelKind.URMA, 0)
    t_lat = time.perf_counter() - t0
    assert 0.099 <= t_lat < 0.1 + SLACK_S, t_lat
    t0 = time.perf_counter()
    em.charge(ChannelKind.SELF, 10**9)  # local memory is never slowed
    assert time.perf_counter() - t0 < 0.05
    assert em.delayed_s["SELF"] == 0 and em.delayed_s["UBMEM"] >= 0.19 and "SIMULATION" in em.label
    # scale dilates time; a full bucket lets `burst` bytes through at once after idling.
    slow = LinkEmulator("UBMEM=1:0:1000000", scale=0.01)
    time.sleep(0.15)
    t0 = time.perf_counter()
    slow.charge(ChannelKind.UBMEM, 10**6)
    assert time.perf_counter() - t0 < 0.05
    t0 = time.perf_counter()
    slow.charge(ChannelKind.UBMEM, 10**6)
    assert 0.099 <= time.perf_counter() - t0 < 0.1 + SLACK_S


def test_emulation_from_environment():
    assert emulator_from_env({}) is None and emulator_from_env({"DEEPEP_ASCEND_LINK_EMULATION": "none"}) is None
    em = emulator_from_env({"DEEPEP_ASCEND_LINK_EMULATION": "delay", "DEEPEP_ASCEND_LINK_PROFILE": "ascend950_scaleout",
                            "DEEPEP_ASCEND_LINK_SCALE": "0.5"})
    assert em.profile.name == "ascend950_scaleout" and em.scale == 0.5
    with pytest.raises(ValueError, match="DEEPEP_ASCEND_LINK_EMULATION"):
        emulator_from_env({"DEEPEP_ASCEND_LINK_EMULATION": "virtual"})
    with pytest.raises(ValueError, match="DEEPEP_ASCEND_LINK_SCALE.*> 0"):
        emulator_from_env({"DEEPEP_ASCEND_LINK_EMULATION": "delay", "DEEPEP_ASCEND_LINK_SCALE": "0"})


@pytest.mark.mpi(min_size=1)
def test_emulation_slows_real_puts_and_projection_matches(shared_tp):
    """Every rank stores 1 MB into the next rank (UBMEM; SELF at 1 rank) with UBMEM emulated at
    20 MB/s: the put takes >= 50 ms (0 ms without), and the projection of the gathered counters
    at the same profile is exactly 1 MB / 20 MB/s + 1 message x 0 us."""
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("emu", 1 << 20, 1)
    data = torch.full((1 << 20,), me, dtype=torch.uint8)
    tp.barrier()
    before = tp.stats.snapshot()
    tp.set_link_emulator(LinkEmulator("UBMEM=0.02:0"))
    try:
        t0 = time.perf_counter()
        tp.put(win, (me + 1) % n, 0, data)
        took = time.perf_counter() - t0
    finally:
        tp.set_link_emulator(None)
    tp.barrier()
    stats = LinkStats.diff(tp.stats.snapshot(), before)
    proj = project(gather_link_stats(stats, tp.comm), "UBMEM=0.02:0,SELF=1000:0")
    if n > 1:
        assert 0.9 * 0.05 <= took < 0.05 + SLACK_S, took
        assert proj["time_s"] == pytest.approx((1 << 20) / 0.02e9, rel=1e-12)
        assert proj["bottleneck"]["kind"] == "UBMEM" and proj["bottleneck"]["bytes"] == 1 << 20
    else:
        assert took < 0.04 and proj["bottleneck"]["kind"] == "SELF"
    assert torch.equal(tp.peer_view(win, me, 0, 1 << 20), torch.full((1 << 20,), (me - 1) % n, dtype=torch.uint8))
    with pytest.raises(TypeError, match="LinkEmulator"):
        tp.set_link_emulator("ascend950")
