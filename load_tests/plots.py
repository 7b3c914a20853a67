"""PNG plots of a report: latency percentiles and throughput against load, speculative and plain together.

One pair of figures per (load kind, prompt set): `latency_<kind>_<set>.png` (TTFT, ITL, TPOT and e2e; p50
solid, p90 dashed, p99 dotted) and `throughput_<kind>_<set>.png` (output tokens/s, requests/s, and the
spec/plain ratios with the break-even line at 1). A level run several times (--repeats) is drawn at the median
of its runs. These are of the stack under test; with a baseline stack, `throughput_vs_baseline.png` sets each
level's throughput on both stacks side by side, every run drawn, with the median ratio.
"""

from __future__ import annotations

import pathlib
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib import ticker  # noqa: E402

from load_tests.report import STACK, load_label  # noqa: E402

MODE_COLORS = {"spec": "tab:blue", "plain": "tab:orange"}
PERCENTILE_STYLES = {"p50": "-", "p90": "--", "p99": ":"}
LATENCY_PANELS = (
    ("ttft", "time to first token"),
    ("itl", "inter-chunk latency (one round)"),
    ("tpot", "time per output token"),
    ("e2e", "end-to-end latency"),
)


def _x(level: dict) -> float:
    return level["concurrency"] if level["load"] == "concurrency" else level["rate_rps"]


def _x_axis(axis, kind: str, levels: list[dict]) -> None:
    if kind == "concurrency":
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({_x(lv) for lv in levels}))
        axis.xaxis.set_major_formatter(ticker.ScalarFormatter())
        axis.xaxis.set_minor_locator(ticker.NullLocator())
        axis.set_xlabel("concurrent requests (closed loop)")
    else:
        axis.set_xlabel("arrival rate, requests/s (open loop, Poisson)")
    axis.grid(True, alpha=0.3)


def _series(levels: list[dict], mode: str, value) -> tuple[list[float], list[float]]:
    """One mode's points against load: per load the value, or the median over the runs of a repeated level."""
    by_x: dict[float, list[float]] = {}
    for level in levels:
        if level["mode"] == mode and value(level) is not None:
            by_x.setdefault(_x(level), []).append(value(level))
    xs = sorted(by_x)
    return xs, [statistics.median(by_x[x]) for x in xs]


def latency_figure(levels: list[dict], kind: str, title: str, path: pathlib.Path) -> pathlib.Path:
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (metric, name) in zip(axes.flat, LATENCY_PANELS):
        for mode, color in MODE_COLORS.items():
            for stat, style in PERCENTILE_STYLES.items():
                xs, ys = _series(levels, mode, lambda lv: lv["latency_ms"][metric][stat])
                if xs:
                    axis.plot(xs, ys, style, color=color, marker="o", markersize=3, label=f"{mode} {stat}")
        axis.set_title(name)
        axis.set_ylabel("ms")
        _x_axis(axis, kind, levels)
    axes.flat[0].legend(fontsize=8, ncol=2)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def throughput_figure(
    levels: list[dict], comparisons: list[dict], kind: str, title: str, path: pathlib.Path
) -> pathlib.Path:
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, key, label in (
        (axes[0], "output_token_throughput_tps", "output tokens/s"),
        (axes[1], "request_throughput_rps", "completed requests/s"),
    ):
        for mode, color in MODE_COLORS.items():
            xs, ys = _series(levels, mode, lambda lv: lv[key])
            if xs:
                axis.plot(xs, ys, "-", color=color, marker="o", label=mode)
            runs = [(_x(lv), lv[key]) for lv in levels if lv["mode"] == mode]
            if len(runs) > len(xs):  # repeated levels: every run, faint, around the median
                axis.plot([x for x, _ in runs], [y for _, y in runs], "x", color=color, alpha=0.5)
        axis.set_title(label)
        axis.legend(fontsize=8)
        _x_axis(axis, kind, levels)
    ratio_axis = axes[2]
    for key, label, color in (
        ("e2e_p50_ratio", "median e2e latency", "tab:red"),
        ("output_token_throughput_ratio", "output-token throughput", "tab:green"),
    ):
        points = sorted((_x(row), row[key]) for row in comparisons if row[key] is not None)
        if points:
            ratio_axis.plot([p[0] for p in points], [p[1] for p in points], "-", marker="o", color=color, label=label)
    ratio_axis.axhline(1.0, color="grey", linewidth=1)
    ratio_axis.set_title("spec / plain")
    if comparisons:
        ratio_axis.legend(fontsize=8)
    _x_axis(ratio_axis, kind, levels)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def baseline_figure(rows: list[dict], baseline: str, title: str, path: pathlib.Path) -> pathlib.Path:
    """Output tokens/s of each (load, prompt set, mode) on the stack and on the baseline: bars at the medians,
    a dot per run, and the median stack/baseline ratio above each pair."""
    figure, axis = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.5))
    for index, row in enumerate(rows):
        for offset, key, color, label in (
            (-0.2, "stack_tps", "tab:blue", "stack"),
            (0.2, "baseline_tps", "tab:grey", f"baseline: {baseline}"),
        ):
            axis.bar(
                index + offset,
                statistics.median(row[key]),
                width=0.4,
                color=color,
                alpha=0.7,
                label=label if index == 0 else None,
            )
            axis.plot([index + offset] * len(row[key]), row[key], "o", color="black", markersize=3)
        axis.annotate(
            f"×{row['output_token_throughput_ratio']:.2f}",
            (index, max(row["stack_tps"])),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
        )
    axis.set_xticks(range(len(rows)), [f"{row['prompt_set']} {row['mode']}\n{load_label(row)}" for row in rows])
    axis.set_ylabel("output tokens/s")
    axis.set_ylim(top=axis.get_ylim()[1] * 1.12)
    figure.legend(fontsize=8, loc="lower center", ncol=2)
    axis.grid(True, axis="y", alpha=0.3)
    axis.set_title(title)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_report(report: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the figures of every (load kind, prompt set) in the report, and the baseline figure when there is a
    baseline stack; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = report["server"].get("target_model_id", "")
    paths = []
    tested = [lv for lv in report["levels"] if lv.get("stack", STACK) == STACK]
    groups = sorted({(lv["load"], lv["prompt_set"]) for lv in tested})
    for kind, prompt_set in groups:
        levels = [lv for lv in tested if lv["load"] == kind and lv["prompt_set"] == prompt_set]
        rows = [
            row
            for row in report["comparisons"]
            if row["load"] == kind and row["prompt_set"] == prompt_set and row.get("stack", STACK) == STACK
        ]
        title = (
            f"{prompt_set} prompts, max_new_tokens {report['config']['max_new_tokens']}, "
            f"γ {report['config']['num_speculative_tokens']} vs plain — {pathlib.Path(target).name}"
        )
        paths.append(latency_figure(levels, kind, title, out_dir / f"latency_{kind}_{prompt_set}.png"))
        paths.append(throughput_figure(levels, rows, kind, title, out_dir / f"throughput_{kind}_{prompt_set}.png"))
    if report.get("baseline_comparisons"):
        title = f"stack vs baseline, max_new_tokens {report['config']['max_new_tokens']} — {pathlib.Path(target).name}"
        paths.append(
            baseline_figure(
                report["baseline_comparisons"],
                report["config"]["baseline"],
                title,
                out_dir / "throughput_vs_baseline.png",
            )
        )
    return paths
