"""What making the coupled rule's noise costs the host: 80 rows (16 seeded sessions at γ 4) at a 128k vocabulary.

Side by side, alternating, on one pinned core with one torch thread:
- `host_rows`: the noise as it was made before it moved to the device (until commit 6208918): per row a CPU
  generator seeded by the position's hash, torch.rand of V float64 uniforms, two logarithms (Gumbel), the rows
  stacked and copied to the logits' device; no cache (16 sessions' rows overflow a 32-row cache in one step);
- `device`: specdec/sampling/coupled_noise.py's exponential_noise on the logits' device, here the CPU, where the
  compiled kernel makes it: the keys on the host, every element on the device;
- `device_tensor_ops` (fewer repeats): the same noise by tensor ops on the CPU, the path of a CPU without a
  compiler (and the path every other device runs).
On a CPU the device's work is host time, so `device` times the whole noise; on a GPU the host time of that path is
the keys and a few kernel launches. The headline is host_rows / device against a floor of 10.

    python -m benchmarks.coupled_noise            # writes benchmarks/results/coupled_noise.json (~1 min)
    python -m benchmarks.coupled_noise --quick    # a small vocabulary, to a temporary folder
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

import torch

from benchmarks.stack_runs import environment, pinned_cores, results_dir, write_json
from specdec.sampling.coupled_noise import exponential_noise, key_words, load_noise_kernel, noise_from_key_words
from specdec.sampling.rules import Stream, _position_key, position_generator

ROWS = 80
VOCAB = 128_256  # Llama 3's
FLOOR = 10.0


def host_rows(draws: list[tuple[int, int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The noise as the host made it before: float64 Gumbel [R, V], one seeded CPU generator per row."""
    rows = []
    for seed, position in draws:
        uniform = torch.rand(vocab, generator=position_generator(seed, position, Stream.GUMBEL), dtype=torch.float64)
        rows.append(-torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float64).tiny))))
    return torch.stack(rows).to(device)


def noise_keys(draws: list[tuple[int, int]]) -> list[int]:
    return [_position_key(seed, position, Stream.GUMBEL) for seed, position in draws]


def device_noise(draws: list[tuple[int, int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The noise now: keys on the host, exponential noise float32 [R, V] on the device."""
    return exponential_noise(noise_keys(draws), vocab, device)


def tensor_op_noise(draws: list[tuple[int, int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The same noise by tensor ops on the device, the kernel left out."""
    return noise_from_key_words(key_words(noise_keys(draws)).to(device), vocab)


def timed_ms(make, draws: list[tuple[int, int]], vocab: int) -> float:
    started = time.perf_counter_ns()
    made = make(draws, vocab, torch.device("cpu"))
    elapsed = (time.perf_counter_ns() - started) / 1e6
    assert made.shape == (len(draws), vocab)
    return elapsed


def measure(rows: int, vocab: int, repeats: int, ops_repeats: int) -> dict:
    """Median ms of each way over fresh draws (a new seed per repeat), taken alternately."""
    samples: dict[str, list[float]] = {"host_rows": [], "device": [], "device_tensor_ops": []}
    timed_ms(device_noise, [(0, 0)], vocab)  # first call: loads (or builds) the kernel
    for repeat in range(repeats):
        draws = [(1000 + repeat, position) for position in range(rows)]
        order = ["host_rows", "device"] if repeat % 2 == 0 else ["device", "host_rows"]
        for way in order:
            samples[way].append(timed_ms(host_rows if way == "host_rows" else device_noise, draws, vocab))
        print(
            f"repeat {repeat + 1}/{repeats}: host_rows {samples['host_rows'][-1]:.1f} ms, "
            f"device {samples['device'][-1]:.1f} ms",
            flush=True,
        )
    for repeat in range(ops_repeats):
        draws = [(5000 + repeat, position) for position in range(rows)]
        samples["device_tensor_ops"].append(timed_ms(tensor_op_noise, draws, vocab))
    return {way: {"median_ms": round(statistics.median(ms), 3), "samples": len(ms)} for way, ms in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="vocabulary 4096, 3 repeats, to a temporary folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    vocab, repeats = (4096, 3) if args.quick else (args.vocab, args.repeats)
    torch.set_num_threads(1)
    core = pinned_cores(1).get("verify")  # the verify service's core, as the other benchmarks pin it
    cores_before = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {int(core)})
    try:
        figures = measure(args.rows, vocab, repeats, ops_repeats=max(1, repeats // 4))
    finally:  # a caller in this process (a test) gets its cores back
        os.sched_setaffinity(0, cores_before)
    today, now = figures["host_rows"]["median_ms"], figures["device"]["median_ms"]
    ratio = round(today / now, 2)
    report = {
        "headline": {"host_rows_ms": today, "device_ms": now, "ratio": ratio, "floor": FLOOR, "meets": ratio >= FLOOR},
        "figures": figures,
        "settings": {"rows": args.rows, "vocab": vocab, "repeats": repeats, "threads": 1, "core": core},
        "kernel_built": load_noise_kernel() is not None,
        "machine": environment(threads=1),
    }
    print(f"host rows {today:.1f} ms, device {now:.1f} ms: {today / now:.1f}x (floor {FLOOR:g})", flush=True)
    write_json(results_dir(args.out_dir, args.quick) / "coupled_noise.json", report)
    return report


if __name__ == "__main__":
    main()
