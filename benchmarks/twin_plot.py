"""twin.png: the twin benchmark's figures at a glance, every panel labelled simulated.

Top left, tokens/s at concurrency 1 per profile (ideal plain, plain and speculative through the stack, and the
ideal times the sequential bound and the overlapped ceiling); top right, CPU time per round by process; bottom left,
throughput against concurrency, speculative and plain; bottom right, speculative over plain time to first token
(p50 and p99) against concurrency, the demo pair's beside the twin's.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

C1_BARS = ("ideal plain", "plain", "speculative", "ideal × bound", "ideal × ceiling")


def _concurrency_axis(axis, levels: dict) -> list[int]:
    values = sorted(int(label[1:]) for label in levels)
    axis.set_xscale("log", base=2)
    axis.set_xticks(values, [str(v) for v in values])
    axis.set_xlabel("concurrency")
    return values


def plot(report: dict, path: pathlib.Path) -> pathlib.Path:
    profiles = report["profiles"]
    figure, ((c1, cpu), (throughput, ttft)) = plt.subplots(2, 2, figsize=(14, 10))
    width = 0.8 / max(1, len(profiles))
    for index, (name, profile) in enumerate(profiles.items()):
        at = profile["concurrency_1"]
        ideal, analytic = at["ideal_plain_tokens_per_s"], profile["analytic"]
        values = [
            ideal,
            at["0"]["plain"]["tokens_per_s"],
            at["0"]["speculative"]["tokens_per_s"],
            ideal * analytic["sequential_bound"]["speedup"],
            ideal * analytic["overlapped_ceiling"]["speedup"],
        ]
        xs = [x + (index - (len(profiles) - 1) / 2) * width for x in range(len(C1_BARS))]
        c1.bar_label(c1.bar(xs, values, width, label=name), [f"{v / ideal:.2f}×" for v in values], fontsize=7)
        rounds = profile["per_round"]
        for offset, mode in enumerate(("plain", "speculative")):
            bottom = 0.0
            x = index * 2.5 + offset
            for process, color in zip(("coordinator", "verify", "draft"), ("tab:blue", "tab:orange", "tab:green")):
                value = rounds[mode]["cpu_ms"][process]
                cpu.bar(x, value, 0.8, bottom=bottom, color=color, label=process if x == 0 else None)
                bottom += value
            cpu.text(x, bottom, f"{name}\n{mode}", ha="center", va="bottom", fontsize=7)
        levels = profile["sweep"]
        concurrency = _concurrency_axis(throughput, levels)
        for mode, style in (("spec", "o-"), ("plain", "s--")):
            throughput.plot(
                concurrency, [levels[f"c{c}"][mode]["tokens_per_s"] for c in concurrency], style, label=f"{name} {mode}"
            )
        _ttft_lines(ttft, name, levels)
    if report.get("demo_pair"):
        _ttft_lines(ttft, "demo pair (CPU, real models)", report["demo_pair"]["sweep"])
    c1.set_xticks(range(len(C1_BARS)), C1_BARS, fontsize=8)
    c1.set_ylabel("tokens/s (labels: × ideal plain)")
    c1.set_title("concurrency 1, no network delay (simulated)")
    cpu.set_ylabel("CPU ms per round")
    cpu.set_xticks([])
    cpu.margins(y=0.15)
    cpu.set_title("host CPU per round by process, concurrency 1 (simulated)")
    throughput.set_ylabel("output tokens/s")
    throughput.set_title("throughput against concurrency (simulated)")
    ttft.axhline(1.05, color="gray", linestyle=":", label="p50 floor at c1 (1.05)")
    ttft.axhline(1.1, color="black", linestyle=":", label="p99 floor (1.1)")
    ttft.set_ylabel("speculative / plain time to first token")
    ttft.set_title("time to first token, speculative over plain")
    for axis in (c1, cpu, throughput, ttft):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    config = report["config"]
    figure.suptitle(
        f"SIMULATED accelerator twin (no GPU): α {config['acceptance']}, {config['vocab']} ids served, "
        f"{config['max_new_tokens']} new tokens, code prompts"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _ttft_lines(axis, name: str, levels: dict) -> None:
    concurrency = _concurrency_axis(axis, levels)
    for stat, style in (("ttft_p50", "o-"), ("ttft_p99", "^--")):
        axis.plot(
            concurrency, [levels[f"c{c}"]["spec_vs_plain"][stat] for c in concurrency], style, label=f"{name} {stat}"
        )
