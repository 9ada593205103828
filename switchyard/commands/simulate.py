"""``switchyard simulate`` and ``switchyard experiment``: the simulator from the command line.

Zero setup: no Kafka, no Redis. The same ``Router`` objects as the service run over a
simulated cluster in virtual time (``sim/``); this file only resolves paths, builds the
inputs and prints.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import typer

from routing.window_defaults import SHED_AFTER_SLO, SHED_BACKLOG
from switchyard.commands.router import POLICY_HELP
from wiring.paths import REPO_ROOT, shared_data, vendored_data

CLUSTERS_DIR = REPO_ROOT / "configs" / "clusters"
RESULTS_DIR = REPO_ROOT / "docs" / "results"
DEFAULT_DATA = ("routing", "llmrouter_dc9", "scores_long.csv.gz")
PAPER = {
    "ontime": "paper A: +33% AUC of OnTimeUtility over the best baseline",
    "batching": "paper B: batch over per-query up to +4% (random) and +24% (adversarial); per-query breaks the budget",
    "robust": "paper B: robust over point +1–14% depending on the estimator",
    "allocation": "paper B: optimised allocation up to +3% over fixed; 177 GPUs instead of 800 to match DeepSeek-Chat",
    "tradeoff": "paper A: δ trades utility against SLO attainment (a curve, no single number)",
    "prefix": "issue 14 targets: prefix-aware batch-ilp-sfs >= 30% lower TTFT p50 than prefix-agnostic at equal or better quality, higher OnTimeUtility than prefix-affinity",
}


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _default_data(data: Path | None, fmt: str | None) -> tuple[Path, str]:
    if data is None:
        return vendored_data(*DEFAULT_DATA), fmt or "long"
    if fmt is None:
        fmt = "irt-wide" if "irt" in data.name or data.parent.name.startswith("irt") else "long"
        if data.suffix == ".jsonl":
            fmt = "nq-records"
    return data, fmt


def cluster_for_models(models: list[str]) -> Path:
    """The shipped cluster config whose model names are exactly the data's."""
    from schemas import ClusterConfig

    want = set(models)
    for p in sorted(CLUSTERS_DIR.glob("*.yaml")):
        if {m.name for m in ClusterConfig.from_file(p).models} == want:
            return p
    raise ValueError(
        f"no cluster config in {CLUSTERS_DIR} serves exactly the data's models {sorted(want)}; pass --cluster"
    )


def paper_a_cluster(models: list[str]) -> Path | None:
    """A shipped paper-A-shaped cluster (``paper_a_*.yaml``) serving a subset of the data's models."""
    from schemas import ClusterConfig

    for p in sorted(CLUSTERS_DIR.glob("paper_a_*.yaml")):
        if {m.name for m in ClusterConfig.from_file(p).models} <= set(models):
            return p
    return None


def _arrivals(
    spec: str, duration_s: float | None, start_s: float, rng: np.random.Generator
) -> tuple[Any, Any, str]:
    """(arrival times, the trace they replay or None, a label) from ``--trace``."""
    from sim import traffic

    kind, _, rest = spec.partition(":")
    if kind == "poisson":
        rate = float(rest or 5.0)
        return traffic.poisson_arrivals(rate, duration_s or 600.0, rng), None, f"Poisson {rate:g}/s"
    if kind == "mmpp":
        vals = [float(x) for x in rest.split(",") if x] or [5.0]
        mmpp = traffic.MMPPSpec.bursty(*vals)
        t, _ = traffic.mmpp_arrivals(mmpp, duration_s or 600.0, rng)
        return (
            t,
            None,
            f"MMPP mean {mmpp.mean_rate_per_s:g}/s (rates {', '.join(f'{r:.3g}' for r in mmpp.rates_per_s)})",
        )
    if kind == "servegen":
        group = rest or "m-small"
        win = traffic.load_servegen(
            shared_data("traces", "servegen", "servegen_client_windows.csv.gz"), "language", group
        )
        return (
            traffic.servegen_arrivals(win, start_s, duration_s or 600.0, rng),
            None,
            f"ServeGen language/{group}",
        )
    path = traffic.resolve_trace(spec, shared_data("traces"))
    tr = traffic.load_trace(path)
    if start_s or duration_s:
        tr = tr.window(start_s, duration_s or tr.duration_s + 1)
    return tr.arrival_s, tr, f"trace {path.name}"


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate(
        cluster: Path = typer.Option(
            CLUSTERS_DIR / "llmrouter_dc9.yaml", help="Cluster YAML (schemas.ClusterConfig)"
        ),
        trace: str = typer.Option(
            "azure-conv",
            help="azure-conv | azure-code | mooncake | a trace CSV | poisson:RATE | mmpp:RATE[,RATIO,SHARE,BURST_S] | servegen:GROUP",
        ),
        data: Path = typer.Option(None, help="Routing data (default: vendored llmrouter_dc9)"),
        format: str = typer.Option(None, "--format", help="irt-wide | long | nq-records"),
        models_csv: Path = typer.Option(
            None, help="Per-model prices (default: models.csv beside the data)"
        ),
        policy: list[str] = typer.Option(
            ["batch-ilp-sfs"], help=POLICY_HELP + "; repeat to compare several"
        ),
        policy_opt: list[str] = typer.Option(
            [],
            "--policy-opt",
            help="A policy knob as key=value (repeat), for every --policy: e.g. delta=0.1, "
            "gap_tol=0.01, robust=false; the effective values are printed",
        ),
        predictor: Path = typer.Option(
            None, help="Quality predictor artefact (default: train gbdt on 70% of the data)"
        ),
        rate_scale: float = typer.Option(1.0, help="Replay the arrivals this many times as fast"),
        duration_s: float = typer.Option(
            None, help="Seconds of traffic (default: the whole trace, 600 for synthetic)"
        ),
        start_s: float = typer.Option(0.0, help="Start this far into the trace"),
        slo: str = typer.Option(
            "lognormal:400,0.5",
            help="TTFT SLO distribution (ms): fixed:X | uniform:A,B | lognormal:MEDIAN,SIGMA | choice:A,B,...",
        ),
        window_s: float = typer.Option(0.05, help="Batching window (s)"),
        max_batch: int = typer.Option(64, help="Most queries per window"),
        budget_usd_per_query: float = typer.Option(
            None, help="Window budget per query in it (USD); none: unlimited"
        ),
        shed_backlog: int = typer.Option(
            SHED_BACKLOG,
            min=0,
            help="Load shedding, as `switchyard router --shed-backlog`: past this many "
            "waiting queries shed the excess, earliest deadline first; 0: off",
        ),
        shed_after_slo: float = typer.Option(
            SHED_AFTER_SLO,
            min=0.0,
            help="Load shedding, as `switchyard router --shed-after-slo`: shed a query that "
            "waited this many times its TTFT SLO; 0: off",
        ),
        utility_lambda: float = typer.Option(
            20.0, help="λ in utility = score − λ·cost (quality per USD)"
        ),
        seed: int = typer.Option(0),
        plots: Path = typer.Option(None, help="Write PNG plots into this folder"),
        report: Path = typer.Option(None, help="Write a markdown report to this file"),
        html: Path = typer.Option(
            None, help="Write the report as one HTML page with its plots embedded"
        ),
        feature_cache: bool = typer.Option(
            True,
            help="Predict quality and length of the workload's texts once, up front (same "
            "decisions; decision time then excludes featurisation)",
        ),
        as_json: bool = typer.Option(
            False, "--json", help="Print one JSON object instead of the table"
        ),
    ) -> None:
        """Run routing policies over real traffic on a simulated cluster."""
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from loaders.predictor import load_predictor
        from loaders.profiles import profiles_for
        from offline.datasets import load_routing_data
        from routing.datasets import split_by_query
        from routing.policies.registry import effective_options, parse_options
        from routing.quality import train_predictor
        from schemas import ClusterConfig
        from sim import report as rep
        from sim.cluster import SimCluster
        from sim.evaluator import EvalConfig, evaluate
        from sim.experiments import CachedLength, CachedQuality, make_policy, workload_for
        from sim.traffic import SloSpec, TrafficError, scale_rate

        console = Console(stderr=as_json, width=None if sys.stdout.isatty() else 160)
        try:
            cfg = ClusterConfig.from_file(cluster)
            profiles = profiles_for(cfg)
            data_path, fmt = _default_data(data, format)
            rd = load_routing_data(data_path, fmt, models_csv)
            if predictor is not None:
                pred, test = load_predictor(predictor), rd
            else:
                train, test = split_by_query(rd, 0.3, seed)
                console.print(
                    f"training a gbdt quality predictor on {train.n} queries of {data_path.name} …"
                )
                pred = train_predictor(train, "gbdt", n_replicates=10, seed=seed)
            rng = np.random.default_rng(seed)
            arrivals, replay, label = _arrivals(trace, duration_s, start_s, rng)
            if rate_scale != 1.0:
                arrivals = scale_rate(arrivals, rate_scale)
                label += f" ×{rate_scale:g}"
            lengths = None
            if replay is None and (shared_data("traces") / "azure_llm_2023_conv.csv.gz").exists():
                from sim.traffic import load_trace

                lengths = load_trace(shared_data("traces") / "azure_llm_2023_conv.csv.gz")
            w = workload_for(
                test,
                arrivals,
                SloSpec.parse(slo),
                rng,
                replay=replay,
                lengths_from=lengths,
                name="sim",
            )
            quality: Any = pred
            length: Any = None
            if feature_cache:
                quality = CachedQuality(pred, w.texts)
                length = CachedLength(pred.length, w.texts, w.prompt_tokens)
            ecfg = EvalConfig(
                window_s=window_s,
                max_batch=max_batch,
                budget_usd_per_query=budget_usd_per_query,
                utility_lambda=utility_lambda,
                shed_backlog=shed_backlog,
                shed_after_slo=shed_after_slo,
            )
            console.print(
                "window config: "
                + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(ecfg).items()),
                highlight=False,
            )
            options = parse_options(policy_opt)
            for p in policy:
                shown = ", ".join(f"{k}={v}" for k, v in effective_options(p, **options).items())
                console.print(f"{p}: options {shown or 'none'}", highlight=False)
            routers = [
                make_policy(
                    p, cfg, quality, utility_lambda, length=length, profiles=profiles, **options
                )
                for p in policy
            ]
        except (OSError, ValueError, KeyError, TrafficError) as exc:
            _fail(str(exc))
            return
        results = []
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=as_json,
        ) as bar:
            for name, router in zip(policy, routers, strict=True):
                task = bar.add_task(f"{name:16s}", total=w.n)
                res = evaluate(
                    router,
                    SimCluster(cfg, seed=seed, profiles=profiles),
                    w,
                    ecfg,
                    progress=lambda done, total, t=task: bar.update(t, completed=done),  # type: ignore[misc]
                )
                results.append(res)
        summaries = [r.summary() for r in results]
        setup = {
            "cluster": str(cluster),
            "instances": len(cfg.instances),
            "traffic": label,
            "queries": w.n,
            "span_s": round(w.duration_s, 1),
            "data": data_path.name,
            "slo_ms": slo,
            "window_s": window_s,
            "max_batch": max_batch,
            "budget_usd_per_query": budget_usd_per_query,
            "shed_backlog": shed_backlog,
            "shed_after_slo": shed_after_slo,
            "utility_lambda": utility_lambda,
            "seed": seed,
            "feature_cache": feature_cache,
        }
        if as_json:
            typer.echo(json.dumps({"setup": setup, "results": summaries}, indent=2, default=float))
        else:
            console.print(rep.rich_table(summaries, rep.SUMMARY_COLUMNS, title=label))
            for s in summaries:
                console.print(f"{s['policy']}: simulated in {s['sim_wall_s']:.1f} s wall")
        pngs: list[Path] = []
        scratch = None
        if html is not None and plots is None:  # plots only for the page: a folder removed after
            import tempfile

            scratch = tempfile.TemporaryDirectory(prefix="switchyard-plots-")
            plots = Path(scratch.name)
        if plots is not None:
            plots.mkdir(parents=True, exist_ok=True)
            pngs.append(
                rep.plot_ttft_cdf(results, plots / "ttft_cdf.png", float(np.median(w.slo_ms)))
            )
            pngs.append(rep.plot_timeline(results, w.arrival_s, plots / "timeline.png"))
        if report is not None:
            cmd = "switchyard simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            text = rep.simulate_report(
                results,
                title=f"Simulation: {label}",
                setup=setup,
                command=cmd,
                plots=pngs,
                report_path=report,
            )
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(text, encoding="utf-8")
        if html is not None:
            cmd = "switchyard simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            page = rep.simulate_html(
                results, title=f"Simulation: {label}", setup=setup, command=cmd, plots=pngs
            )
            html.parent.mkdir(parents=True, exist_ok=True)
            html.write_text(page, encoding="utf-8")
            console.print(f"wrote {html}")
        if scratch is not None:
            scratch.cleanup()

    @app.command("experiment")
    def experiment(
        name: str = typer.Argument(
            ..., help="ontime | batching | robust | allocation | tradeoff | prefix"
        ),
        data: Path = typer.Option(None, help="Routing data (default: vendored llmrouter_dc9)"),
        format: str = typer.Option(None, "--format", help="irt-wide | long | nq-records"),
        models_csv: Path = typer.Option(
            None, help="Per-model prices (default: models.csv beside the data)"
        ),
        trace: str = typer.Option(
            "azure-conv", help="Trace whose request sizes synthetic arrivals take"
        ),
        cluster: Path = typer.Option(
            None, help="Cluster YAML (default: the shipped one for the data's models)"
        ),
        quick: bool = typer.Option(False, help="A small, fast run"),
        delta: float = typer.Option(
            None,
            help="ontime: δ of latency-aware and batch-ilp-sfs (default: each policy's own)",
        ),
        seeds: int = typer.Option(
            None, help="ontime: traffic seeds from --seed on (default: 3; quick: 2)"
        ),
        shift: str = typer.Option(
            None,
            help="robust: serve a task mix unlike training: these tasks (comma-separated) cut "
            "to 5% of their training queries and over-represented when served",
        ),
        seed: int = typer.Option(0),
        out_dir: Path = typer.Option(RESULTS_DIR, help="Where the table, JSON and PNG go"),
        as_json: bool = typer.Option(False, "--json", help="Print the result JSON"),
    ) -> None:
        """Reproduce one paper figure; writes <name>.md, <name>.json and <name>.png."""
        from rich.console import Console

        from loaders.profiles import profiles_for
        from offline.datasets import load_routing_data
        from schemas import ClusterConfig
        from sim import experiments as ex
        from sim import report as rep
        from sim.traffic import resolve_trace

        console = Console(stderr=True)
        if name not in ex.EXPERIMENTS:
            _fail(f"unknown experiment {name!r}; choose one of {', '.join(ex.EXPERIMENTS)}")
        data_path, fmt = _default_data(data, format)
        try:
            if cluster is None and name == "prefix":
                cluster = CLUSTERS_DIR / "prefix_dc9.yaml"
            if cluster is None:
                models = load_routing_data(data_path, fmt, models_csv).models
                cluster = paper_a_cluster(models) if name in ("ontime", "tradeoff") else None
                cluster = cluster or cluster_for_models(models)
            profiles = profiles_for(ClusterConfig.from_file(cluster))
        except (OSError, ValueError) as exc:
            _fail(str(exc))
            return
        if name == "prefix" and trace == "azure-conv":
            trace = "mooncake"  # the trace with prefix block hashes
        trace_path = resolve_trace(trace, shared_data("traces"))
        cmd = "switchyard experiment " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        tag = "" if data is None else f"-{data_path.parent.name}"
        shift_tasks = tuple(t for t in (shift or "").split(",") if t)
        if shift_tasks and name != "robust":
            _fail("--shift applies to the robust experiment only")
        suffix = (
            tag
            + (f"-delta{delta:g}" if delta is not None else "")
            + (f"-shift-{shift_tasks[0]}" if shift_tasks else "")
            + ("-quick" if quick else "")
        )
        inputs = ex.ExperimentInputs(
            data_path,
            fmt,
            models_csv,
            cluster,
            out_dir,
            trace_path if trace_path.exists() else None,
            quick,
            seed,
            cmd,
            tag=suffix,
            delta=delta,
            seeds=seeds,
            shift=shift_tasks,
            loader=load_routing_data,
            profiles=profiles,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        result = ex.run(name, inputs, progress=lambda msg: console.print(f"[dim]{msg}[/dim]"))
        wall = time.perf_counter() - started
        payload = {
            "experiment": name,
            "command": cmd,
            "quick": quick,
            "seed": seed,
            "data": data_path.name,
            "cluster": cluster.name,
            "wall_s": round(wall, 1),
            "paper": PAPER[name],
            **result.json,
        }
        (out_dir / f"{name}{suffix}.json").write_text(
            json.dumps(payload, indent=2, default=float) + "\n"
        )
        md = [
            f"# {name}{' (quick)' if quick else ''}",
            "",
            "```",
            cmd,
            "```",
            "",
            f"Paper: {PAPER[name]}.",
            "",
            f"Data: `{data_path.name}`; cluster: `{cluster.name}`; seed {seed}; {wall:.0f} s wall.",
            "",
            result.markdown(),
            "",
            *result.notes,
            "",
            f"![{name}]({result.png.name})",
            "",
        ]
        (out_dir / f"{name}{suffix}.md").write_text("\n".join(md), encoding="utf-8")
        if as_json:
            typer.echo(json.dumps(payload, indent=2, default=float))
        else:
            console.print(
                rep.rich_table(result.rows, result.columns, title=f"{name} — {PAPER[name]}")
            )
            console.print(f"wrote {out_dir / (name + suffix)}.{{md,json,png}}")
