"""The first run on a GPU, as one command: does the CUDA path come up as designed, and how fast is a step?

One call on one GPU (an H100: about 5-7 minutes), every result written into --out-dir (default $OUT) as its phase
ends, so a run stopped anywhere keeps what it reached (gpu_check.json). Phases, each reported with its figures or
the error that stopped it:

1. `environment`: the device, torch, CUDA, triton;
2. `noise`: the coupled rule's noise for 80 rows at a 128k vocabulary on the device: device and host ms, and its
   bits against the CPU's (specdec/sampling/coupled_noise.py);
3. `runtime`: an 8B-shaped GQA Llama (random bf16 weights, benchmarks/gpu_models.py) loaded by the runtime:
   packed or not and why, the graphs captured, the KV pool, float32 logits (or why not), load time;
4. `graphs`: a verify step of 4 rows replayed from its CUDA graph against the same step run eagerly (logits
   compared, ms each);
5. `steps`: a plain step and a γ 4 verify step at batch 1 (graphs and eager) against the bandwidth bound (weight
   bytes / measured copy bandwidth); headline: the verify step within 1.5x of the bound;
6. `flex`: compiled FlexAttention through the project's backend (block masks from block tables, the mask's tiles
   as the kernel's) on Llama-3-8B attention shapes (32 query heads on 8 KV heads of 128) over a paged pool, at
   T = 1 ... 256 queries: largest error against a dense SDPA reference, first call (compile) and ms per call;
   at T = 1 and 5 the decode kernel as well, for comparison; whether new steps of a compiled size recompile.

    python3 benchmarks/gpu_check.py --out-dir $OUT     # one GPU; needs torch, transformers, triton only
    python3 benchmarks/gpu_check.py --dry-run          # CPU, tiny shapes, every phase (tests/benchmarks)
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch._dynamo.utils
import torch.nn.functional as F

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script: the helpers and the project import from the root

from benchmarks.device_run import Clock, PhasedReport, environment, out_dir_of, run_within_budget  # noqa: E402
from benchmarks.gpu_models import LLAMA_8B, TINY_TARGET, LlamaShape, build_random, weight_bytes, word_tokenizer  # noqa: E402
from benchmarks.gpu_timing import copy_bandwidth, project_step, synchronize, time_step  # noqa: E402
from specdec.engine.attention.flex_backend import FlexBackend  # noqa: E402
from specdec.engine.attention.flex_layout import Q_TILE, FlexLayout  # noqa: E402
from specdec.engine.attention.selection import AttentionBackendChoice  # noqa: E402
from specdec.engine.cuda_graph_steps import CudaGraphSteps  # noqa: E402
from specdec.engine.float32_head import float32_head_refusal  # noqa: E402
from specdec.engine.model_runtime import LoadedModel, ModelSettings  # noqa: E402
from specdec.engine.packed_step import StaticStep  # noqa: E402
from specdec.sampling.coupled_noise import key_words, noise_from_key_words  # noqa: E402
from specdec.sampling.rules import Stream, _position_key  # noqa: E402

VERIFY_BOUND_CEILING = 1.5  # a γ 4 verify step at batch 1 within this factor of the bandwidth bound
DECODE_COMPARED = (1, 5)  # query counts the decode kernel is also timed at (each one more compile)


@dataclass(frozen=True)
class CheckPlan:
    """The shapes and sizes of one run."""

    heads: int  # attention shapes of the flex phase
    kv_heads: int
    head_dim: int
    block_size: int
    pool_blocks: int
    context: int  # cached positions per row in the flex phase
    query_counts: tuple[int, ...]
    model: LlamaShape
    graph_max_tokens: int  # largest captured bucket (each bucket is a compile and a capture)
    kv_bytes: int
    step_context: int  # cached positions before the graph and step phases' steps
    repeats: int
    noise_rows: int
    noise_vocab: int


GPU_PLAN = CheckPlan(
    32, 8, 128, 16, 2048, 500, (1, 2, 4, 5, 8, 16, 32, 64, 128, 256), LLAMA_8B, 64, 8 << 30, 512, 20, 80, 128_256
)
DRY_PLAN = CheckPlan(4, 2, 16, 16, 64, 40, (1, 5, 17), TINY_TARGET, 32, 1 << 24, 16, 3, 8, 4096)


def flex_phase(plan: CheckPlan, device: torch.device, dtype: torch.dtype) -> dict:
    """Compiled flex through the project's backend against a dense SDPA reference, per query count."""
    generator = torch.Generator().manual_seed(0)
    shape = (plan.kv_heads, plan.pool_blocks + 1, plan.block_size, plan.head_dim)
    keys = torch.randn(shape, generator=generator).to(device, dtype)  # [H_kv, N + 1, B, D]
    values = torch.randn(shape, generator=generator).to(device, dtype)
    backend = FlexBackend(device)
    counters = torch._dynamo.utils.counters
    figures: dict = {"compiled": backend.compiled is not None, "by_queries": {}}
    for queries in plan.query_counts:
        layout, dense_mask = random_step(plan, queries, generator, device)
        query = torch.randn((1, plan.heads, queries, plan.head_dim), generator=generator).to(device, dtype)
        step = StaticStep(None, None, backend, layout)  # what attend reads of a step: its plan
        reference = dense_attention(query, keys, values, dense_mask)  # [T, H, D]
        started = time.perf_counter()
        attended = backend.attend(step, query, keys, values, plan.head_dim**-0.5, None)  # [T, H, D]
        synchronize(device)
        entry = {
            "first_call_s": round(time.perf_counter() - started, 3),
            "max_abs_error": float((attended.float() - reference).abs().max()),
            **time_step(lambda: backend.attend(step, query, keys, values, plan.head_dim**-0.5, None), device, 3, 10),
        }
        if backend.compiled is not None and queries in DECODE_COMPARED:
            entry["decode_kernel"] = decode_kernel_figures(backend, query, keys, values, layout, reference, device)
        figures["by_queries"][str(queries)] = entry
        print(f"  T={queries}: {entry}", flush=True)
    graphs_before = counters["stats"]["unique_graphs"]
    queries = plan.query_counts[-1]
    for _ in range(2):  # new steps of a size compiled already: new layouts, new masks
        layout, _ = random_step(plan, queries, generator, device)
        query = torch.randn((1, plan.heads, queries, plan.head_dim), generator=generator).to(device, dtype)
        backend.attend(StaticStep(None, None, backend, layout), query, keys, values, plan.head_dim**-0.5, None)
    figures["graphs_compiled_by_new_steps_of_a_seen_size"] = counters["stats"]["unique_graphs"] - graphs_before
    return figures


def decode_kernel_figures(backend, query, keys, values, layout, reference, device) -> dict:
    """The compiler's decode kernel on the same step (the mask's tiles, without forcing the main kernel)."""
    heads, num_blocks, block_size, head_dim = keys.shape
    mask = layout.block_mask(None, num_blocks)

    def call():
        return backend.compiled(
            query,
            keys.view(1, heads, -1, head_dim),
            values.view(1, heads, -1, head_dim),
            block_mask=mask,
            scale=head_dim**-0.5,
            enable_gqa=True,
            kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": block_size},
        )

    try:
        error = float((call()[0].transpose(0, 1).float() - reference).abs().max())
        return {"max_abs_error": error, **time_step(call, device, 3, 10)}
    except Exception as failure:  # noqa: BLE001 - reported: the comparison, not the check, fails
        return {"error": f"{type(failure).__name__}: {failure}"[:500]}


def random_step(plan: CheckPlan, queries: int, generator, device) -> tuple[FlexLayout, torch.Tensor]:
    """A step of `queries` tokens in rows of 5 (or 1) after plan.context cached positions, rows in random blocks of
    the pool: its FlexLayout, and the dense mask [T, (N + 1) B] of what each query may see, from the tables."""
    per_row = 5 if queries >= 5 else 1
    counts = [per_row] * max(1, queries // per_row)
    counts[-1] += queries - sum(counts)
    blocks_per_row = -(-(plan.context + max(counts)) // plan.block_size)
    tables = torch.randperm(plan.pool_blocks, generator=generator)[: len(counts) * blocks_per_row]
    tables = tables.view(len(counts), blocks_per_row)  # [R, M]
    row_of = torch.tensor([r for r, count in enumerate(counts) for _ in range(count)])  # [T]
    positions = torch.tensor([p for count in counts for p in range(plan.context, plan.context + count)])  # [T]
    logical = torch.full(((plan.pool_blocks + 1) * plan.block_size,), -1).repeat(len(counts), 1)  # [R, (N+1) B]
    offsets = torch.arange(plan.block_size)
    for row in range(len(counts)):
        for index, block in enumerate(tables[row].tolist()):
            logical[row, block * plan.block_size + offsets] = index * plan.block_size + offsets
    seen = logical[row_of]  # [T, (N+1) B]: each key's position in the query's row, -1 if not the row's
    dense = (seen >= 0) & (seen <= positions[:, None])
    layout = FlexLayout(row_of.to(device), positions.to(device), tables.to(device), plan.block_size)
    return layout, dense.to(device)


def dense_attention(query, keys, values, mask) -> torch.Tensor:
    """float32 SDPA of query [1, H, T, D] over the whole pool [H_kv, N, B, D] under mask [T, N B]: [T, H, D]."""
    heads, _, _, head_dim = keys.shape
    group = query.shape[1] // heads
    pool_keys = keys.reshape(1, heads, -1, head_dim).repeat_interleave(group, 1).float()
    pool_values = values.reshape(1, heads, -1, head_dim).repeat_interleave(group, 1).float()
    return F.scaled_dot_product_attention(query.float(), pool_keys, pool_values, attn_mask=mask)[0].transpose(0, 1)


def runtime_phase(plan: CheckPlan, device: torch.device, dtype: torch.dtype, held: dict) -> dict:
    """The runtime loads an 8B-shaped GQA Llama: packed with graphs, or why not."""
    started = time.perf_counter()
    model = build_random(plan.model, device, dtype, seed=1)
    built_s = time.perf_counter() - started
    settings = ModelSettings(
        model=plan.model.name,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=AttentionBackendChoice.FLEX,
        cuda_graph_max_tokens=plan.graph_max_tokens,
        kv_cache_budget=plan.kv_bytes,
    )
    loaded = LoadedModel(settings, model, word_tokenizer(plan.model.vocab))
    if loaded.graph_steps is None and device.type != "cuda" and loaded.packed:  # the CPU rehearsal: eager buckets
        steps = CudaGraphSteps(
            model, loaded.kv_pool, loaded.attention_backend, plan.graph_max_tokens, loaded.max_context_tokens
        )
        steps.capture(cuda_graphs=False)
        loaded.graph_steps = steps
    held["model"] = loaded
    figures = {
        "model": plan.model.describe(),
        "build_s": round(built_s, 2),
        "load_s": round(time.perf_counter() - started - built_s, 2),  # self-test, pool, graph capture
        "packed": loaded.packed,
        "unpacked_reason": loaded.unpacked_reason,
        "attention_backend": loaded.attention_backend.name if loaded.attention_backend else None,
        "graph_buckets": sorted(loaded.graph_steps.graphs) if loaded.graph_steps else [],
        "cuda_graphs": device.type == "cuda" and loaded.graph_steps is not None,
        "float32_logits": loaded.float32_logits,
        "float32_logits_refusal": float32_head_refusal(model) if not loaded.float32_logits else None,
        "kv_blocks": loaded.kv_pool.blocks.num_blocks if loaded.kv_pool else 0,
        "weight_bytes": weight_bytes(model),
    }
    if device.type == "cuda":
        figures["memory_allocated_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        figures["memory_reserved_gib"] = round(torch.cuda.memory_reserved(device) / 2**30, 2)
    return figures


def graphs_phase(plan: CheckPlan, held: dict) -> dict:
    """A verify step of 4 rows from its graph against the same step eagerly: logits and ms."""
    loaded = held["model"]
    if loaded.graph_steps is None:
        return {"skipped": "no graphs were captured (the runtime phase says why)"}
    eager = project_step(loaded, 4, plan.step_context, 4, graphs=False)
    graphed = project_step(loaded, 4, plan.step_context, 4, graphs=True)
    replays = loaded.graph_steps.replays
    difference = max(float((a - b).abs().max()) for a, b in zip(graphed(), eager()))
    return {
        "replayed": loaded.graph_steps.replays > replays,
        "max_abs_logit_difference": difference,
        "graph": time_step(graphed, loaded.device, 3, plan.repeats),
        "eager": time_step(eager, loaded.device, 3, plan.repeats),
    }


def steps_phase(plan: CheckPlan, held: dict) -> dict:
    """Plain and γ 4 verify steps at batch 1 against weight bytes / copy bandwidth."""
    loaded = held["model"]
    device = loaded.device
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 20), repeats=20)
    bound_ms = weight_bytes(loaded.model) / bandwidth * 1e3
    figures: dict = {"copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 2), "bandwidth_bound_ms": round(bound_ms, 4)}
    for name, drafted in (("plain", 0), ("verify", 4)):
        for way in ("graphs", "eager"):
            if way == "graphs" and loaded.graph_steps is None:
                continue
            step = project_step(loaded, 1, plan.step_context, drafted, graphs=way == "graphs")
            timed = time_step(step, device, 3, plan.repeats)
            figures[f"{name}_{way}"] = {**timed, "over_bound": round(timed["median_ms"] / bound_ms, 3)}
    verify = figures.get("verify_graphs") or figures["verify_eager"]
    figures["headline"] = {
        "verify_ms": verify["median_ms"],
        "bound_ms": round(bound_ms, 4),
        "ratio": verify["over_bound"],
        "ceiling": VERIFY_BOUND_CEILING,
        "meets": verify["over_bound"] <= VERIFY_BOUND_CEILING,
    }
    return figures


def noise_phase(plan: CheckPlan, device: torch.device) -> dict:
    """The coupled rule's noise on the device: ms on the device and on the host, bits against the CPU's."""
    keys = [_position_key(7, position, Stream.GUMBEL) for position in range(plan.noise_rows)]
    words = key_words(keys).to(device)
    noise = noise_from_key_words(words, plan.noise_vocab)  # warm
    host_ms = []
    for _ in range(plan.repeats):
        synchronize(device)
        started = time.perf_counter_ns()
        noise_from_key_words(words, plan.noise_vocab)
        host_ms.append((time.perf_counter_ns() - started) / 1e6)  # launches only, on CUDA
    on_cpu = noise_from_key_words(key_words(keys[:4]), plan.noise_vocab)
    same_bits = torch.equal(noise[:4].cpu().view(torch.int32), on_cpu.view(torch.int32))
    return {
        "rows": plan.noise_rows,
        "vocab": plan.noise_vocab,
        "device": time_step(lambda: noise_from_key_words(words, plan.noise_vocab), device, 2, plan.repeats),
        "host_median_ms": round(statistics.median(host_ms), 4),
        "bits_equal_cpu": same_bits,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None, help="where gpu_check.json goes (default $OUT)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="everything stops at this many seconds")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        torch.set_num_threads(1)
    clock = Clock(args.budget_s)
    report = PhasedReport(
        out_dir_of(args.out_dir, "gpu-check") / "gpu_check.json", clock, benchmark="gpu_check", dry_run=args.dry_run
    )
    held: dict = {}

    def phases() -> None:
        report.run("environment", lambda: environment(device))
        with torch.inference_mode():  # the most telling first: a run cut short keeps those
            report.run("noise", lambda: noise_phase(plan, device))
            if report.run("runtime", lambda: runtime_phase(plan, device, dtype, held)) is not None:
                report.run("graphs", lambda: graphs_phase(plan, held))
                report.run("steps", lambda: steps_phase(plan, held))
            held.clear()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report.run("flex", lambda: flex_phase(plan, device, dtype))

    return run_within_budget(report, phases)


if __name__ == "__main__":
    main()
