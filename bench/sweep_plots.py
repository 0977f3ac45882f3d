"""The bandwidth sweep's plots (``scripts/sweep_bandwidth.py``), drawn from the rows of
:mod:`bench.sweep_records` with matplotlib:

* ``gbps_vs_size.png``: GB/s vs tokens per rank, per mode, for the formula bandwidths (MegaMoE:
  the fused call's per-pair bytes, with and without self-rank pairs) and per channel kind;
* ``peers.png``: deepep_ascend vs the MPI ``Alltoallv`` and gloo ``all_to_all_single`` pipelines;
* ``projected_vs_measured.png``: the link-model projection (a model, labelled as such) next to the
  measured GB/s; emulated runs are labelled ``EMULATED``.
"""
from __future__ import annotations

import os

from bench.sweep_records import KINDS, MMA, MODES, PHASES, emulated, number

EMULATED_TAG = " EMULATED"  # plot labels of rows measured with emulated links


# How a row was measured, beside what it measured: rows differing in one of these are separate series
# (labelled by the differing settings only), never points of one line. The link scale counts for
# emulated rows only (it slows nothing otherwise).
SETTINGS = ("iters", "warmup", "warmup_s", "seed", "link_scale")


def _setting(r: dict, field: str):
    return None if field == "link_scale" and not emulated(r) else r.get(field)


def varying_settings(rows: list) -> tuple:
    """The :data:`SETTINGS` taking more than one value among ``rows`` (the link scale: among the emulated
    ones), in that order."""
    return tuple(f for f in SETTINGS
                 if len({repr(_setting(r, f)) for r in rows if f != "link_scale" or emulated(r)}) > 1)


def _group_label(r: dict, varying: tuple = ()) -> str:
    topo = f"{r['nodes']}x{r['ranks_per_node']}" if r.get("ranks_per_node") else "1 node"
    emu = EMULATED_TAG if emulated(r) else ""
    how = "".join(f", {f} {_setting(r, f)}" for f in varying if _setting(r, f) is not None)
    if r.get("mode") == "mega_moe":
        return (f"R{r['ranks']} {topo}, H{r['hidden']} I{r.get('inter')}, top-{r['num_topk']}/{r['num_experts']}, "
                f"{MMA.get(str(r['dtype']), str(r['dtype'])).upper()}{how}{emu}")
    return (f"R{r['ranks']} {topo}, H{r['hidden']}, top-{r['num_topk']}/{r['num_experts']}, "
            f"{str(r['dtype']).upper()}{how}{emu}")


def _series(rows: list, field: str, varying: tuple = ()) -> dict:
    """``{group label: (tokens[], values[])}`` sorted by tokens, rows without the field left out; ``varying``:
    the settings that split groups (:func:`varying_settings` of every row plotted)."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["tokens"]):
        v = number(r.get(field))
        if v is not None and v > 0:
            xs, ys = out.setdefault(_group_label(r, varying), ([], []))
            xs.append(r["tokens"])
            ys.append(v)
    return out


def _finish_axes(ax, title: str, ylabel: str, empty_note: str = "no data") -> None:
    """Titles, units, plain-number ticks at the measured sizes; log y only when values span > 20x."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(ylabel)
    if not ax.lines:
        ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, fontsize=8, wrap=True)
        return
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    xs = sorted({float(x) for ln in ax.lines for x in ln.get_xdata()})
    ys = [float(y) for ln in ax.lines for y in ln.get_ydata()]
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    if max(ys) > 20 * min(ys):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, max(ys) * 1.15)
    ax.yaxis.set_major_formatter(plain)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6)


# Per mode, the formula-bandwidth panels of gbps_vs_size.png ((field, title), ...), their byte formula,
# and the phases of projected_vs_measured.png ((measured field, projected phase), ...).
_FORMULA_PANELS = {
    "normal": ([("dispatch_gbps", "dispatch (formula)"), ("combine_gbps", "combine (formula)")], "V1 bottleneck bytes"),
    "low_latency": ([("dispatch_gbps", "dispatch (formula)"), ("combine_gbps", "combine (formula)")],
                    "DeepEP LL-formula bytes, busiest rank"),
    "mega_moe": ([("fused_gbps", "fused call, with self-rank pairs"),
                  ("fused_cross_rank_gbps", "fused call, cross-rank")], "per-pair bytes, mean over ranks"),
}
_PROJ_PANELS = {"normal": [("dispatch_gbps", "dispatch"), ("combine_gbps", "combine")],
                "low_latency": [("dispatch_gbps", "dispatch"), ("combine_gbps", "combine")],
                "mega_moe": [("fused_gbps", "fused")]}


def make_plots(out_dir: str, rows: list) -> list:
    """Regenerate the three PNGs from every ``ok`` row; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    modes = [m for m in MODES if any(r["mode"] == m for r in ok)] or ["normal"]
    by_mode = {m: [r for r in ok if r["mode"] == m] for m in modes}
    varying_in = {m: varying_settings(by_mode[m]) for m in modes}  # one mode's rows share its panels
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []

    palette: dict = {}

    def color_of(label):  # one colour per configuration group across all three figures
        return palette.setdefault(label, colors[len(palette) % len(colors)])

    # (1) GB/s vs size per mode and channel kind
    ncols = 2 + len(KINDS)
    fig, axes = plt.subplots(len(modes), ncols, figsize=(4.2 * ncols, 3.6 * len(modes)), squeeze=False)
    for i, m in enumerate(modes):
        formula_panels, formula = _FORMULA_PANELS[m]
        per_call = "fused call" if m == "mega_moe" else "round trip"
        cols = formula_panels + [(f"rt_{k}_gbps", f"{k} bytes moved / {per_call}") for k in KINDS]
        for j, (field, what) in enumerate(cols):
            ax = axes[i][j]
            for label, (xs, ys) in _series(by_mode[m], field, varying_in[m]).items():
                ax.plot(xs, ys, marker="o", color=color_of(label), label=label)
            sub = formula if j < 2 else "busiest rank"
            _finish_axes(ax, f"{m}: {what}\n({sub})", "GB/s (1 GB = 1e9 B)", "none moved" if j >= 2 else "no data")
    fig.suptitle("deepep_ascend measured bandwidth vs size, per mode and channel kind (median over iterations)")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "gbps_vs_size.png", plt))

    # (2) deepep_ascend vs the peers on the same axes (mega_moe has no peer pipelines)
    styles = {"deepep_ascend": "-", "mpi_alltoallv": "--", "gloo_all_to_all": ":"}
    panels = []
    if "normal" in by_mode:
        panels += [("normal", p, "GB/s (V1 bottleneck bytes, 1 GB = 1e9 B)") for p in PHASES]
    for m in modes:
        if m != "mega_moe":
            panels.append((m, "round_trip", "round trip, ms (median)"))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
        for ax, (m, what, ylabel) in zip(axes[0], panels):
            for system, ls in styles.items():
                if what == "round_trip":
                    field = "round_trip_s" if system == "deepep_ascend" else f"{system}_round_trip_s"
                else:
                    field = f"{what}_gbps" if system == "deepep_ascend" else f"{system}_{what}_gbps"
                for label, (xs, ys) in _series(by_mode[m], field, varying_in[m]).items():
                    if what == "round_trip":
                        ys = [y * 1e3 for y in ys]
                    # only deepep_ascend's links are emulated: a peer measured in an emulated run is not
                    # slowed, so its label drops the tag (its colour stays that of its run's group)
                    shown = label if system == "deepep_ascend" else label.replace(EMULATED_TAG, "")
                    ax.plot(xs, ys, ls, marker="o" if system == "deepep_ascend" else ".", color=color_of(label),
                            label=f"{system}: {shown}")
            _finish_axes(ax, f"{m}: {what.replace('_', ' ')}", ylabel)
        emu_note = ("\nEMULATED: deepep_ascend's links slowed to the profile; the MPI and gloo peers are never slowed"
                    if any(emulated(r) for m, _, _ in panels for r in by_mode[m]) else "")
        fig.suptitle("deepep_ascend (solid) vs the peer pipelines MPI Alltoallv (dashed) and gloo all_to_all_single "
                     "(dotted): same workload, same run" + emu_note, fontsize=10)
        fig.tight_layout()
    else:  # only mega_moe rows
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "No peer comparison: these rows are all mega_moe,\n"
                          "and the mega-moe command runs no peer pipelines.",
                ha="center", va="center", transform=ax.transAxes)
    paths.append(_save(fig, out_dir, "peers.png", plt))

    # (3) projected vs measured
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4.0 * len(modes)), squeeze=False)
    for i, m in enumerate(modes):
        profiles = sorted({str(r["proj_profile"]) for r in by_mode[m] if r.get("proj_profile")})
        for j in range(2):
            ax = axes[i][j]
            if j >= len(_PROJ_PANELS[m]):
                ax.axis("off")  # mega_moe: one phase, the fused call
                continue
            field, p = _PROJ_PANELS[m][j]
            for label, (xs, ys) in _series(by_mode[m], field, varying_in[m]).items():
                tag = "measured, EMULATED links" if "EMULATED" in label else "measured"
                ax.plot(xs, ys, "-", marker="o", color=color_of(label), label=f"{tag}: {label}")
            for prof in profiles:
                rows_p = [r for r in by_mode[m] if str(r.get("proj_profile")) == prof]
                for label, (xs, ys) in _series(rows_p, f"proj_{p}_gbps", varying_in[m]).items():
                    ax.plot(xs, ys, "--", marker="^", color=color_of(label),
                            label=f"projected on {prof} (model): {label}")
            same = ("same per-pair formula; measured: mean over ranks,\nprojected: busiest rank" if m == "mega_moe"
                    else "same formula bytes")
            _finish_axes(ax, f"{m} {p}: measured vs projected GB/s\n({same})", "GB/s (1 GB = 1e9 B)")
            if not profiles:
                ax.text(0.02, 0.02, "no projection in the benchmark JSON", transform=ax.transAxes, fontsize=7)
    fig.suptitle("Projected (link-model, not measured) vs measured bandwidth")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "projected_vs_measured.png", plt))
    return paths


def _save(fig, out_dir: str, name: str, plt) -> str:
    path = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".{name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
