"""twin_scale.png: the scale run at a glance, every panel labelled simulated.

Top left, tokens/s against concurrency for the scaled stack and 1 x 1, speculative and plain; top right, time to
first token p50 and p99 (speculative) on both; bottom left, sessions each replica of the scaled stack took
(speculative); bottom right, calls a model step batched on each replica, scaled stack against 1 x 1.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLES = {"spec": "-", "plain": "--"}


def _concurrency_axis(axis, values: list[int]) -> None:
    axis.set_xscale("log", base=2)
    axis.set_xticks(values, [str(v) for v in values])
    axis.set_xlabel("concurrency")


def _replica_bars(axis, levels: dict, stack: str, field: str, offset: float, width: float, label_of) -> None:
    """One bar group per concurrency level, one bar per replica of `stack` (speculative runs)."""
    for index, stacks in enumerate(levels.values()):
        replicas = stacks[stack]["spec"]["placement"]["replicas"]
        for slot, (name, figures) in enumerate(replicas.items()):
            value = figures[field] or 0
            x = index + offset + slot * width
            axis.bar(x, value, width * 0.9, color=f"C{slot}", label=label_of(name) if index == 0 else None)


def plot(report: dict, path: pathlib.Path) -> pathlib.Path:
    levels = report["levels"]
    scaled = report["config"]["draft_replicas"], report["config"]["verify_replicas"]
    scaled_name = f"{scaled[0]}x{scaled[1]}"
    values = sorted(int(label[1:]) for label in levels)
    labels = [f"c{v}" for v in values]
    figure, ((throughput, ttft), (sessions, batching)) = plt.subplots(2, 2, figsize=(14, 10))
    for stack, color in ((scaled_name, "C0"), ("1x1", "C3")):
        for mode, style in STYLES.items():
            throughput.plot(
                values,
                [levels[c][stack][mode]["tokens_per_s"] for c in labels],
                style,
                marker="o",
                color=color,
                label=f"{stack} {mode}",
            )
        for key, style in (("ttft_p50_ms", "-"), ("ttft_p99_ms", ":")):
            ttft.plot(
                values,
                [levels[c][stack]["spec"][key] for c in labels],
                style,
                marker="o",
                color=color,
                label=f"{stack} spec {key[5:8]}",
            )
    for axis, title, unit in (
        (throughput, "output tokens/s (simulated)", "tokens/s"),
        (ttft, "time to first token, speculative (simulated)", "ms"),
    ):
        _concurrency_axis(axis, values)
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.legend(fontsize=8)
    count = len(next(iter(levels.values()))[scaled_name]["spec"]["placement"]["replicas"])
    width = 0.8 / count
    _replica_bars(sessions, levels, scaled_name, "sessions", -0.4, width, lambda name: name)
    sessions.set_title(f"sessions each replica took, {scaled_name}, speculative (simulated)")
    sessions.set_ylabel("sessions opened")
    _replica_bars(batching, levels, scaled_name, "calls_per_step", -0.4, width, lambda name: f"{scaled_name} {name}")
    for index, label in enumerate(labels):
        for slot, figures in enumerate(levels[label]["1x1"]["spec"]["placement"]["replicas"].values()):
            y = figures["calls_per_step"] or 0
            batching.hlines(y, index - 0.4, index + 0.4, colors="k", linestyles=":" if slot else "-")
    batching.plot([], [], "k-", label="1x1 draft")
    batching.plot([], [], "k:", label="1x1 verify")
    batching.set_title("calls batched a model step, speculative (simulated)")
    batching.set_ylabel("calls per step")
    for axis in (sessions, batching):
        axis.set_xticks(range(len(labels)), labels)
        axis.legend(fontsize=7, ncol=2, loc="lower right")
    figure.suptitle(f"{report['label']}\n{report['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
