"""GPU step benchmark: what one target, verify and draft step costs on one GPU, each way the step can run, and
the whole stack on that GPU, speculative against plain.

Random-weight models with the shapes of Llama-3.1-8B (target, bf16) and Llama-3.2-1B (draft), built on the
device without initialisation cost (benchmarks/gpu_models.py). Two phases, each its own call (a lent machine gives
a command at most 10 minutes):

- `--phase steps` (the default): at batch 1, 4 and 16 after 512 cached positions it times a plain target step
  (1 token per row), a γ 4 verify step (5 tokens per row) and a draft step (1 token per row), each as HF eager
  `forward` over a StaticCache, that forward replayed from a CUDA graph, the project's step (KVSession +
  run_forwards), and the project's step replayed from its CUDA graphs, against the bandwidth bound, weight bytes /
  measured device-to-device copy bandwidth (benchmarks/gpu_timing.py). Writes gpu_steps.json (and gpu_steps.png
  where matplotlib imports);
- `--phase stack`: the whole stack on the same GPU (draft, verify and coordinator processes, benchmarks/gpu_stack.py)
  at concurrency 1 and 16, γ 4 against γ 0, greedy. Writes gpu_stack.json.

Everything counts against --budget-s (480 s): building and loading the models (self-test, graph capture, cold
compiles) and each timed attempt; attempts that would not fit are skipped and named, and when the budget runs out
mid-attempt the run stops there. The report is written into --out-dir (default $OUT) after every phase and batch, so
a run cut short keeps what it measured.

The stack phase needs the project's serving dependencies, which the GPU machine lacks: carry them as wheels made
here from requirements.txt (`python -m benchmarks.device_wheels`, benchmarks/README.md). Without them the stack phase
is skipped with the missing module named. `--dry-run` runs a phase on CPU with tiny shapes, in about half a minute
(tests/benchmarks/test_gpu_step.py).
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script: the helpers and the project import from the root

from benchmarks.device_run import Clock, PhasedReport, environment, out_dir_of, run_within_budget  # noqa: E402
from benchmarks.gpu_models import (  # noqa: E402
    LLAMA_1B,
    LLAMA_8B,
    TINY_DRAFT,
    TINY_TARGET,
    LlamaShape,
    build_random,
    save_model_dir,
    weight_bytes,
    word_tokenizer,
)
from benchmarks.gpu_timing import (  # noqa: E402
    StaticCacheStep,
    copy_bandwidth,
    load_project_model,
    project_graph_step,
    project_step,
    time_step,
)

CONTENDERS = {
    "hf_eager_static_cache": "transformers eager forward over a StaticCache",
    "hf_cuda_graph_static_cache": "the same HF forward captured once in a CUDA graph (torch.cuda.graph), replayed",
    "project_step": "KVSession.plan_extend per row + one run_forwards (packed LoadedModel.forward_rows) + rollback",
    "project_step_cuda_graphs": "the project's step replayed from CUDA graphs",
}
PHASES = ("steps", "stack")


@dataclass(frozen=True)
class Plan:
    """What one run measures and how long it may take."""

    target: LlamaShape
    draft: LlamaShape
    batches: tuple[int, ...]
    context: int  # cached positions before every timed step
    gamma: int  # drafted tokens per verify step
    warmup: int
    repeats: int
    copy_bytes: int  # buffer size of the bandwidth measurement
    prompt_tokens: int  # stack phase: prompt length
    new_tokens: int  # stack phase: max_new_tokens per request
    prompts_at_concurrency_1: int
    attempt_reserve_s: float  # least time left for another batch's attempts to start

    @property
    def samples(self) -> tuple[int, int]:
        """(warm-up, timed) calls per contender."""
        return self.warmup, self.repeats


GPU_PLAN = Plan(LLAMA_8B, LLAMA_1B, (1, 4, 16), 512, 4, 3, 20, 1 << 30, 128, 64, 4, 20.0)
DRY_PLAN = Plan(TINY_TARGET, TINY_DRAFT, (1, 4, 16), 16, 4, 1, 3, 1 << 20, 8, 6, 2, 0.5)
STACK_CONCURRENCY = (1, 16)
STACK_KV_BUDGET = "0.4"  # share of the GPU's memory each service may hold: the draft and verify services share it


def step_cases(plan: Plan) -> dict[str, tuple[str, int]]:
    """Step name -> (which model, drafted tokens fed after each row's last token)."""
    return {"target_plain": ("target", 0), "target_verify": ("target", plan.gamma), "draft_plain": ("draft", 0)}


def attempt(clock: Clock, label: str, measure) -> dict:
    """One contender's figures, or the error that stopped it (the run goes on; a spent budget, BudgetSpent, is no
    Exception and stops it)."""
    try:
        figures = measure()
    except Exception as error:  # a contender that fails on this machine is reported, not fatal
        clock.log(f"    {label}: failed: {type(error).__name__}: {error}")
        return {"error": f"{type(error).__name__}: {error}"[:1000]}
    clock.log(f"    {label}: {figures['median_ms']:.3f} ms")
    return figures


def measure_hf(clock: Clock, plan: Plan, model, case: str, drafted: int, steps: dict, report: PhasedReport) -> None:
    """The HF contenders of one step case at every batch, into steps[case][batch]."""
    for batch in plan.batches:
        figures = steps[case].setdefault(str(batch), {})
        if clock.left() < plan.attempt_reserve_s:
            figures["skipped"] = "time budget spent"
            continue
        clock.log(f"  {case} batch {batch}")
        tokens = drafted + 1
        figures["hf_eager_static_cache"] = attempt(
            clock,
            "hf eager",
            lambda: time_step(StaticCacheStep(model, batch, plan.context, tokens), model.device, *plan.samples),
        )
        if model.device.type == "cuda":
            figures["hf_cuda_graph_static_cache"] = attempt(
                clock,
                "hf cuda graph",
                lambda: time_step(
                    StaticCacheStep(model, batch, plan.context, tokens).captured(), model.device, *plan.samples
                ),
            )
        else:
            figures["hf_cuda_graph_static_cache"] = {"error": "not available: CUDA graphs need a CUDA device"}
        release_memory()
        report.write()


def measure_project(
    clock: Clock, plan: Plan, loaded, case: str, drafted: int, steps: dict, report: PhasedReport
) -> None:
    """The project's contenders of one step case at every batch, into steps[case][batch]."""
    for batch in plan.batches:
        figures = steps[case][str(batch)]
        if "skipped" in figures or clock.left() < plan.attempt_reserve_s:
            figures["skipped"] = "time budget spent"
            continue
        if isinstance(loaded, str):
            figures["project_step"] = figures["project_step_cuda_graphs"] = {"error": f"no LoadedModel: {loaded}"}
            continue
        clock.log(f"  {case} batch {batch} (project)")
        figures["project_step"] = attempt(
            clock,
            "project step",
            lambda: time_step(project_step(loaded, batch, plan.context, drafted), loaded.device, *plan.samples),
        )
        graph_step = project_graph_step(loaded, batch, plan.context, drafted)
        figures["project_step_cuda_graphs"] = (
            {"error": f"not available: {graph_step}"}
            if isinstance(graph_step, str)
            else attempt(clock, "project cuda graphs", lambda: time_step(graph_step, loaded.device, *plan.samples))
        )
        release_memory()
        report.write()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_steps(clock: Clock, plan: Plan, models: dict, tokenizer, report: PhasedReport) -> dict:
    """The copy bandwidth, then every step case at every batch, HF contenders on a model before the project wraps
    it; the figures stand in the report as they come."""
    device = models["target"].device
    bandwidth = copy_bandwidth(device, plan.copy_bytes, repeats=20)
    clock.log(f"device-to-device copy: {bandwidth / 1e9:.1f} GB/s (read + written)")
    cases = step_cases(plan)
    steps: dict = {"copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 2), **{case: {} for case in cases}}
    report.data["phases"]["steps"] = steps  # filled in place, written after every batch
    for role, model in models.items():
        role_cases = {case: drafted for case, (owner, drafted) in cases.items() if owner == role}
        bound_ms = round(weight_bytes(model) / bandwidth * 1e3, 4)
        for case in role_cases:
            steps[case]["bandwidth_bound_ms"] = bound_ms
            steps[case]["tokens_per_row"] = role_cases[case] + 1
        for case, drafted in role_cases.items():
            measure_hf(clock, plan, model, case, drafted, steps, report)
        started = time.monotonic()
        try:
            loaded = load_project_model(model, tokenizer, getattr(plan, role).name)
        except Exception as error:  # reported per contender below; the HF figures stand
            loaded = f"{type(error).__name__}: {error}"
        steps[f"{role}_load_s"] = round(time.monotonic() - started, 2)  # self-test, pool, graph capture
        for case, drafted in role_cases.items():
            measure_project(clock, plan, loaded, case, drafted, steps, report)
    return steps


def stack_phase(clock: Clock, plan: Plan, dirs: dict, device: torch.device) -> dict:
    """The whole stack on this device, speculative against plain, at each concurrency."""
    from benchmarks.gpu_stack import run_stack
    from benchmarks.gpu_timing import random_ids

    service_args = (
        ["--device", str(device), "--dtype", "bfloat16", "--kv-cache-budget", STACK_KV_BUDGET]
        if device.type == "cuda"
        else ["--threads", "1"]
    )
    prompts = {
        concurrency: random_ids(count, plan.prompt_tokens, plan.target.vocab, seed=100 + concurrency).tolist()
        for concurrency, count in zip(STACK_CONCURRENCY, (plan.prompts_at_concurrency_1, 16))
    }
    report = run_stack(
        dirs["target"], dirs["draft"], service_args, prompts, plan.new_tokens, plan.gamma, clock.deadline - 20.0
    )
    return {"service_args": service_args, "prompt_tokens": plan.prompt_tokens, **report}


def write_png(path: pathlib.Path, steps: dict, plan: Plan) -> str:
    """Bars of median step ms per contender and batch, one panel per step case, the bandwidth bound as a line;
    returns the path, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"not written: {error}"
    cases = {case: figures for case, figures in steps.items() if case in step_cases(plan)}
    figure, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
    width = 0.8 / len(CONTENDERS)
    for axis, (case, figures) in zip(axes[0], cases.items()):
        for index, contender in enumerate(CONTENDERS):
            values = [figures.get(str(b), {}).get(contender, {}).get("median_ms", 0.0) for b in plan.batches]
            positions = [b + (index - (len(CONTENDERS) - 1) / 2) * width for b in range(len(plan.batches))]
            axis.bar(positions, values, width, label=contender)
            for position, value in zip(positions, values):
                if not value:  # not measured: the JSON says why
                    axis.text(position, 0, "n/a", rotation=90, fontsize=6, ha="center", va="bottom")
        axis.axhline(figures["bandwidth_bound_ms"], color="black", linestyle="--", label="bandwidth bound")
        axis.set_xticks(range(len(plan.batches)), [f"batch {b}" for b in plan.batches])
        axis.set_title(f"{case}: {figures['tokens_per_row']} token(s) per row")
        axis.set_ylabel("median ms per step")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def build_models(clock: Clock, plan: Plan, device: torch.device, dtype: torch.dtype, report: PhasedReport) -> dict:
    """Both random models on the device (and their sizes into the report); returns role -> model."""
    clock.log(f"building {plan.target.name} and {plan.draft.name} on {device} ({dtype})")
    models = {
        "target": build_random(plan.target, device, dtype, seed=1),
        "draft": build_random(plan.draft, device, dtype, seed=2),
    }
    report.data["models"] = {
        role: {
            **getattr(plan, role).describe(),
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes(model),
        }
        for role, model in models.items()
    }
    return models


def steps_run(clock: Clock, plan: Plan, device: torch.device, dtype: torch.dtype, report: PhasedReport) -> None:
    """The steps phase: the models built, every step case timed, the PNG drawn."""
    models: dict = {}

    def build() -> dict:
        models.update(build_models(clock, plan, device, dtype, report))
        return {"roles": list(models)}

    report.run("build", build)
    if models:
        tokenizer = word_tokenizer(plan.target.vocab)
        with torch.inference_mode():
            report.run("steps", lambda: measure_steps(clock, plan, models, tokenizer, report))
        steps = report.data["phases"]["steps"]
        report.data["png"] = write_png(report.path.with_suffix(".png"), steps, plan) if "error" not in steps else None
        report.write()


def stack_run(clock: Clock, plan: Plan, device: torch.device, dtype: torch.dtype, report: PhasedReport, args) -> None:
    """The stack phase: the models built and saved for the services, then the stack run on them."""
    from benchmarks.gpu_stack import missing_stack_module

    clock.log("checking that the services import here")
    blocked = missing_stack_module()
    if blocked is not None:
        report.skip("stack", blocked)
        clock.log(f"stack phase skipped: {blocked}")
        return
    work_dir = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="gpu-step-"))
    try:
        dirs: dict = {}

        def save() -> dict:
            models = build_models(clock, plan, device, dtype, report)
            tokenizer = word_tokenizer(plan.target.vocab)
            dirs.update({role: work_dir / role for role in models})
            return {role: {"save_s": round(save_model_dir(m, tokenizer, dirs[role]), 2)} for role, m in models.items()}

        report.run("save", save)
        release_memory()
        if dirs:
            report.run("stack", lambda: stack_phase(clock, plan, dirs, device))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--phase", choices=PHASES, default="steps", help="what this call measures")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None, help="where the reports go (default $OUT)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="where the stack's model dirs go")
    parser.add_argument("--budget-s", type=float, default=480.0, help="everything stops at this many seconds")
    args = parser.parse_args(argv)
    clock = Clock(args.budget_s)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        torch.set_num_threads(1)
    out_dir = out_dir_of(args.out_dir, "gpu-step")
    report = PhasedReport(
        out_dir / f"gpu_{args.phase}.json",
        clock,
        benchmark="gpu_step",
        phase=args.phase,
        dry_run=args.dry_run,
        budget_s=args.budget_s,
        plan={**{k: v for k, v in asdict(plan).items() if k not in ("target", "draft")}, "batches": list(plan.batches)},
        contenders=CONTENDERS,
        environment=environment(device),
    )
    if args.phase == "steps":
        return run_within_budget(report, lambda: steps_run(clock, plan, device, dtype, report))
    return run_within_budget(report, lambda: stack_run(clock, plan, device, dtype, report, args))


if __name__ == "__main__":
    main()
