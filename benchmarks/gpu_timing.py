"""The ways of running one model step that the GPU step benchmark times, and the clock it times them with.

Every step is `batch` rows of `tokens` new tokens after `context` cached positions (1 token: a plain or draft
step; γ+1: a verify block), repeated on the same positions so every sample sees the same context:

- `hf_eager_static_cache`: transformers' eager `forward` over a StaticCache (prefilled once; each step writes
  the same cache slots again);
- `hf_cuda_graph_static_cache`: that same forward captured once in a CUDA graph (torch.cuda.graph) and
  replayed: what graphs save a plain HF step, not the project's step;
- `project_step`: the project's step as its services run it with `--no-cuda-graphs`: `KVSession.plan_extend` for
  every row, one `run_forwards` (a packed `LoadedModel.forward_rows` pass), then the rollback to `context`;
- `project_step_cuda_graphs`: the same step replayed from the CUDA graph the runtime captured for its bucket
  (specdec/engine/cuda_graph_steps.py), as the services run it by default on CUDA;
- the bandwidth bound: weight bytes / the device's measured copy bandwidth, the least time a step can take.

Imports only torch and transformers at module level; the project's modules load inside the functions that use them.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, StaticCache

Step = Callable[[], object]
PROJECT_KV_BYTES = 4 * 2**30  # each project model's KV pool: 16 rows of 512 positions need 1 GiB on the 8B shape


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on `device` (CUDA runs kernels asynchronously; CPU work is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Step, device: torch.device, warmup: int, repeats: int) -> dict:
    """Median and fastest milliseconds of `repeats` calls after `warmup` untimed ones, the device synchronised
    before each clock read."""
    for _ in range(warmup):
        step()
    samples_ns = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter_ns()
        step()
        synchronize(device)
        samples_ns.append(time.perf_counter_ns() - started)
    return {
        "median_ms": round(statistics.median(samples_ns) / 1e6, 4),
        "min_ms": round(min(samples_ns) / 1e6, 4),
        "samples": repeats,
    }


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and bytes written."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)  # [nbytes]
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2.0 * nbytes * repeats / (time.perf_counter() - started)


def random_ids(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token ids [rows, length] in [1, vocab): no EOS."""
    return torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


class StaticCacheStep:
    """HF eager forward of `tokens` new tokens per row after `context` cached positions, over a StaticCache.

    Each call first sets the cache's write position back to `context` (recent transformers keep it on the device,
    one counter per layer, and ignore cache_position when writing), so every call scores the same positions."""

    def __init__(self, model: PreTrainedModel, batch: int, context: int, tokens: int, seed: int = 0):
        self.model = model
        self.context = context
        device = model.device
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5
        self.cache = StaticCache(config=model.config, max_cache_len=context + tokens)
        prefix = random_ids(batch, context, model.config.vocab_size, seed).to(device)  # [B, L]
        with torch.inference_mode():
            model(input_ids=prefix, use_cache=True, **{self.cache_argument: self.cache})
        self.write_positions = [
            layer.cumulative_length for layer in self.cache.layers if hasattr(layer, "cumulative_length")
        ]
        self.input_ids = random_ids(batch, tokens, model.config.vocab_size, seed + 1).to(device)  # [B, T]
        self.cache_position = torch.arange(context, context + tokens, device=device)  # [T]
        self.position_ids = self.cache_position.unsqueeze(0).expand(batch, -1).contiguous()  # [B, T]

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        for position in self.write_positions:
            position.fill_(self.context)
        return self.model(
            input_ids=self.input_ids,
            cache_position=self.cache_position,
            position_ids=self.position_ids,
            use_cache=True,
            **{self.cache_argument: self.cache},
        ).logits  # [B, T, V]

    def captured(self) -> Step:
        """This step captured in a CUDA graph (after warm-up passes on a side stream); returns its replay."""
        from specdec.engine.cuda_graph_steps import capture_graph

        replay, _ = capture_graph(self, warmups=3)
        return replay


def load_project_model(model: PreTrainedModel, tokenizer, name: str):
    """`model` as the project's runtime holds it (a LoadedModel on the model's device, its KV pool a fixed size: a
    share of the GPU would count the other models this process holds). This switches the model's attention to the
    packed kernel, so time the HF contenders on it first."""
    from specdec.engine.model_runtime import LoadedModel, ModelSettings

    dtype_name = str(model.dtype).removeprefix("torch.")
    settings = ModelSettings(model=name, device=str(model.device), dtype=dtype_name, kv_cache_budget=PROJECT_KV_BYTES)
    return LoadedModel(settings, model, tokenizer)


def project_step(loaded, batch: int, context: int, drafted: int, seed: int = 0, graphs: bool = False) -> Step:
    """The project's step on a LoadedModel: `batch` sessions holding `context` tokens, each feeding its last
    token plus `drafted` new ones in one packed pass, then rolled back to `context`; eager, or (graphs) through
    the model's captured CUDA graphs."""
    from specdec.engine.kv.session import KVSession, run_forwards

    prompts = random_ids(batch, context, loaded.vocab_size, seed).tolist()
    sessions = [KVSession(loaded, prompt) for prompt in prompts]
    run_forwards([s.plan_prefill() for s in sessions])
    for session in sessions:
        session.next_logits = None  # each step feeds the last token again, as a round in steady state does
    new_tokens = random_ids(1, drafted, loaded.vocab_size, seed + 1)[0].tolist()

    captured = loaded.graph_steps

    def step() -> list[torch.Tensor]:
        loaded.graph_steps = captured if graphs else None
        try:
            logits = run_forwards([s.plan_extend(new_tokens) for s in sessions])  # per row [drafted + 1, V]
        finally:
            loaded.graph_steps = captured
        for session in sessions:
            session.truncate(context)
        return logits

    return step


def project_graph_step(loaded, batch: int, context: int, drafted: int) -> Step | str:
    """The project's step replayed from CUDA graphs, or why there is none (the runtime logged why it captured
    none: not CUDA, not the flex backend, or the capture failed)."""
    if loaded.graph_steps is None:
        return "the runtime captured no CUDA graphs (see its log for why)"
    if not loaded.graph_steps.serves([([0] * (drafted + 1), None, 1)] * batch):
        return f"a step of {batch} x {drafted + 1} tokens is larger than the largest captured bucket"
    return project_step(loaded, batch, context, drafted, graphs=True)
