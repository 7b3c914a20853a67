"""Shared by the gRPC benchmarks (overlap, n-gram): prompts, timed requests, per-mode totals, JSON reports.

A benchmark starts one LocalStack (draft, verify and coordinator processes on loopback), so every mode
it compares talks to the same service processes on the same cores; modes run interleaved, request by
request or run by run, so drift on a shared machine hits them alike.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from load_tests.prompts import load_prompt_set
from specdec.client import Client
from specdec.local_stack import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
QUICK_RESULTS_DIR = pathlib.Path(tempfile.gettempdir()) / "specdec-benchmarks"


@dataclass
class RequestRun:
    """One completed request as the client saw it."""

    token_ids: list[int]
    seconds: float
    rounds: int
    drafted: int
    accepted: int
    predraft_attempts: int
    predraft_hits: int
    draft_ns: int
    verify_ns: int
    predraft_guesses: int = 0
    wire_bytes: int = 0
    sampling_ns: int = 0
    wire_ns: int = 0
    prefill_ns: int = 0
    total_ns: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.predraft_hits / self.predraft_attempts if self.predraft_attempts else None


def timed_generate(client: Client, prompt: str | Sequence[int], **kwargs) -> RequestRun:
    """One Generate call with stats, timed at the client (prefill, every round and the wire included)."""
    started = time.perf_counter()
    reply = client.generate(prompt, include_stats=True, **kwargs)
    seconds = time.perf_counter() - started
    stats = reply.stats
    return RequestRun(
        list(reply.token_ids),
        seconds,
        stats.rounds,
        stats.drafted_tokens,
        stats.accepted_tokens,
        stats.predraft_attempts,
        stats.predraft_hits,
        stats.draft_ns,
        stats.verify_ns,
        stats.predraft_guesses,
        stats.wire_bytes,
        stats.sampling_ns,
        stats.wire_ns,
        stats.prefill_ns,
        stats.total_ns,
    )


def totals(runs: Iterable[RequestRun]) -> dict:
    """Figures of a batch of requests of one mode: throughput over the summed wall time, α, hit rate."""
    runs = list(runs)
    tokens = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    rounds = sum(r.rounds for r in runs)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    attempts = sum(r.predraft_attempts for r in runs)
    hits = sum(r.predraft_hits for r in runs)
    return {
        "requests": len(runs),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
        "rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round((accepted + rounds) / rounds, 4) if rounds else None,
        "drafted_per_round": round(drafted / rounds, 3) if rounds else None,
        "predraft_attempts": attempts,
        "predraft_hits": hits,
        "predraft_hit_rate": round(hits / attempts, 4) if attempts else None,
        "guesses_per_predraft": round(sum(r.predraft_guesses for r in runs) / attempts, 3) if attempts else None,
        "draft_ms_per_round": round(sum(r.draft_ns for r in runs) / rounds / 1e6, 3) if rounds else None,
        "verify_ms_per_round": round(sum(r.verify_ns for r in runs) / rounds / 1e6, 3) if rounds else None,
        "sampling_ms_per_round": round(sum(r.sampling_ns for r in runs) / rounds / 1e6, 3) if rounds else None,
        "wire_ms_per_round": round(sum(r.wire_ns for r in runs) / rounds / 1e6, 3) if rounds else None,
        "server_ms_per_round": (
            round(sum(r.total_ns - r.prefill_ns for r in runs) / rounds / 1e6, 3) if rounds else None
        ),
        "prefill_ms_per_request": round(sum(r.prefill_ns for r in runs) / len(runs) / 1e6, 3) if runs else None,
        "wire_bytes_per_round": round(sum(r.wire_bytes for r in runs) / rounds, 1) if rounds else None,
    }


def prompt_texts(set_name: str, count: int, seed: int = 0) -> list[str]:
    """`count` prompts of a load_tests prompt set ("code", "grounded", or "words" for the tiny test models)."""
    return [p.prompt for p in load_prompt_set(set_name, count, seed=seed)]


def environment(**extra) -> dict:
    """What the figures were measured on."""
    import torch
    import transformers

    return {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        **extra,
    }


def results_dir(out_dir: pathlib.Path | None, quick: bool) -> pathlib.Path:
    """Where a report goes: --out-dir, else the committed results folder (a temp folder for --quick runs)."""
    directory = out_dir or (QUICK_RESULTS_DIR if quick else RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def pinned_cores(threads: int) -> dict[str, str]:
    """--cpus values giving the draft service and the verify service `threads` cores each, when there are enough.
    The coordinators share the draft service's cores: in overlapped mode the verifications are the critical path
    and a pre-draft ends before its verification does, so the drafter's cores have the slack for the coordinator's
    work (taking in a pre-draft's lanes while a verification runs); sequential rounds wait on every call either way."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * threads:
        return {}
    draft_cores = ",".join(map(str, cores[:threads]))
    return {
        "draft": draft_cores,
        "verify": ",".join(map(str, cores[threads : 2 * threads])),
        "coordinator": draft_cores,
    }


def write_json(path: pathlib.Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def write_report_and_png(path: pathlib.Path, report: dict, plot: Callable[[dict, pathlib.Path], pathlib.Path]) -> None:
    """Writes the report, then its plot beside it (same name, .png), then the report again with the plot's file name
    in `png`: the figures are on disk even if plotting fails."""
    write_json(path, report)
    report["png"] = plot(report, path.with_suffix(".png")).name
    write_json(path, report)
