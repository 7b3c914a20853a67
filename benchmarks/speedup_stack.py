"""The speedup benchmark's gRPC stack: a draft and a verify service whose model threads each run on a core group of
their own, and two coordinators on them (overlapped and sequential rounds) pinned with the draft service.

The verify service's passes run in a model process of their own on the verifier's cores (`--model-process`), and
its serving threads (gRPC, event loop) on the coordinators' cores, as a GPU deployment's host threads run off its
accelerator (`--model-cpus`, docs/operations.md). The draft service's short passes run in its own process: a
round trip to a model process per pass would cost them more than the serving threads do.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from specdec.local_stack import LocalStack, start_service


def start_stack(
    target: str, draft: str, threads: int, pins: dict[str, str], progress: Callable[[str], None]
) -> tuple[LocalStack, dict[str, str]]:
    """Starts the stack; returns it and the coordinators' addresses by contender name.

    `pins` holds the cores per process ("draft", "verify", "coordinator"; empty: no pinning). Both modes run on
    the very same replica processes. Processes that do not wait for each other start side by side
    (importing torch dominates start-up).
    """
    where = f"draft on cores {pins['draft']}, verify on {pins['verify']}" if pins else "unpinned"
    progress(
        f"starting the gRPC stack ({where}, {threads} thread(s) each, coordinators with --overlap and --no-overlap) ..."
    )
    stack = LocalStack(target, draft)
    draft_cpus = ["--cpus", pins["draft"]] if pins else []
    verify_cpus = ["--cpus", pins["coordinator"], "--model-cpus", pins["verify"]] if pins else []
    coordinator_cpus = ["--cpus", pins["coordinator"]] if pins else []
    replicas = {
        "draft": ("draft_service", ["--model", draft, "--threads", str(threads), *draft_cpus]),
        "verify": ("verify_service", ["--model", target, "--threads", str(threads), *verify_cpus, "--model-process"]),
    }
    try:
        start_together(stack, replicas)
        wiring = [
            "--tokenizer",
            target,
            "--draft-replicas",
            stack.services["draft"].address,
            "--verify-replicas",
            stack.services["verify"].address,
            "--no-adaptive-gamma",  # every round drafts the γ under test
            *coordinator_cpus,
        ]
        start_together(
            stack,
            {
                "coordinator": ("coordinator", [*wiring, "--overlap"]),
                "coordinator-sequential": ("coordinator", [*wiring, "--no-overlap"]),
            },
        )
    except BaseException:
        stop_stack(stack)
        raise
    sequential = stack.services["coordinator-sequential"].address
    progress(f"coordinators at {stack.address} (overlap) and {sequential} (sequential); logs in {stack.log_dir}")
    return stack, {"grpc_overlap": stack.address, "grpc_sequential": sequential}


def start_together(stack: LocalStack, services: dict[str, tuple[str, list[str]]]) -> None:
    """Starts services (name -> module, args) in parallel into stack.services; raises the first failure."""
    with concurrent.futures.ThreadPoolExecutor(len(services)) as pool:
        futures = {
            name: pool.submit(start_service, name, module, args, stack.log_dir)
            for name, (module, args) in services.items()
        }
    for name, future in futures.items():
        if future.exception() is None:
            stack.services[name] = future.result()
    for future in futures.values():
        future.result()


def stop_stack(stack: LocalStack | None) -> None:
    """SIGTERM to every service at once (they drain in parallel), then wait for each."""
    if stack is None:
        return
    for service in stack.services.values():
        if service.process.poll() is None:
            service.process.terminate()
    for service in stack.services.values():
        service.stop()
