"""Constrained and penalised rounds in process: speculation changes the speed only.

Held to: greedy speculative decoding with a JSON schema, a regex or penalties equals plain decoding under the same
rules, token for token, and the JSON parses and validates; sampled output under a regex constraint and under
penalties and min_p passes Pearson's chi-square test (significance 0.001) against the exact distribution of its
first two tokens, computed here from the target's logits with the rules written out afresh (a repeat-rewarding penalty
and min_p, whose effect on the pairs is clear of noise); a constraint the
vocabulary cannot satisfy ends with a dead end on both paths; a cursor moved back and forth masks as a fresh one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

import jsonschema
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import noisy_copy, save, tiny_llama

from specdec.decoding.drafting import DraftRun
from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import REPO_ROOT
from specdec.sampling.constraints import ConstraintCompiler, ConstraintKind, ConstraintSpec
from specdec.sampling.rules import SamplingParams, SamplingRule
from specdec.sampling.sequence_rules import session_rules, shape_step

DEMO_TOKENIZER = REPO_ROOT / "models" / "demo-target"
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50}},
                "required": ["n"],
            },
        },
        "required": ["name", "tags", "inner"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1, "maxItems": 4},
]
REGEX = "(ab|cd|ef)[0-9]{1,3}"
ALPHA = 0.001
NO_PENALTIES = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
SAMPLES = 1200


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random target and its noisy-copy draft over the demo tokenizer (8,192 byte-level BPE ids), loaded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    root = tmp_path_factory.mktemp("byte_pair")
    target = tiny_llama(len(tokenizer), hidden=32, layers=2, seed=3)
    draft = noisy_copy(target, 0.2, seed=4)
    target_dir, draft_dir = save(target, tokenizer, root / "target"), save(draft, tokenizer, root / "draft")
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))


@pytest.fixture(scope="module")
def compiler(pair) -> ConstraintCompiler:
    target = pair[0]
    return ConstraintCompiler(target.tokenizer, target.vocab_size, target.eos_token_ids)


def both_ways(pair, compiler, params, spec, prompt, max_new_tokens=48, gamma=4):
    """(plain, speculative) GenerationResults under the same rules, each side with its own cursor."""
    target, draft = pair

    def rules():
        return session_rules(compiler, params, len(prompt), spec)

    plain = target_only_generate(target, prompt, params, max_new_tokens, rules=rules())
    speculative = speculative_generate(
        target, draft, prompt, gamma, params, max_new_tokens, target_rules=rules(), draft_rules=rules()
    )
    return plain, speculative


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array"])
def test_greedy_json_schema_equals_plain_and_validates(pair, compiler, schema):
    spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    tokenizer = pair[0].tokenizer
    for prompt_text in ("data = ", "x", "{"):
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        plain, speculative = both_ways(pair, compiler, SamplingParams(), spec, prompt, max_new_tokens=120)
        assert speculative.token_ids == plain.token_ids
        assert plain.finished_by_eos, "the schema's output is bounded: it must end"
        jsonschema.validate(json.loads(tokenizer.decode(plain.token_ids, skip_special_tokens=True)), schema)
        assert speculative.stats.drafted > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=1.2, presence_penalty=0.5),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.4),
    ],
    ids=["repetition", "frequency+presence", "rewarding"],
)
def test_greedy_penalties_equal_plain(pair, compiler, params):
    spec = ConstraintSpec(ConstraintKind.REGEX, REGEX) if params.repetition_penalty == 0.7 else None
    saw_change = False
    for seed in range(3):
        prompt = [(seed * 37 + 11 * i) % 8000 + 1 for i in range(9)]
        plain, speculative = both_ways(pair, compiler, params, spec, prompt, max_new_tokens=32)
        assert speculative.token_ids == plain.token_ids
        unpenalised = target_only_generate(pair[0], prompt, SamplingParams(), 32)
        saw_change |= unpenalised.token_ids != plain.token_ids
    assert saw_change, "the penalties changed no output: the test cannot tell"


def test_dead_end_ends_both_paths(tiny_pair):
    """A word-level vocabulary cannot spell 'x': after 'w1' the constraint allows no token."""
    target, draft = tiny_pair
    compiler = ConstraintCompiler(target.tokenizer, target.vocab_size, target.eos_token_ids)
    spec = ConstraintSpec(ConstraintKind.REGEX, "w1x")
    prompt = [3, 4, 5]
    plain, speculative = both_ways((target, draft), compiler, SamplingParams(), spec, prompt)
    assert plain.token_ids == speculative.token_ids == [1]
    assert plain.dead_end and speculative.dead_end


def test_cursor_rolled_back_masks_as_fresh(compiler, pair):
    tokenizer = pair[0].tokenizer
    spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[0]))
    text = '{"name":"ab","tags":["red"],"inner":{"n":12}}'
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    moved = compiler.cursor(spec)
    for length in (len(tokens), 3, len(tokens) - 2, 0, 7):  # forward, back, forward, back to the start, forward
        moved.sync(tokens[:length])
    forked = moved.fork()
    for cut in (7, 4, len(tokens)):
        expected, _ = compiler.cursor(spec).block_mask(tokens[:cut], tokens[cut:], len(tokens) - cut + 1)
        assert torch.equal(moved.block_mask(tokens[:cut], tokens[cut:], len(tokens) - cut + 1)[0], expected)
        assert torch.equal(forked.block_mask(tokens[:cut], tokens[cut:], len(tokens) - cut + 1)[0], expected)


def allowed(compiler, spec, generated) -> torch.Tensor:
    """[V] bool: the tokens the constraint allows after `generated` (a fresh cursor, bit by bit)."""
    mask, _ = compiler.cursor(spec).block_mask(generated, [], 1)
    bits = torch.arange(compiler.vocab_size)
    return ((mask[0, bits // 32] >> (bits % 32)) & 1).bool()


@torch.no_grad()
def exact_row(model, sequence, prompt_len, params, compiler=None, spec=None) -> torch.Tensor:
    """[V] float64: the next-token distribution after `sequence`, rules written out plainly (vLLM's order)."""
    logits = model.model(torch.tensor([sequence])).logits[0, -1, : model.vocab_size].double()
    output = sequence[prompt_len:]
    for token in set(sequence):
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    if spec is not None:
        logits[~allowed(compiler, spec, output)] = -math.inf
    probs = torch.softmax(logits / params.temperature, -1)
    if params.min_p:
        probs[probs < params.min_p * probs.max()] = 0
        probs /= probs.sum()
    return probs


def pair_distribution(model, prompt, params, compiler=None, spec=None, top=6) -> dict:
    """{(t1, t2): probability} over the `top` most likely first tokens, and {t1: p} for the rest."""
    first = exact_row(model, prompt, len(prompt), params, compiler, spec)
    cells = {}
    for t1 in first.argsort(descending=True)[:top].tolist():
        second = exact_row(model, [*prompt, t1], len(prompt), params, compiler, spec)
        cells.update({(t1, t2): float(first[t1] * p) for t2, p in enumerate(second.tolist()) if p > 0})
    return cells


def chi_square(observed: collections.Counter, cells: dict, total: int) -> tuple[float, int]:
    """p-value of observed pairs against the cells' probabilities; every pair outside the cells kept (expected 5
    times or more) goes to one pooled cell, itself folded into the smallest cell when expected fewer than 5 times."""
    kept = [cell for cell, p in cells.items() if p * total >= 5]
    expected = [cells[c] * total for c in kept]
    counts = [observed.get(c, 0) for c in kept]
    rest_expected, rest_count = total - sum(expected), total - sum(counts)
    if rest_expected >= 5:
        expected.append(rest_expected)
        counts.append(rest_count)
    else:
        smallest = expected.index(min(expected))
        expected[smallest] += rest_expected
        counts[smallest] += rest_count
    return float(chisquare(counts, [e * total / sum(expected) for e in expected]).pvalue), len(kept)


@pytest.mark.parametrize(
    "params, constrained",
    [
        (SamplingParams(temperature=1.0), True),
        (SamplingParams(temperature=1.0, rule=SamplingRule.COUPLED), True),
        (SamplingParams(temperature=1.0, repetition_penalty=0.5, frequency_penalty=-1.0, min_p=0.05), False),
        (
            SamplingParams(
                temperature=1.0, repetition_penalty=0.5, frequency_penalty=-1.0, min_p=0.05, rule=SamplingRule.COUPLED
            ),
            False,
        ),
    ],
    ids=["regex-rejection", "regex-coupled", "penalties-rejection", "penalties-coupled"],
)
def test_sampled_pairs_follow_the_exact_distribution(pair, compiler, params, constrained):
    target = pair[0]
    spec = ConstraintSpec(ConstraintKind.REGEX, REGEX) if constrained else None
    prompt = [5, 9, 5, 9, 5, 9, 52] if not constrained else [17, 52]  # the penalised: its pairs spread over cells
    observed = collections.Counter()
    for seed in range(SAMPLES):
        seeded = dataclasses.replace(params, seed=seed)
        rules = [session_rules(compiler, seeded, len(prompt), spec) for _ in range(2)]
        speculative = speculative_generate(target, pair[1], prompt, 2, seeded, 2, *rules)
        observed[tuple(speculative.token_ids[:2])] += 1
    cells = pair_distribution(target, prompt, params, compiler, spec)
    p_value, kept = chi_square(observed, cells, SAMPLES)
    assert kept >= 8, "too few cells for a meaningful test"
    assert p_value > ALPHA, f"p = {p_value:.2g} over {kept} cells"
    if constrained:
        assert all(re.fullmatch("(ab|cd|ef)[0-9]{0,3}", target.tokenizer.decode(list(t))) for t in observed)
    else:  # the reference is the penalised distribution: it differs from the one without the penalties
        plain = pair_distribution(target, prompt, dataclasses.replace(params, **NO_PENALTIES))
        assert sum(abs(cells.get(c, 0.0) - plain.get(c, 0.0)) for c in {*cells, *plain}) / 2 > 0.02


FORCING = "(x|y)\x01\x02\x03"  # after x or y, three control bytes no merge joins, then only the stop token


def test_forced_tokens_are_the_only_allowed_ones_and_take_no_pass(pair, compiler):
    """The drafter takes the tokens the constraint forces beyond its num_tokens, within its budget, with no pass of
    their own (here none at all: the prefill's row drafts the one token, the forced ones stay pending); each is the
    only token a fresh cursor allows where it stands."""
    draft, tokenizer = pair[1], pair[0].tokenizer
    spec = ConstraintSpec(ConstraintKind.REGEX, FORCING)
    control = [
        tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(i))
        for i in tokenizer("\x01\x02\x03", add_special_tokens=False)["input_ids"]
    ]
    prompt = tokenizer("data = ", add_special_tokens=False)["input_ids"]
    for budget, expected_forced in ((8, [*control, *sorted(draft.eos_token_ids)]), (2, control[:2])):
        session = KVSession(draft, prompt)
        session.prefill()
        rules = session_rules(compiler, SamplingParams(), len(prompt), spec)
        run, passes = DraftRun(), 0
        assert run.add("job", session, 1, SamplingParams(), rules=rules, forced_tokens=budget) is None
        finished = []
        while run:
            passes += run.runs_a_pass
            finished += run.step()
        [(_, drafted)] = finished
        assert drafted.token_ids[1:] == expected_forced and passes == 0
        fresh = compiler.cursor(spec)
        for end in range(1, len(drafted.token_ids)):
            mask, _ = fresh.block_mask(drafted.token_ids[:end], [], 1)
            allowed = [t for t in range(compiler.vocab_size) if mask[0, t // 32] >> (t % 32) & 1]
            assert allowed == [drafted.token_ids[end]]


def test_one_mask_for_a_steps_rows_equals_each_rows_own_rules(compiler):
    """shape_step (a drafting step's rows under one bitmask) shapes every row as its own SequenceRules.shape does:
    constraint rows, penalised and min_p rows with or without one, and rows without rules side by side."""
    from transformers import AutoTokenizer

    encode, vocab = AutoTokenizer.from_pretrained(DEMO_TOKENIZER), compiler.vocab_size
    prompt = encode("data = ", add_special_tokens=False)["input_ids"]
    json_spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[0]))
    regex_spec = ConstraintSpec(ConstraintKind.REGEX, REGEX)
    sampled = SamplingParams(temperature=1.0, seed=5, min_p=0.2, repetition_penalty=1.3, presence_penalty=0.5)
    rows = [  # (params, constraint, output so far)
        (SamplingParams(), json_spec, '{"name": "ab'),
        (sampled, regex_spec, "cd1"),
        (SamplingParams(), None, "x"),
        (sampled, None, "y = y"),
        (SamplingParams(), json_spec, ""),
    ]
    sequences = [prompt + encode(text, add_special_tokens=False)["input_ids"] for _, _, text in rows]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(7))  # [K, V]
    each = [session_rules(compiler, params, len(prompt), spec) for params, spec, _ in rows]
    step = shape_step(
        [session_rules(compiler, params, len(prompt), spec) for params, spec, _ in rows], logits, sequences
    )
    assert step.ended == {}
    for row, (rules, tokens) in enumerate(zip(each, sequences)):
        expected = logits[row : row + 1] if rules is None else rules.shape(logits[row : row + 1], tokens, len(tokens))
        own = expected if isinstance(expected, torch.Tensor) else expected.logits
        assert torch.equal(step.logits[row], own[0].float()), f"row {row}"
    allowed = (step.logits > float("-inf")).sum(dim=-1).tolist()  # [K]
    assert allowed[2] == vocab and 0 < allowed[0] < vocab and 0 < allowed[1] < vocab, allowed


def test_forced_text_is_spelled_as_the_tokenizer_writes_it_while_the_target_keeps_it(pair):
    """Where the constraint allows several tokens but forces the text ahead, the drafter's forced tokens are that
    text as the tokenizer spells it (a guess the verifier judges), while the record of spelled tokens says they are
    committed often enough; past that, only single forced ids."""
    compiler = ConstraintCompiler(pair[0].tokenizer, pair[0].vocab_size, pair[0].eos_token_ids)  # its own record
    spec = ConstraintSpec(ConstraintKind.REGEX, "(a|b)config_name = [0-9]")
    vocabulary = compiler.spelling
    after_a = vocabulary.encode("a")
    spelled = vocabulary.encode("config_name = ")
    assert len(spelled) >= 2  # several tokens, and "c", "co", ... are allowed first: none is forced alone
    forced = compiler.cursor(spec).forced(after_a, 16)
    assert [token for token, _ in forced] == spelled
    for token, instead in forced:  # instead: the token of the longest shorter prefix, which the grammar allows too
        text = pair[0].tokenizer.decode([token])
        assert instead == [] if len(text) == 1 else len(instead) == 1
        for other in instead:
            assert text.startswith(pair[0].tokenizer.decode(instead)) and other != token
    for _ in range(40):
        vocabulary.count(hit=False)
    assert not compiler.cursor(spec).forced(after_a, 16)


def test_the_drafter_counts_its_spelled_tokens_against_the_committed_output(pair):
    """A ProposeLanes call's committed_len tells the drafter which of its spelled tokens the verifier kept: one kept
    and the next replaced count a hit and a miss, and nothing counts while the committed output has not reached
    them."""
    from draft_service.service import DraftService, LaneProposal
    from draft_service.settings import DraftSettings

    draft = pair[1]
    drafter = DraftService(DraftSettings(model=""), draft, draft.vocab_size)
    spec = ConstraintSpec(ConstraintKind.REGEX, "(a|b)config_name = [0-9]")
    prompt = draft.tokenizer("x = ", add_special_tokens=False)["input_ids"]
    drafter.open("s", prompt, SamplingParams(), "model", constraint=spec)
    vocabulary = drafter.constraints.spelling
    first = LaneProposal(0, len(prompt), [], 1, num_forced_tokens=16, committed_len=len(prompt))
    [[result]] = drafter.propose_many([("s", [first])])
    chosen, *spelled = result.proposal.token_ids
    assert spelled == vocabulary.encode("config_name = ") and (vocabulary.hits, vocabulary.misses) == (0, 0)
    other = vocabulary.encode("c")[0]
    assert other != spelled[1]
    committed = [chosen, spelled[0], other]
    sync = LaneProposal(0, len(prompt), committed, 0, committed_len=len(prompt) + len(committed))
    drafter.propose_many([("s", [sync])])
    assert (vocabulary.hits, vocabulary.misses) == (1, 1)


def test_the_drafter_spells_a_forced_text_as_the_target_committed_it_there(pair):
    """Once the committed output shows the target writing a forced text its own way (letter by letter here, not as
    the tokenizer would), the drafter's next spelling of that text after the same token is the target's."""
    from draft_service.service import DraftService, LaneProposal
    from draft_service.settings import DraftSettings

    draft = pair[1]
    drafter = DraftService(DraftSettings(model=""), draft, draft.vocab_size)
    spec = ConstraintSpec(ConstraintKind.REGEX, "(a|b)config_name = [0-9]")
    prompt = draft.tokenizer("x = ", add_special_tokens=False)["input_ids"]
    vocabulary = drafter.constraints.spelling
    by_letter = [token for letter in "config_name = " for token in vocabulary.encode(letter)]
    assert by_letter != vocabulary.encode("config_name = ")
    proposals = []
    for session in ("first", "second"):
        drafter.open(session, prompt, SamplingParams(), "model", constraint=spec)
        first = LaneProposal(0, len(prompt), [], 1, num_forced_tokens=16, committed_len=len(prompt))
        [[result]] = drafter.propose_many([(session, [first])])
        proposals.append(result.proposal.token_ids)
        chosen = result.proposal.token_ids[0]
        committed = [chosen, *by_letter, *vocabulary.encode("7")]  # the target's own spelling, then a digit
        sync = LaneProposal(0, len(prompt), committed, 0, committed_len=len(prompt) + len(committed))
        drafter.propose_many([(session, [sync])])
    assert proposals[0][1:] == vocabulary.encode("config_name = ")
    assert proposals[1] == [proposals[0][0], *by_letter]


def test_a_cursor_stops_following_at_the_stop_token_without_engine_warnings(pair, compiler, capfd):
    """Tokens after the stop token (a lane drafting past the end) leave the cursor not following, and the engine is
    not asked to accept them, which it would log on every call."""
    eos = min(pair[0].eos_token_ids)
    cursor = compiler.cursor(ConstraintSpec(ConstraintKind.REGEX, "ab"))
    ab = cursor.spelling.vocabulary.encode("ab")
    cursor.sync([*ab, eos, ab[0]])
    assert not cursor.follows and cursor.tokens == [*ab, eos]
    assert "terminated" not in capfd.readouterr().err
