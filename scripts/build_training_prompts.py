"""Build the extra training prompts in data/train/ from pinned public sources (standard library only).

Self-distillation needs prompts only: the base model writes the answers. This script reads each source
from a bare git mirror at a pinned commit (`git show COMMIT:PATH`), checks the source file's sha256,
copies the small sources and the license texts byte for byte into data/train/raw/, and writes derived JSONL prompt files:

    {"id", "source", "kind", "instruction", "input"}   # input: the text the answer copies from
    {"id", "source", "kind", "messages"}               # multi-turn chat; the last message is a user turn

Every random choice comes from random.Random(f"{SEED}:{name}"), so a rerun writes identical bytes.
Provenance, licenses and the rule that the benchmark sets are never used: docs/training-data.md (data/train/ is gitignored:
fetched data stays out of commits).

    python scripts/build_training_prompts.py --mirror DIR [--out data/train]   # DIR: the fetched repositories' snapshots
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import subprocess
from pathlib import Path

SEED = 20250601  # one seed for every source; each source draws from its own Random(f"{SEED}:{name}")

# repo -> (commit, git dir under --mirror)
REPOS = {
    "xquad": ("7d30520c717524000f0d9d2f9c10a069acd9d285", "google-deepmind+xquad/repo"),
    "flores": ("306b01981744bb3892aaa9fe516104765480282e", "AI4Bharat+CTQScorer/repo"),
    "oasst": ("f1e6ed9526f5817531f3ab85441a40b3671ddccb", "LAION-AI+Open-Assistant/repo"),
    "sgd": (
        "e852981ae34990f4358979625854259302feaa78",
        "google-research-datasets+dstc8-schema-guided-dialogue/repo",
    ),
    "algorithms": ("f5988cc09713315817df6a7e327e258013a94440", "TheAlgorithms+Python/repo"),
    "peps": ("ba4deeb7969588d937da609008d05bb83a47b1ab", "python+peps/repo"),
}

# small source files copied unchanged into raw/: (repo key, path in repo, file name under raw/)
RAW = [
    ("xquad", "xquad.en.json", "xquad/xquad.en.json"),
    ("xquad", "xquad.de.json", "xquad/xquad.de.json"),
    ("xquad", "xquad.es.json", "xquad/xquad.es.json"),
    ("flores", "dataset/train/eng_Latn.dev", "flores200_dev/eng_Latn.dev"),
    ("flores", "dataset/train/deu_Latn.dev", "flores200_dev/deu_Latn.dev"),
    ("flores", "dataset/train/fra_Latn.dev", "flores200_dev/fra_Latn.dev"),
    ("flores", "dataset/train/spa_Latn.dev", "flores200_dev/spa_Latn.dev"),
    ("oasst", "model/model_eval/manual/data/en_100_tree.jsonl", "oasst/en_100_tree.jsonl"),
    # the license texts, unchanged, beside the data (CC BY-SA 4.0 also covers FLORES-200 and SGD)
    ("xquad", "CC-BY-SA4.0.txt", "licenses/CC-BY-SA-4.0.txt"),
    ("sgd", "LICENSE.txt", "licenses/sgd-LICENSE.txt"),
    ("oasst", "LICENSE", "licenses/Open-Assistant-LICENSE-Apache-2.0.txt"),
    ("algorithms", "LICENSE.md", "licenses/TheAlgorithms-Python-LICENSE-MIT.md"),
]
SGD_FILES = [f"dev/dialogues_{i:03d}.json" for i in range(1, 8)]  # the dev files present in the snapshot

MAX_WORDS = 1200  # a prompt (all of a conversation) longer than this is dropped: we generate on a CPU
ARTICLE_WORDS = 800  # article summaries take the first paragraphs up to this many words
# TheAlgorithms has hundreds of near-identical Project Euler `solution()`s: take at most this many
EULER_SHARE = 50

LANG = {"en": "English", "de": "German", "fr": "French", "es": "Spanish"}


class Sources:
    def __init__(self, mirror: Path):
        self.mirror = mirror
        self.hashes: dict[str, str] = {}  # "repo:path" -> sha256 of the bytes read
        self.batch: dict[str, subprocess.Popen] = {}

    def read(self, repo: str, path: str) -> bytes:
        commit, gitdir = REPOS[repo]
        # one `git cat-file --batch` per repository: thousands of files, one process
        if repo not in self.batch:
            self.batch[repo] = subprocess.Popen(
                ["git", "--git-dir", str(self.mirror / gitdir), "cat-file", "--batch"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        proc = self.batch[repo]
        proc.stdin.write(f"{commit}:{path}\n".encode())
        proc.stdin.flush()
        header = proc.stdout.readline().split()
        if len(header) != 3 or header[1] != b"blob":
            raise FileNotFoundError(f"{repo} {commit}:{path}: {b' '.join(header).decode()}")
        data = proc.stdout.read(int(header[2]))
        proc.stdout.read(1)  # the newline after each object
        self.hashes[f"{repo}:{path}"] = hashlib.sha256(data).hexdigest()
        return data

    def ls(self, repo: str, under: str) -> list[str]:
        commit, gitdir = REPOS[repo]
        out = subprocess.run(
            ["git", "--git-dir", str(self.mirror / gitdir), "ls-tree", "-r", "--name-only", commit, under],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return sorted(out.split())


def words(text: str) -> int:
    return len(text.split())


def prompt_words(r: dict) -> int:
    if "messages" in r:
        return sum(words(m["content"]) for m in r["messages"])
    return words(r["instruction"] + " " + r["input"])


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def squad_articles(raw: bytes) -> list[dict]:
    return json.loads(raw.decode("utf-8"))["data"]


# ---------------------------------------------------------------- XQuAD: context QA, RAG, summaries, translation
QA_TEMPLATES = [
    "Answer the question using only the passage below.\n\nQuestion: {q}",
    "Read the passage and answer the question. Quote the relevant words from the passage.\n\nQuestion: {q}",
    "{q}\n\nBase your answer on the text below.",
    "According to the following text, {q_lc}",
]
WH_WORDS = {
    "What",
    "Which",
    "Who",
    "Whom",
    "Whose",
    "When",
    "Where",
    "Why",
    "How",
    "In",
    "On",
    "At",
    "During",
}
MULTI_QA = "Read the passage below and answer each question in one or two sentences.\n\n{qs}"
RAG_TEMPLATES = [
    "Use the retrieved passages below to answer the question. Say which passage the answer comes from.\n\n"
    "Question: {q}",
    "Some of the documents below are relevant to the question and some are not. Answer the question from the "
    "relevant ones.\n\nQuestion: {q}",
]
SUM_PARA = [
    "Summarize the following passage in two or three sentences.",
    "Write a short summary of this text.",
    "Give the key points of the passage below as a bulleted list.",
    "Summarize the paragraph below for a high-school student.",
]
SUM_ARTICLE = [
    "Summarize the following article in one paragraph.",
    "Write a summary of the text below, then list its three most important facts.",
]
TRANSLATE = [
    "Translate the following {src} text into {tgt}.",
    "Translate this {src} passage into {tgt}. Keep names and numbers unchanged.",
    "Translate {src} to {tgt}:",
]


def build_xquad(src: Sources) -> list[dict]:
    rng = random.Random(f"{SEED}:xquad")
    arts = {lang: squad_articles(src.read("xquad", f"xquad.{lang}.json")) for lang in ("en", "de", "es")}
    en = arts["en"]
    out: list[dict] = []
    all_paras = [(ai, pi, p) for ai, a in enumerate(en) for pi, p in enumerate(a["paragraphs"])]
    for ai, pi, p in all_paras:
        ctx, qas = p["context"], p["qas"]
        for qa in rng.sample(qas, min(2, len(qas))):  # two single questions per paragraph
            q = qa["question"].strip()
            t = rng.choice(QA_TEMPLATES)
            if t.startswith("According") and q.split()[0] not in WH_WORDS:
                t = QA_TEMPLATES[0]  # lower-casing would mangle a question that opens with a name
            out.append(
                {
                    "id": f"xquad-en-{qa['id']}",
                    "source": "xquad",
                    "kind": "context_qa",
                    "instruction": t.format(q=q, q_lc=q[:1].lower() + q[1:]),
                    "input": ctx,
                }
            )
        qs = "\n".join(f"{i + 1}. {qa['question'].strip()}" for i, qa in enumerate(qas))
        out.append(
            {
                "id": f"xquad-en-{ai}-{pi}-all",
                "source": "xquad",
                "kind": "context_qa",
                "instruction": MULTI_QA.format(qs=qs),
                "input": ctx,
            }
        )
        # RAG: the paragraph with the answer among 3 others (2 from the same article, 1 from another)
        qa = rng.choice(qas)
        same = [p2["context"] for j, p2 in enumerate(en[ai]["paragraphs"]) if j != pi]
        other = [x[2]["context"] for x in all_paras if x[0] != ai]
        docs = rng.sample(same, min(2, len(same))) + rng.sample(other, 3 - min(2, len(same))) + [ctx]
        rng.shuffle(docs)
        passages = "\n\n".join(f"[{i + 1}] {d}" for i, d in enumerate(docs))
        out.append(
            {
                "id": f"xquad-en-{qa['id']}-rag",
                "source": "xquad",
                "kind": "rag",
                "instruction": rng.choice(RAG_TEMPLATES).format(q=qa["question"].strip()),
                "input": passages,
            }
        )
        out.append(
            {
                "id": f"xquad-en-{ai}-{pi}-sum",
                "source": "xquad",
                "kind": "summarize",
                "instruction": rng.choice(SUM_PARA),
                "input": ctx,
            }
        )
    for ai, a in enumerate(en):
        paras = []  # the article's first paragraphs, up to ARTICLE_WORDS words (at least one paragraph)
        for p in a["paragraphs"]:
            if paras and words(" ".join(paras + [p["context"]])) > ARTICLE_WORDS:
                break
            paras.append(p["context"])
        text = "\n\n".join(paras)
        title = a.get("title", "")
        inst = rng.choice(SUM_ARTICLE) + (f" (Topic: {title.replace('_', ' ')}.)" if title else "")
        out.append(
            {
                "id": f"xquad-en-{ai}-article-sum",
                "source": "xquad",
                "kind": "summarize",
                "instruction": inst,
                "input": text,
            }
        )
    # paragraph translation: XQuAD's de/es paragraphs are professional translations of the en ones
    for lang, n_into_en, n_from_en in (("de", 150, 75), ("es", 150, 75)):
        pairs = [
            (ai, pi, p["context"], arts[lang][ai]["paragraphs"][pi]["context"]) for ai, pi, p in all_paras
        ]
        picks = rng.sample(pairs, n_into_en + n_from_en)
        for k, (ai, pi, en_ctx, x_ctx) in enumerate(picks):
            into_en = k < n_into_en
            s, t = (lang, "en") if into_en else ("en", lang)
            out.append(
                {
                    "id": f"xquad-{s}-{t}-{ai}-{pi}",
                    "source": "xquad",
                    "kind": "translate",
                    "instruction": rng.choice(TRANSLATE).format(src=LANG[s], tgt=LANG[t]),
                    "input": x_ctx if into_en else en_ctx,
                }
            )
    return out


# ---------------------------------------------------------------- FLORES-200 dev: sentence-group translation
def build_flores(src: Sources) -> list[dict]:
    rng = random.Random(f"{SEED}:flores")
    code = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn", "es": "spa_Latn"}
    lines = {
        k: src.read("flores", f"dataset/train/{v}.dev").decode("utf-8").splitlines() for k, v in code.items()
    }
    n = len(lines["en"])
    assert all(len(v) == n for v in lines.values()), {k: len(v) for k, v in lines.items()}
    chunks, i = [], 0  # consecutive groups of 1-3 sentences (FLORES keeps an article's sentences together)
    while i < n:
        size = rng.choice((1, 2, 2, 3))
        chunks.append((i, min(n, i + size)))
        i += size
    out = []
    plan = [
        ("de", "en", 300),
        ("fr", "en", 200),
        ("es", "en", 200),
        ("en", "de", 80),
        ("en", "fr", 60),
        ("en", "es", 60),
    ]
    for s, t, k in plan:
        for a, b in sorted(rng.sample(chunks, min(k, len(chunks)))):
            text = " ".join(lines[s][a:b])
            out.append(
                {
                    "id": f"flores-dev-{s}-{t}-{a}-{b}",
                    "source": "flores200_dev",
                    "kind": "translate",
                    "instruction": rng.choice(TRANSLATE).format(src=LANG[s], tgt=LANG[t]),
                    "input": text,
                }
            )
    return out


# ---------------------------------------------------------------- OASST: multi-turn paths ending in a user turn
def build_oasst(src: Sources) -> list[dict]:
    raw = src.read("oasst", "model/model_eval/manual/data/en_100_tree.jsonl").decode("utf-8")
    out = []

    def ok(m: dict) -> bool:
        return not m.get("deleted") and m.get("review_result", True) is not False and not m.get("synthetic")

    def walk(m: dict, hist: list[dict], tree: str) -> None:
        if not ok(m):
            return
        h = hist + [{"role": "user" if m["role"] == "prompter" else "assistant", "content": m["text"]}]
        if m["role"] == "prompter" and len(h) >= 3:
            out.append(
                {
                    "id": f"oasst-{tree}-{m['message_id']}",
                    "source": "oasst1_en_100",
                    "kind": "multi_turn",
                    "messages": h,
                }
            )
        for r in m.get("replies", []):
            walk(r, h, tree)

    for line in raw.splitlines():
        t = json.loads(line)
        walk(t["prompt"], [], t["message_tree_id"])
    return out


# ---------------------------------------------------------------- SGD: task dialogues cut at a later user turn
def build_sgd(src: Sources, k: int = 500) -> list[dict]:
    rng = random.Random(f"{SEED}:sgd")
    dialogues = []
    for path in SGD_FILES:
        dialogues.extend(json.loads(src.read("sgd", path)))
    dialogues.sort(key=lambda d: d["dialogue_id"])
    out = []
    for d in sorted(rng.sample(dialogues, k), key=lambda d: d["dialogue_id"]):
        turns = [
            {"role": "user" if t["speaker"] == "USER" else "assistant", "content": t["utterance"]}
            for t in d["turns"]
        ]
        user_idx = [i for i, t in enumerate(turns) if t["role"] == "user" and i >= 2]
        cut = rng.choice(user_idx)
        out.append(
            {
                "id": f"sgd-{d['dialogue_id']}-{cut}",
                "source": "sgd",
                "kind": "multi_turn",
                "messages": turns[: cut + 1],
            }
        )
    return out


# ---------------------------------------------------------------- TheAlgorithms/Python: code explain/edit
CODE_TASKS = [
    ("code_explain", "Explain what the following Python code does and how it works."),
    ("code_explain", "Walk through this function step by step, then state its time and space complexity."),
    (
        "code_edit",
        "Refactor the following Python code for readability without changing its behaviour. "
        "Return the complete code.",
    ),
    ("code_edit", "Add a comment above each non-trivial line of this code. Return the complete code."),
    ("code_edit", "Rename the variables in this code to clearer names and return the complete code."),
    ("code_translate", "Translate this Python code into JavaScript."),
    ("code_translate", "Rewrite this Python code in C++."),
    ("code_translate", "Port the following Python code to Java."),
    ("code_test", "Write pytest unit tests for the following code, covering normal and edge cases."),
]
DOC_TASK = (
    "code_edit",
    "Write a docstring for this function and return the function with the docstring added.",
)
HINT_TASK = ("code_edit", "Add type hints to this function and return the complete function.")


def _strip_docstring(node: ast.AST, seg_lines: list[str], first: int) -> str | None:
    body = getattr(node, "body", [])
    if not (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return None
    a, b = body[0].lineno - first, body[0].end_lineno - first  # 0-based inclusive within the segment
    kept = seg_lines[:a] + seg_lines[b + 1 :]
    return "\n".join(kept) if len(body) > 1 else None


def build_algorithms(src: Sources, k: int = 1000) -> list[dict]:
    rng = random.Random(f"{SEED}:algorithms")
    cands = []
    for path in src.ls("algorithms", "."):
        if not path.endswith(".py") or "/test" in path or path.split("/")[-1].startswith(("test_", "__")):
            continue
        text = src.read("algorithms", path).decode("utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            seg = lines[first - 1 : node.end_lineno]
            code = "\n".join(seg)
            if not (6 <= len(seg) <= 60 and len(code) <= 2500):
                continue
            cands.append((path, node, seg, first, code))
    # 1,385 files: the provenance records the commit and the file list, not each file's hash
    src.hashes = {key: h for key, h in src.hashes.items() if not key.startswith("algorithms:")}
    euler = [c for c in cands if c[0].startswith("project_euler/")]
    rest = [c for c in cands if not c[0].startswith("project_euler/")]
    picks = rng.sample(euler, min(EULER_SHARE, len(euler)))
    picks += rng.sample(rest, min(k - len(picks), len(rest)))
    picks.sort(key=lambda c: (c[0], c[3]))
    out = []
    for path, node, seg, first, code in picks:
        options = list(CODE_TASKS)
        stripped = _strip_docstring(node, seg, first) if isinstance(node, ast.FunctionDef) else None
        if stripped:
            options += [DOC_TASK] * 2
        if (
            isinstance(node, ast.FunctionDef)
            and node.returns is None
            and not any(a.annotation for a in node.args.args)
        ):
            options += [HINT_TASK] * 2
        kind, inst = rng.choice(options)
        body = stripped if (kind, inst) == DOC_TASK else code
        out.append(
            {
                "id": f"thealgorithms-{path}:{node.name}",
                "source": "thealgorithms_python",
                "kind": kind,
                "instruction": inst,
                "input": f"```python\n{body}\n```",
            }
        )
    return out


# ---------------------------------------------------------------- PEPs (public domain / CC0): section prompts
PEP_TASKS = [
    ("summarize", "Summarize the following section of {pep} in a short paragraph."),
    ("summarize", "List the main points of this excerpt from {pep}."),
    ("summarize", "Write a TL;DR (three sentences at most) of the text below, taken from {pep}."),
    (
        "explain",
        "Explain the following excerpt from {pep} to a Python programmer who has not read it. "
        "Use examples from the text.",
    ),
    (
        "context_qa",
        "Based only on the excerpt from {pep} below, what problem does it address and what does it "
        "propose or conclude?",
    ),
]
UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
SKIP_SECTIONS = {
    "copyright",
    "references",
    "footnotes",
    "acknowledgements",
    "acknowledgments",
    "resolution",
    "version history",
    "change history",
}


def build_peps(src: Sources, k: int = 500) -> list[dict]:
    rng = random.Random(f"{SEED}:peps")
    sections = []
    for path in src.ls("peps", "peps"):
        if not re.fullmatch(r"peps/pep-\d{4}\.rst", path):
            continue
        text = src.read("peps", path).decode("utf-8", errors="replace")
        m = re.search(r"^Copyright\n=+\n\n(.+?)(?:\n\n|\Z)", text, flags=re.M | re.S)
        if not m or not re.search(r"public domain|CC0", m.group(1)):
            continue  # only PEPs placed in the public domain or under CC0
        title = re.search(r"^Title: (.+)$", text, flags=re.M)
        num = int(path[-8:-4])
        if not title or "Release Schedule" in title.group(1):
            continue
        pep = f"PEP {num} ({title.group(1).strip()})"
        lines = text.splitlines()
        heads = [
            i - 1
            for i in range(1, len(lines))
            if UNDERLINE.match(lines[i])
            and lines[i - 1].strip()
            and len(lines[i]) >= len(lines[i - 1].strip())
            and not UNDERLINE.match(lines[i - 1])
        ]
        for j, h in enumerate(heads):
            end = heads[j + 1] if j + 1 < len(heads) else len(lines)
            name = lines[h].strip()
            body = "\n".join(lines[h + 2 : end]).strip()
            if name.lower() in SKIP_SECTIONS or not 120 <= words(body) <= 700:
                continue
            sections.append((num, h, pep, f"{name}\n{'=' * len(name)}\n\n{body}"))
    src.hashes = {
        key: h for key, h in src.hashes.items() if not key.startswith("peps:")
    }  # 736 files, as above
    out = []
    for num, h, pep, sec in sorted(rng.sample(sections, min(k, len(sections)))):
        kind, inst = rng.choice(PEP_TASKS)
        out.append(
            {
                "id": f"pep-{num:04d}-line{h + 1}",
                "source": "python_peps",
                "kind": kind,
                "instruction": inst.format(pep=pep),
                "input": sec,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--mirror", type=Path, required=True, help="the folder of the source repositories' git snapshots"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "train")
    args = ap.parse_args()
    src = Sources(args.mirror)
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    for repo, path, name in RAW:
        dest = args.out / "raw" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read(repo, path))
    outputs = {
        "xquad_prompts.jsonl": build_xquad(src),
        "flores200_dev_translate.jsonl": build_flores(src),
        "oasst1_en100_multiturn.jsonl": build_oasst(src),
        "sgd_dev_multiturn.jsonl": build_sgd(src),
        "thealgorithms_python_code.jsonl": build_algorithms(src),
        "python_peps_sections.jsonl": build_peps(src),
    }
    for name, recs in outputs.items():
        recs[:] = [r for r in recs if prompt_words(r) <= MAX_WORDS]
        longest = max(prompt_words(r) for r in recs)
        write_jsonl(args.out / name, recs)
        kinds: dict[str, int] = {}
        for r in recs:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        print(f"{name}: {len(recs)} records, kinds {kinds}, longest {longest} words")
    print("source files read (sha256):")
    for key, h in sorted(src.hashes.items()):
        print(f"  {key} {h}")
    print("files written (sha256, first 16 hex):")
    for p in sorted(args.out.rglob("*")):
        if p.is_file() and p.name != "PROVENANCE.md":
            digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            print(f"  {p.relative_to(args.out)} {p.stat().st_size} {digest}")


if __name__ == "__main__":
    main()
