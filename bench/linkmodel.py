"""Link model (``deepep_ascend.transports`` link profiles; docs/design/transports.md §5): emulation and projection.

The options are declared with the rest of the vocabulary (:func:`bench.cli.add_link_args`);
:func:`link_setup` turns them into a profile and an optional emulator; :func:`project_phases`
projects a Buffer's counted traffic onto the profile's links (a model, never a measurement) and
:func:`projection_lines` prints it next to the measured numbers.
"""
from __future__ import annotations

from bench.formulas import fmt_bytes, gbps


def link_setup(p, args):
    """``(profile, emulator or None)`` from :func:`bench.cli.add_link_args`' options; ``p.error`` on bad values."""
    from deepep_ascend.transports import LinkEmulator, get_profile

    try:
        profile = get_profile(args.link_profile)
        emulator = None
        if args.link_emulation == "delay":
            if not profile.links:
                raise ValueError("--link-emulation delay needs a --link-profile with links (not 'none')")
            emulator = LinkEmulator(profile, args.link_scale)
    except ValueError as exc:
        p.error(f"--link-profile/--link-scale: {exc}")
    return profile, emulator


def use_link_emulator(runtime, emulator):
    """Install ``emulator`` (from :func:`link_setup`; ``None`` = leave as is) on a Buffer's
    ``runtime`` and return the emulator that runtime now uses: ``emulator``, or the one
    ``$DEEPEP_ASCEND_LINK_EMULATION`` installed, or ``None`` (links not emulated)."""
    if emulator is not None:
        runtime.set_link_emulator(emulator)
    return runtime.stats.emulator


def link_model_doc(profile, emulator) -> dict:
    """The ``link_model`` entry of a benchmark's JSON: what was emulated (if anything) and projected."""
    return dict(emulation="none" if emulator is None else "delay", profile=profile.name,
                scale=None if emulator is None else emulator.scale,
                label="measured on this host, links not emulated" if emulator is None else emulator.label,
                profile_links=profile.as_dict()["links"])


def project_phases(link_stats: dict | None, comm, profile, formula_bytes: dict) -> dict | None:
    """Collective: :func:`transports.project` of each phase's gathered counters on ``profile``.

    ``link_stats``: phase → this rank's ``Buffer.get_link_stats()`` of one call (``None`` on
    every rank: no projection). ``formula_bytes``: phase → this rank's bytes under the
    benchmark's byte formula; ``formula_GBps`` = their max over ranks / the projected time,
    comparable with the measured GB/s of the same formula. ``None`` for a profile without links.
    """
    from deepep_ascend.transports import gather_link_stats, project

    if link_stats is None or not profile.links:
        return None
    from mpi4py import MPI

    out = dict(profile=profile.name, links={k: dict(GBps=v.GBps, latency_us=v.latency_us)
                                            for k, v in profile.links.items()})
    for phase, snap in link_stats.items():
        p = project(gather_link_stats(snap, comm), profile)
        fb = comm.allreduce(int(formula_bytes[phase]), op=MPI.MAX)
        p["formula_bytes"] = fb
        p["formula_GBps"] = gbps(fb, p["time_s"])
        out[phase] = p
    out["round_trip_s"] = sum(out[ph]["time_s"] for ph in link_stats)
    return out


def projection_lines(proj: dict | None, measured: dict, formula: str, emulator=None) -> list:
    """``[project]`` lines: per phase the projected time, bottleneck port and formula GB/s next to
    ``measured`` (phase → ``(median_s, GB/s by the same formula)``); under emulation, also the
    projected time dilated by ``1 / scale``, what the emulated links alone model (see
    :class:`transports.LinkEmulator`)."""
    if proj is None:
        return []
    lines = []
    for phase, (t_meas, gb_meas) in measured.items():
        p = proj[phase]
        b = p["bottleneck"]
        where = "nothing sent" if b is None else (
            f"bottleneck rank {b['rank']} {b['kind']} {b['direction']} {fmt_bytes(b['bytes'])} "
            f"({p['bottleneck_GBps']:.1f} GB/s)")
        lines.append(f"[project]  {phase:<8} on {proj['profile']} (model of the counted traffic, not measured): "
                     f"{p['time_s'] * 1e6:.1f} us, {where} | {formula} {p['formula_GBps']:.1f} GB/s projected "
                     f"vs {gb_meas:.2f} GB/s measured{' on EMULATED links' if emulator is not None else ''} "
                     f"({t_meas * 1e3:.3f} ms)")
        if emulator is not None and emulator.profile.name == proj["profile"]:
            lines[-1] += f" | projected / link scale: {p['time_s'] / emulator.scale * 1e3:.3f} ms"
    return lines
