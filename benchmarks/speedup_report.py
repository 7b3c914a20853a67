"""Turning the speedup benchmark's raw runs into figures: medians, α, the analytic bound, ratios, table, PNG."""

from __future__ import annotations

import pathlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from benchmarks.contenders import RunOutput  # noqa: E402

TARGET_ONLY = ("hf_target_only", "own_target_only")
PLAIN = (*TARGET_ONLY, "grpc_plain")  # grpc_plain: the stack's γ 0 path
SPECULATIVE = ("hf_assisted", "hf_assisted_all_cores", "reference_loop", "grpc_sequential", "grpc_overlap")
CONTENDERS = (*PLAIN, *SPECULATIVE)
PROJECT_SPECULATIVE = ("reference_loop", "grpc_sequential", "grpc_overlap")  # coupled draws: they sample alike
TEMPERATURES = {"greedy": 0.0, "temperature_1": 1.0}
HEADLINE = "greedy"


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E = (1 − α^(γ+1)) / (1 − α): tokens one round commits when each draft is accepted with probability α."""
    return float(gamma + 1) if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup_bound(alpha: float, gamma: int, c: float) -> float:
    """The analytic speedup over target-only decoding, E / (1 + γc) (Leviathan et al. 2022, eq. 1)."""
    return expected_tokens_per_round(alpha, gamma) / (1 + gamma * c)


def overlapped_ceiling(alpha: float, gamma: int, c: float) -> float:
    """E / max(1, γc): the speedup if every next draft were hidden behind the current verification."""
    return expected_tokens_per_round(alpha, gamma) / max(1.0, gamma * c)


@dataclass
class Repetition:
    """One pass of one contender over the whole prompt set."""

    outputs: list[RunOutput]

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Measurement:
    """Every repetition of one contender at one temperature (or one γ of the sweep)."""

    repetitions: list[Repetition] = field(default_factory=list)

    @property
    def token_ids(self) -> list[list[int]]:
        """The first repetition's completions, one per prompt."""
        return [o.token_ids for o in self.repetitions[0].outputs]

    def summary(self) -> dict:
        outputs = [o for rep in self.repetitions for o in rep.outputs]
        drafted, accepted = sum(o.drafted for o in outputs), sum(o.accepted for o in outputs)
        rounds = sum(o.rounds for o in outputs)
        attempts, hits = sum(o.predraft_attempts for o in outputs), sum(o.predraft_hits for o in outputs)
        per_rep = [rep.tokens_per_s for rep in self.repetitions]
        return {
            "tokens_per_s": statistics.median(per_rep),
            "tokens_per_s_reps": per_rep,
            "seconds_reps": [rep.seconds for rep in self.repetitions],
            "tokens": self.repetitions[0].tokens,
            "rounds": rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "alpha": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + rounds) / rounds if drafted and rounds else None,
            "predraft_hit_rate": hits / attempts if attempts else None,
        }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def figures(summaries: dict[str, dict[str, dict]], gamma: int, c_by_contender: dict[str, float]) -> dict:
    """tokens/s, α, bound, ratios and efficiency per temperature, from per-contender summaries."""
    out = {
        key: {}
        for key in ("tokens_per_s", "alpha", "bound", "overlapped_ceiling", "target_only", "ratios", "efficiency")
    }
    for label, by_name in summaries.items():
        tps = {name: by_name[name]["tokens_per_s"] for name in by_name}
        best = max(TARGET_ONLY, key=lambda name: tps[name])
        baseline, assisted = tps[best], tps["hf_assisted"]
        out["tokens_per_s"][label] = tps
        out["target_only"][label] = {"best": best, "tokens_per_s": baseline}
        out["alpha"][label] = {name: by_name[name]["alpha"] for name in SPECULATIVE}
        out["bound"][label], out["overlapped_ceiling"][label] = {}, {}
        out["ratios"][label], out["efficiency"][label] = {}, {}
        for name in SPECULATIVE:
            alpha, c = by_name[name]["alpha"] or 0.0, c_by_contender[name]
            bound = speedup_bound(alpha, gamma, c)
            out["bound"][label][name] = bound
            out["overlapped_ceiling"][label][name] = overlapped_ceiling(alpha, gamma, c)
            out["efficiency"][label][name] = _ratio(tps[name] / baseline, bound)
        for name in CONTENDERS:
            out["ratios"][label][f"{name}_vs_target_only"] = _ratio(tps[name], baseline)
            if name != "hf_assisted":
                out["ratios"][label][f"{name}_vs_hf_assisted"] = _ratio(tps[name], assisted)
    return out


def summary_table(report: dict) -> str:
    """A fixed-width table: one row per contender, greedy and temperature 1 side by side."""
    labels = list(report["tokens_per_s"])
    header = f"{'contender':<21}" + "".join(
        f" | {label:<13} {'tok/s':>7} {'×target':>7} {'×HF-as':>6} {'α':>5} {'bound':>5} {'eff':>5}" for label in labels
    )
    lines = [header, "-" * len(header)]
    for name in CONTENDERS:
        row = f"{name:<21}"
        for label in labels:
            ratios = report["ratios_by_temperature"][label]
            alpha = report["alpha"][label].get(name)
            cells = [
                report["tokens_per_s"][label][name],
                ratios.get(f"{name}_vs_target_only"),
                ratios.get(f"{name}_vs_hf_assisted", 1.0),
                alpha,
                report["bound"][label].get(name),
                report["efficiency_by_temperature"][label].get(name),
            ]
            formats = ("7.1f", "7.2f", "6.2f", "5.2f", "5.2f", "5.2f")
            row += f" | {'':<13} " + " ".join(
                f"{'–':>{int(f.split('.')[0])}}" if v is None else f"{v:{f}}" for v, f in zip(cells, formats)
            )
        lines.append(row)
    steps = report["step_times_ms"]
    lines.append("")
    lines.append(
        "per-step time, ms (batch 1, one token, warm cache): bare forward / LoadedModel.forward / KVSession.extend step"
    )
    for result in steps.values():
        for side in ("target", "draft"):
            t = result[side]
            lines.append(
                f"  {side:<6} {result['threads']} thread(s): {t['bare_forward_ms']:.2f} / "
                f"{t['runtime_forward_ms']:.2f} ({t['runtime_overhead_pct']:+.0f}%) / "
                f"{t['session_step_ms']:.2f} ({t['session_overhead_pct']:+.0f}%); "
                f"verify γ+1 block {t['verify_block_ms']:.2f}"
            )
        lines.append(f"  c = {result['c']:.3f} at {result['threads']} thread(s)")
    sweep = report["gamma_sweep"]["points"]
    if sweep:
        lines.append("")
        lines.append("γ sweep (greedy): γ  " + "  ".join(f"{p['gamma']:>5}" for p in sweep))
        for name in report["gamma_sweep"]["contenders"]:
            lines.append(f"  {name:<15} speedup " + "  ".join(f"{p[name]['speedup']:5.2f}" for p in sweep))
            lines.append(f"  {'':<15} α       " + "  ".join(f"{(p[name]['alpha'] or 0):5.2f}" for p in sweep))
            lines.append(f"  {'':<15} bound   " + "  ".join(f"{p[name]['bound']:5.2f}" for p in sweep))
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> pathlib.Path:
    """Left: tokens/s by contender (greedy and temperature 1). Right: speedup vs γ, measured and bound."""
    figure, (bars, sweep) = plt.subplots(1, 2, figsize=(14, 5.5))
    labels = list(report["tokens_per_s"])
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [report["tokens_per_s"][label][name] for name in CONTENDERS]
        xs = [x + (i - (len(labels) - 1) / 2) * width for x in range(len(CONTENDERS))]
        drawn = bars.bar(xs, values, width, label=label)
        ratios = [report["ratios_by_temperature"][label][f"{name}_vs_target_only"] for name in CONTENDERS]
        bars.bar_label(drawn, [f"{r:.2f}×" for r in ratios], fontsize=7)
    bars.set_xticks(range(len(CONTENDERS)), [n.replace("_", "\n", 1) for n in CONTENDERS], fontsize=7)
    bars.set_ylabel("tokens/s (median of repetitions)")
    bars.set_title("tokens/s by contender (labels: × best target-only)")
    bars.legend()
    bars.grid(True, axis="y", alpha=0.3)

    points = report["gamma_sweep"]["points"]
    gammas = [p["gamma"] for p in points]
    for name, color in zip(report["gamma_sweep"]["contenders"], ("tab:blue", "tab:green", "tab:red")):
        sweep.plot(gammas, [p[name]["speedup"] for p in points], "o-", color=color, label=f"{name} measured")
        sweep.plot(
            gammas, [p[name]["bound"] for p in points], "--", color=color, alpha=0.7, label=f"{name} bound E/(1+γc)"
        )
    sweep.axhline(1.0, color="gray", linewidth=1)
    sweep.set_xticks(gammas)
    sweep.set_xlabel("γ (num_speculative_tokens)")
    sweep.set_ylabel("speedup vs best target-only (greedy)")
    sweep.set_title("speedup vs γ")
    sweep.grid(True, alpha=0.3)
    sweep.legend(fontsize=8)
    config = report["config"]
    figure.suptitle(
        f"{pathlib.Path(config['target']).name} / {pathlib.Path(config['draft']).name}, "
        f"{config['threads']} thread(s) per core group, {config['prompts']} {config.get('prompt_set', 'code')} "
        "prompts × "
        f"{config['max_new_tokens']} new tokens"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def first_mismatches(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> list[dict]:
    """Per prompt where two sets of completions differ: the prompt index and the first differing position."""
    found = []
    for index, (a, b) in enumerate(zip(reference, other)):
        if list(a) != list(b):
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append({"prompt": index, "position": position})
    return found


def agreement_checks(
    measurements: dict, sweep_outputs: dict[str, list[list[int]]], primary: str = "code"
) -> tuple[dict, dict]:
    """From prompt set -> temperature -> contender -> Measurement: the greedy completions by prompt set (the
    primary set's with the γ sweep's), and whether every contender's greedy completions equal the project's plain
    loop's and the project's three speculative paths sample alike at temperature 1, on each prompt set."""
    greedy_ids, mismatches, sampled_alike = {}, {}, True
    for set_name, by_label in measurements.items():
        ids = {name: by_label["greedy"][name].token_ids for name in CONTENDERS}
        greedy_ids[set_name] = {**ids, **sweep_outputs} if set_name == primary else ids
        reference = greedy_ids[set_name]["own_target_only"]
        mismatches[set_name] = {
            name: found for name, other in greedy_ids[set_name].items() if (found := first_mismatches(reference, other))
        }
        sampled = [by_label["temperature_1"][name].token_ids for name in PROJECT_SPECULATIVE]
        sampled_alike = sampled_alike and all(ids == sampled[0] for ids in sampled)
    checks = {
        "greedy_outputs_identical": not any(mismatches.values()),
        "greedy_mismatches": mismatches[primary],
        "greedy_mismatches_grounded": mismatches.get("grounded", {}),
        "sampled_project_outputs_identical": sampled_alike,
    }
    return checks, greedy_ids
