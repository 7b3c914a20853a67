"""The twin's hardware profiles: which models run on which GPUs, with the figures the cost model reads.

A profile pairs a target placement (a model shape on one or more GPUs under tensor parallelism) with a draft
placement. The figures are data-sheet peaks and achieved shares; docs/architecture.md ("The accelerator twin")
works each profile's step time out by hand. `--device sim:PROFILE[:VOCAB]` names a profile and, optionally, how
many token ids the twin serves (the cost model charges the profile's whole vocabulary either way).
"""

from __future__ import annotations

from dataclasses import dataclass

SIM_PREFIX = "sim:"
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One accelerator's data-sheet peaks and the shares of them a serving engine achieves."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float  # memory bandwidth, peak
    bf16_flops_per_s: float  # dense bfloat16 tensor throughput, peak
    bandwidth_share: float = 0.8  # achieved share of the bandwidth on a decode step
    compute_share: float = 0.7  # achieved share of the tensor throughput on large products


H100 = Gpu("H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12)
L40S = Gpu("L40S 48GB", 48 * GIB, 864e9, 362e12)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that set what one pass reads and computes (bfloat16 weights)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_context: int = 131072
    bytes_per_value: int = 2  # bfloat16 weights and KV cache

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention projections and the gated MLP (norms are negligible)."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters: the layers, the embedding and (untied) the LM head."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + head

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_value

    @property
    def bytes_read_per_pass(self) -> int:
        """Weight bytes a pass streams from memory: all but an untied embedding table, of which a pass gathers only
        its tokens' rows (a tied table is read whole as the LM head)."""
        gathered_only = 0 if self.tied_embeddings else self.embedding_params
        return (self.params - gathered_only) * self.bytes_per_value

    @property
    def kv_bytes_per_position(self) -> int:
        """Keys and values of one position in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value


LLAMA_70B = ModelShape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, tied_embeddings=False)
LLAMA_8B = ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, tied_embeddings=False)
LLAMA_1B = ModelShape("Llama-3.2-1B", 16, 2048, 8192, 32, 8, 64, 128256, tied_embeddings=True)
# A small draft sharing the Llama-3 vocabulary (12 layers of width 1024, 0.32B parameters), as one would distil for
# an 8B target; no such checkpoint is implied, only its shape.
SMALL_DRAFT = ModelShape("draft-0.3B", 12, 1024, 4096, 16, 8, 64, 128256, tied_embeddings=True)


@dataclass(frozen=True)
class Placement:
    """A model on `tensor_parallel` GPUs of one kind: what a pass costs besides reading and computing."""

    model: ModelShape
    gpu: Gpu
    tensor_parallel: int = 1
    launch_s: float = 50e-6  # a pass's fixed cost: graph launch, the one host read, scheduling
    all_reduce_latency_s: float = 10e-6  # one all-reduce of a few KB over NVLink (NCCL, 4 GPUs)
    all_reduce_bytes_per_s: float = 360e9  # NVLink bus bandwidth an all-reduce of many tokens reaches

    @property
    def free_memory_bytes(self) -> int:
        """Memory the placement's GPUs hold beside the weights: what a KV budget share is taken of."""
        return max(0, self.tensor_parallel * self.gpu.memory_bytes - self.model.weight_bytes)


@dataclass(frozen=True)
class Profile:
    """A deployment to twin: the target's placement and the draft's."""

    name: str
    target: Placement
    draft: Placement

    def placement(self, role: str) -> Placement:
        if role not in ROLES:
            raise ValueError(f"model: with --device {SIM_PREFIX}{self.name}, name the role: target or draft")
        return self.target if role == "target" else self.draft


ROLES = ("target", "draft")
PROFILES = {
    profile.name: profile
    for profile in (
        Profile(
            "llama70b-tp4-h100",
            Placement(LLAMA_70B, H100, tensor_parallel=4, launch_s=300e-6),
            Placement(LLAMA_1B, L40S),
        ),
        Profile("llama8b-h100", Placement(LLAMA_8B, H100, launch_s=300e-6), Placement(SMALL_DRAFT, L40S)),
    )
}


@dataclass(frozen=True)
class TwinDevice:
    """A parsed `sim:PROFILE[:VOCAB]`: the profile and the number of token ids the twin serves."""

    profile: Profile
    served_vocab: int

    @property
    def spec(self) -> str:
        """The canonical device string."""
        return f"{SIM_PREFIX}{self.profile.name}:{self.served_vocab}"


def is_simulated(device: str) -> bool:
    return device.startswith(SIM_PREFIX)


def parse_twin_device(device: str, field: str = "device") -> TwinDevice:
    """`sim:PROFILE` or `sim:PROFILE:VOCAB` -> TwinDevice; ValueError naming `field` for anything else."""
    if not is_simulated(device):
        raise ValueError(f"{field}: {device!r} is not a twin device ({SIM_PREFIX}PROFILE[:VOCAB])")
    name, _, vocab = device.removeprefix(SIM_PREFIX).partition(":")
    if name not in PROFILES:
        raise ValueError(f"{field}: unknown twin profile {name!r}; choose from {', '.join(PROFILES)}")
    profile = PROFILES[name]
    full = profile.target.model.vocab
    try:
        served = int(vocab) if vocab else full
    except ValueError:
        raise ValueError(f"{field}: the served vocabulary in {device!r} must be an integer") from None
    if not MIN_SERVED_VOCAB <= served <= full:
        raise ValueError(f"{field}: the served vocabulary must lie in [{MIN_SERVED_VOCAB}, {full}], got {served}")
    return TwinDevice(profile, served)


MIN_SERVED_VOCAB = 8192  # the byte-level BPE the twin's tokenizer starts from (specdec/engine/simulated/tokenizer.py)
