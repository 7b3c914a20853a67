"""constrained.png: what a constraint costs speculative decoding, at a glance.

Left: tokens/s of constrained speculative, unconstrained speculative and constrained plain decoding, per
constraint (medians over runs, side by side in one stack). Right: the two ratios the floors judge, each run a dot
and the median a bar, with the floors drawn in.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ("constrained", "unconstrained", "constrained_plain")
RATIOS = ("vs_unconstrained", "vs_constrained_plain")


def plot(report: dict, path: pathlib.Path) -> pathlib.Path:
    constraints = report["constraints"]
    names = list(constraints)
    figure, (speed, ratios) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(MODES)
    for slot, mode in enumerate(MODES):
        values = [constraints[name]["modes"][mode]["tokens_per_s"] for name in names]
        xs = [index - 0.4 + (slot + 0.5) * width for index in range(len(names))]
        speed.bar(xs, values, width * 0.9, label=mode.replace("_", " "))
    speed.set_xticks(range(len(names)), [name.replace("_", " ") for name in names])
    speed.set_ylabel("tokens/s (median of runs)")
    speed.set_title(f"{report['pair']} pair, γ {report['gamma']}, {report['gamma_policy']}")
    speed.legend(fontsize=8)
    width = 0.8 / len(RATIOS)
    floors = report["floors"]  # also when a run of some constraints has no headline
    for slot, ratio in enumerate(RATIOS):
        for index, name in enumerate(names):
            x = index - 0.4 + (slot + 0.5) * width
            ratios.bar(
                x,
                constraints[name]["ratio_median"][ratio],
                width * 0.9,
                color=f"C{slot}",
                alpha=0.6,
                label=ratio.replace("_", " ") if index == 0 else None,
            )
            per_run = constraints[name]["ratio_per_run"][ratio]
            ratios.plot([x] * len(per_run), per_run, "k.", markersize=4)
        ratios.axhline(floors[ratio], color=f"C{slot}", linestyle="--", linewidth=1, label=f"floor {floors[ratio]}")
    ratios.set_xticks(range(len(names)), [name.replace("_", " ") for name in names])
    ratios.set_ylabel("constrained speculative / other (dots: runs)")
    ratios.set_title("constrained speculative decoding against the others")
    ratios.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
