"""twin_scale.png: the scale run at a glance, every panel labelled simulated.

Top row: tokens/s against concurrency for the scaled stack and 1 x 1, speculative and plain; time to first token
p50 and p99 (speculative) on both; how busy each pinned core group was. Bottom row: sessions each replica of the
scaled stack took (speculative); calls a model step batched on each replica, scaled stack against 1 x 1.
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


def _busy_bars(axis, levels: dict, labels: list[str], scaled_name: str) -> None:
    """Cores' worth of CPU each pinned core group used, per level, stack and mode."""
    runs = [(stack, mode) for stack in ("1x1", scaled_name) for mode in STYLES]
    groups = sorted(
        {cpus for stacks in levels.values() for cpus in stacks["1x1"]["spec"]["host"]["busy_cores_by_cpus"]}
    )
    width = 0.8 / (len(runs) * len(groups))
    for index, label in enumerate(labels):
        for slot, ((stack, mode), cpus) in enumerate((run, cpus) for run in runs for cpus in groups):
            value = levels[label][stack][mode]["host"]["busy_cores_by_cpus"].get(cpus, 0.0)
            x = index - 0.4 + slot * width
            name = f"{stack} {mode}, cpus {cpus}"
            axis.bar(x, value, width * 0.9, color=f"C{slot}", label=name if index == 0 else None)
    axis.axhline(1.0, color="k", linewidth=0.8)
    axis.set_xticks(range(len(labels)), labels)
    axis.set_title("busy cores by pinned group (1.0 = one core; simulated)")
    axis.set_ylabel("CPU seconds / wall second")
    axis.legend(fontsize=7, ncol=2)


def plot(report: dict, path: pathlib.Path) -> pathlib.Path:
    levels = report["levels"]
    scaled = report["config"]["draft_replicas"], report["config"]["verify_replicas"]
    scaled_name = f"{scaled[0]}x{scaled[1]}"
    values = sorted(int(label[1:]) for label in levels)
    labels = [f"c{v}" for v in values]
    figure, ((throughput, ttft, busy), (sessions, batching, unused)) = plt.subplots(2, 3, figsize=(20, 10))
    figure.delaxes(unused)
    _busy_bars(busy, levels, labels, scaled_name)
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
        axis.legend(fontsize=7, ncol=2, loc="upper left")
    figure.suptitle(f"{report['label']}\n{report['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
