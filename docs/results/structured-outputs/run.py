"""Structured outputs on the CPU (issue #64): a JSON-extraction workload and a tool-calling workload, greedy, on
the embedded model's Q4_1 GGUF, against llama-cpp-python's own grammar-constrained decoding of the same file.

    python docs/results/structured-outputs/run.py [--prompts 8] [--rounds 2] [--out DIR] [--backend transformers]

Workloads (real prompts, never tuned on): extraction = the first GSM8K questions of the test split (prompts.py),
each to be written as an 8-field JSON object (SCHEMA); tools = the first Spec-Bench "qa" questions of the test
split with three functions and
tool_choice "required" (a call of web_search, calculator or get_weather, arguments valid against its schema).
The prompts are the chat template's, the same token ids for every engine; the tools' system message is
entmtp's (tools.py), and the peer's grammar is the same call wrapped in <tool_call> ... </tool_call>.

Engines, one thread count (2) for all, interleaved per prompt and round:
  llama-cpp-python   Llama.generate with LlamaGrammar (its JSON Schema converter; its own JSON spacing)
  default            entmtp's default on llama.cpp (`EngineSpec(backend="llama-cpp")`: heads, lookup and trees
                     as this machine's cost curve chooses) under the grammar (constraints.py)
  lookup             prompt lookup drafts (`heads="none"`: the lookup hybrid) under the grammar
  *-no-forced        the same without the grammar's forced-token drafts (engine.forced_step)
(`--backend transformers`: entmtp's engines on transformers in bf16 instead, where a drafted node costs little,
against the same peer.)

Per engine: every output parsed and validated (jsonschema), seconds per request (prefill included: a request's
whole time), tokens/s (its own tokens; the peer's JSON has spaces, ours none), steps, forced tokens accepted,
and the grammar's own time (masks, pruning, consuming, forced tokens: shaping.Shaping's methods, timed) per
token against the plain step, and of it the masks' (computed per node and applied to the logits). Prints a table, writes results.json (and the outputs) into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
import torch

from entmtp import constraints, shaping
from entmtp.bench.peers import LlamaCppPlain
from entmtp.build import build_engine
from entmtp.engine import Engine
from entmtp.engine_args import EngineSpec
from entmtp.machine import cpu_info, versions
from entmtp.model import encode_prompt
from entmtp.prompts import load_prompts
from entmtp.tools import Tools

HERE = Path(__file__).parent
SCHEMA = {
    "type": "object",
    "properties": {
        "subject": {"type": "string", "maxLength": 60},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "unit": {"type": "string", "maxLength": 20},
        "asks_for": {"type": "string", "maxLength": 80},
        "operation": {"enum": ["addition", "subtraction", "multiplication", "division", "mixed"]},
        "steps": {"type": "integer", "minimum": 1, "maximum": 10},
        "has_money": {"type": "boolean"},
    },
    "required": ["subject", "people", "numbers", "unit", "asks_for", "operation", "steps", "has_money"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "web_search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60}}, "required": ["query"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 40}},
        "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}},
]  # fmt: skip
MAX_TOKENS = {"extraction": 200, "tools": 120}


def workloads(n: int, tokenizer) -> dict[str, list[dict]]:
    """Per workload, n requests: {"ids", "constraint", "validate"}."""
    questions, qa = load_prompts("gsm8k", "test", n), load_prompts("specbench-qa", "test", n)
    tools = Tools.of(TOOLS, "required")
    from entmtp.constraints import Constraint

    extraction = Constraint.json_schema(SCHEMA)
    out = {"extraction": [], "tools": []}
    for q in questions:
        msgs = [{"role": "user", "content": f"Write the facts of this math problem as JSON.\n\n{q}"}]
        out["extraction"].append(
            dict(ids=encode_prompt(tokenizer, msgs), constraint=extraction, schema=SCHEMA)
        )
    for q in qa:
        msgs, kw = tools.messages([{"role": "user", "content": q}], tokenizer)
        out["tools"].append(
            dict(ids=encode_prompt(tokenizer, msgs, template=kw), constraint=tools.constraint(), tools=tools)
        )
    return out


def valid(request: dict, text: str) -> bool:
    try:
        if "schema" in request:
            jsonschema.validate(json.loads(text), request["schema"])
            return True
        calls = request["tools"].parse(text.strip())
        if not calls or len(calls) != 1:
            return False
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), params)
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def peer_grammar(request: dict):
    """llama-cpp-python's grammar for the request: its JSON Schema converter's, the call wrapped for tools."""
    from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

    if "schema" in request:
        return LlamaGrammar.from_json_schema(json.dumps(request["schema"]), verbose=False)
    gbnf = json_schema_to_gbnf(json.dumps(request["tools"].call_schema())).replace("root ::=", "call ::=", 1)
    return LlamaGrammar.from_string(f'root ::= "<tool_call>" call "</tool_call>"\n{gbnf}', verbose=False)


class Timed:
    """Seconds spent in shaping.Shaping's per-step methods (the grammar's and the controls' own work:
    `seconds`) and, within them, in computing and applying masks (llguidance's mask of a node,
    `constraints.Matcher._fill`; a step's masks on its logits, `apply_masks`: `mask_seconds`)."""

    def __init__(self):
        self.seconds = self.mask_seconds = 0.0
        for name in ("draft", "logits", "consume", "forced", "root_masks"):
            setattr(shaping.Shaping, name, self._wrap(getattr(shaping.Shaping, name), "seconds"))
        constraints.Matcher._fill = self._wrap(constraints.Matcher._fill, "mask_seconds")
        shaping.apply_masks = self._wrap(shaping.apply_masks, "mask_seconds")

    def _wrap(self, fn, into: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - t)

        return timed


def plain_step_ms(engine, loads: dict) -> dict[str, float]:
    """Per workload, the median ms of an unconstrained plain step on its first prompt (what a mask's time is
    a share of)."""
    out = {}
    for name, requests in loads.items():
        r = engine.generate(requests[0]["ids"], max_new_tokens=48)
        out[name] = 1e3 * sorted(s.seconds["total"] for s in r.steps)[len(r.steps) // 2]
    return out


def report(runs: dict, plain_ms: dict) -> tuple[dict, dict]:
    """The table (printed) and its figures per workload and engine; the plain step's ms per workload."""
    summary = {}
    print(
        "| workload | engine | valid | s per request | tokens/s | tokens | steps | forced tokens | grammar ms / token (share of a plain step) | of it masks | time vs llama-cpp-python | tokens/s vs llama-cpp-python |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, by_engine in runs.items():
        peer = by_engine["llama-cpp-python"]
        base = sum(r["seconds"] for r in peer)
        base_rate = sum(r["tokens"] for r in peer) / base
        for label, rows in by_engine.items():
            seconds, tokens = sum(r["seconds"] for r in rows), sum(r["tokens"] for r in rows)
            shaping_ms = 1e3 * sum(r["shaping_s"] for r in rows) / max(1, tokens)
            mask_ms = 1e3 * sum(r.get("mask_s", 0.0) for r in rows) / max(1, tokens)
            s = dict(
                valid=f"{sum(r['valid'] for r in rows)}/{len(rows)}", seconds_per_request=seconds / len(rows),
                tokens_per_second=tokens / seconds, tokens=tokens, steps=sum(r["steps"] for r in rows),
                forced=sum(r["forced"] for r in rows), shaping_ms_per_token=shaping_ms,
                shaping_share=shaping_ms / plain_ms[name], mask_ms_per_token=mask_ms,
                mask_share=mask_ms / plain_ms[name], speedup=base / seconds,
                rate_ratio=tokens / seconds / base_rate,
            )  # fmt: skip
            summary.setdefault(name, {})[label] = s
            print(
                f"| {name} | {label} | {s['valid']} | {s['seconds_per_request']:.2f} | {s['tokens_per_second']:.1f} | "
                f"{tokens} | {s['steps']} | {s['forced']} | {shaping_ms:.3f} ({100 * s['shaping_share']:.2f}%) | "
                f"{mask_ms:.3f} ({100 * s['mask_share']:.2f}%) | "
                f"{s['speedup']:.2f}x | {s['rate_ratio']:.2f}x |"
            )
    return summary, plain_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "epyc"))
    ap.add_argument("--backend", default="llama-cpp", choices=["llama-cpp", "transformers"])
    ap.add_argument(
        "--patched-peer",
        action="store_true",
        help="llama-cpp-python as entmtp's patched build runs it (an AMX CPU: its repacked weights on), "
        "not as pip's build runs there",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    timer = Timed()
    dtype = "bfloat16" if args.backend == "transformers" else "auto"  # llama.cpp: the embedded Q4_1 GGUF
    default = build_engine(EngineSpec(backend=args.backend, dtype=dtype))
    lookup = build_engine(EngineSpec(backend=args.backend, dtype=dtype, heads="none"))
    plain = Engine(
        default.model, default.tokenizer
    )  # plain steps, unconstrained: what a mask's time is a share of
    peer = LlamaCppPlain(n_threads=2, as_patched=args.patched_peer)
    forced = shaping.Shaping.forced
    loads = workloads(args.prompts, default.tokenizer)
    runs: dict[str, dict[str, list]] = {}

    def entmtp_run(engine, request, with_forced=True):
        shaping.Shaping.forced = forced if with_forced else (lambda self, cost, limit: [])
        before, masks_before = timer.seconds, timer.mask_seconds
        r = engine.generate(
            request["ids"], max_new_tokens=request["max"], response_format=request["constraint"]
        )
        shaping.Shaping.forced = forced
        return dict(text=r.text, tokens=len(r.token_ids), seconds=r.seconds, steps=r.num_steps,
                    forced=sum(s.forced for s in r.steps), shaping_s=timer.seconds - before,
                    mask_s=timer.mask_seconds - masks_before,
                    plain_ms=None)  # fmt: skip

    def peer_run(request):
        grammar = peer_grammar(request)
        t0 = time.perf_counter()
        peer.llm.reset()
        new = []
        for tok in peer.llm.generate(request["ids"], temp=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                     repeat_penalty=1.0, reset=True, grammar=grammar):  # fmt: skip
            if tok in peer.eos_ids:
                break
            new.append(int(tok))
            if len(new) == request["max"]:
                break
        seconds = time.perf_counter() - t0
        text = peer.llm.detokenize(new).decode("utf-8", errors="replace")
        return dict(text=text, tokens=len(new), seconds=seconds, steps=len(new), forced=0, shaping_s=0.0)

    engines = {
        "llama-cpp-python": peer_run,
        "default": lambda rq: entmtp_run(default, rq),
        "default-no-forced": lambda rq: entmtp_run(default, rq, with_forced=False),
        "lookup": lambda rq: entmtp_run(lookup, rq),
        "lookup-no-forced": lambda rq: entmtp_run(lookup, rq, with_forced=False),
    }
    for name, requests in loads.items():
        for rq in requests:
            rq["max"] = MAX_TOKENS[name]
        for run in engines.values():  # warm: each engine's grammar tokenizer, first forward, grammar compile
            run(requests[0])
        for rnd in range(args.rounds):
            for i, rq in enumerate(requests):
                for label, run in engines.items():
                    out = run(rq)
                    out.update(valid=valid(rq, out["text"]), prompt=i, round=rnd)
                    runs.setdefault(name, {}).setdefault(label, []).append(out)
    summary, plain_ms = report(runs, plain_step_ms(plain, loads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        command="python docs/results/structured-outputs/run.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items() if k != "out" and v is not False),
        machine=cpu_info(), versions=versions(), threads=2, peer=peer.settings, plain_step_ms=plain_ms,
        summary=summary, runs=runs,
    ), indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
