"""The PNG plots of a run's summary (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .summary import Row, find

if TYPE_CHECKING:
    from pathlib import Path

#: Plot order: orchestra first, then the bare floors, then the peers.
VARIANT_ORDER = (
    "orchestra",
    "worker_queue",
    "gather",
    "taskgroup",
    "anyio",
    "aiometer",
    "langgraph",
    "orchestra_stream",
    "worker_stream",
)


def plots(summary: list[Row], out: Path) -> list[str]:
    """Draw the PNGs into ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []

    rows = [r for r in summary if r["scenario"] == "speedup" and "speedup" in r]
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
        limits = sorted({r["limit"] for r in rows})
        n = rows[0]["n"]
        achievable = {r["limit"]: r["achievable_speedup"] for r in rows}
        ax1.plot(limits, [min(n, c) for c in limits], "k:", label="ideal min(N, limit)")
        ax2.axhline(0.95, color="tab:red", linestyle=":", label="target 0.95")
        for ax, scale in ((ax1, lambda c: 1.0), (ax2, lambda c: 1 / min(n, c))):
            ax.plot(
                limits,
                [achievable[c] * scale(c) for c in limits],
                "k--",
                alpha=0.5,
                label="zero-overhead runtime (same jittered latencies)",
            )
        for variant in [v for v in VARIANT_ORDER if any(r["variant"] == v for r in rows)]:
            vr = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["limit"])
            xs = [r["limit"] for r in vr]
            med = [r["speedup"]["median"] for r in vr]
            err = [
                [m - r["speedup"]["min"] for m, r in zip(med, vr, strict=True)],
                [r["speedup"]["max"] - m for m, r in zip(med, vr, strict=True)],
            ]
            ax1.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=variant)
            ax2.plot(
                xs, [m / min(n, c) for m, c in zip(med, xs, strict=True)], marker="o", label=variant
            )
        ax1.set_yscale("log")
        ax1.set_ylabel("speed-up vs limit 1")
        ax1.set_title(f"Speed-up, {n} simulated agent calls")
        ax2.set_ylabel("speed-up / min(N, limit)")
        ax2.set_title("Parallel efficiency")
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.set_xlabel("concurrency limit")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_concurrency.png", dpi=110)
        plt.close(fig)
        written.append("speedup_vs_concurrency.png")

    rows = [r for r in summary if r["scenario"] == "dispatch" and "wall_s" in r]
    if rows:
        loops = [lp for lp in ("asyncio", "uvloop") if any(r["loop"] == lp for r in rows)]
        variants = [v for v in VARIANT_ORDER if any(r["variant"] == v for r in rows)]
        ns = sorted({r["n"] for r in rows})
        fig, axes = plt.subplots(1, len(loops), figsize=(6.0 * len(loops), 4.6), squeeze=False)
        width = 0.8 / len(variants)
        for ax, lp in zip(axes[0], loops, strict=True):
            for j, variant in enumerate(variants):
                xs, med, lo, hi = [], [], [], []
                for i, n in enumerate(ns):
                    r = find(rows, variant=variant, n=n, loop=lp)
                    if r is None:
                        continue
                    s = r["us_per_task"]
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    med.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
                if xs:
                    ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=variant)
            ax.set_xticks(range(len(ns)), [f"N={n:,}" for n in ns])
            ax.set_yscale("log")
            ax.set_ylabel("µs per subtask (log)")
            ax.set_title(f"No-op dispatch, limit {rows[0]['limit']}, {lp}")
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "dispatch_us_per_subtask.png", dpi=110)
        plt.close(fig)
        written.append("dispatch_us_per_subtask.png")

    rows = [r for r in summary if r["scenario"] == "million" and r.get("slice_throughput")]
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for r in rows:
            xs = [(i + 1) * r["slice"] for i in range(len(r["slice_throughput"]))]
            ax1.plot(
                xs, [s["median"] for s in r["slice_throughput"]], marker="o", label=r["variant"]
            )
            line = ax2.plot(
                xs,
                [s["median"] for s in r.get("slice_rss_mib") or r["slice_peak_rss_mib"]],
                marker="o",
                label=f"{r['variant']} RSS",
            )
            ax2.plot(
                xs,
                [s["median"] for s in r["slice_peak_rss_mib"]],
                linestyle=":",
                color=line[0].get_color(),
                label=f"{r['variant']} peak",
            )
        ax1.set_xlabel("tasks completed")
        ax1.set_ylabel("tasks/s in slice (log)")
        ax1.set_yscale(
            "log"
        )  # the bare pool runs ~30x faster: on a linear axis orchestra is flat at 0
        ax1.set_title("Streamed run: throughput per slice")
        ax2.set_xlabel("tasks completed")
        ax2.set_ylabel("MiB")
        ax2.set_ylim(bottom=0)
        ax2.set_title("Streamed run: RSS and peak RSS so far")
        for ax in (ax1, ax2):
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "million_stream.png", dpi=110)
        plt.close(fig)
        written.append("million_stream.png")

    rows = [r for r in summary if r["scenario"] == "features" and "wall_s" in r]
    if rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        names = [r["variant"].removeprefix("orchestra_") for r in rows]
        med = [r["us_per_task"]["median"] for r in rows]
        err = [
            [m - r["us_per_task"]["min"] for m, r in zip(med, rows, strict=True)],
            [r["us_per_task"]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.bar(names, med, yerr=err, capsize=3, color="tab:blue")
        ax.set_ylabel("µs per task")
        ax.set_title(f"orchestra with one feature on, {rows[0]['n']:,} no-op tasks")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "feature_cost.png", dpi=110)
        plt.close(fig)
        written.append("feature_cost.png")
    return written
