"""Per-link accounting, optional emulation and a projection of the simulated channels (docs/design/transports.md §5).

* **Accounting** (always on): :class:`LinkStats` counts, for the operations issued by one rank,
  the bytes and messages moved per (channel kind, peer). Each transfer is counted once, by the
  rank that issued it: a store into a peer's window (``put``), a load from it (``get`` / a
  gather through a peer view, counted in the data's direction as ``fetched``), a signal.
* **Profiles**: :class:`LinkProfile` gives each channel kind a bandwidth per direction and a
  per-message latency, by name (:data:`PROFILES`: ``none``, ``ascend950``,
  ``ascend950_scaleout``) or explicit numbers (``"UBMEM=400:1,URMA=50:5"``, GB/s:µs).
* **Emulation** (optional, off by default): :class:`LinkEmulator` slows this rank's UBMEM and
  URMA transfers to a profile scaled by ``scale`` — a token bucket per channel kind plus a
  per-message delay, paid by the rank that issues the transfer. It is a SIMULATION of slower
  links, not a measurement of Ascend hardware; every benchmark line it affects says so.
* **Projection**: :func:`project` turns the counted traffic of a call on every rank into the time
  the same traffic would take on a profile's links (a model, shown next to measured numbers).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..settings import LINK_EMULATION, LINK_PROFILE, LINK_SCALE
from .topology import ChannelKind

_FIELDS = ("bytes_put", "bytes_fetched", "puts", "gets", "signals")


class LinkStats:
    """Counters ``[kind, peer]`` (int64) for one rank; kinds are :class:`ChannelKind`.

    Attributes (each ``np.ndarray[len(ChannelKind), world_size]`` of int64):
        bytes_put: bytes this rank stored into ``peer``'s memory.
        bytes_fetched: bytes this rank loaded from ``peer``'s memory (data moved peer → this rank).
        puts, gets, signals: message counts (a URMA signal is one ``MPI_Accumulate``).

    Every recorded transfer also goes through ``emulator`` when one is set (see
    :class:`LinkEmulator`): counting and emulation happen at the same single point.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.emulator: LinkEmulator | None = None
        # One array behind every field (each attribute a view of it): a snapshot is one copy.
        self._all = np.zeros((len(_FIELDS), len(ChannelKind), world_size), dtype=np.int64)
        for name, view in zip(_FIELDS, self._all):
            setattr(self, name, view)

    def record_put(self, kind: ChannelKind, peer: int, nbytes: int) -> None:
        self.bytes_put[kind, peer] += nbytes
        self.puts[kind, peer] += 1
        if self.emulator is not None:
            self.emulator.charge(kind, nbytes)

    def record_fetch(self, kind: ChannelKind, peer: int, nbytes: int) -> None:
        self.bytes_fetched[kind, peer] += nbytes
        self.gets[kind, peer] += 1
        if self.emulator is not None:
            self.emulator.charge(kind, nbytes)

    def record_signal(self, kind: ChannelKind, peer: int) -> None:
        self.signals[kind, peer] += 1
        if self.emulator is not None:
            self.emulator.charge(kind, 0)

    def snapshot(self) -> dict:
        """A copy of every counter, ``{field: array}``."""
        return dict(zip(_FIELDS, self._all.copy()))

    def copy_counters(self) -> np.ndarray:
        """A copy of every counter as one array ``[field, kind, world]`` (fields in :meth:`snapshot`'s order):
        the snapshot of a caller that differences two of them, rarely read (:meth:`diff_counters`)."""
        return self._all.copy()

    @staticmethod
    def diff_counters(after: np.ndarray, before: np.ndarray) -> dict:
        """:meth:`diff` of two :meth:`copy_counters` arrays, as ``{field: array}``."""
        return dict(zip(_FIELDS, after - before))

    def reset(self) -> None:
        for name in _FIELDS:
            getattr(self, name)[...] = 0

    @staticmethod
    def diff(after: dict, before: dict) -> dict:
        return {k: after[k] - before[k] for k in after}

    @staticmethod
    def bytes_by_kind(snap: dict) -> dict:
        """``{'SELF': n, 'UBMEM': n, 'URMA': n}``: bytes moved (put + fetched) per channel kind."""
        total = snap["bytes_put"] + snap["bytes_fetched"]
        return {k.name: int(total[k].sum()) for k in ChannelKind}

    def gather(self, comm) -> dict:
        """Collective: ``{field: array[world, kind, world]}``, row ``r`` = rank ``r``'s counters."""
        return gather_link_stats(self.snapshot(), comm)


# -- profiles --------------------------------------------------------------------------------

GB = 1e9  # bandwidths are decimal GB/s, as DeepEP reports them


@dataclass(frozen=True)
class LinkSpec:
    """One channel kind's link, per rank and per direction.

    Attributes:
        GBps: bandwidth per direction, GB/s (1 GB = 1e9 B).
        latency_us: cost of one message (put, load, signal), microseconds.
        burst_bytes: token-bucket depth of the emulation (bytes that may go at once before the
            rate applies); unused by the projection.
        basis: where the numbers come from (a public source, or ``assumption``).
    """

    GBps: float
    latency_us: float
    burst_bytes: int = 0
    basis: str = ""

    def as_dict(self) -> dict:
        return dict(GBps=self.GBps, latency_us=self.latency_us, burst_bytes=self.burst_bytes, basis=self.basis)


@dataclass(frozen=True)
class LinkProfile:
    """Named link numbers per channel kind (keys: ``'SELF'``, ``'UBMEM'``, ``'URMA'``); a kind
    without an entry is neither emulated nor projected."""

    name: str
    links: Mapping[str, LinkSpec] = field(default_factory=dict)
    description: str = ""

    def link(self, kind: ChannelKind) -> LinkSpec | None:
        return self.links.get(ChannelKind(kind).name)

    def as_dict(self) -> dict:
        return dict(name=self.name, description=self.description, links={k: v.as_dict() for k, v in self.links.items()})


_UB_BASIS = ("assumption from press reports of the Ascend 950 SuperPoD UBL128 design (128 cards, single-stage "
             "3.2 Tb/s network; no primary spec found), consistent with DeepEP-Ascend's README: EP8 dispatch "
             "373-375 GB/s, combine 345-347 GB/s on 950DT called 90-95 % of the payload limit")
_SELF = LinkSpec(4000.0, 0.0, 0, "950DT HBM 4 TB/s (HiZQ 2.0), Huawei Connect 2025")
_UBMEM = LinkSpec(400.0, 1.0, 0, _UB_BASIS + "; latency: assumption (CloudMatrix384 quotes < 1 us over UB)")

#: Built-in profiles. ``ascend950``: simulated nodes are boards inside one supernode, URMA runs
#: over the supernode's UB Clos. ``ascend950_scaleout``: simulated nodes are separate supernodes,
#: URMA runs over a 400 Gb/s scale-out NIC. ``none``: no links (no emulation, no projection).
PROFILES: dict[str, LinkProfile] = {
    "none": LinkProfile("none", {}, "no link model"),
    "ascend950": LinkProfile("ascend950", {
        "SELF": _SELF, "UBMEM": _UBMEM,
        "URMA": LinkSpec(400.0, 2.0, 0, "URMA inside the supernode (UB Clos): " + _UB_BASIS
                         + "; latency: assumption"),
    }, "Ascend 950 supernode: UBMEM between boards' NPUs, URMA inside the same supernode"),
    "ascend950_scaleout": LinkProfile("ascend950_scaleout", {
        "SELF": _SELF, "UBMEM": _UBMEM,
        "URMA": LinkSpec(50.0, 5.0, 0, "assumption: 400 Gb/s scale-out NIC per NPU (UBoE/RoCE; CloudMatrix384's "
                         "RDMA plane is 400 Gb/s per NPU; DeepEP's CX7 ~ 50 GB/s); latency: assumption"),
    }, "Ascend 950 supernodes joined by scale-out: UBMEM inside a supernode, URMA between supernodes"),
}

def get_profile(spec: str | LinkProfile | None) -> LinkProfile:
    """A :class:`LinkProfile` from a name of :data:`PROFILES` or explicit numbers.

    Explicit form: comma-separated ``KIND=GBPS:LATENCY_US[:BURST_BYTES]`` for kinds SELF, UBMEM,
    URMA, e.g. ``"UBMEM=400:1,URMA=50:5"``; kinds left out are not modelled. ``None`` = ``none``.
    Raises:
        ValueError: unknown name, unknown kind, or a number that is not finite and positive
            (bandwidth) / non-negative (latency, burst).
    """
    if spec is None:
        return PROFILES["none"]
    if isinstance(spec, LinkProfile):
        return spec
    text = str(spec).strip()
    if text in PROFILES:
        return PROFILES[text]
    if "=" not in text:
        raise ValueError(f"link profile {text!r}: expected one of {sorted(PROFILES)} or explicit "
                         f"'KIND=GBPS:LATENCY_US[:BURST_BYTES],...' (KIND in SELF, UBMEM, URMA)")
    links = {}
    for part in text.split(","):
        kind, _, nums = part.partition("=")
        kind = kind.strip().upper()
        if kind not in ChannelKind.__members__:
            raise ValueError(f"link profile {text!r}: unknown channel kind {kind!r} (expected SELF, UBMEM or URMA)")
        try:
            vals = [float(v) for v in nums.split(":")]
        except ValueError:
            vals = []
        if len(vals) not in (2, 3) or not all(math.isfinite(v) for v in vals) or vals[0] <= 0 or min(vals[1:]) < 0:
            raise ValueError(f"link profile {text!r}: {part.strip()!r} must be {kind}=GBPS:LATENCY_US[:BURST_BYTES] "
                             f"with GBPS > 0 and LATENCY_US, BURST_BYTES >= 0")
        links[kind] = LinkSpec(vals[0], vals[1], int(vals[2]) if len(vals) == 3 else 0, "explicit")
    return LinkProfile(text, links, "explicit numbers")


# -- emulation -------------------------------------------------------------------------------

class LinkEmulator:
    """Slows the UBMEM and URMA transfers this rank issues to ``profile`` x ``scale``.

    Per channel kind, a token bucket of depth ``burst_bytes`` refilled at ``GBps * scale``: a
    transfer of ``n`` bytes waits until the bucket has held ``n`` bytes, then every message waits
    ``latency_us / scale`` more. The wait is a sleep inside the recording call, so it delays the
    issuing rank exactly where the real link would (a store before its signal, a gather before
    the rank goes on). SELF (local memory) is never slowed. With ``burst_bytes = 0`` (the
    built-in profiles) a rank's emulated transfers take ``issued bytes / rate + messages x
    latency``: :func:`project`'s port time for its own traffic, dilated by ``1/scale`` (the
    projection also charges a port for what peers push into it, which the emulation does not).
    ``scale < 1`` dilates time; choose it so the emulated links are slower than this host's memory copies
    (``scale=1e-3`` makes ``ascend950``'s UBMEM 0.4 GB/s).

    Attributes:
        delayed_s: ``{kind name: seconds slept}`` since construction (or :meth:`reset`).
    """

    def __init__(self, profile: str | LinkProfile, scale: float = 1.0):
        self.profile = get_profile(profile)
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"link emulation scale must be a finite number > 0, got {scale!r}")
        self.scale = scale
        self._lock = threading.Lock()  # the Buffer's worker thread and the caller may both transfer
        self._rate, self._lat, self._burst, self._free = {}, {}, {}, {}
        for kind in (ChannelKind.UBMEM, ChannelKind.URMA):
            spec = self.profile.link(kind)
            if spec is not None:
                self._rate[kind] = spec.GBps * GB * scale
                self._lat[kind] = spec.latency_us * 1e-6 / scale
                self._burst[kind] = spec.burst_bytes
                self._free[kind] = 0.0
        self.delayed_s = {k.name: 0.0 for k in ChannelKind}

    @property
    def label(self) -> str:
        """``SIMULATION: ...`` line describing the emulated links."""
        parts = [f"{k.name} {self._rate[k] / GB:.4g} GB/s + {self._lat[k] * 1e6:.4g} us/msg" for k in self._rate]
        return (f"SIMULATION: links emulated as profile {self.profile.name} x {self.scale:g} ("
                + ("; ".join(parts) or "nothing emulated") + "); SELF at host speed")

    def charge(self, kind: ChannelKind, nbytes: int) -> None:
        """Account one message of ``nbytes`` on ``kind`` and sleep until it would have completed."""
        rate = self._rate.get(kind)
        if rate is None:
            return
        with self._lock:
            now = time.perf_counter()
            start = max(self._free[kind], now - self._burst[kind] / rate)  # unused credit is capped by the depth
            self._free[kind] = start + nbytes / rate
            done = self._free[kind] + self._lat[kind]
        delay = done - now
        if delay > 0:
            time.sleep(delay)
            self.delayed_s[kind.name] += delay

    def reset(self) -> None:
        with self._lock:
            for k in self._free:
                self._free[k] = 0.0
            self.delayed_s = {k.name: 0.0 for k in ChannelKind}


def emulator_from_env(environ=None) -> LinkEmulator | None:
    """The emulator ``$DEEPEP_ASCEND_LINK_EMULATION`` asks for, or ``None``.

    ``DEEPEP_ASCEND_LINK_EMULATION``: ``none`` (default) or ``delay``;
    ``DEEPEP_ASCEND_LINK_PROFILE``: profile name or explicit numbers (default ``ascend950``);
    ``DEEPEP_ASCEND_LINK_SCALE``: time scale (default 1e-3).
    Raises:
        ValueError: an unknown mode, profile or scale (naming the variable; ``SettingError`` for the mode
            and the scale).
    """
    if LINK_EMULATION.get(environ) == "none":
        return None
    scale = LINK_SCALE.get(environ)
    try:
        return LinkEmulator(LINK_PROFILE.get(environ), scale)
    except ValueError as exc:
        raise ValueError(f"${LINK_PROFILE.name}: {exc}") from None


# -- projection ------------------------------------------------------------------------------

def gather_link_stats(snapshot: dict, comm) -> dict:
    """Collective: per-rank :meth:`LinkStats.snapshot` dicts → ``{field: int64[world, kind, world]}``."""
    rows = comm.allgather({k: np.asarray(snapshot[k]) for k in _FIELDS})
    return {k: np.stack([r[k] for r in rows]) for k in _FIELDS}


def project(matrices: dict, profile: str | LinkProfile) -> dict:
    """Time the counted traffic of one call would take on ``profile``'s links (a model, not a measurement).

    Model: each rank has one port per channel kind, with the profile's bandwidth ``B`` in each
    direction. The data a rank sends on a kind (its stores + what peers load from it) and the
    data it receives (peers' stores into it + its loads) flow concurrently; the port is busy
    ``max(sent, received) / B + messages * L``, where ``messages`` are the puts, loads and signals
    the rank issues on that kind and ``L`` the per-message latency. Ports and kinds work in
    parallel, so the call takes as long as the busiest port (the bottleneck).

    Args:
        matrices: ``{field: int64[world, kind, world]}`` as :func:`gather_link_stats` returns
            (row = the issuing rank's counters).
        profile: profile or its name (see :func:`get_profile`).
    Returns:
        ``{"profile", "time_s", "bottleneck": {"rank", "kind", "direction", "bytes"} | None,
        "bottleneck_GBps", "ports": {kind: {"time_s": [world], "sent": [world], "received": [world],
        "messages": [world]}}}`` — ``time_s`` 0 and no bottleneck when nothing was sent.
    Raises:
        ValueError: the profile models no link, or the matrices are not ``[world, kind, world]``.
    """
    prof = get_profile(profile)
    if not prof.links:
        raise ValueError(f"link profile {prof.name!r} models no link: nothing to project")
    put = np.asarray(matrices["bytes_put"], dtype=np.float64)
    world = put.shape[0]
    if put.shape != (world, len(ChannelKind), world):
        raise ValueError(f"link matrices must be [world, {len(ChannelKind)}, world], got {put.shape}")
    flow = put + np.asarray(matrices["bytes_fetched"], dtype=np.float64).transpose(2, 1, 0)  # [src, kind, dst]
    sent, received = flow.sum(axis=2), flow.sum(axis=0).T  # [rank, kind]
    msgs = sum(np.asarray(matrices[f], dtype=np.float64) for f in ("puts", "gets", "signals")).sum(axis=2)
    best = dict(time_s=0.0, bottleneck=None, bottleneck_GBps=float("nan"))
    ports = {}
    for kind in ChannelKind:
        spec = prof.link(kind)
        if spec is None:
            continue
        volume = np.maximum(sent[:, kind], received[:, kind])
        t = volume / (spec.GBps * GB) + msgs[:, kind] * spec.latency_us * 1e-6
        ports[kind.name] = dict(time_s=t.tolist(), sent=sent[:, kind].astype(np.int64).tolist(),
                                received=received[:, kind].astype(np.int64).tolist(),
                                messages=msgs[:, kind].astype(np.int64).tolist())
        r = int(np.argmax(t))
        if t[r] > best["time_s"]:
            direction = "sent" if sent[r, kind] >= received[r, kind] else "received"
            best = dict(time_s=float(t[r]), bottleneck=dict(rank=r, kind=kind.name, direction=direction,
                                                            bytes=int(volume[r])),
                        bottleneck_GBps=float(volume[r] / t[r] / GB))
    return dict(profile=prof.name, **best, ports=ports)
