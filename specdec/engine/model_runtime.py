"""Loading a causal LM with its tokenizer, and the settings that say where and how it runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specdec.engine.attention.flex_layout import flex_block_size_refusal
from specdec.engine.attention.selection import AttentionBackendChoice, choose_attention_backend
from specdec.engine.borrowed_embeddings import embeddings_source, use_borrowed_embeddings
from specdec.engine.cpu_linears import use_onednn_linears
from specdec.engine.cuda_graph_steps import CudaGraphSteps, cuda_graphs_refusal
from specdec.engine.direct_forward import direct_forward_refusal
from specdec.engine.draft_kernels import runs_bf16_products, use_draft_kernels, use_float32_layer_products
from specdec.engine.float32_head import use_float32_head
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.kv.budget import make_pool, release_cached_memory
from specdec.engine.kv.pool import KVPool, SequenceKV
from specdec.engine.packed_forward import PACKED_ATTENTION, packed_forward, packed_forward_refusal
from specdec.engine.packed_self_test import (
    UnsupportedModelError,
    cached_mismatch,
    logits_dtype,
    packed_mismatch,
    plain_logits,
    probe_tokens,
)
from specdec.engine.packed_step import AttentionBackend
from specdec.engine.subset_head import read_head_ids, use_subset_head

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSettings:
    """Where a model comes from and how it runs."""

    model: str  # local directory, hub id or GGUF file
    gguf_file: str = ""  # a GGUF file inside the `model` directory (specdec/engine/gguf_checkpoint.py)
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str = "float32"  # a key of DTYPES
    threads: int = 0  # intra-op CPU threads; 0 keeps torch's default
    attention_backend: AttentionBackendChoice = AttentionBackendChoice.AUTO  # how packed passes attend
    cuda_graphs: bool = True  # CUDA, flex, one GPU: decode and verify steps replayed from captured graphs
    cuda_graph_max_tokens: int = 256  # largest step replayed from a graph
    kv_cache_budget: float = 0.5  # KV cache bytes, or (at most 1) a share of memory (specdec/engine/kv/budget.py)
    kv_block_size: int = 16  # positions per KV cache block
    draft_kernels: bool = (
        False  # CPU float32 Llama drafts: fused products, bfloat16 ones (specdec/engine/draft_kernels.py)
    )
    float32_logits: bool = True  # CUDA, 16-bit weights: the LM head's products come out in float32
    model_process: bool = False  # passes in a process of their own (specdec/engine/model_process.py); not on CUDA

    def __post_init__(self) -> None:
        """Refuses what cannot run, before any weight is loaded (ValueError naming the setting's flag)."""
        cuda = self.device.split(":")[0] == "cuda"
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size} (--kv-block-size)")
        flex = self.attention_backend is AttentionBackendChoice.FLEX or (
            self.attention_backend is AttentionBackendChoice.AUTO and cuda
        )
        refusal = flex_block_size_refusal(self.kv_block_size) if flex and cuda else None
        if refusal is not None:
            raise ValueError(f"kv_block_size {self.kv_block_size}: {refusal} (--kv-block-size)")
        if self.model_process and cuda:
            raise ValueError(
                f"model_process is for CPU models, not {self.device}: a model process resizes its KV pool to the "
                "serving process's, which would move the buffers CUDA graphs replay into (drop --model-process)"
            )

    @classmethod
    def of(cls, service_settings: object) -> ModelSettings:
        """The model part of a service's settings: its fields of the same names. One it lacks raises
        AttributeError, except those only some services offer (SERVICE_OPTIONAL), which keep their defaults."""
        names = [
            field.name
            for field in dataclasses.fields(cls)
            if field.name not in SERVICE_OPTIONAL or hasattr(service_settings, field.name)
        ]
        return cls(**{name: getattr(service_settings, name) for name in names})


SERVICE_OPTIONAL = frozenset(
    {"draft_kernels", "gguf_file"}
)  # the draft service's alone: a target never gets a draft's kernels


class TokenizerMismatchError(ValueError):
    """Draft and target do not share a tokenizer, so their distributions are not comparable."""


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of the token -> id map, independent of dict order."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class VocabularyIdentity:
    """What must agree between a draft and a target: the tokenizer, and so the ids served (vocab_size)."""

    model_id: str
    vocab_size: int  # ids served: the tokenizer's (embedding rows past it are padding, never served)
    tokenizer_sha256: str


def check_same_vocabulary(target: VocabularyIdentity, draft: VocabularyIdentity) -> None:
    """Refuses a draft/target pair whose tokenizers differ, saying what differs. Models that share a tokenizer but
    pad their embedding matrices to different sizes agree: each serves the tokenizer's ids only."""
    if target.tokenizer_sha256 != draft.tokenizer_sha256:
        raise TokenizerMismatchError(
            f"token->id map differs: target {target.model_id!r} sha256 {target.tokenizer_sha256[:12]}…, "
            f"draft {draft.model_id!r} sha256 {draft.tokenizer_sha256[:12]}…"
        )
    if target.vocab_size != draft.vocab_size:  # one tokenizer, so only a model-free drafter's setting can differ
        raise TokenizerMismatchError(
            f"vocabulary size differs: target {target.model_id!r} serves {target.vocab_size} ids, "
            f"draft {draft.model_id!r} {draft.vocab_size}"
        )


Cache = DynamicCache | SequenceKV


class LoadedModel:
    """A causal LM and its tokenizer, ready for cached forward passes on one device.

    Models whose attention the packed forward reproduces run packed (specdec/engine/packed_forward.py): their caches are
    SequenceKV block tables in one paged pool under the settings' budget, and `forward_rows` runs many sequences in
    one pass. Others keep a DynamicCache and run one sequence per pass; `unpacked_reason` says why. A start-up
    self-test decides (specdec/engine/packed_self_test.py).
    """

    def __init__(self, settings: ModelSettings, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(settings.device)
        # Ids served: the tokenizer's, of the embedding's rows (a matrix padded past the tokenizer, e.g. Qwen2.5-7B's
        # 152,064 rows for 151,665 ids, has rows no token names). Logits are cut to this width, so padded ids
        # are never drafted or sampled and a draft and a target that share a tokenizer have the same width.
        self.vocab_size: int = min(model.config.vocab_size, len(tokenizer))
        self.max_context_tokens: int = model.config.max_position_embeddings
        self.identity = VocabularyIdentity(settings.model, self.vocab_size, tokenizer_sha256(tokenizer))
        self.eos_token_ids: frozenset[int] = frozenset(_eos_ids(model, tokenizer))
        self.packed = False
        self.kv_pool: KVPool | None = None  # every sequence's keys and values; None: not packed
        self.attention_backend: AttentionBackend | None = None  # how packed passes attend; None: not packed
        self.graph_steps: CudaGraphSteps | None = None  # decode and verify steps from CUDA graphs; None: eager
        self.float32_logits = settings.float32_logits and use_float32_head(model)  # the head writes float32
        self.unpacked_reason = self._choose_forward_path()  # None: packed
        if self.unpacked_reason is not None:
            log.warning("%s runs one sequence per pass: %s", settings.model, self.unpacked_reason)

    def _choose_forward_path(self) -> str | None:
        """Runs the start-up self-test (specdec/engine/packed_self_test.py) and leaves the model on the packed path
        (returns None) or on the cached one (returns why not packed). Raises UnsupportedModelError when neither
        reproduces the model's own pass.

        In this order (docs/architecture.md, "The KV cache"): the self-test, on a probe pool of its own; then, once
        packing is accepted, the KV pool sized by the budget and (on CUDA) allocated whole; then the CUDA graphs,
        captured on that pool. A model refused packing never allocates the pool."""
        ids = probe_tokens(self.vocab_size)
        reference = plain_logits(self.model, ids, self.device)[:, : self.vocab_size]  # [T, V served]
        reason = packed_forward_refusal(self.model.config)
        if reason is None:
            own_attention = self.model.config._attn_implementation
            backend = self._attention_backend()
            self.model.set_attn_implementation(PACKED_ATTENTION)
            reason = packed_mismatch(self.model, backend, self.settings.kv_block_size, self.device, ids, reference)
            if reason is not None and runs_bf16_products(self.model):
                # A draft whose bfloat16 products drift past the tolerance computes in float32 and stays packed.
                log.warning("%s: bfloat16 layer products refused (%s); float32 ones", self.settings.model, reason)
                use_float32_layer_products(self.model)
                self.model.set_attn_implementation(own_attention)
                reference = plain_logits(self.model, ids, self.device)[:, : self.vocab_size]
                self.model.set_attn_implementation(PACKED_ATTENTION)
                reason = packed_mismatch(self.model, backend, self.settings.kv_block_size, self.device, ids, reference)
            if reason is None:
                self.use_packed_forward(backend)
            else:
                self.use_cached_forward(own_attention)
        if reason is not None:
            broken = cached_mismatch(self.forward, self.new_cache(), logits_dtype(self.model), ids, reference)
            if broken is not None:
                raise UnsupportedModelError(
                    f"model {self.settings.model!r} cannot be served: packed forward refused ({reason}); "
                    f"cached forward refused ({broken})"
                )
        return reason

    def _attention_backend(self) -> AttentionBackend:
        """The settings' attention backend for this model's device, dtype and head size; logs it and why."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads)
        choice = self.settings.attention_backend
        backend, why = choose_attention_backend(choice, self.device, self.model.dtype, head_dim)
        log.info("%s attends through the %s backend (%s)", self.settings.model, backend.name, why)
        return backend

    def use_packed_forward(self, backend: AttentionBackend) -> None:
        """Many sequences per pass from now on, attending through `backend`: the KV pool, then the graphs."""
        not_direct = direct_forward_refusal(self.model)
        how = (
            "direct (specdec/engine/direct_forward.py)" if not_direct is None else f"through its modules: {not_direct}"
        )
        log.info("%s runs packed passes %s", self.settings.model, how)
        self.model.set_attn_implementation(PACKED_ATTENTION)
        self.attention_backend = backend
        self.packed = True
        self.kv_pool = self._allocated_pool()  # every sequence's keys/values on this model
        self.graph_steps = self._captured_steps()

    def _captured_steps(self) -> CudaGraphSteps | None:
        """Decode and verify steps captured as CUDA graphs where they can be (CUDA, flex, one process), else None;
        logs the choice."""
        why_not = cuda_graphs_refusal(self.settings, self.device, self.attention_backend)
        if why_not is None:
            steps = CudaGraphSteps(
                self.model,
                self.kv_pool,
                self.attention_backend,
                self.settings.cuda_graph_max_tokens,
                self.max_context_tokens,
            )
            try:
                steps.capture()
                return steps
            except Exception as error:  # noqa: BLE001 - serving eagerly is correct, only slower
                why_not = f"capture failed: {error!r}"
        log.info("%s runs every step eagerly: %s", self.settings.model, why_not)
        return None

    def use_cached_forward(self, attention: str) -> None:
        """One sequence per pass from now on, on DynamicCache, with the model's own `attention` implementation; a
        KV pool held so far goes back to the device."""
        self.model.set_attn_implementation(attention)
        self.attention_backend = None
        self.graph_steps = None
        self.kv_pool = None
        self.packed = False
        release_cached_memory(self.device)

    def _allocated_pool(self) -> KVPool:
        """The model's paged KV pool, as many blocks as the budget buys once the self-test has run (the memory it
        held is back); where the pool is held whole (CUDA), its buffers are allocated now, by a one-token pass
        through every layer, so what serving needs is held before it starts."""
        release_cached_memory(self.device)
        settings = self.settings
        pool = make_pool(settings.kv_cache_budget, self.model, self.device, settings.kv_block_size, settings.model)
        if pool.preallocated:
            sequence = pool.new_sequence()
            packed_forward(self.model, [([0], sequence, 1)], self.device, self.attention_backend)
            del sequence  # its block goes back; the buffers stay
        return pool

    @classmethod
    def load(cls, settings: ModelSettings, **from_pretrained_kwargs) -> LoadedModel:
        """Loads weights and tokenizer from a local directory, hub id (no download happens offline) or GGUF file
        (dequantized on first use, specdec/engine/gguf_checkpoint.py). A directory that borrows its target's
        embeddings gets them (specdec/engine/borrowed_embeddings.py); one with a subset head's ids gets that head
        (specdec/engine/subset_head.py)."""
        if settings.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {settings.dtype!r}")
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        started = time.perf_counter()
        source = resolve_model(settings.model, settings.gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[settings.dtype], **from_pretrained_kwargs)
        borrowed = embeddings_source(source)
        if borrowed is not None:
            use_borrowed_embeddings(model, borrowed)
        if "tp_plan" not in from_pretrained_kwargs:
            model = model.to(settings.device)
            use_onednn_linears(model)
            if settings.draft_kernels:
                use_draft_kernels(model)
            head_ids = read_head_ids(source)
            if head_ids is not None:
                use_subset_head(model, head_ids)
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "loaded %s (%.1fM params, %s, %s) in %.1fs",
            settings.model,
            params / 1e6,
            settings.dtype,
            settings.device,
            time.perf_counter() - started,
        )
        return cls(settings, model, tokenizer)

    def new_cache(self) -> Cache:
        """An empty KV cache for one sequence."""
        if self.packed:
            return self.kv_pool.new_sequence()
        return DynamicCache()  # full layers, even for sliding-window models: a rollback may go past the window

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Runs input_ids [1, T] after the cached prefix, extending the cache; returns float32 logits [T, V]."""
        if self.packed:
            return self.forward_rows([(input_ids[0].tolist(), cache, input_ids.shape[1])])[0]
        output = self.model(input_ids=input_ids.to(self.device), cache=cache, use_cache=True)
        return output.logits[0, :, : self.vocab_size].float()

    def forward_rows(self, rows: Sequence[tuple[Sequence[int], Cache, int]]) -> list[torch.Tensor]:
        """Runs several sequences' new tokens, each after its own cached prefix: one packed pass when the model
        packs, else one pass per row. rows: (token ids, cache, how many last positions need logits); returns
        per row float32 logits [keep, V]."""
        if self.packed:
            if self.graph_steps is not None and self.graph_steps.serves(rows):
                logits = self.graph_steps.forward(rows)
            else:
                logits = packed_forward(self.model, rows, self.device, self.attention_backend)
            return [row_logits[:, : self.vocab_size] for row_logits in logits]
        return forward_each_row(self.forward, rows)


def forward_each_row(
    forward: Callable[[torch.Tensor, Cache], torch.Tensor], rows: Sequence[tuple[Sequence[int], Cache, int]]
) -> list[torch.Tensor]:
    """forward_rows one row per pass: `forward(input_ids [1, T], cache)` -> logits [T, V], last `keep` rows kept."""
    return [forward(torch.tensor([list(ids)], dtype=torch.long), cache)[len(ids) - keep :] for ids, cache, keep in rows]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found
