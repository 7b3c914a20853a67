"""Constraints on what a request may generate (a JSON schema, any JSON object, a regex, a grammar), as token masks.

The grammar engine is xgrammar (docs/architecture.md, "Constrained and penalised decoding", says why): a constraint
is compiled once per vocabulary (its compiler caches compiled grammars across requests), and each sequence holds a
`ConstraintCursor`, a matcher that follows the sequence's generated tokens. The cursor syncs to whatever the sequence
holds when asked, rolling back past tokens it no longer holds, so a session's rollback to base_len moves it too,
and a block's masks follow its drafted tokens: row j's mask is the one after the first j drafted tokens.
"""

from __future__ import annotations

import collections
import enum
import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy
import torch
import xgrammar

from specdec.common.errors import InvalidFieldError
from specdec.common.settings import setting
from specdec.sampling.spelled_text import SpelledText, VocabularySpelling

JSON_SEPARATORS = (", ", ": ")  # JSON output as Python and most code write it: one space after ',' and ':'
COMPILED_KEPT = 256  # compiled constraints kept by spec, most recently used first (the engine caches by bytes too)
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"  # xgrammar's class of a length-bounded string's characters
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"  # its class of an unbounded string's: no control character
_ENGINE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[16:06:49] /project/cpp/x.cc:94: " before the reason


class ConstraintKind(enum.Enum):
    """What a constraint's source is."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (as JSON text): the output is one JSON value it accepts
    JSON_OBJECT = "json_object"  # no source: the output is any JSON object
    REGEX = "regex"  # the whole output matches the regular expression
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF dialect) with a rule named root
    LARK = "lark_grammar"  # a Lark grammar with a rule named start


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint: its kind and source text (empty for JSON_OBJECT). `field` names it in errors."""

    kind: ConstraintKind
    source: str = ""

    @property
    def field(self) -> str:
        return f"constraint.{self.kind.value}"


@dataclass(frozen=True)
class ConstraintLimits:
    """What a service compiles: sources of at most max_source_chars, compiled within max_compile_s; compiled
    grammars cached up to cache_bytes."""

    max_source_chars: int = 65_536
    max_compile_s: float = 10.0
    cache_bytes: int = 256 << 20


@dataclass(frozen=True)
class ConstraintSettings:
    """The constraint part of a service's settings (a base of the coordinator's, drafter's and verifier's)."""

    max_constraint_chars: int = setting(65_536, "longest constraint source (schema, regex, grammar) accepted")
    max_constraint_compile_s: float = setting(
        10.0, "longest a constraint may take to compile; slower ones are refused (INVALID_ARGUMENT) from then on"
    )
    constraint_cache_mb: int = setting(256, "memory for compiled constraints, cached across requests")

    def constraint_limits(self) -> ConstraintLimits:
        return ConstraintLimits(
            self.max_constraint_chars, self.max_constraint_compile_s, self.constraint_cache_mb << 20
        )


class ConstraintCompiler:
    """Compiles constraints for one vocabulary; compiled grammars are cached across requests (xgrammar's cache,
    bounded by limits.cache_bytes). `stop_token_ids` are the ones a finished output may end with (the model's EOS)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        limits: ConstraintLimits = ConstraintLimits(),
    ):
        # no stop ids given (a model without EOS in its configs): xgrammar looks for the tokenizer's own
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        self.limits = limits
        self.spelling = VocabularySpelling(tokenizer)  # how forced text is spelled, and how often it was kept
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=limits.cache_bytes)
        self._slow: set[ConstraintSpec] = set()  # compiled, but past max_compile_s: refused from then on
        self._compiled: collections.OrderedDict[ConstraintSpec, xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()  # compiles run on request threads and the model thread

    def compile(self, spec: ConstraintSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`; InvalidFieldError naming its field with the engine's reason, or the
        limit it is over."""
        field, limits = spec.field, self.limits
        if len(spec.source) > limits.max_source_chars:
            raise InvalidFieldError(
                field, f"{len(spec.source)} characters exceed the limit of {limits.max_source_chars}"
            )
        if spec in self._slow:
            raise InvalidFieldError(field, f"took longer than the limit of {limits.max_compile_s} s to compile")
        with self._lock:
            if (compiled := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return compiled
        started = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError) as error:
            raise InvalidFieldError(field, engine_reason(error)) from None
        if time.perf_counter() - started > limits.max_compile_s:
            self.refuse_slow(spec)
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def refuse_slow(self, spec: ConstraintSpec) -> None:
        """Raises the compile-time limit's InvalidFieldError for `spec`, and for every later request with it."""
        self._slow.add(spec)
        raise InvalidFieldError(spec.field, f"took longer than the limit of {self.limits.max_compile_s} s to compile")

    def _compile(self, spec: ConstraintSpec) -> xgrammar.CompiledGrammar:
        compiler, kind = self._compiler, spec.kind
        if kind in (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA):
            schema = spec.source if kind is ConstraintKind.JSON_SCHEMA else '{"type": "object"}'
            json.loads(schema)  # a clear parse error before the engine's
            grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
            # A string with a length bound lets any character but '"', '\\', CR and LF through; JSON allows no
            # control character unescaped, as the engine's unbounded strings already say.
            return compiler.compile_grammar(str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
        if kind is ConstraintKind.REGEX:
            return compiler.compile_regex(spec.source)
        if kind is ConstraintKind.GRAMMAR:
            return compiler.compile_grammar(spec.source)
        return compiler.compile_lark(spec.source)

    def cursor(self, spec: ConstraintSpec) -> ConstraintCursor:
        """A fresh cursor for one sequence (at the start of its output)."""
        matcher = xgrammar.GrammarMatcher(self.compile(spec), max_rollback_tokens=-1)
        return ConstraintCursor(matcher, self.vocab_size, spelling=SpelledText(self.spelling))


def engine_reason(error: Exception) -> str:
    """The engine's message without its source location: what was wrong with the constraint."""
    return _ENGINE_LOCATION.sub("", str(error).strip().splitlines()[0] if str(error).strip() else repr(error))


def allowing_all(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask [rows, ceil(V / 32)] int32 that allows every token."""
    return xgrammar.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Sets the logits [n, V] float32 that the bitmask [n, ceil(V / 32)] int32 refuses to -inf, in place. On the CPU
    by unpacking the bits with numpy (2-5x faster here than the engine's CPU kernel, whose time grows with the
    tokens allowed); elsewhere by the engine's kernel."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        xgrammar.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=vocab)
        return
    allowed = numpy.unpackbits(mask.numpy().view(numpy.uint8), axis=-1, count=vocab, bitorder="little")  # [n, V]
    numpy.copyto(logits.numpy(), -numpy.inf, where=~allowed.view(numpy.bool_))


class ConstraintCursor:
    """A matcher following one sequence's generated tokens (`tokens`, those it has accepted).

    A token the grammar refuses (one after the stop token, or a drafted token the verifier will reject) is not
    followed: the cursor then allows everything past it, rows whose tokens can never be committed.
    """

    def __init__(
        self,
        matcher: xgrammar.GrammarMatcher,
        vocab_size: int,
        tokens: Sequence[int] = (),
        spelling: SpelledText | None = None,
    ):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.spelling = spelling  # spells the text the grammar forces, shared with forks; None: single ids only
        self.tokens: list[int] = list(tokens)
        self.follows = True  # the last sync accepted every token it was given
        self._row: torch.Tensor | None = None  # forced()'s bitmask row [1, ceil(V / 32)], allocated once

    def fork(self) -> ConstraintCursor:
        """An independent copy at the same tokens."""
        twin = ConstraintCursor(self._matcher.fork(), self.vocab_size, self.tokens, self.spelling)
        twin.follows = self.follows
        return twin

    def sync(self, generated: Sequence[int]) -> None:
        """Moves the matcher to exactly `generated` (the sequence's tokens since its output began): rolls back past
        the tokens it no longer holds, then accepts the new ones as far as the grammar allows."""
        tokens = self.tokens
        common = len(tokens) if tokens == list(generated[: len(tokens)]) else _common_prefix(tokens, generated)
        if common < len(tokens):
            self._matcher.rollback(len(tokens) - common)
            del tokens[common:]
        self.follows = True
        for token in generated[common:]:  # none after the stop token (the engine would log each refusal)
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                self.follows = False
                return
            tokens.append(int(token))

    def allowed_prefix(self, generated: Sequence[int], proposed: Sequence[int]) -> int:
        """How many leading tokens of `proposed` the constraint allows after `generated`."""
        self.sync([*generated, *proposed])
        return max(0, len(self.tokens) - len(generated))

    def forced(self, generated: Sequence[int], limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` tokens the constraint decides after `generated` (docs/architecture.md, "Constrained and
        penalised decoding": forced tokens), each with the allowed tokens a target may write instead: where it
        allows one token, that token (and none); where it allows several but forces the text ahead (the engine's
        jump-forward string), that text as the target last wrote it there or else as the tokenizer spells it, a
        guess the verifier judges (and the other ways to write the rest of the text: VocabularySpelling.
        other_spellings). Leaves the matcher after them."""
        self.sync(generated)
        forced: list[tuple[int, list[int]]] = []
        if self._row is None:
            self._row = allowing_all(1, self.vocab_size)  # [1, ceil(V / 32)], reused from call to call
        row = self._row
        while len(forced) < limit and self.follows and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(row, 0)
            token = only_token(row.numpy()[0], self.vocab_size)
            spelled = token is None
            rest, tokens, learnt = ("", [token], False) if token is not None else self._spell_forced_text()
            taken = 0
            for token in tokens[: limit - len(forced)]:
                if not self._matcher.accept_token(token):
                    break
                instead: list[int] = []
                if spelled:
                    self.spelling.proposed(self.tokens, token, learnt)
                    instead, rest = self.spelling.vocabulary.other_spellings(rest, token)
                self.tokens.append(token)
                forced.append((token, instead))
                taken += 1
            if taken < len(tokens) or not taken:  # refused, or nothing forced: what follows is the draft's
                break
        return forced

    def _spell_forced_text(self) -> tuple[str, list[int], bool]:
        """The text the grammar forces where the matcher stands, the ids to propose for it (SpelledText.spell) and
        whether they are the target's own spelling of it; no ids when it forces no text or the cursor has no
        tokenizer."""
        text = self._matcher.find_jump_forward_string() if self.spelling is not None else ""
        return (text, *self.spelling.spell(self.tokens, text)) if text else (text, [], False)

    def block_mask(
        self, generated: Sequence[int], drafted: Sequence[int], rows: int
    ) -> tuple[torch.Tensor, int | None]:
        """Bitmask [rows, ceil(V / 32)] of a block after `generated`: row j allows what the constraint allows after
        the first j drafted tokens (everything once they leave the grammar or it has ended with its stop token), and
        the first row that allows nothing (a dead end), or None. Leaves the matcher after the rows' tokens."""
        mask = allowing_all(rows, self.vocab_size)
        self.sync(generated)
        for row in range(rows):
            if not self._fill(mask, row):
                return mask, row
            if not self.follows or self._matcher.is_terminated():
                break
            if row < len(drafted) and row + 1 < rows:
                self.follows = self._matcher.accept_token(int(drafted[row]))
                if self.follows:
                    self.tokens.append(int(drafted[row]))
        return mask, None

    def fill_row(self, mask: torch.Tensor, row: int, generated: Sequence[int]) -> bool:
        """Fills row `row` of a bitmask [n, ceil(V / 32)] that allows everything with what the constraint allows
        after `generated` (one row of a step's shared mask: docs/architecture.md, "Constrained and penalised
        decoding"); False at a dead end (no token allowed). Leaves the matcher after `generated`."""
        self.sync(generated)
        return self._fill(mask, row)

    def _fill(self, mask: torch.Tensor, row: int) -> bool:
        """Fills row `row` of `mask` where the matcher stands, left allowing everything once the tokens left the
        grammar or it has ended; whether the row allows any token."""
        if not self.follows or self._matcher.is_terminated():
            return True
        self._matcher.fill_next_token_bitmask(mask, row)
        return bool(mask.numpy()[row].any())  # the same memory: numpy reads a row faster than a torch op


def only_token(words: numpy.ndarray, vocab_size: int) -> int | None:
    """The one token a bitmask row [ceil(V / 32)] int32 allows, or None when it allows none or several."""
    nonzero = numpy.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = int(nonzero[0]) * 32 + word.bit_length() - 1
    return token if token < vocab_size else None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
