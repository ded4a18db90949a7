"""Training prompts: where the self-distillation data's prompts come from (never the benchmark sets).

Sources are data directories (``train/*.json``, ``train/*.jsonl``, ``gsm8k/train.jsonl``: the shared data
directory, the project's own ``data/``) or one user prompt file (JSONL or a JSON list). A record is a chat
(``messages`` ending with a user turn) or one string (instruction(+input), question, prompt or text).
`load_training_prompts` reads them all, deduplicated in file order; `shards` turns them into data.
`entmtp train-heads` reads the prompts shipped in the package by default (`shipped_dir`: every prompt of the
shared data's training sources, derived by `write_shipped`, with their provenance beside them), plus the
project's own ``data/`` where a checkout has built it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from ..errors import DataError

ROLES = ("system", "user", "assistant")


def _prompt_text(rec: dict) -> str:
    """instruction (+ blank line + input) for instruction records, question for GSM8K, prompt/text otherwise."""
    for key in ("instruction", "question", "prompt", "text"):
        value = rec.get(key)
        if isinstance(value, str) and value.strip():
            extra = rec.get("input") if key == "instruction" else None
            if isinstance(extra, str) and extra.strip():
                return value.strip() + "\n\n" + extra.strip()
            return value.strip()
    return ""


def _prompt(rec: dict) -> str | list[dict] | None:
    """A record's prompt (records come from ``read_records``): a chat (``messages``, a list of {role, content}
    ending with a user turn; the earlier assistant turns are given, the model answers the last user turn) or
    one string (see ``_prompt_text``). None when the record holds neither."""
    msgs = rec.get("messages")
    if msgs is not None:
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok or msgs[-1]["role"] != "user":
            return None
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    return _prompt_text(rec) or None


def _key(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def read_records(path: Path) -> Iterator[dict]:
    """Records of a JSON list file or a JSONL file; JSONL lines that do not parse are skipped (alpaca-libre
    v2 ends in broken lines upstream)."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"cannot read prompt file {path} ({e}): give a JSON list or a JSONL file") from e
        if not isinstance(data, list):
            raise DataError(f"prompt file {path} is not a JSON list of records: give a list of objects")
        yield from (r if isinstance(r, dict) else {"prompt": r} for r in data)
        return
    opened = gzip.open(path, "rt", encoding="utf-8", errors="replace") if path.suffix == ".gz" else None
    with opened or path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            yield rec if isinstance(rec, dict) else {"prompt": rec}


def read_prompt_file(path: str | os.PathLike[str]) -> list[str | list[dict]]:
    """Prompts of a user file: JSONL or a JSON list; each record a string, an object with one of
    instruction(+input), question, prompt or text, or a chat in ``messages`` (ending with a user turn)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompt file {p} does not exist: give a JSONL or JSON file of prompts")
    prompts = [t for t in map(_prompt, read_records(p)) if t]
    if not prompts:
        raise DataError(
            f"prompt file {p} holds no prompts: give records with an instruction, question, prompt or text "
            "field, or messages ending with a user turn"
        )
    return prompts


def training_prompt_sources(data_dir: str | os.PathLike[str]) -> list[Path]:
    """The training prompt files under ``data_dir``: train/*.json (GPTeacher), train/*.jsonl (alpaca-libre, the
    project's context-copy and chat prompts), train/*.jsonl.gz (the shipped prompts), gsm8k/train.jsonl. Never
    the benchmark prompt sets."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(
            f"training data directory {d} does not exist: pass --data-dir (holding train/ and gsm8k/) "
            f"or --prompts FILE"
        )
    files = [*sorted((d / "train").glob("*.json")), *sorted((d / "train").glob("*.jsonl")),
             *sorted((d / "train").glob("*.jsonl.gz"))]  # fmt: skip
    if (d / "gsm8k" / "train.jsonl").is_file():
        files.append(d / "gsm8k" / "train.jsonl")
    if not files:
        raise DataError(
            f"no training prompts in {d}: expected train/*.json, train/*.jsonl or "
            f"gsm8k/train.jsonl; pass another --data-dir or --prompts FILE"
        )
    return files


def load_training_prompts(
    data_dir: str | os.PathLike[str] | list | None = None, prompts_file=None, *, with_sources: bool = False
):
    """All training prompts, deduplicated, in file order: from ``prompts_file`` if given, else from the data
    directories ``data_dir`` (a path, a comma-separated string of paths or a list; one of the two is needed).
    ``with_sources``: also return each prompt's source file name (the data manifest counts them)."""
    if prompts_file is not None:
        pairs = [(t, Path(prompts_file).name) for t in read_prompt_file(prompts_file)]
    else:
        pairs = [pair for d in _data_dirs(data_dir) for pair in _directory_prompts(d)]
    seen: dict[str, tuple[str | list[dict], str]] = {}
    for t, src in pairs:
        seen.setdefault(_key(t), (t, src))  # the first occurrence wins
    unique = list(seen.values())
    if not unique:
        raise DataError("the prompt set is empty: give a data directory or prompt file with prompts in it")
    prompts = [t for t, _ in unique]
    return (prompts, [src for _, src in unique]) if with_sources else prompts


def _data_dirs(data_dir: str | os.PathLike[str] | list | None) -> list[Path]:
    names = list(data_dir) if isinstance(data_dir, (list, tuple)) else str(data_dir or "").split(",")
    dirs = [shipped_dir() if str(x) == "shipped" else Path(x) for x in names if x]  # "shipped": the package's
    if not dirs:
        raise DataError(
            "no training prompt source given: pass a data directory (--data-dir, holding train/ and gsm8k/) "
            "or a prompt file (--prompts FILE)"
        )
    return dirs


def _directory_prompts(directory: Path) -> list[tuple[str | list[dict], str]]:
    """(prompt, source file name) of every training prompt file under ``directory``; alpaca-libre records
    count only with status "ok"."""
    pairs = []
    for path in training_prompt_sources(directory):
        records = read_records(path)
        if path.name.startswith("alpaca_libre"):
            records = (r for r in records if r.get("status") == "ok")
        for rec in records:  # the shipped file names each prompt's own source file
            if t := _prompt(rec):
                pairs.append((t, rec.get("source") if isinstance(rec.get("source"), str) else path.name))
    return pairs


SHIPPED = "prompts.jsonl.gz"  # under shipped_dir()/train


def shipped_dir() -> Path:
    """The training prompts shipped in the package, as a data directory (train/prompts.jsonl.gz)."""
    return Path(str(resources.files("entmtp") / "assets" / "training"))


def default_data_dirs(cwd: Path | None = None) -> list[str]:
    """`entmtp train-heads`' prompt sources when none is named: "shipped" (the prompts in the package), and the
    project's own ``data/`` (context-copy tasks, multi-turn chat) where a checkout has built ``data/train/``."""
    cwd = Path.cwd() if cwd is None else cwd
    return ["shipped"] + (["data"] if (cwd / "data" / "train").is_dir() else [])


def write_shipped(data_dir: str | os.PathLike[str], out: Path | None = None) -> Path:
    """Write every training prompt of ``data_dir`` (the shared data's train/ and gsm8k/train.jsonl), deduplicated
    in file order, as the shipped file: one JSON object a line, {"prompt"} or {"messages"}, and its "source" file
    (gzip level 9, no timestamp, so that the same data gives the same bytes)."""
    prompts, sources = load_training_prompts(data_dir, with_sources=True)
    out = out or shipped_dir() / "train" / SHIPPED
    lines = [
        json.dumps({"messages": t} if isinstance(t, list) else {"prompt": t}, ensure_ascii=False)[:-1]
        + f', "source": {json.dumps(src)}}}'
        for t, src in zip(prompts, sources, strict=True)
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), 9, mtime=0))
    return out
