"""Structured outputs: a grammar the output must follow (OpenAI's `response_format`, a tool call, a regular
expression, a Lark grammar), enforced by llguidance, lossless under speculation.

A `Constraint` is what a request asks for, checked when it is made (a bad schema, or a JSON Schema keyword the
matcher would not enforce, is an error naming it: an output that silently ignores `uniqueItems` would not
validate). A generation holds a `Matcher` (llguidance's LLMatcher over the model's tokenizer) that has consumed
exactly the emitted tokens. Each step, before verification, it walks the drafted tree depth first, consuming
each node's token and rolling it back after the node's subtree, so every node gets the mask of its own path:

  prune   a drafted token the mask at its parent forbids is dropped with its subtree (it could never be
          accepted, so verifying it is wasted work)
  mask    each kept node's row of allowed tokens [N+1, V/32] (bits), applied to the verification logits
          (forbidden tokens -inf) before the acceptance rule reads them

Every rule then accepts against the constrained distribution at each node, exactly what constrained plain
decoding samples from: greedy output equals constrained plain greedy output token for token, and sampling draws
from the constrained distribution (tests/test_constraints.py, tests/test_lossless.py).

`forced()` is the grammar's forced continuation (llguidance's fast-forward tokens: a JSON key, a closing brace,
a fixed tool-call wrapper): the engine offers it as a draft chain that is nearly always accepted
(engine.forced_step). It is a draft like any other, verified against the masked logits: where the model would
tokenize the forced text differently, the draft is rejected there and the output is still the model's. Where a
node's mask allows one token (`one_token`: most of a forced chain, as llguidance allows one tokenization of a
forced key), its logits decide nothing, so the engine asks the backend for no row there (`Pending.outputs`:
llama.cpp then runs no output head for the node, ~a fifth of a token's work on a 135M model).

JSON is compact (no whitespace between tokens, "," and ":" separators): a small model then cannot loop on
whitespace, and the separators are forced tokens. llguidance was chosen over xgrammar by measurement
(docs/results/grammar-library: masks in 10 us a token against 2 us, both under 0.2% of a CPU step; llguidance
names the keywords it does not enforce where xgrammar ignores them, gives forced tokens as tokens, and takes
Lark grammars).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import EntMTPError, FieldError

# what `response_format` may say (OpenAI's three, and entmtp's two grammar extensions, as vLLM and SGLang take)
FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (the module docstring)


class ConstraintError(FieldError):
    """A response format, schema or grammar that cannot be used (the message names it and the fix)."""


@dataclass(frozen=True)
class Constraint:
    """A grammar every output must match: `grammar` is llguidance's (what LLMatcher takes), `kind` one of
    FORMATS, `name` a schema's name or the kind (for messages). Make one with `json_schema`, `json_object`,
    `regex`, `lark` or `of` (an OpenAI `response_format`)."""

    kind: str
    grammar: str
    name: str = ""

    @classmethod
    def json_schema(cls, schema: Mapping | str, name: str = "") -> Constraint:
        """The output is a JSON value valid against `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(
                    f"the JSON schema is not valid JSON ({e}): send a JSON Schema object"
                ) from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(
                f"a JSON schema is an object, got {type(schema).__name__}: send a JSON Schema object"
            )
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        return cls("json_schema", _checked(grammar, "the JSON schema"), name or "json_schema")

    @classmethod
    def json_object(cls) -> Constraint:
        """The output is a JSON object (OpenAI's JSON mode)."""
        return dataclasses.replace(cls.json_schema({"type": "object"}, "json_object"), kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The output matches the regular expression `pattern` (Rust regex syntax, anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("a regex constraint needs a non-empty pattern string")
        grammar = _llguidance().LLMatcher.grammar_from_regex(pattern)
        return cls("regex", _checked(grammar, f"the regular expression {pattern!r}"), "regex")

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """The output is derived from `grammar`'s `start` rule (llguidance's Lark dialect, which embeds JSON
        schemas as `%json {...}`; llguidance.gbnf_to_lark converts a GBNF grammar)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ConstraintError("a grammar constraint needs the grammar's text (Lark, with a `start` rule)")
        return cls(
            "grammar", _checked(_llguidance().LLMatcher.grammar_from_lark(grammar), "the grammar"), "grammar"
        )

    @classmethod
    def of(cls, value) -> Constraint | None:
        """A constraint from `value`: one already, None (no constraint), or an OpenAI `response_format` object:
        {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}, "strict": true}}, and the extensions {"type": "regex", "regex": "..."} and
        {"type": "grammar", "grammar": "<Lark>"}."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, Mapping) or value.get("type") not in FORMATS:
            kinds = ", ".join(f'{{"type": "{k}"}}' for k in FORMATS)
            raise ConstraintError(f"response_format must be an object with a type: one of {kinds}")
        kind = value["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise ConstraintError(
                    'response_format json_schema needs "json_schema": {"name": "...", "schema": {...}}'
                )
            if spec.get("strict") is False:
                raise ConstraintError(
                    'response_format json_schema with "strict": false is not supported: entmtp always enforces '
                    'the schema; send "strict": true or leave it out'
                )
            return cls.json_schema(spec["schema"], str(spec.get("name") or "json_schema"))
        if kind == "regex":
            return cls.regex(value.get("regex"))
        return cls.lark(value.get("grammar"))


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency: only a broken install lacks it
        raise ConstraintError(
            "structured outputs need llguidance: pip install llguidance (entmtp's dependency)"
        ) from None
    return llguidance


def _checked(grammar: str, what: str) -> str:
    """`grammar` once llguidance compiled it without error and without a warning (a warning names a keyword it
    would not enforce)."""
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(
            f"{what} cannot be used ({' '.join(messages) or 'llguidance refused it'}): correct it, or leave out "
            "what the message names"
        )
    if messages:
        raise ConstraintError(
            f"{what} uses what entmtp cannot enforce ({'; '.join(messages)}): leave those keywords out"
        )
    return grammar


# -- the tokenizer llguidance reads -------------------------------------------------------------------------

_TOKENIZERS: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # tokenizer -> {(vocab, eos): LLTokenizer}


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of `tokenizer` over a `vocab_size` model (ids past the tokenizer's are never allowed),
    ending at any of `eos_ids`; built once per tokenizer (~0.3 s). A transformers fast tokenizer, or one that
    lists each id's bytes (`byte_tokens`: tests' byte tokenizers)."""
    if not eos_ids:
        raise ConstraintError(
            "structured outputs need the model's end-of-sequence token, and this model declares none: set "
            "eos_token_id in its config"
        )
    key = (int(vocab_size), tuple(sorted(eos_ids)))
    try:
        cache = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: built each time
        cache = {}
    if key not in cache:
        llg = _llguidance()
        eos = list(key[1])
        if hasattr(tokenizer, "byte_tokens"):
            cache[key] = llg.LLTokenizer(
                llg.TokenizerWrapper(_ByteTokens(tokenizer, eos[0])), n_vocab=key[0], eos_token=eos
            )
        else:
            import llguidance.hf

            try:
                cache[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=key[0], eos_token=eos)
            except (ValueError, TypeError) as e:
                raise ConstraintError(
                    f"structured outputs need a fast (Rust) transformers tokenizer; this one cannot be read ({e})"
                ) from None
    return cache[key]


class _ByteTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer that lists its tokens' bytes."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos_token_id, self.bos_token_id = tokenizer, eos, None
        self.tokens = list(tokenizer.byte_tokens)

    def __call__(self, text) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8") if isinstance(text, bytes) else text)


# -- one generation's matcher --------------------------------------------------------------------------------


class Matcher:
    """A constraint's state over one generation: it has consumed the emitted tokens (`consume`)."""

    def __init__(self, constraint: Constraint, tokenizer, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.constraint, self.vocab = constraint, tokenizer.vocab_size
        self.eos = sorted(eos_ids)
        self.words = (self.vocab + 31) // 32
        self._tokenizer = tokenizer
        self._m = llg.LLMatcher(tokenizer, constraint.grammar, log_level=0)  # its errors: ours (`_error`)
        self._row = np.empty(self.words, dtype=np.int32)  # a scratch mask

    def _fill(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def _error(self) -> EntMTPError:
        return EntMTPError(f"the {self.constraint.name} constraint's matcher failed: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more but the end of the sequence."""
        return self._m.is_stopped()

    def consume(self, tokens: Sequence[int]) -> None:
        """Emitted tokens (each one the mask allowed; an end-of-sequence token ends the grammar)."""
        for t in tokens:
            if not self._m.consume_token(int(t)):
                raise self._error()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none where the model has a choice): llguidance's fast-forward
        tokens, which stop short of a token that could merge with what follows the forced text, continued by
        the canonical tokens of the whole forced text (`"unit":"` ends in the token `":"`, which the model
        writes there on 60 of 60 keys measured: docs/results/structured-outputs). Drafts, so a boundary token
        the model writes otherwise is rejected there."""
        if self._m.is_stopped():
            return []
        tokens = list(self._m.compute_ff_tokens())
        if tokens:
            canonical = self._tokenizer.tokenize_bytes(self._m.compute_ff_bytes())
            if canonical[: len(tokens)] == tokens:
                tokens = list(canonical)
        return tokens

    def tree(self, parents: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """(kept, masks) of a drafted tree (`parents` [N+1], -1 at the root; `tokens` [N+1], root first): the
        nodes whose token the mask at their parent allows, every ancestor kept too (ascending, root excluded),
        and the allowed-token bits [1 + len(kept), words] of the root and each kept node, in that order. A node
        at an end-of-sequence token keeps no child, and its row allows every token: the engine ends there, so
        its next token is never emitted (the row only has to be a distribution)."""
        kids: list[list[int]] = [[] for _ in parents]
        for node, parent in enumerate(parents):
            if parent >= 0:
                kids[parent].append(node)
        rows: dict[int, np.ndarray] = {}
        m, eos = self._m, set(self.eos)

        def visit(node: int) -> None:  # the matcher has consumed node's path
            row = rows[node] = np.empty(self.words, dtype=np.int32)
            self._fill(row)
            for child in kids[node]:
                t = int(tokens[child])
                if not (row[t >> 5] >> (t & 31)) & 1:
                    continue  # forbidden: pruned with its subtree
                if t in eos:
                    rows[child] = np.full(self.words, -1, dtype=np.int32)
                    continue
                if not m.consume_token(t):
                    raise self._error()
                visit(child)
                m.rollback(1)

        visit(0)
        kept = sorted(rows)[1:]
        return kept, np.stack([rows[n] for n in [0, *kept]])

    def root_mask(self) -> np.ndarray:
        """[1, words] the allowed-token bits after the emitted tokens."""
        self._fill(self._row)
        return self._row[None].copy()


def one_token(masks: np.ndarray) -> np.ndarray:
    """[n] bool: which rows of `masks` [n, words] allow exactly one token (a forced token: its node's logits
    decide nothing, since every acceptance rule then takes that token)."""
    words = masks.view(np.uint32)
    one = np.count_nonzero(words, axis=1) == 1
    if one.any():
        w = words[one].max(axis=1)  # the row's one non-zero word: one bit set?
        one[one] = (w & (w - 1)) == 0
    return one


def apply_masks(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """[n, V] float32, a new tensor: `logits` [n, V] where the token's bit in `masks` [n, words] is set, else
    -inf (ids past the masks' vocabulary too). One pass (a select), ~30 us a row of 49k on a CPU core."""
    n, vocab = logits.shape
    count = min(vocab, masks.shape[1] * 32)
    bits = np.unpackbits(masks.view(np.uint8), axis=1, count=count, bitorder="little")  # [n, count] 0/1
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    if count < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(n, vocab - count)], dim=1)
    return torch.where(allowed, logits.float(), -torch.inf)
