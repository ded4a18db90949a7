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


def main() -> None:
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(embedded_model_dir())
    vocab = len(hf)
    doc = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    schema = json.dumps(SCHEMA)
    rows, coverage = {}, {}

    # llguidance
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    ll_tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    ll_compile = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)

    def ll_walk():
        m = llguidance.LLMatcher(lltok, grammar)
        times = []
        for t in doc:
            s = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - s)
            assert m.consume_token(t), m.get_error()
        return times

    ll_walk()  # warm: llguidance builds its lexer states lazily
    ll_times = ll_walk()

    def ll_tree():  # 8 drafted tokens per step as a chain: consume, mask each, roll back (a tree's branch)
        m = llguidance.LLMatcher(lltok, grammar)
        times = []
        for i in range(0, len(doc) - 9):
            s = time.perf_counter()
            for t in doc[i : i + 8]:
                llguidance.torch.fill_next_token_bitmask(m, mask, 0)
                m.consume_token(t)
            m.rollback(8)
            times.append(time.perf_counter() - s)
            m.consume_token(doc[i])
        return times

    ll_tree_times = ll_tree()
    fresh = llguidance.LLMatcher(lltok, grammar)
    fresh.consume_tokens(doc[:3])  # inside the first key: its rest is forced
    ll_ff = timed(fresh.compute_ff_tokens, 5)
    rows["llguidance"] = dict(
        version=importlib.metadata.version("llguidance"),
        tokenizer_s=ll_tok_s, compile_ms=ll_compile * 1e3,
        mask_us_median=statistics.median(ll_times) * 1e6, mask_us_mean=statistics.mean(ll_times) * 1e6,
        mask_us_max=max(ll_times) * 1e6, chain8_us_median=statistics.median(ll_tree_times) * 1e6,
        forced_tokens_us=ll_ff * 1e6,
    )  # fmt: skip
    for name, s in KEYWORDS.items():
        is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s))
        )  # a keyword it does not implement is a warning, and would go unenforced
        coverage.setdefault(name, {})["llguidance"] = not is_error and not warnings

    # xgrammar
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    xg_tok_s = time.perf_counter() - t0
    xg_compile = timed(lambda: xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(schema, any_whitespace=False, separators=(",", ":")))
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def xg_walk():
        m = xgr.GrammarMatcher(compiled)
        times = []
        for t in doc:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - s)
            assert m.accept_token(t)
        return times

    xg_walk()
    xg_times = xg_walk()

    def xg_tree():
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        times = []
        for i in range(0, len(doc) - 9):
            s = time.perf_counter()
            for t in doc[i : i + 8]:
                m.fill_next_token_bitmask(bitmask)
                m.accept_token(t)
            m.rollback(8)
            times.append(time.perf_counter() - s)
            m.accept_token(doc[i])
        return times

    xg_tree_times = xg_tree()
    fresh = xgr.GrammarMatcher(compiled)
    for t in doc[:3]:
        fresh.accept_token(t)
    xg_ff = timed(fresh.find_jump_forward_string, 5)  # a string: its tokens are a second step
    rows["xgrammar"] = dict(
        version=importlib.metadata.version("xgrammar"), tokenizer_s=xg_tok_s, compile_ms=xg_compile * 1e3,
        mask_us_median=statistics.median(xg_times) * 1e6, mask_us_mean=statistics.mean(xg_times) * 1e6,
        mask_us_max=max(xg_times) * 1e6, chain8_us_median=statistics.median(xg_tree_times) * 1e6,
        forced_tokens_us=xg_ff * 1e6,
    )  # fmt: skip
    for name, s in KEYWORDS.items():
        try:
            compiler.compile_json_schema(json.dumps(s))
            coverage[name]["xgrammar"] = True
        except Exception:  # noqa: BLE001 (a keyword it refuses)
            coverage[name]["xgrammar"] = False

    print(f"{len(doc)} tokens of an 8-field JSON document, SmolLM2 tokenizer ({vocab} tokens), 1 thread")
    print("| library | version | compile ms | mask us (median / mean / max) | 8-token branch, masks + roll back, us | forced tokens us |")
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
