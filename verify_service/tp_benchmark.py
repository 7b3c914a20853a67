"""Weight memory per rank and verify latency at TP = 1 vs TP = 2, side by side in one run.

    python -m verify_service.tp_benchmark --model models/demo-target --gamma 4 --rounds 40

One verify round = what VerifyService.verify does for a γ-token block after a prompt: roll back to base_len,
score γ drafts in one forward (under TP: send the Step, run it on every rank), rejection-sample, commit.
TP = 1 runs in this process with 1 and with 2 threads; TP = 2 runs rank 0 in this process (1 thread) and
rank 1 in a spawned process (1 thread), so TP = 2 uses as many cores as TP = 1 with 2 threads. Blocks of
rounds alternate between the configurations so machine noise hits all of them alike; medians are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams
from verify_service.rank_launchers import LocalLauncher
from verify_service.service import VerifyService
from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import TensorParallelLeader
from verify_service.tp_ranks import local_weight_bytes


def time_rounds(
    service: VerifyService, session_id: str, base_len: int, vocab_size: int, gamma: int, rounds: int, rng: random.Random
) -> list[float]:
    """Milliseconds per verify round, each rolled back to base_len (so every round scores the same length)."""
    times = []
    for _ in range(rounds):
        drafts = [rng.randrange(1, vocab_size) for _ in range(gamma)]
        started = time.perf_counter()
        service.verify(session_id, base_len, drafts, None)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40, help="rounds per configuration (in blocks of 10)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    settings = VerifySettings(model=args.model, dtype=args.dtype, threads=1, tensor_parallel_size=2)
    torch.set_num_threads(1)
    plain = LoadedModel.load(ModelSettings(args.model, "cpu", args.dtype, 1))
    leader = TensorParallelLeader.start(settings, LocalLauncher())
    try:
        services = {
            "TP=1, 1 thread": (VerifyService(settings, plain), 1),
            "TP=1, 2 threads": (VerifyService(settings, plain), 2),
            "TP=2, 1 thread/rank": (VerifyService(settings, leader.model, leader), 1),
        }
        rng = random.Random(0)
        prompt = [rng.randrange(1, plain.vocab_size) for _ in range(args.prompt_len)]
        for name, (service, threads) in services.items():
            torch.set_num_threads(threads)
            service.open(name, prompt, SamplingParams())
            time_rounds(service, name, len(prompt), plain.vocab_size, args.gamma, 3, rng)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in services}
        for _ in range(max(1, args.rounds // 10)):
            for name, (service, threads) in services.items():
                torch.set_num_threads(threads)
                times[name] += time_rounds(service, name, len(prompt), plain.vocab_size, args.gamma, 10, rng)
        for name, (service, _) in services.items():
            service.close(name)
    finally:
        leader.close()

    params = sum(p.numel() for p in plain.model.parameters())
    print(
        f"model {args.model}: {params / 1e6:.2f}M parameters, {args.dtype}; verify block γ={args.gamma} after a "
        f"{args.prompt_len}-token prompt; {len(times[next(iter(times))])} rounds each"
    )
    print(f"weights, TP=1: {local_weight_bytes(plain.model) / 2**20:.2f} MiB")
    for info in leader.ranks:
        print(f"weights, TP=2 rank {info.rank}: {info.weight_bytes / 2**20:.2f} MiB")
    base = statistics.median(times["TP=1, 1 thread"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"verify latency, {name:<20} median {median:7.2f} ms   "
            f"p90 {sorted(samples)[int(0.9 * len(samples))]:7.2f} ms"
            f"   ({base / median:.2f}x TP=1 1 thread)"
        )


if __name__ == "__main__":
    main()
