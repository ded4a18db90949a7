"""llguidance against xgrammar for entmtp's constraints (issue #64): per-token mask time with the embedded
SmolLM2 tokenizer, the masks of a drafted tree's nodes (fork/roll back per branch), compile time, and which
JSON Schema keywords each compiles. Prints a table and writes results.json beside this file.

    python docs/results/grammar-library/measure.py
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from entmtp.machine import cpu_info
from entmtp.model import embedded_model_dir

HERE = Path(__file__).parent
SCHEMA = {  # an extraction schema of 8 fields, the kind the JSON-extraction workload uses
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["France", "Germany", "Japan", "USA", "Other"]},
        "member": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "city", "country", "member", "score", "tags"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "city": "London", "country": "Other",
    "member": True, "score": 9.5, "tags": ["math", "engines", "poetry"],
}  # fmt: skip
KEYWORDS = {  # one schema per keyword family a client may send
    "enum/const": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"const": 3}}},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "pattern": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "minimum/maximum": {"type": "integer", "minimum": 0, "maximum": 120},
    "nested objects": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "null"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
}  # fmt: skip


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass(frozen=True)
class Library:
    """What the measurements call of one library: a fresh matcher (`branches`: one that may roll back 8
    tokens), a mask into its buffer, a token consumed (True: allowed), a roll back, the forced continuation."""

    version: str
    tokenizer_s: float  # building its view of the tokenizer
    compile_ms: float  # a matcher from the schema, as a request would make it
    new: Callable[[bool], object]
    fill: Callable[[object], None]
    consume: Callable[[object, int], bool]
    rollback: Callable[[object, int], None]
    forced: Callable[[object], object]


def llguidance_library(hf, vocab: int, schema: str) -> Library:
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    return Library(
        importlib.metadata.version("llguidance"), tokenizer_s,
        timed(lambda: llguidance.LLMatcher(lltok, grammar)) * 1e3,
        new=lambda branches: llguidance.LLMatcher(lltok, grammar),
        fill=lambda m: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
        consume=lambda m, t: m.consume_token(t),
        rollback=lambda m, n: m.rollback(n),
        forced=lambda m: m.compute_ff_tokens(),
    )  # fmt: skip


def xgrammar_library(hf, vocab: int, schema: str) -> Library:
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tokenizer_s = time.perf_counter() - t0
    compile_ = lambda c: c.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))  # noqa: E731
    compiled = compile_(compiler)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    return Library(
        importlib.metadata.version("xgrammar"), tokenizer_s,
        timed(lambda: compile_(xgr.GrammarCompiler(info, max_threads=1))) * 1e3,
        new=lambda branches: xgr.GrammarMatcher(compiled, max_rollback_tokens=16) if branches else xgr.GrammarMatcher(compiled),
        fill=lambda m: m.fill_next_token_bitmask(bitmask),
        consume=lambda m, t: m.accept_token(t),
        rollback=lambda m, n: m.rollback(n),
        forced=lambda m: m.find_jump_forward_string(),  # a string: its tokens are a second step
    )  # fmt: skip


def measure(lib: Library, doc: list[int]) -> dict:
    """The library's row: mask time per token along `doc`, an 8-token branch's masks and roll back, the forced
    continuation inside the first key."""

    def walk():
        m, times = lib.new(False), []
        for t in doc:
            s = time.perf_counter()
            lib.fill(m)
            times.append(time.perf_counter() - s)
            assert lib.consume(m, t)
        return times

    def branches():  # 8 drafted tokens per step as a chain: consume, mask each, roll back (a tree's branch)
        m, times = lib.new(True), []
        for i in range(0, len(doc) - 9):
            s = time.perf_counter()
            for t in doc[i : i + 8]:
                lib.fill(m)
                lib.consume(m, t)
            lib.rollback(m, 8)
            times.append(time.perf_counter() - s)
            lib.consume(m, doc[i])
        return times

    walk()  # warm: llguidance builds its lexer states lazily
    token_times, chain_times = walk(), branches()
    fresh = lib.new(False)
    for t in doc[:3]:  # inside the first key: its rest is forced
        lib.consume(fresh, t)
    return dict(
        version=lib.version, tokenizer_s=lib.tokenizer_s, compile_ms=lib.compile_ms,
        mask_us_median=statistics.median(token_times) * 1e6, mask_us_mean=statistics.mean(token_times) * 1e6,
        mask_us_max=max(token_times) * 1e6, chain8_us_median=statistics.median(chain_times) * 1e6,
        forced_tokens_us=timed(lambda: lib.forced(fresh), 5) * 1e6,
    )  # fmt: skip


def coverage_of(hf, vocab: int) -> dict:
    """Per keyword family, whether each library enforces it: llguidance names a keyword it does not implement
    (a warning or an error), xgrammar refuses it or compiles it."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1)
    out = {}
    for name, s in KEYWORDS.items():
        is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s))
        )
        try:
            compiler.compile_json_schema(json.dumps(s))
            xg = True
        except Exception:  # noqa: BLE001 (a keyword it refuses)
            xg = False
        out[name] = {"llguidance": not is_error and not warnings, "xgrammar": xg}
    return out


def main() -> None:
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(embedded_model_dir())
    vocab = len(hf)
    doc = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    schema = json.dumps(SCHEMA)
    rows = {
        "llguidance": measure(llguidance_library(hf, vocab, schema), doc),
        "xgrammar": measure(xgrammar_library(hf, vocab, schema), doc),
    }
    coverage = coverage_of(hf, vocab)

    print(f"{len(doc)} tokens of an 8-field JSON document, SmolLM2 tokenizer ({vocab} tokens), 1 thread")
    print(
        "| library | version | compile ms | mask us (median / mean / max) | 8-token branch, masks + roll back, us | forced tokens us |"
    )
    print("|---|---|---|---|---|---|")
    for lib, r in rows.items():
        print(
            f"| {lib} | {r['version']} | {r['compile_ms']:.1f} | {r['mask_us_median']:.0f} / {r['mask_us_mean']:.0f} / "
            f"{r['mask_us_max']:.0f} | {r['chain8_us_median']:.0f} | {r['forced_tokens_us']:.0f} |"
        )
    print("\n| schema keyword | llguidance | xgrammar |\n|---|---|---|")
    for name, c in coverage.items():
        print(f"| {name} | {'yes' if c['llguidance'] else 'no'} | {'yes' if c['xgrammar'] else 'no'} |")
    out = dict(
        machine=cpu_info(),
        torch=torch.__version__, tokens=len(doc), vocab=vocab, libraries=rows, coverage=coverage,
    )  # fmt: skip
    (HERE / "results.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
