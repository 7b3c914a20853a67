"""KV cache memory of the draft and verify services under concurrent greedy overlapped requests: the paged pool
(blocks, lanes sharing their session's prefix) against the contiguous pool it replaced (a slot per sequence).

The draft and verify services run in this process (so their pools can be read) behind a coordinator process with
adaptive γ off, so every request pre-drafts with 1 + 2γ lanes. `--concurrency` requests of `--new-tokens` run at
once, and again as each finishes, until `--requests` are done. Per service the report gives:

- paged: the most blocks held at once during the run (the allocator's high-water mark) × bytes per block;
- contiguous: what the replaced pool would have held for the same sequences, from its sizing rule: slots doubling
  from 4 to hold the most sequences open at once (a sequence took the lowest free slot), × capacity doubling from
  64 positions to hold the longest sequence, × bytes per position. Sequences made for the start-up calibration are
  not counted (the replaced pool kept their slots too, so it would have held at least this).

    python -m benchmarks.kv_memory                       # demo pair: 16 requests at once, 128 new tokens, γ 4
    python -m benchmarks.kv_memory --requests 4 --concurrency 4 --new-tokens 32 --out-dir /tmp/kv_memory
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from benchmarks.stack_runs import environment, prompt_texts, results_dir, write_json
from draft_service.service import DraftService
from draft_service.servicer import DrafterServicer
from draft_service.settings import DraftSettings
from specdec.client import Client
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.kv.budget import block_bytes
from specdec.engine.kv.pool import KVPool
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import start_service
from specdec.serving.server import start_server
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings


def doubled(start: int, needed: int) -> int:
    """start doubled until it holds `needed`."""
    size = start
    while size < needed:
        size *= 2
    return size


def pool_figures(model: LoadedModel) -> dict:
    """Bytes of the paged pool at its high-water mark, and of the contiguous pool for the same sequences."""
    pool: KVPool = model.kv_pool
    per_block = block_bytes(model.model.config, model.model.dtype, pool.block_size)
    per_position = block_bytes(model.model.config, model.model.dtype, 1)
    slots, capacity = doubled(4, pool.peak_sequences), doubled(64, pool.longest_sequence)
    paged = pool.blocks.peak_used * per_block
    contiguous = slots * capacity * per_position
    return {
        "block_size": pool.block_size,
        "peak_blocks": pool.blocks.peak_used,
        "paged_bytes": paged,
        "peak_sequences": pool.peak_sequences,
        "longest_sequence": pool.longest_sequence,
        "contiguous_slots": slots,
        "contiguous_capacity": capacity,
        "contiguous_bytes": contiguous,
        "contiguous_over_paged": round(contiguous / paged, 2),
    }


def reset_peaks(pool: KVPool) -> None:
    """Counts from now: the sequences open and the blocks held now are the starting marks."""
    pool.peak_sequences = pool.open_sequences
    pool.blocks.peak_used = pool.blocks.used
    pool.longest_sequence = 0


async def serve_replicas(draft: LoadedModel, target: LoadedModel, threads: int):
    """A draft and a verify service on loopback, served from this process's event loop: (their servicers, their
    running servers)."""
    drafter = DrafterServicer(DraftService(DraftSettings(model="", threads=threads), draft, draft.vocab_size))
    verifier = VerifierServicer(VerifyService(VerifySettings(model="", threads=threads), target))
    servers = [
        await start_server(
            "127.0.0.1:0",
            lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(drafter, s),
            [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name],
        ),
        await start_server(
            "127.0.0.1:0",
            lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, s),
            [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name],
        ),
    ]
    return (drafter, verifier), servers


async def run_requests(args: argparse.Namespace, draft: LoadedModel, target: LoadedModel) -> list:
    """Serves the replicas here, starts a coordinator process on them and runs the requests; their replies."""
    servicers, servers = await serve_replicas(draft, target, args.threads)
    for model in (draft, target):
        reset_peaks(model.kv_pool)
    draft_port, verify_port = (server.port for server in servers)
    wiring = ["--draft-replicas", f"127.0.0.1:{draft_port}", "--verify-replicas", f"127.0.0.1:{verify_port}"]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="kv-memory-"))
    loop = asyncio.get_running_loop()
    coordinator = await loop.run_in_executor(
        None,
        start_service,
        "coordinator",
        "coordinator",
        ["--tokenizer", args.target, *wiring, "--no-adaptive-gamma"],
        log_dir,
    )
    prompts = prompt_texts("code", args.requests)
    try:
        with Client(coordinator.address, timeout_s=600) as client, ThreadPoolExecutor(args.concurrency) as pool:

            def generate(prompt: str):
                return client.generate(
                    prompt, max_new_tokens=args.new_tokens, num_speculative_tokens=args.gamma, include_stats=True
                )

            return list(await asyncio.gather(*(loop.run_in_executor(pool, generate, p) for p in prompts)))
    finally:
        await loop.run_in_executor(None, coordinator.stop)
        for server in servers:
            await server.stop(0)
        for servicer in servicers:
            servicer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    draft = LoadedModel.load(ModelSettings(args.draft, threads=args.threads))
    target = LoadedModel.load(ModelSettings(args.target, threads=args.threads))
    replies = asyncio.run(run_requests(args, draft, target))
    report = {
        "benchmark": "kv_memory",
        "command": " ".join(["python -m benchmarks.kv_memory", *(sys.argv[1:] if argv is None else argv)]),
        "settings": vars(args) | {"out_dir": str(args.out_dir) if args.out_dir else None},
        "environment": environment(),
        "requests": {
            "completed": len(replies),
            "new_tokens": sum(len(r.token_ids) for r in replies),
            "predraft_guesses_per_attempt": round(
                sum(r.stats.predraft_guesses for r in replies)
                / max(sum(r.stats.predraft_attempts for r in replies), 1),
                2,
            ),
        },
        "draft": pool_figures(draft),
        "verify": pool_figures(target),
    }
    write_json(results_dir(args.out_dir, quick=False) / "kv_memory.json", report)
    for name in ("draft", "verify"):
        figures = report[name]
        print(
            f"{name}: paged {figures['paged_bytes'] / 2**20:.2f} MiB ({figures['peak_blocks']} blocks), "
            f"contiguous {figures['contiguous_bytes'] / 2**20:.2f} MiB "
            f"({figures['contiguous_slots']} slots x {figures['contiguous_capacity']} positions): "
            f"{figures['contiguous_over_paged']}x"
        )


if __name__ == "__main__":
    main()
