"""The masks of a whole drafted tree (issue #64, item 1: "batching of masks across tree nodes"): entmtp's way
(`constraints.Matcher.tree`: one llguidance matcher walked depth first, consume, mask, roll back) against the
two libraries' batch APIs: llguidance's `fill_next_token_bitmask_par_with_draft_tokens` (one forked matcher per
root-to-leaf path, masks along each path, on an `LLExecutor` of 1 or 2 threads; paths that share a prefix
compute its masks again) and xgrammar's `GrammarMatcher.traverse_draft_tree` (the tree in one call). Prints a
table and writes tree-masks.json beside this file.

    python docs/results/grammar-library/tree_masks.py

Trees, drafted at every position of the 8-field document of measure.py: a chain of 8 and of 32 tokens (the
document's next tokens: a forced chain, a prediction's branch) and a 16-node tree (that chain of 8 with a wrong
sibling at each depth, the heads' shape).
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.torch
import torch
import xgrammar as xgr
from measure import DOC, SCHEMA
from transformers import AutoTokenizer

from entmtp.constraints import Constraint, Matcher, grammar_tokenizer
from entmtp.machine import cpu_info
from entmtp.model import embedded_model_dir

HERE = Path(__file__).parent
WRONG = 90  # a sibling's token: a byte the schema never allows after a JSON value starts ("Z")


def tree_of(doc: list[int], at: int, kind: str) -> tuple[list[int], list[int]]:
    """(parents [N+1], tokens [N+1]) of a drafted tree at position `at` of `doc` (root: doc[at])."""
    if kind.startswith("chain"):
        n = int(kind[5:])
        toks = doc[at : at + n + 1]
        return [-1, *range(len(toks) - 1)], toks
    parents, tokens = [-1], [doc[at]]  # "tree16": chain of 8, a wrong sibling at each depth
    for d, t in enumerate(doc[at + 1 : at + 9]):
        spine = len(parents) - 2 if d else 0  # the chain's node at depth d
        parents += [spine, spine]
        tokens += [t, WRONG]
    return parents, tokens


def paths(parents: list[int]) -> list[list[int]]:
    """Each leaf's path of node ids below the root."""
    kids = {p for p in parents if p >= 0}
    out = []
    for leaf in (n for n in range(1, len(parents)) if n not in kids):
        path, n = [], leaf
        while n > 0:
            path.append(n)
            n = parents[n]
        out.append(path[::-1])
    return out


def new_matcher(method: str, emitted: list[int], constraint, lltok, eos, grammar, compiled):
    """A fresh matcher of `method`'s library that has consumed `emitted`."""
    if method == "xgrammar":
        m = xgr.GrammarMatcher(compiled)
        for t in emitted:
            assert m.accept_token(t)
    elif method == "entmtp":
        m = Matcher(constraint, lltok, eos)
        m.consume(emitted)
    else:
        m = llguidance.LLMatcher(lltok, grammar)
        assert m.consume_tokens(emitted)
    return m


def llguidance_par(executor, matcher, lltok_vocab: int, parents, tokens) -> int:
    """Masks along every root-to-leaf path, one forked matcher each; returns the rows it computed."""
    chains = [[tokens[n] for n in p] for p in paths(parents)]
    rows = sum(len(c) + 1 for c in chains)
    bitmask = llguidance.torch.allocate_token_bitmask(rows, lltok_vocab)
    jobs, row = [], 0
    for c in chains:
        jobs.append((matcher.deep_copy(), row, c))
        row += len(c) + 1
    llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(executor, jobs, bitmask)
    return rows


def xgrammar_tree(matcher, words: int, parents, tokens) -> None:
    n = len(parents)
    first_child, next_sibling = [-1] * n, [-1] * n
    for node in range(n - 1, 0, -1):  # children in ascending order
        p = parents[node]
        next_sibling[node], first_child[p] = first_child[p], node
    bitmask = torch.zeros((n, words), dtype=torch.int32)
    matcher.traverse_draft_tree(
        torch.tensor(first_child), torch.tensor(next_sibling), torch.tensor(tokens), bitmask
    )


def main() -> None:
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(embedded_model_dir())
    vocab = len(hf)
    doc = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    eos = [hf.eos_token_id]
    constraint = Constraint.json_schema(SCHEMA)
    lltok = grammar_tokenizer(hf, vocab, eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    words = (vocab + 31) // 32
    executors = {k: llguidance.LLExecutor(num_threads=k) for k in (1, 2)}
    rows: dict[str, dict] = {}
    for kind in ("chain8", "tree16", "chain32"):
        size = 8 if kind == "chain8" else 16 if kind == "tree16" else 32
        positions = list(range(0, len(doc) - size - 1))
        row = {"nodes": size, "positions": len(positions)}
        for method in ("entmtp", "llguidance-par-1", "llguidance-par-2", "xgrammar"):
            times = []
            for at in positions:  # a matcher that has consumed doc[:at + 1] (the root, emitted), untimed
                m = new_matcher(method, doc[: at + 1], constraint, lltok, eos, grammar, compiled)
                parents, tokens = tree_of(doc, at, kind)
                for _ in range(3):  # each call leaves the matcher where it was (rolled back or forked)
                    t = time.perf_counter()
                    if method == "entmtp":
                        m.tree(parents, tokens)
                    elif method == "xgrammar":
                        xgrammar_tree(m, words, parents, tokens)
                    else:
                        llguidance_par(executors[int(method[-1])], m, lltok.vocab_size, parents, tokens)
                    times.append(time.perf_counter() - t)
            row[method] = statistics.median(times) * 1e6
        rows[kind] = row
    print(
        f"masks of a drafted tree at each of a JSON document's positions, SmolLM2 tokenizer ({vocab} tokens)"
    )
    print(
        "| tree | nodes | entmtp (llguidance, depth first) us | llguidance par, 1 thread | 2 threads | xgrammar traverse_draft_tree |"
    )
    print("|---|---|---|---|---|---|")
    for kind, r in rows.items():
        print(
            f"| {kind} | {r['nodes']} | {r['entmtp']:.0f} | {r['llguidance-par-1']:.0f} | {r['llguidance-par-2']:.0f} | "
            f"{r['xgrammar']:.0f} |"
        )
    out = dict(
        machine=cpu_info(), torch=torch.__version__, llguidance=importlib.metadata.version("llguidance"),
        xgrammar=importlib.metadata.version("xgrammar"), tokens=len(doc), vocab=vocab, trees=rows,
    )  # fmt: skip
    (HERE / "tree-masks.json").write_text(json.dumps(out, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
