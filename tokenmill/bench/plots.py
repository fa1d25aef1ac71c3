"""Pictures for the benchmarks. Figure objects only (no pyplot state), so the Agg renderer draws them
headless and nothing leaks between calls or threads."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.figure import Figure  # savefig to .png renders through Agg; no display, no backend switch

from .stats import percentile


def plot_step_latency(curves: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """Per-step decode latency (ms) against step number, and the running total: with the KV cache a step
    costs about the same at every length (O(n) in all); recomputing the sequence grows each step (O(n²))."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax, cum = fig.subplots(1, 2)
    for label, lat in curves.items():
        steps = range(1, len(lat) + 1)
        ax.plot(steps, [x * 1000 for x in lat], label=label, linewidth=1)
        total, run = 0.0, []
        for x in lat:
            total += x
            run.append(total)
        cum.plot(steps, run, label=label)
    ax.set(xlabel="decode step", ylabel="step latency (ms)", title="per-step latency")
    cum.set(xlabel="decode step", ylabel="cumulative time (s)", title="total decode time")
    for a in (ax, cum):
        a.grid(alpha=0.3)
        a.legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_latency_distributions(series: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """One histogram per metric (values in ms), with p50/p90/p99 marked."""
    names = [k for k, v in series.items() if len(v)]
    cols = 2
    rows = max(1, (len(names) + cols - 1) // cols)
    fig = Figure(figsize=(10, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        vals = list(series[name])
        ax.hist(vals, bins=min(50, max(5, len(vals) // 4)), color="tab:blue", alpha=0.75)
        for p, c in ((50, "tab:green"), (90, "tab:orange"), (99, "tab:red")):
            v = percentile(vals, p)
            ax.axvline(v, color=c, linestyle="--", label=f"p{p} {v:.1f} ms")
        ax.set(title=name, xlabel="ms", ylabel="count")
        ax.legend(fontsize=8)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)
