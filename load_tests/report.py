"""Figures per level, spec/plain comparisons, and the JSON, CSV and text forms of a sweep's report.

JSON report (one file, `schema_version` 3):
    config       the sweep's settings (levels, prompt sets, γ, max_new_tokens, bounds, seed, baseline, ...)
    server       the coordinator's Info (models, replicas, default γ, overlap, limits)
    baseline_server  the baseline stack's coordinator Info (None without a baseline)
    environment  host, Python, CPU count, start time (UTC)
    levels       one object per run level, in the order run (LEVEL_FIELDS, `latency_ms` and `speculation`)
    comparisons  one object per (load, prompt set): spec/plain ratios of the median e2e latency, of the
                 output-token throughput, of median TTFT and median TPOT, each the median over the pair's runs
                 (`repeats`), with every run's throughput and e2e ratios and the levels compared; per stack
    baseline_comparisons  one object per (load, prompt set, mode) run on both stacks: stack/baseline ratios of
                 the output-token throughput and of the median e2e latency, medians over the runs, with every
                 run's figures ([] without a baseline)
    requests     one object per request (level id, status, times in ms, tokens, speculation stats)
"""

from __future__ import annotations

import csv
import json
import pathlib
import statistics
from collections import Counter
from collections.abc import Sequence

import numpy as np

from load_tests.generator import RequestResult

STACK, BASELINE = "stack", "baseline"  # a level's `stack`: the stack under test, or the one it is compared with

SCHEMA_VERSION = 3  # 2: levels carry `repeat`; comparisons are medians over a pair's runs; 3: `stack`, baseline
PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e")
LEVEL_FIELDS = (
    "level_id",
    "order",
    "load",
    "concurrency",
    "rate_rps",
    "prompt_set",
    "mode",
    "repeat",
    "stack",
    "num_speculative_tokens",
    "requests",
    "ok",
    "errors",
    "errors_by_status",
    "finish_reasons",
    "stopped_by",
    "wall_s",
    "request_throughput_rps",
    "output_tokens",
    "output_token_throughput_tps",
    "prompt_tokens",
)
SPECULATION_FIELDS = (
    "rounds",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "requests_with_stats",
)


def distribution(values_s: Sequence[float]) -> dict:
    """count, mean, p50/p90/p99 and max of a list of seconds, in milliseconds (None when empty)."""
    if not len(values_s):
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ms = np.asarray(values_s, dtype=float) * 1e3
    return {
        "count": int(ms.size),
        "mean": round(float(ms.mean()), 3),
        **{f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES))},
        "max": round(float(ms.max()), 3),
    }


def latency_figures(results: Sequence[RequestResult]) -> dict:
    """Distributions of TTFT, ITL (pooled over all chunk gaps), TPOT and e2e over the successful requests."""
    ok = [r for r in results if r.ok]
    return {
        "ttft": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl_s]),
        "tpot": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e": distribution([r.e2e_s for r in ok]),
    }


def speculation_figures(results: Sequence[RequestResult]) -> dict:
    """Token-weighted acceptance rate (accepted / drafted) and round-weighted mean accepted length over
    the requests that returned stats; None where nothing was drafted or no stats came back."""
    with_stats = [r for r in results if r.rounds is not None]
    rounds = sum(r.rounds for r in with_stats)
    drafted = sum(r.drafted_tokens for r in with_stats)
    accepted = sum(r.accepted_tokens for r in with_stats)
    committed = sum(r.mean_accepted_length * r.rounds for r in with_stats)
    return {
        "rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round(committed / rounds, 4) if rounds else None,
        "requests_with_stats": len(with_stats),
    }


def summarize_level(identity: dict, results: Sequence[RequestResult], wall_s: float, stopped_by: str) -> dict:
    """One level's report object: `identity` (level_id, order, load, concurrency, rate_rps, prompt_set,
    mode, num_speculative_tokens) plus counts, throughput, latency distributions and speculation figures.
    Throughput divides by the level's wall time (first send to last reply); output tokens count every
    token streamed, failed requests' partial output included."""
    ok = sum(r.ok for r in results)
    output_tokens = sum(r.output_tokens for r in results)
    wall = max(wall_s, 1e-9)
    return {
        **identity,
        "requests": len(results),
        "ok": ok,
        "errors": len(results) - ok,
        "errors_by_status": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "finish_reasons": dict(sorted(Counter(r.finish_reason or "NONE" for r in results if r.ok).items())),
        "stopped_by": stopped_by,
        "wall_s": round(wall_s, 4),
        "request_throughput_rps": round(ok / wall, 4),
        "output_tokens": output_tokens,
        "output_token_throughput_tps": round(output_tokens / wall, 4),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
        "latency_ms": latency_figures(results),
        "speculation": speculation_figures(results),
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def request_record(level_id: str, result: RequestResult) -> dict:
    """One request as it goes into the JSON report (times in ms)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    return {
        "level_id": level_id,
        "index": result.index,
        "status": result.status,
        "error": result.error,
        "start_ms": ms(result.start_s),
        "ttft_ms": ms(result.ttft_s),
        "tpot_ms": ms(result.tpot_s),
        "e2e_ms": ms(result.e2e_s),
        "itl_ms": [ms(gap) for gap in result.itl_s],
        "output_tokens": result.output_tokens,
        "chunks": result.chunks,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "rounds": result.rounds,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
        "acceptance_rate": _round(result.acceptance_rate),
        "mean_accepted_length": _round(result.mean_accepted_length),
        "server_total_ms": ms(result.server_total_s),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 4)


def run_ratios(spec: dict, plain: dict) -> dict:
    """One run's spec/plain ratios (None where a figure is missing)."""
    return {
        "e2e_p50_ratio": _ratio(spec["latency_ms"]["e2e"]["p50"], plain["latency_ms"]["e2e"]["p50"]),
        "output_token_throughput_ratio": _ratio(
            spec["output_token_throughput_tps"], plain["output_token_throughput_tps"]
        ),
        "ttft_p50_ratio": _ratio(spec["latency_ms"]["ttft"]["p50"], plain["latency_ms"]["ttft"]["p50"]),
        "tpot_p50_ratio": _ratio(spec["latency_ms"]["tpot"]["p50"], plain["latency_ms"]["tpot"]["p50"]),
    }


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(statistics.median(present), 4) if present else None


LEVEL_IDENTITY = ("stack", "load", "concurrency", "rate_rps", "prompt_set", "mode")  # what a level runs, but the run


def paired_runs(levels: Sequence[dict], side: str, sides: tuple[str, str]) -> list[tuple[dict, list[dict]]]:
    """Levels that differ only in `side` (a LEVEL_IDENTITY field) and the run: per group its identity without that
    field, and its runs that have both `sides`, in run order, each {side value: level}."""

    def field(level: dict, name: str) -> object:
        return level.get("stack", STACK) if name == "stack" else level[name]  # one stack before schema 3

    by_identity: dict[tuple, dict[int, dict[str, dict]]] = {}
    for level in levels:
        identity = tuple((name, field(level, name)) for name in LEVEL_IDENTITY if name != side)
        by_identity.setdefault(identity, {}).setdefault(level.get("repeat", 0), {})[field(level, side)] = level
    groups = []
    for identity, runs in by_identity.items():
        paired = [run for _, run in sorted(runs.items()) if all(value in run for value in sides)]
        if paired:
            groups.append((dict(identity), paired))
    return groups


def comparisons(levels: Sequence[dict]) -> list[dict]:
    """Per stack and (load, prompt set) with both modes: spec/plain ratios, each the median over the runs that
    have both modes. Below 1 is better for the latency ratios, above 1 for the throughput ratio."""
    rows = []
    for identity, paired in paired_runs(levels, "mode", ("spec", "plain")):
        ratios = [run_ratios(modes["spec"], modes["plain"]) for modes in paired]
        rows.append(
            {
                **identity,
                "repeats": len(paired),
                "spec_level_ids": [modes["spec"]["level_id"] for modes in paired],
                "plain_level_ids": [modes["plain"]["level_id"] for modes in paired],
                **{name: _median([run[name] for run in ratios]) for name in ratios[0]},
                "output_token_throughput_ratios": [run["output_token_throughput_ratio"] for run in ratios],
                "e2e_p50_ratios": [run["e2e_p50_ratio"] for run in ratios],
            }
        )
    return rows


def baseline_comparisons(levels: Sequence[dict]) -> list[dict]:
    """Per (load, prompt set, mode) run on both stacks: stack/baseline ratios of the output-token throughput
    (above 1 favours the stack) and of the median e2e latency (below 1 does), each the median over the runs
    that have both stacks, with every run's figures."""
    rows = []
    for identity, paired in paired_runs(levels, "stack", (STACK, BASELINE)):
        throughput = [
            (s[STACK]["output_token_throughput_tps"], s[BASELINE]["output_token_throughput_tps"]) for s in paired
        ]
        e2e_ratios = [
            _ratio(s[STACK]["latency_ms"]["e2e"]["p50"], s[BASELINE]["latency_ms"]["e2e"]["p50"]) for s in paired
        ]
        throughput_ratios = [_ratio(*pair) for pair in throughput]
        rows.append(
            {
                **identity,
                "repeats": len(paired),
                "output_token_throughput_ratio": _median(throughput_ratios),
                "e2e_p50_ratio": _median(e2e_ratios),
                "output_token_throughput_ratios": throughput_ratios,
                "e2e_p50_ratios": e2e_ratios,
                "stack_tps": [tps for tps, _ in throughput],
                "baseline_tps": [tps for _, tps in throughput],
                "stack_level_ids": [s[STACK]["level_id"] for s in paired],
                "baseline_level_ids": [s[BASELINE]["level_id"] for s in paired],
            }
        )
    return rows


def baseline_headline(report: dict, throughput_floor: float, latency_ceiling: float) -> dict:
    """Whether every (load, prompt set, mode) meets the floor of its stack/baseline throughput ratio and the ceiling of
    its median e2e latency ratio, with the two figures each is the ratio of (medians over the runs)."""
    rows = []
    for row in report["baseline_comparisons"]:
        throughput, latency = row["output_token_throughput_ratio"], row["e2e_p50_ratio"]
        rows.append(
            {
                "level": f"{load_label(row).strip()} {row['prompt_set']} {row['mode']}",
                "stack_tps": _median(row["stack_tps"]),
                "baseline_tps": _median(row["baseline_tps"]),
                "throughput_ratio": throughput,
                "throughput_floor": throughput_floor,
                "e2e_p50_ratio": latency,
                "e2e_p50_ceiling": latency_ceiling,
                "meets": throughput is not None
                and latency is not None
                and throughput >= throughput_floor
                and latency <= latency_ceiling,
            }
        )
    return {"rows": rows, "meets": bool(rows) and all(row["meets"] for row in rows)}


def build_report(
    config: dict,
    server: dict,
    environment: dict,
    levels: list[dict],
    requests: list[dict],
    baseline_server: dict | None = None,
) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "config": config,
        "server": server,
        "baseline_server": baseline_server,
        "environment": environment,
        "levels": levels,
        "comparisons": comparisons(levels),
        "baseline_comparisons": baseline_comparisons(levels),
        "requests": requests,
    }


def write_json(report: dict, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def flat_level(level: dict) -> dict:
    """A level as one CSV row: the plain fields, `<metric>_<stat>_ms` columns, speculation columns, and the
    count dicts as `CODE:n;CODE:n`."""
    row = {}
    for name in LEVEL_FIELDS:
        value = level[name]
        row[name] = ";".join(f"{k}:{v}" for k, v in value.items()) if isinstance(value, dict) else value
    for metric in LATENCY_METRICS:
        for stat, value in level["latency_ms"][metric].items():
            row[f"{metric}_{stat}" + ("" if stat == "count" else "_ms")] = value
    row.update({name: level["speculation"][name] for name in SPECULATION_FIELDS})
    return row


def write_csv(levels: Sequence[dict], path: pathlib.Path) -> pathlib.Path:
    rows = [flat_level(level) for level in levels]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def load_label(level: dict) -> str:
    return f"c={level['concurrency']}" if level["load"] == "concurrency" else f"{level['rate_rps']:g}/s"


def mode_label(level: dict) -> str:
    """A level's mode, and its stack when that is the baseline."""
    return level["mode"] + (f" {BASELINE}" if level.get("stack") == BASELINE else "")


def progress_line(level: dict, total: int) -> str:
    """The line printed when a level finishes."""
    latency, spec = level["latency_ms"], level["speculation"]
    return (
        f"[{level['order'] + 1:>3}/{total}] {load_label(level):>7} {level['prompt_set']:<8} {mode_label(level):<13} "
        f"{level['ok']:>4}/{level['requests']:<4} ok in {level['wall_s']:6.1f}s  "
        f"e2e p50 {_fmt(latency['e2e']['p50']):>6} ms  ttft p50 {_fmt(latency['ttft']['p50']):>5} ms  "
        f"{level['output_token_throughput_tps']:7.1f} tok/s  α {_fmt(spec['acceptance_rate'], '.2f')}"
        + (f"  errors {level['errors_by_status']}" if level["errors"] else "")
    )


def summary_text(report: dict) -> str:
    """A one-screen summary: a row per level, then the spec/plain ratios."""
    config = report["config"]
    lines = [
        f"load test: {len(report['levels'])} levels, prompt sets {', '.join(config['prompt_sets'])}, "
        f"max_new_tokens {config['max_new_tokens']}, γ {config['num_speculative_tokens']} vs 0, "
        f"server {report['server'].get('target_model_id', '?')}",
        f"{'load':>7} {'set':<8} {'mode':<13} {'run':>3} {'ok/req':>9} {'e2e p50':>8} {'e2e p99':>8} {'ttft p50':>8} "
        f"{'tpot p50':>8} {'tok/s':>7} {'req/s':>6} {'α':>5} {'tok/rnd':>7}",
    ]
    for level in sorted(
        report["levels"],
        key=lambda lv: (
            lv["prompt_set"],
            lv["load"],
            lv["concurrency"] or 0,
            lv["rate_rps"] or 0,
            lv["mode"] != "spec",
            lv.get("repeat", 0),
        ),
    ):
        latency, spec = level["latency_ms"], level["speculation"]
        lines.append(
            f"{load_label(level):>7} {level['prompt_set']:<8} {mode_label(level):<13} {level.get('repeat', 0) + 1:>3} "
            f"{str(level['ok']) + '/' + str(level['requests']):>9} {_fmt(latency['e2e']['p50']):>8} "
            f"{_fmt(latency['e2e']['p99']):>8} {_fmt(latency['ttft']['p50']):>8} "
            f"{_fmt(latency['tpot']['p50'], '.1f'):>8} "
            f"{level['output_token_throughput_tps']:>7.1f} {level['request_throughput_rps']:>6.2f} "
            f"{_fmt(spec['acceptance_rate'], '.2f'):>5} {_fmt(spec['mean_accepted_length'], '.2f'):>7}"
        )
    if report["comparisons"]:
        lines.append("spec/plain (latency < 1 and throughput > 1 favour speculation; medians over the runs):")
    for row in report["comparisons"]:
        stack = "baseline " if row.get("stack") == BASELINE else ""
        runs = (
            ""
            if row["repeats"] < 2
            else "  runs tok/s " + " ".join(f"×{_fmt(ratio, '.2f')}" for ratio in row["output_token_throughput_ratios"])
        )
        lines.append(
            f"{load_label(row):>7} {row['prompt_set']:<8} {stack}e2e p50 ×{_fmt(row['e2e_p50_ratio'], '.2f')}  "
            f"tok/s ×{_fmt(row['output_token_throughput_ratio'], '.2f')}  "
            f"ttft p50 ×{_fmt(row['ttft_p50_ratio'], '.2f')}  tpot p50 ×{_fmt(row['tpot_p50_ratio'], '.2f')}" + runs
        )
    if report.get("baseline_comparisons"):
        stack = report["config"].get("stack") or "no extra flags"
        lines.append(
            f"stack/baseline, stack = {stack}, baseline = the stack's flags and {report['config']['baseline']} "
            "(throughput > 1 and latency < 1 favour the stack; medians over the runs):"
        )
    for row in report.get("baseline_comparisons", []):
        runs = " ".join(f"{s:.1f}/{b:.1f}" for s, b in zip(row["stack_tps"], row["baseline_tps"]))
        lines.append(
            f"{load_label(row):>7} {row['prompt_set']:<8} {row['mode']:<5} "
            f"tok/s ×{_fmt(row['output_token_throughput_ratio'], '.2f')}  "
            f"e2e p50 ×{_fmt(row['e2e_p50_ratio'], '.2f')}  runs tok/s {runs}"
        )
    errors = sum(level["errors"] for level in report["levels"])
    if errors:
        totals = Counter()
        for level in report["levels"]:
            totals.update(level["errors_by_status"])
        lines.append(f"errors: {errors} ({', '.join(f'{k} {v}' for k, v in sorted(totals.items()))})")
    return "\n".join(lines)
