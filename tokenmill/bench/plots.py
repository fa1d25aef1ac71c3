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


def plot_memory_plan(stacks: Mapping[str, tuple[float, float]], path: str | Path, memory_gb: float | None = None,
                     highlight: str | None = None, kv_label: str = "KV cache", title: str = "") -> Path:
    """One stacked bar per weight precision, weights under the KV cache (bytes in, drawn in GB), and the
    memory budget as a horizontal line: a bar under the line fits."""
    names = list(stacks)
    weights = [stacks[n][0] / 1e9 for n in names]
    kv = [stacks[n][1] / 1e9 for n in names]
    fig = Figure(figsize=(max(6.0, 0.7 * len(names) + 2), 4.5), layout="constrained")
    ax = fig.subplots()
    x = range(len(names))
    ax.bar(x, weights, color="tab:blue", label="weights")
    ax.bar(x, kv, bottom=weights, color="tab:orange", label=kv_label)
    if highlight in stacks:  # outline the chosen precision
        i = names.index(highlight)
        ax.bar([i], [weights[i] + kv[i]], fill=False, edgecolor="black", linewidth=2)
    if memory_gb is not None:
        ax.axhline(memory_gb, color="tab:red", linestyle="--", label=f"budget {memory_gb:g} GB")
    ax.set_xticks(list(x), names, rotation=45, ha="right")
    top = max([w + k for w, k in zip(weights, kv)] + [memory_gb or 0.0])
    ax.set_ylim(0, top * 1.2)  # headroom so the legend sits above the bars
    ax.set(ylabel="GB (1e9 B)", title=title or "weights + KV cache by weight precision")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.savefig(path, dpi=110)
    return Path(path)
