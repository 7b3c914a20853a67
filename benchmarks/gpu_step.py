"""GPU step benchmark: what one target, verify and draft step costs on one GPU, each way the step can run, and
the whole stack on that GPU, speculative against plain.

Random-weight models with the shapes of Llama-3.1-8B (target, bf16) and Llama-3.2-1B (draft), built on the
device without initialisation cost (benchmarks/gpu_models.py). At batch 1, 4 and 16 after 512 cached positions
it times a plain target step (1 token per row), a γ 4 verify step (5 tokens per row) and a draft step (1 token
per row), each as HF eager `forward` over a StaticCache, that forward replayed from a CUDA graph, the project's
step (KVSession + run_forwards), the project's step in CUDA graphs (reported unavailable until the runtime has
one), against the bandwidth bound, weight bytes / measured device-to-device copy bandwidth
(benchmarks/gpu_timing.py). Then the whole stack on the same GPU (draft, verify and coordinator processes,
benchmarks/gpu_stack.py) at concurrency 1 and 16, γ 4 against γ 0, greedy. Writes gpu_step.json and, where
matplotlib imports, gpu_step.png. Phases that would overrun --budget-s (8 minutes) are skipped and named.

Needs torch, transformers, triton and grpcio; the stack phase also the project's serving dependencies, which
the GPU machine lacks, so carry them as wheels. Once, in the repository root of the checkout that travels:

    echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \\
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \\
      grpcio-reflection==1.85.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\
      opentelemetry-semantic-conventions==0.66b2 redis==8.2.0 dnspython==2.9.2

(about 9 MB). Then on the GPU machine, carrying `.whl`, with a 600 s limit (about 5-7 minutes expected), as one
line:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 timeout 570 python3
      benchmarks/gpu_step.py 2>&1 | tee $OUT/gpu_step.log; cp benchmarks/results/gpu_step.* $OUT/

Without the wheels the stack phase is skipped with the missing module named and the rest still runs.
`--dry-run` runs every phase on CPU with tiny shapes, in about half a minute on an idle core
(tests/benchmarks/test_gpu_step.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import transformers

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script: the helpers and the project import from the root

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
    stack_reserve_s: float  # time the stack phase needs: the step phase stops short of it

    @property
    def samples(self) -> tuple[int, int]:
        """(warm-up, timed) calls per contender."""
        return self.warmup, self.repeats


GPU_PLAN = Plan(LLAMA_8B, LLAMA_1B, (1, 4, 16), 512, 4, 3, 20, 1 << 30, 128, 64, 4, 240.0)
DRY_PLAN = Plan(TINY_TARGET, TINY_DRAFT, (1, 4, 16), 16, 4, 1, 3, 1 << 20, 8, 6, 2, 20.0)
STACK_CONCURRENCY = (1, 16)


class Clock:
    """Seconds since the run started, the budget's deadline, and progress lines stamped with both."""

    def __init__(self, budget_s: float):
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


def step_cases(plan: Plan) -> dict[str, tuple[str, int]]:
    """Step name -> (which model, drafted tokens fed after each row's last token)."""
    return {"target_plain": ("target", 0), "target_verify": ("target", plan.gamma), "draft_plain": ("draft", 0)}


def attempt(clock: Clock, label: str, measure) -> dict:
    """One contender's figures, or the error that stopped it (the run goes on)."""
    try:
        figures = measure()
    except Exception as error:  # a contender that fails on this machine is reported, not fatal
        clock.log(f"    {label}: failed: {type(error).__name__}: {error}")
        return {"error": f"{type(error).__name__}: {error}"[:1000]}
    clock.log(f"    {label}: {figures['median_ms']:.3f} ms")
    return figures


def measure_hf(clock: Clock, plan: Plan, model, case: str, drafted: int, steps: dict, reserve_s: float) -> None:
    """The HF contenders of one step case at every batch, into steps[case][batch]."""
    for batch in plan.batches:
        figures = steps[case].setdefault(str(batch), {})
        if clock.left() < reserve_s:
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


def measure_project(clock: Clock, plan: Plan, loaded, case: str, drafted: int, steps: dict, reserve_s: float) -> None:
    """The project's contenders of one step case at every batch, into steps[case][batch]."""
    for batch in plan.batches:
        figures = steps[case][str(batch)]
        if "skipped" in figures or clock.left() < reserve_s:
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


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_steps(clock: Clock, plan: Plan, models: dict, tokenizer, bandwidth: float, reserve_s: float) -> dict:
    """Every step case at every batch, HF contenders on a model before the project wraps it."""
    cases = step_cases(plan)
    steps: dict = {case: {} for case in cases}
    for role, model in models.items():
        role_cases = {case: drafted for case, (owner, drafted) in cases.items() if owner == role}
        for case, drafted in role_cases.items():
            measure_hf(clock, plan, model, case, drafted, steps, reserve_s)
        try:
            loaded = load_project_model(model, tokenizer, getattr(plan, role).name)
        except Exception as error:  # reported per contender below; the HF figures stand
            loaded = f"{type(error).__name__}: {error}"
        for case, drafted in role_cases.items():
            measure_project(clock, plan, loaded, case, drafted, steps, reserve_s)
        bound_ms = round(weight_bytes(model) / bandwidth * 1e3, 4)
        for case in role_cases:
            steps[case]["bandwidth_bound_ms"] = bound_ms
            steps[case]["tokens_per_row"] = role_cases[case] + 1
    return steps


def stack_phase(clock: Clock, plan: Plan, dirs: dict, device: torch.device) -> dict:
    """The whole stack on this device, speculative against plain, at each concurrency."""
    from benchmarks.gpu_stack import run_stack
    from benchmarks.gpu_timing import random_ids

    service_args = ["--device", str(device), "--dtype", "bfloat16"] if device.type == "cuda" else ["--threads", "1"]
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
    figure, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 4.5), squeeze=False)
    width = 0.8 / len(CONTENDERS)
    for axis, (case, figures) in zip(axes[0], steps.items()):
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


def environment(device: torch.device) -> dict:
    import importlib.metadata
    import subprocess

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": version("triton"),
        "grpcio": version("grpcio"),
        "protobuf": version("protobuf"),
        "git_commit": commit.stdout.strip() or None,
    }


def build_phase(clock: Clock, plan: Plan, device: torch.device, dtype: torch.dtype, report: dict) -> dict:
    """Both random models on the device (and their sizes into the report); returns role -> model."""
    started = time.monotonic()
    clock.log(f"building {plan.target.name} and {plan.draft.name} on {device} ({dtype})")
    models = {
        "target": build_random(plan.target, device, dtype, seed=1),
        "draft": build_random(plan.draft, device, dtype, seed=2),
    }
    report["models"] = {
        role: {
            **getattr(plan, role).describe(),
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes(model),
        }
        for role, model in models.items()
    }
    report["phases_s"]["build"] = round(time.monotonic() - started, 2)
    return models


def save_phase(clock: Clock, models: dict, tokenizer, work_dir: pathlib.Path, report: dict) -> dict:
    """The models as HF directories for the services; returns role -> directory."""
    started = time.monotonic()
    clock.log(f"saving the models for the services under {work_dir}")
    dirs = {role: work_dir / role for role in models}
    report["save_s"] = {role: round(save_model_dir(m, tokenizer, dirs[role]), 2) for role, m in models.items()}
    report["phases_s"]["save"] = round(time.monotonic() - started, 2)
    return dirs


def steps_phase(clock: Clock, plan: Plan, models: dict, tokenizer, reserve_s: float, report: dict) -> None:
    """The copy bandwidth, then every step case (and the bound) into the report."""
    started = time.monotonic()
    device = models["target"].device
    bandwidth = copy_bandwidth(device, plan.copy_bytes, repeats=20)
    report["copy_bandwidth_gb_per_s"] = round(bandwidth / 1e9, 2)
    clock.log(f"device-to-device copy: {bandwidth / 1e9:.1f} GB/s (read + written)")
    with torch.inference_mode():
        report["steps"] = measure_steps(clock, plan, models, tokenizer, bandwidth, reserve_s)
    report["phases_s"]["steps"] = round(time.monotonic() - started, 2)


def write_report(out_dir: pathlib.Path, report: dict, plan: Plan, clock: Clock) -> None:
    """gpu_step.json and the PNG as they stand (written after the steps too, so a run cut short keeps them)."""
    report["png"] = write_png(out_dir / "gpu_step.png", report["steps"], plan)
    report["wall_s"] = round(time.monotonic() - clock.started, 2)
    (out_dir / "gpu_step.json").write_text(json.dumps(report, indent=2) + "\n")
    clock.log(f"wrote {out_dir / 'gpu_step.json'}; png: {report['png']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None, help="where gpu_step.json/png go")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="where the stack's model dirs go")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip what would run past this")
    parser.add_argument("--no-stack", action="store_true", help="skip the stack phase")
    args = parser.parse_args(argv)
    clock = Clock(args.budget_s)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    if args.dry_run:
        torch.set_num_threads(1)
    temp_results = pathlib.Path(tempfile.gettempdir()) / "specdec-benchmarks"
    out_dir = args.out_dir or (temp_results if args.dry_run else REPO_ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "benchmark": "gpu_step",
        "dry_run": args.dry_run,
        "plan": {
            **{k: v for k, v in asdict(plan).items() if k not in ("target", "draft")},
            "batches": list(plan.batches),
        },
        "contenders": CONTENDERS,
        "environment": environment(device),
        "phases_s": {},
    }

    stack_blocked = "--no-stack given" if args.no_stack else None
    if stack_blocked is None:
        from benchmarks.gpu_stack import missing_stack_module

        clock.log("checking that the services import here")
        stack_blocked = missing_stack_module()
    clock.log(f"stack phase: {'skipped: ' + stack_blocked if stack_blocked else 'will run'}")

    tokenizer = word_tokenizer(plan.target.vocab)
    models = build_phase(clock, plan, device, torch.float32 if args.dry_run else torch.bfloat16, report)
    work_dir = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="gpu-step-"))
    if stack_blocked is None:
        dirs = save_phase(clock, models, tokenizer, work_dir, report)
    steps_phase(clock, plan, models, tokenizer, plan.stack_reserve_s if stack_blocked is None else 10.0, report)
    del models
    release_memory()
    report["stack"] = {"skipped": stack_blocked or "not run yet"}
    write_report(out_dir, report, plan, clock)

    if stack_blocked is None and clock.left() < plan.stack_reserve_s / 2:
        stack_blocked = f"time budget: {clock.left():.0f}s left"
        report["stack"] = {"skipped": stack_blocked}
    if stack_blocked is None:
        started = time.monotonic()
        clock.log("stack phase")
        try:
            report["stack"] = stack_phase(clock, plan, dirs, device)
        except Exception as error:  # a stack that fails to start is reported with its log tail
            report["stack"] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
            clock.log(f"stack phase failed: {report['stack']['error']}")
        report["phases_s"]["stack"] = round(time.monotonic() - started, 2)
    if args.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    write_report(out_dir, report, plan, clock)
    return report


if __name__ == "__main__":
    main()
