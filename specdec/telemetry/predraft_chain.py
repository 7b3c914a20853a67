"""How early pre-drafted rounds reach the verifier, from a coordinator's spans of many requests.

    python -m specdec.telemetry.predraft_chain --spans spans.jsonl [--wait-ms 20]

In overlapped, chained mode round k+1 is drafted while round k is verified and handed to the verifier
(VerifyNext) so that it runs in the very next pass. It makes that pass only if the VerifyNext arrives before the
pass holding round k ends (when round k's verdict comes back), or within the verifier's step wait after. Each round
k that pre-drafted its successor is split into the links of that chain:

- to_propose: from round k-1's verdict to the pre-draft's ProposeLanes call (the coordinator's own time);
- propose: the ProposeLanes round trip (the drafter's queue and passes, and the wire);
- to_verify_next: from the drafter's reply to the VerifyNext call;
- slack: from the VerifyNext call to round k's verdict; below 0 the next round came after its pass had ended,
  and below -wait it missed that pass.

The spans are what the coordinator writes with `--trace-exporter jsonl:PATH`.
"""

from __future__ import annotations

import argparse
import pathlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.telemetry.timeline import read_spans

LINKS = ("to_propose", "propose", "to_verify_next", "slack")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class ChainTimes:
    """Per link the times in ms, one per round that pre-drafted and chained its successor."""

    links: dict[str, list[float]] = field(default_factory=lambda: {link: [] for link in LINKS})

    @property
    def rounds(self) -> int:
        return len(self.links["slack"])

    def late_share(self, beyond_ms: float = 0.0) -> float:
        """Share of the rounds whose successor reached the verifier more than beyond_ms after their verdict."""
        slack = self.links["slack"]
        return sum(value < -beyond_ms for value in slack) / len(slack) if slack else 0.0


def chain_times(spans: Sequence[dict]) -> ChainTimes:
    """The chain links of every round in the spans that has a pre-draft and a VerifyNext, and a round before it
    with a verdict."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    times = ChainTimes()
    for trace in by_trace.values():
        children: dict[str | None, list[dict]] = defaultdict(list)
        for span in trace:
            children[span["parent_span_id"]].append(span)
        rounds = sorted((span for span in trace if span["name"] == "round"), key=lambda span: span["start_ns"])
        previous_verdict = None
        for round_span in rounds:
            kids = children[round_span["span_id"]]
            verify = _first(kids, "verify")
            predraft = _first(kids, "draft.propose", predraft=True)
            verify_next = _first(kids, "verify_next")
            if previous_verdict is not None and verify and predraft and verify_next:
                for link, (start, end) in zip(
                    LINKS,
                    [
                        (previous_verdict["end_ns"], predraft["start_ns"]),
                        (predraft["start_ns"], predraft["end_ns"]),
                        (predraft["end_ns"], verify_next["start_ns"]),
                        (verify_next["start_ns"], verify["end_ns"]),
                    ],
                ):
                    times.links[link].append((end - start) / 1e6)
            previous_verdict = verify
    return times


def _first(spans: Sequence[dict], name: str, predraft: bool | None = None) -> dict | None:
    for span in spans:
        if span["name"] == name and (predraft is None or span["attributes"].get("specdec.predraft") == predraft):
            return span
    return None


def describe(times: ChainTimes, wait_ms: float) -> str:
    """A table of each link's quantiles and the shares of late successors."""
    header = f"{'link (ms)':<16}" + "".join(f"{f'p{round(q * 100)}':>9}" for q in QUANTILES)
    lines = [f"{times.rounds} rounds that pre-drafted and chained their successor", header]
    for link in LINKS:
        quantiles = np.quantile(times.links[link], QUANTILES)
        lines.append(f"{link:<16}" + "".join(f"{value:>9.1f}" for value in quantiles))
    lines.append(
        f"successor after its pass ended: {times.late_share():.1%}; "
        f"more than {wait_ms:g} ms after (missed it): {times.late_share(wait_ms):.1%}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m specdec.telemetry.predraft_chain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spans", type=pathlib.Path, nargs="+", required=True, help="JSONL span files")
    parser.add_argument(
        "--wait-ms", type=float, default=20.0, help="the verifier's step wait (its --max-batch-wait-ms) [20]"
    )
    args = parser.parse_args(argv)
    times = chain_times(read_spans(args.spans))
    if not times.rounds:
        parser.error("no round with a pre-draft and a VerifyNext in the spans (overlapped, chained mode, traced?)")
    report = describe(times, args.wait_ms)
    print(report)
    return report


if __name__ == "__main__":
    main()
