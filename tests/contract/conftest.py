"""Fixtures of the contract suite: one redis-server, one draft and one verify process and two coordinators
(adaptive γ on and off) shared by every module; modules that kill or starve replicas start their own.
The target model is loaded once, in this process, with transformers, as the reference the stack must match."""

from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # `import harness` however pytest is started

from harness import (  # noqa: E402
    DRAFT_DIR,
    JOURNAL_ARGS,
    TARGET_DIR,
    Coordinator,
    Process,
    ProcessGroup,
    RedisProcess,
    in_parallel,
)


@dataclass
class SharedStack:
    """The suite's shared processes: `adaptive` and `fixed` (--no-adaptive-gamma) front one draft and one verify
    replica and journal into one redis-server."""

    group: ProcessGroup
    redis: RedisProcess
    draft: Process
    verify: Process
    adaptive: Coordinator
    fixed: Coordinator

    def coordinator_args(self, draft: str = "", verify: str = "", redis: bool = True) -> list[str]:
        args = ["--tokenizer", str(TARGET_DIR), "--draft-replicas", draft or self.draft.address]
        args += ["--verify-replicas", verify or self.verify.address]
        return [*args, "--redis-url", self.redis.url, *JOURNAL_ARGS] if redis else args

    def start_coordinator(self, *args: str, name: str = "coordinator", **replicas) -> Coordinator:
        process = self.group.serve("coordinator", *self.coordinator_args(**replicas), *args, name=name)
        return Coordinator(process.address, process)


@pytest.fixture(scope="session")
def processes(tmp_path_factory):
    """Every process the suite starts; all are SIGKILLed at the end, whatever happened. Logs: pytest's tmp."""
    group = ProcessGroup(tmp_path_factory.mktemp("processes"))
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(scope="session")
def shared_stack(processes) -> SharedStack:
    redis = processes.redis()
    draft, verify = in_parallel(
        lambda: processes.serve("draft", "--model", str(DRAFT_DIR)),
        lambda: processes.serve("verify", "--model", str(TARGET_DIR)),
    )
    stack = SharedStack(processes, redis, draft, verify, None, None)  # type: ignore[arg-type]
    adaptive, fixed = in_parallel(
        lambda: stack.start_coordinator(name="coordinator-adaptive"),
        lambda: stack.start_coordinator("--no-adaptive-gamma", name="coordinator-fixed"),
    )
    stack.adaptive, stack.fixed = adaptive, fixed
    yield stack
    adaptive.close()
    fixed.close()


@pytest.fixture(scope="session")
def target():
    """(model, tokenizer): the target, float32 on CPU, loaded with transformers as any user would."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TARGET_DIR)
