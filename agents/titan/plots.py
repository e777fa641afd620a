"""Plots for the offline study and the emulated run (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_COLORS = {"nearest-wan": "#7f7f7f", "wan-lp": "#8c564b", "titan": "#1f77b4", "greedy-internet": "#ff7f0e",
           "titan-next": "#2ca02c", "titan-next-oracle": "#98df8a"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def study_plots(summary: dict, evals: dict, world, T: int, slot_minutes: int, top_links, out: Path) -> list[Path]:
    plt = _plt()
    written = []
    hours = np.arange(next(iter(evals.values())).link_load.shape[1]) * slot_minutes / 60.0

    # per-link load over the evaluated days, the links busiest under nearest-DC
    links = list(top_links)[:4]
    fig, axes = plt.subplots(len(links), 1, figsize=(11, 2.4 * len(links)), sharex=True)
    for ax, link in zip(np.atleast_1d(axes), links):
        for name, ev in evals.items():
            ax.plot(hours, ev.link_load[link] / 1e3, label=name, color=_COLORS.get(name), lw=1)
        ax.set_ylabel("Mbit/s")
        ax.set_title(world.link_name(link), fontsize=9)
    np.atleast_1d(axes)[0].legend(fontsize=7, ncol=3)
    np.atleast_1d(axes)[-1].set_xlabel("hours from Monday 00:00 UTC")
    fig.tight_layout()
    written.append(_save(fig, out / "link_load.png", plt))

    # sum of peaks per policy: the week and the mean day
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(summary["policies"])
    week = [summary["policies"][n]["sum_of_peaks_week_kbps"] / 1e6 for n in names]
    day = [summary["policies"][n]["sum_of_peaks_day_mean_kbps"] / 1e6 for n in names]
    xs = np.arange(len(names))
    ax.bar(xs - 0.2, week, 0.4, label="peak over the week", color=[_COLORS.get(n) for n in names])
    ax.bar(xs + 0.2, day, 0.4, label="mean daily peak", color=[_COLORS.get(n) for n in names], alpha=0.5)
    ax.set_xticks(xs, names, rotation=20, fontsize=8)
    ax.set_ylabel("sum over WAN links of the peak (Gbit/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out / "sum_of_peaks.png", plt))

    # latency CDFs per route
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("nearest-wan", "titan", "titan-next"):
        ev = evals.get(name)
        if ev is None:
            continue
        for route, style in ((0, "-"), (1, "--")):
            sel = (ev.latency_route == route) & (ev.latency > 0)
            if sel.sum() < 2:
                continue
            lat, w = ev.latency[sel], ev.latency_weight[sel]
            o = np.argsort(lat)
            ax.plot(lat[o], np.cumsum(w[o]) / w.sum(), style, color=_COLORS.get(name),
                    label=f"{name} {'WAN' if route == 0 else 'Internet'}")
    ax.set_xlabel("participant RTT to the media server (ms, cross-region participants)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "latency_cdf.png", plt))

    # Internet share of cross-region traffic over time
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for name, ev in evals.items():
        share = np.divide(ev.internet_kbps, ev.cross_kbps, out=np.zeros_like(ev.cross_kbps), where=ev.cross_kbps > 0)
        if share.any():
            ax.plot(hours, share, label=name, color=_COLORS.get(name), lw=1)
    ax.set_ylabel("Internet share of cross-region traffic")
    ax.set_xlabel("hours from Monday 00:00 UTC")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "internet_share.png", plt))

    # solver time per day
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, rows in summary["solves"].items():
        ax.plot([r["day"] + 1 for r in rows], [r["solve_s"] for r in rows], "o-", label=name,
                color=_COLORS.get(name))
    ax.axhline(60, color="red", lw=0.8, ls=":", label="60 s budget")
    ax.set_xlabel("day")
    ax.set_ylabel("LP build + solve + tie-break (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out / "solver_time.png", plt))
    return written


def emulation_plots(result: dict, out: Path) -> list[Path]:
    plt = _plt()
    written = []
    pols = result["policies"]
    links = result["world"]["links"]
    if pols:
        first = next(iter(pols.values()))
        load = np.array(first["slot_load_kbps"])
        busiest = np.argsort(-np.array([np.array(p["slot_load_kbps"]).max(axis=1) for p in pols.values()]).max(axis=0))[:4]
        fig, axes = plt.subplots(len(busiest), 1, figsize=(9, 2.3 * len(busiest)), sharex=True)
        for ax, link in zip(np.atleast_1d(axes), busiest):
            for name, p in pols.items():
                meas = np.array(p["slot_load_kbps"])[link]
                model = np.array(p["model_slot_load_kbps"])[link]
                ax.step(np.arange(len(meas)), meas / 1e3, where="post", color=_COLORS.get(name), label=name)
                ax.step(np.arange(len(model)), model / 1e3, where="post", color=_COLORS.get(name), ls=":", lw=0.8)
            ax.set_title(f"{links[link]} (solid: counters, dotted: model)", fontsize=9)
            ax.set_ylabel("Mbit/s")
        np.atleast_1d(axes)[0].legend(fontsize=7, ncol=3)
        np.atleast_1d(axes)[-1].set_xlabel("slot of the emulated day")
        fig.tight_layout()
        written.append(_save(fig, out / "emu_link_load.png", plt))
        del load

        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(pols)
        xs = np.arange(len(names))
        ax.bar(xs - 0.2, [pols[n]["sum_of_peaks_kbps"] / 1e3 for n in names], 0.4, label="measured (counters)",
               color=[_COLORS.get(n) for n in names])
        ax.bar(xs + 0.2, [pols[n]["model_sum_of_peaks_kbps"] / 1e3 for n in names], 0.4, label="model",
               color=[_COLORS.get(n) for n in names], alpha=0.5)
        ax.set_xticks(xs, names, rotation=20, fontsize=8)
        ax.set_ylabel("sum of WAN-link peaks (Mbit/s)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out / "emu_sum_of_peaks.png", plt))

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, p in pols.items():
            for route, style in ((0, "-"), (1, "--")):
                r = sorted(x["rtt_ms"] for x in p["participant_rtt"] if x["route"] == route and x["model_rtt_ms"] > 0)
                if len(r) > 1:
                    ax.plot(r, np.arange(1, len(r) + 1) / len(r), style, color=_COLORS.get(name),
                            label=f"{name} {'WAN' if route == 0 else 'Internet'}")
        ax.set_xlabel("measured participant RTT (ms, cross-region participants)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=6)
        fig.tight_layout()
        written.append(_save(fig, out / "emu_latency_cdf.png", plt))
    ctl = result.get("controller")
    if ctl:
        faults = ctl.get("faults", [])
        fig, axes = plt.subplots(1 + len(faults), 1, figsize=(11, 3.2 + 2.2 * len(faults)), sharex=True,
                                 squeeze=False)
        ax = axes[0][0]
        faulted = {f["path"] for f in faults}
        for path in sorted({r["path"] for r in ctl["timeline"]}):
            rows = [r for r in ctl["timeline"] if r["path"] == path]
            ax.step([r["t"] for r in rows], [r["fraction"] for r in rows], where="post", label=path,
                    lw=2 if path in faulted else 1)
        ax.set_ylabel("offload fraction")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        for f, row in zip(faults, axes[1:]):
            fa = row[0]
            series = f.get("lane_call_streams", [])
            fa.step([t for t, _ in series], [r for _, r in series], where="post", color="black", lw=1)
            what = ", ".join(x for x in (f"loss {f['loss']:g}" if f["loss"] else "",
                                         f"+{f['extra_delay_ms']:g} ms" if f["extra_delay_ms"] else "",
                                         f"+{f['extra_jitter_ms']:g} ms jitter" if f["extra_jitter_ms"] else "") if x)
            for a in (ax, fa):
                if f["at_s"] is not None:
                    a.axvline(f["at_s"], color="red", ls=":")
                if f["cleared_at_s"] is not None:
                    a.axvline(f["cleared_at_s"], color="green", ls=":")
            if f.get("mitigated_at_s") is not None:
                fa.axvline(f["mitigated_at_s"], color="orange", ls="--", label="no call left")
                fa.legend(fontsize=7, loc="upper right")
            fa.set_ylabel("call streams")
            fa.set_title(f"{f['path']} ({what}): streams on the path, from the hub's lane counters", fontsize=8)
        axes[-1][0].set_xlabel("s")
        fig.tight_layout()
        written.append(_save(fig, out / "emu_controller.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
