"""What the parts of one request's generation share: its plan, what it committed, its draft lanes, its figures."""

from __future__ import annotations

import time

from coordinator.draft_lanes import DraftLane
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from coordinator.verdict_guesses import VerdictHistory


class GenerationState:
    """One request's progress, shared by its round loop, its replica calls, its block sizing and its pre-drafts.

    - committed: the prompt and every token committed since; lanes: what each draft lane holds
    - stats, metrics and spans (telemetry): where every round's figures go
    """

    def __init__(self, plan: GenerationPlan, stats: RequestStats, telemetry: RequestTelemetry):
        self.plan = plan
        self.stats = stats
        self.telemetry = telemetry
        self.metrics = telemetry.metrics
        self.committed: list[int] = list(plan.prompt_ids)
        self.lanes = [DraftLane(index, [], 0) for index in range(plan.draft_lanes)]
        self.lanes_on_committed()
        self.verdicts = VerdictHistory()  # which guesses this request's verdicts matched, to rank the next ones
        self.started_ns = time.perf_counter_ns()

    def lanes_on_committed(self) -> None:
        """Every draft lane as holding the committed tokens: what a draft session just opened on them holds."""
        committed = self.committed
        self.lanes[:] = [DraftLane(lane.index, list(committed), len(committed)) for lane in self.lanes]

    def elapsed_ns(self) -> int:
        """Time since the request started."""
        return time.perf_counter_ns() - self.started_ns

    @property
    def remaining(self) -> int:
        return self.plan.max_new_tokens - (len(self.committed) - len(self.plan.prompt_ids))
