"""How a model service runs its passes: the attention backend, CUDA graphs and the model thread's CPU cores (a base
of each one's settings)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.settings import setting
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.cpu_affinity import parse_cpus


@dataclass(frozen=True)
class ExecutionSettings:
    """The pass-execution part of a model service's settings."""

    attention_backend: AttentionBackendChoice = setting(
        AttentionBackendChoice.AUTO,
        "how packed passes attend: kernel (CPU float32: the compiled kernel, built on first start, for short rows), "
        "sdpa, flex (FlexAttention, one call per layer), or auto (kernel on CPU float32, flex on CUDA, else sdpa)",
    )
    cuda_graphs: bool = setting(
        True,
        "CUDA with the flex backend on one GPU: replay decode and verify steps from CUDA graphs captured at start-up "
        "(--no-cuda-graphs runs every step eagerly)",
    )
    cuda_graph_max_tokens: int = setting(256, "largest step (tokens over all its rows) replayed from a CUDA graph")
    float32_logits: bool = setting(
        True,
        "CUDA with bfloat16 or float16 weights: the LM head's products come out in float32, so near-tied logits "
        "are not rounded to 16 bits before the argmax (docs/architecture.md, 'Exactness in 16-bit weights')",
    )
    model_cpus: str = setting(
        "",
        "CPU cores the model thread (and the torch threads it starts) runs on, e.g. '1'; with --cpus naming other "
        "cores, the serving threads (gRPC, event loop) stay off the model's cores (empty: the service's --cpus)",
    )
    model_process: bool = setting(
        False,
        "run the model's passes in a process of its own (weights and keys/values there, block tables here), so the "
        "serving threads never hold a pass up (packed CPU models on one rank; refused on CUDA; docs/architecture.md, "
        "'The model process')",
    )

    def model_thread_cpus(self) -> frozenset[int]:
        """--model-cpus as a set of cores (empty: the thread keeps the process's)."""
        return frozenset(parse_cpus(self.model_cpus, "model_cpus")) if self.model_cpus else frozenset()
