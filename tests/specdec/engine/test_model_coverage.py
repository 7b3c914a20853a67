"""Which model families the verifier serves, and how: a tiny random model of each, loaded through the start-up
self-test (specdec/engine/packed_self_test.py), then served greedy-identical to transformers' own `generate` in batched
verification rounds with rejected drafts (rollbacks), and a deep rollback past the sliding window where the
model has one (window 8 here). The README's table of models served lists the same outcomes."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import word_tokenizer

from specdec.decoding.verification import VerifyJob, verify_rounds
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams

VOCAB = 64
WINDOW = 8
NEW_TOKENS = 24
PROMPTS = ([5, 9, 2], [7, 3, 11, 40, 2, 19, 33, 8, 1], [12, 60, 4, 4, 9, 31, 2, 27, 50, 6, 3, 17, 44, 8])
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=256, initializer_range=0.4)
PACKED = "packed"

# family: (its tiny config, PACKED or a phrase of the reason it runs one sequence per pass)
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(**SHAPE, **IDS, num_key_value_heads=2), PACKED),
    "qwen2": (lambda: transformers.Qwen2Config(**SHAPE, **IDS, num_key_value_heads=1), PACKED),
    "qwen3": (lambda: transformers.Qwen3Config(**SHAPE, **IDS, num_key_value_heads=1, head_dim=16), PACKED),
    "mistral_sliding_window": (
        lambda: transformers.MistralConfig(**SHAPE, **IDS, num_key_value_heads=1, sliding_window=WINDOW),
        PACKED,
    ),
    "gemma2": (
        lambda: transformers.Gemma2Config(**SHAPE, **IDS, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW),
        "soft-capping",
    ),
    "gemma3": (
        lambda: transformers.Gemma3TextConfig(
            **SHAPE, **IDS, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2
        ),
        PACKED,
    ),
    "phi3_sliding_window": (
        lambda: transformers.Phi3Config(**SHAPE, **IDS, num_key_value_heads=2, sliding_window=WINDOW),
        PACKED,
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=256, bos_token_id=0, eos_token_id=0,
            initializer_range=0.4,
        ),
        PACKED,
    ),
    "opt": (
        lambda: transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
            word_embed_proj_dim=32, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            init_std=0.4,
        ),
        PACKED,
    ),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**SHAPE, **IDS), PACKED),
    "falcon": (
        lambda: transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, bos_token_id=0,
            eos_token_id=0, pad_token_id=0, max_position_embeddings=256, initializer_range=0.4,
        ),
        "a packed pass raises",
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(
            **SHAPE, **IDS, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2
        ),
        PACKED,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model directory, expected outcome) of one family's tiny random model."""
    make_config, expected = FAMILIES[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config()).eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    word_tokenizer(VOCAB).save_pretrained(directory)
    return directory, expected


def generate_reference(directory, prompt: list[int]) -> list[int]:
    """transformers' own greedy generate, with the model's own attention, on a fresh load."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    output = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return output[0, len(prompt) :].tolist()


def serve_until(sessions: list[KVSession], expected: list[list[int]], prompts, target_len: int) -> None:
    """Batched verification rounds of γ = 3 drafted from the expected continuation, every other round with its
    last draft wrong (so it is rejected and the session rolls back), until each session holds target_len tokens."""
    greedy = SamplingParams()
    for round_index in range(4 * NEW_TOKENS):
        live = [i for i, s in enumerate(sessions) if len(s) < target_len]
        if not live:
            return
        jobs = []
        for i in live:
            done = len(sessions[i]) - len(prompts[i])
            drafts = list(expected[i][done : done + 3])
            if drafts and round_index % 2:
                drafts[-1] = (drafts[-1] + 1) % VOCAB
            jobs.append(VerifyJob(sessions[i], str(i), len(sessions[i]), drafts, None, greedy))
        for outcome in verify_rounds(jobs):
            assert not isinstance(outcome, Exception), outcome
    raise AssertionError("the sessions did not reach their length")


def test_each_family_is_served_packed_or_unpacked_with_its_reason_and_matches_generate(family):
    directory, expected_path = family
    serve_and_compare(LoadedModel.load(ModelSettings(str(directory))), directory, expected_path)


@pytest.mark.parametrize("backend", [AttentionBackendChoice.SDPA, AttentionBackendChoice.FLEX], ids=lambda b: b.value)
def test_each_family_matches_generate_through_the_sdpa_and_flex_backends(family, backend):
    directory, expected_path = family
    target = LoadedModel.load(ModelSettings(str(directory), attention_backend=backend))
    assert not target.packed or target.attention_backend.name == backend.value
    serve_and_compare(target, directory, expected_path)


def serve_and_compare(target: LoadedModel, directory, expected_path: str) -> None:
    """The target is served packed or not as expected, and its greedy verification rounds, with rollbacks past the
    window, commit generate()'s tokens."""
    if expected_path == PACKED:
        assert target.packed, target.unpacked_reason
    else:
        assert not target.packed and expected_path in target.unpacked_reason
    expected = [generate_reference(directory, prompt) for prompt in PROMPTS]
    sessions = [KVSession(target, prompt) for prompt in PROMPTS]
    for session in sessions:
        session.prefill()
    lengths = [len(prompt) + len(tokens) for prompt, tokens in zip(PROMPTS, expected)]
    serve_until(sessions, expected, PROMPTS, max(lengths))
    for session, prompt, tokens in zip(sessions, PROMPTS, expected):
        assert session.tokens[len(prompt) : len(prompt) + len(tokens)] == tokens
    for session, prompt in zip(sessions, PROMPTS):  # a rollback deep past the window, then the same again
        session.truncate(len(prompt) + 2)
    serve_until(sessions, expected, PROMPTS, max(lengths))
    for session, prompt, tokens in zip(sessions, PROMPTS, expected):
        assert session.tokens[len(prompt) : len(prompt) + len(tokens)] == tokens
