"""Tables, PNG plots (matplotlib, Agg backend) and markdown reports of simulator runs.

Everything here formats numbers that ``sim.evaluator`` and ``sim.experiments`` computed;
nothing is measured here. Writers take an explicit path (the shell decides where).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sim.evaluator import EvalResult  # noqa: E402

SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("ontime_utility", "OnTimeUtility"),
    ("mean_utility", "mean utility"),
    ("slo_attainment", "SLO att."),
    ("mean_quality", "quality"),
    ("spend_usd", "spend $"),
    ("budget_breaches", "breaches"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("decide_p50_ms", "decide p50 ms"),
    ("decide_p99_ms", "decide p99 ms"),
)


def fmt(value: Any) -> str:
    """A number as a table cell: 4 significant digits, percentages left to callers."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def pct(value: float | None) -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value * 100:+.1f}%"
    )


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A GitHub markdown table of ``rows`` (dicts) with ``(key, header)`` columns."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join(" --- " for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def rich_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], title: str = ""
) -> Any:
    """The same table for the terminal (``rich``)."""
    from rich.table import Table

    t = Table(title=title or None)
    for k, h in columns:
        t.add_column(
            h, justify="left" if k in ("policy", "estimator", "method", "name") else "right"
        )
    for r in rows:
        t.add_row(*(fmt(r.get(k)) for k, _ in columns))
    return t


# ------------------------------------------------------------------------ plots


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(
    x: Sequence[float],
    curves: Mapping[str, Sequence[float]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    highlight: Sequence[str] = (),
) -> Path:
    """One line per policy (e.g. OnTimeUtility vs arrival rate)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, ys in curves.items():
        lw = 2.4 if name in highlight else 1.4
        ax.plot(list(x), list(ys), marker="o", ms=3.5, lw=lw, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_panels(
    panels: Mapping[str, tuple[Sequence[float], Mapping[str, Sequence[float]]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    highlight: Sequence[str] = (),
    bands: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
) -> Path:
    """Side-by-side curve panels sharing the y axis (e.g. Poisson | MMPP); ``bands``
    (panel -> curve -> half-widths, e.g. a standard deviation) shades ± around curves."""
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), 4.2), sharey=True, squeeze=False
    )
    for ax, (title, (x, curves)) in zip(axes[0], panels.items(), strict=True):
        for name, ys in curves.items():
            (line,) = ax.plot(
                list(x),
                list(ys),
                marker="o",
                ms=3.5,
                lw=2.4 if name in highlight else 1.4,
                label=name,
            )
            half = (bands or {}).get(title, {}).get(name)
            if half is not None:
                y, h = np.asarray(ys, dtype=float), np.asarray(half, dtype=float)
                ax.fill_between(list(x), y - h, y + h, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    return _save(fig, path)


def plot_bars(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: Path,
    *,
    ylabel: str,
    title: str,
) -> Path:
    """Grouped bars: one group per x label, one bar per series."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    k = len(series)
    width = 0.8 / max(k, 1)
    xs = np.arange(len(groups))
    for n, (name, ys) in enumerate(series.items()):
        ax.bar(xs + (n - (k - 1) / 2) * width, list(ys), width, label=name)
    ax.set_xticks(xs, list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_scatter(
    points: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    lines: Sequence[str] = (),
) -> Path:
    """Named point sets; the ones in ``lines`` are joined (e.g. paper A's δ curve)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in points.items():
        if name in lines:
            ax.plot(list(xs), list(ys), marker="o", ms=4, lw=2, label=name)
        else:
            ax.scatter(list(xs), list(ys), s=50, marker="s", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ttft_cdf(results: Sequence[EvalResult], path: Path, slo_ms: float | None = None) -> Path:
    """Empirical CDF of TTFT per policy (log x)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        t = np.sort(r.ttft_ms[~np.isnan(r.ttft_ms)])
        if t.size:
            ax.plot(t, np.arange(1, t.size + 1) / t.size, label=r.policy)
    if slo_ms:
        ax.axvline(slo_ms, color="k", ls="--", lw=1, label="median SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of queries")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_timeline(
    results: Sequence[EvalResult], arrival_s: np.ndarray, path: Path, bin_s: float = 60.0
) -> Path:
    """SLO attainment and spend per time bin, per policy."""
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.0, 5.2), sharex=True)
    bins = (np.asarray(arrival_s) // bin_s).astype(np.int64)
    nb = int(bins.max()) + 1 if bins.size else 1
    x = (np.arange(nb) + 0.5) * bin_s / 60.0
    cnt = np.maximum(np.bincount(bins, minlength=nb), 1)
    for r in results:
        a1.plot(
            x,
            np.bincount(bins, weights=r.on_time.astype(float), minlength=nb) / cnt,
            label=r.policy,
        )
        a2.plot(x, np.bincount(bins, weights=r.cost_usd, minlength=nb), label=r.policy)
    a1.set_ylabel("SLO attainment")
    a2.set_ylabel("spend per bin ($)")
    a2.set_xlabel("time (min)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------- markdown


def simulate_report(
    results: Sequence[EvalResult],
    *,
    title: str,
    setup: Mapping[str, Any],
    command: str,
    plots: Sequence[Path] = (),
    report_path: Path | None = None,
) -> str:
    """A markdown report of one ``switchyard simulate`` run."""
    lines = [f"# {title}", "", "```", command, "```", "", "## Setup", ""]
    lines += [f"- **{k}**: {fmt(v)}" for k, v in setup.items()]
    lines += [
        "",
        "## Results",
        "",
        markdown_table([r.summary() for r in results], SUMMARY_COLUMNS),
        "",
    ]
    for r in results:
        s = r.summary()
        if r.breaches:
            lines.append(
                f"- `{r.policy}` broke its window budget {len(r.breaches)} times "
                f"(worst by ${s['worst_breach_usd']:.3g})."
            )
        if s["flags"]:
            lines.append(f"- `{r.policy}` decision flags: {s['flags']}")
    if plots:
        lines += ["", "## Plots", ""]
        base = report_path.parent if report_path is not None else None
        for p in plots:
            rel = p.relative_to(base) if base is not None and p.is_relative_to(base) else p
            lines.append(f"![{p.stem}]({rel})")
    return "\n".join(lines) + "\n"
