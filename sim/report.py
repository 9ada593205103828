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


def timeline_bin_s(span_s: float, bins: int = 40) -> float:
    """A round bin width giving about ``bins`` bins over ``span_s`` (1 s at least)."""
    raw = max(1.0, span_s / bins)
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if step >= raw:
            return float(step)
    return float(math.ceil(raw / 3600) * 3600)


def plot_timeline(
    results: Sequence[EvalResult], arrival_s: np.ndarray, path: Path, bin_s: float | None = None
) -> Path:
    """SLO attainment and spend per time bin, per policy.

    The bin width follows the span (about 40 bins; a 60 s bin over a 30 s run drew one
    point, which matplotlib shows as an empty plot); each bin is drawn as a marker too,
    so even a two-bin run shows its values.
    """
    arrival = np.asarray(arrival_s, dtype=np.float64)
    start = float(arrival.min()) if arrival.size else 0.0
    span = float(arrival.max()) - start if arrival.size else 0.0
    width = bin_s or timeline_bin_s(span)
    minutes = span > 300
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.0, 5.2), sharex=True)
    bins = ((arrival - start) // width).astype(np.int64)
    nb = int(bins.max()) + 1 if bins.size else 1
    x = (np.arange(nb) + 0.5) * width / (60.0 if minutes else 1.0)
    arrived = np.bincount(bins, minlength=nb)
    cnt = np.maximum(arrived, 1)
    style = {"marker": "o", "markersize": 3 if nb > 20 else 5}
    for r in results:
        att = np.bincount(bins, weights=r.on_time.astype(float), minlength=nb) / cnt
        a1.plot(x, np.where(arrived > 0, att, np.nan), label=r.policy, **style)
        a2.plot(x, np.bincount(bins, weights=r.cost_usd, minlength=nb), label=r.policy, **style)
    a1.set_ylabel("SLO attainment")
    a1.set_ylim(-0.02, 1.02)
    a2.set_ylabel(f"spend per {fmt(width)} s ($)")
    a2.set_xlabel("time (min)" if minutes else "time (s)")
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


# ------------------------------------------------------------------------ html


def _img(path: Path) -> str:
    import base64

    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<figure><img alt="{path.stem}" src="data:image/png;base64,{data}"><figcaption>{path.stem.replace("_", " ")}</figcaption></figure>'


def html_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    from html import escape

    head = "".join(f"<th>{escape(h)}</th>" for _, h in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(fmt(r.get(k)))}</td>" for k, _ in columns) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:2rem auto;
max-width:1100px;color:#1b1f24;padding:0 1rem}
h1{font-size:1.5rem;margin-bottom:.2rem} h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
pre{background:#f5f6f8;padding:.6rem .8rem;border-radius:4px;white-space:pre-wrap;word-break:break-all;font-size:.85rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{border:1px solid #d0d4d9;padding:.3rem .55rem;text-align:right}
th{background:#eef1f4} td:first-child,th:first-child{text-align:left}
dl{display:grid;grid-template-columns:max-content auto;gap:.15rem 1rem;font-size:.9rem}
dt{font-weight:600} dd{margin:0}
.plots{display:flex;flex-wrap:wrap;gap:1rem}
figure{margin:0;flex:1 1 480px} figure img{width:100%;border:1px solid #e3e6ea}
figcaption{font-size:.8rem;color:#555;text-align:center}
ul{font-size:.9rem}
"""


def simulate_html(
    results: Sequence[EvalResult],
    *,
    title: str,
    setup: Mapping[str, Any],
    command: str,
    plots: Sequence[Path] = (),
) -> str:
    """One self-contained HTML page of a ``switchyard simulate`` run (plots embedded)."""
    from html import escape

    summaries = [r.summary() for r in results]
    notes = []
    for r, s in zip(results, summaries, strict=True):
        if r.breaches:
            notes.append(
                f"<li><code>{escape(r.policy)}</code> broke its window budget "
                f"{len(r.breaches)} times (worst by ${s['worst_breach_usd']:.3g}).</li>"
            )
        if s["flags"]:
            notes.append(
                f"<li><code>{escape(r.policy)}</code> decision flags: {escape(str(s['flags']))}</li>"
            )
    setup_rows = "".join(
        f"<dt>{escape(str(k))}</dt><dd>{escape(fmt(v))}</dd>" for k, v in setup.items()
    )
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<pre>{escape(command)}</pre>",
        "<h2>Results</h2>",
        html_table(summaries, SUMMARY_COLUMNS),
        f"<ul>{''.join(notes)}</ul>" if notes else "",
        "<h2>Plots</h2>" if plots else "",
        f'<div class="plots">{"".join(_img(p) for p in plots)}</div>' if plots else "",
        "<h2>Setup</h2>",
        f"<dl>{setup_rows}</dl>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"
