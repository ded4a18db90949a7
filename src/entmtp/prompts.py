"""Benchmark prompt sets (shipped in entmtp/assets/prompts, see PROVENANCE.md there).

Each task is split once, deterministically: the first `CALIB` prompts are the calibration split (for offline
work such as building a task's tree bank), the rest the test split (for reported numbers). Neither split is
ever used to train heads.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

from .errors import DataError

CALIB = 20  # prompts per task reserved for offline calibration
TASKS = {  # task -> (file, label used in reports)
    "humaneval": ("humaneval.jsonl.gz", "HumanEval"),
    # an edit of HumanEval's canonical solution, the solution itself as the prediction (PredictedPrompt)
    "edits": ("humaneval.jsonl.gz", "HumanEval edits (the code as prediction)"),
    # one extraction schema over many inputs (GSM8K problems): repeated structure across requests (suffix.py)
    "extraction": ("gsm8k_test.jsonl", "GSM8K extraction (one JSON schema over many inputs)"),
    "sharegpt": ("sharegpt.jsonl", "ShareGPT"),
    "gsm8k": ("gsm8k_test.jsonl", "GSM8K"),
    "writing": ("writingprompts_200.jsonl", "litbench-style (r/WritingPrompts)"),
    "mt_bench": ("mt_bench.jsonl", "MT-Bench"),
    # Spec-Bench's copy-heavy categories (development set): the records of one category each
    "specbench-translation": ("specbench_dev.jsonl", "Spec-Bench translation"),
    "specbench-summarization": ("specbench_dev.jsonl", "Spec-Bench summarization"),
    "specbench-qa": ("specbench_dev.jsonl", "Spec-Bench QA"),
    "specbench-rag": ("specbench_dev.jsonl", "Spec-Bench RAG"),
    "specbench-math": ("specbench_dev.jsonl", "Spec-Bench math reasoning"),
    "specbench-mtbench": ("specbench_dev.jsonl", "Spec-Bench MT-Bench"),
}
SPECBENCH = {  # task -> Spec-Bench categories
    "specbench-translation": ("translation",),
    "specbench-summarization": ("summarization",),
    "specbench-qa": ("qa",),
    "specbench-rag": ("rag",),
    "specbench-math": ("math_reasoning",),
    "specbench-mtbench": (
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    ),
}
FOUR_TASKS = ("humaneval", "sharegpt", "gsm8k", "writing")  # the paper's four tasks (LitBench stand-in)


def _records(filename: str) -> list[dict]:
    path = resources.files("entmtp") / "assets" / "prompts" / filename
    raw = path.read_bytes()
    if filename.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


class PredictedPrompt(str):
    """A prompt that carries the output its user expects (`prediction`: OpenAI's Predicted Outputs,
    entmtp/prediction.py): the bench's speculative methods decode with it, its plain baselines without."""

    prediction: str

    def __new__(cls, text: str, prediction: str):
        self = super().__new__(cls, text)
        self.prediction = prediction
        return self


# what a user asks of code they paste, in turn: each keeps most of the code (the prediction) as it was
EDITS = (
    "Rename the function `{name}` to `{name}_v2` and update every use of the name.",
    "Add type hints to every parameter and variable of the function where they are missing.",
    "Add a comment above each line of the body that says what the line does.",
    "Add a check at the start of the function that raises ValueError for invalid input.",
    "Rewrite the docstring so that it is one short sentence, and keep the code as it is.",
)


def _edit(i: int, rec: dict) -> PredictedPrompt:
    """HumanEval record `i` as an edit request: its canonical solution, one of EDITS, the code as prediction."""
    code = rec["prompt"] + rec["canonical_solution"]
    ask = EDITS[i % len(EDITS)].format(name=rec["entry_point"])
    text = f"{ask} Reply with the whole edited code in one ```python block.\n\n```python\n{code}```"
    return PredictedPrompt(text, f"```python\n{code}```")


# the repeated-structure workload: the same instruction and schema over every input, as an extraction job sends
EXTRACTION = (
    "Extract the facts of this math problem as JSON with exactly these keys: "
    '{{"quantities": [{{"name": string, "value": number, "unit": string}}], "question": string}}. '
    "Reply with the JSON only.\n\nProblem: {question}"
)


def _prompt(task: str, rec: dict) -> str:
    if task == "extraction":
        return EXTRACTION.format(question=rec["question"])
    if task == "humaneval":
        return "Complete the following Python function.\n\n```python\n" + rec["prompt"] + "```"
    if task == "gsm8k":
        return rec["question"]
    if task == "writing":
        return rec["prompt"]
    return rec["turns"][0]  # sharegpt, mt_bench, specbench: the first user turn


def load_prompts(task: str, split: str = "test", n: int | None = None) -> list[str]:
    """Prompts of `task` ("humaneval", "sharegpt", "gsm8k", "writing", "mt_bench"); split "calib", "test"
    or "all"; the first `n` of that split (all if None)."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if split not in ("calib", "test", "all"):
        raise DataError(f"unknown split {split!r}: use calib, test or all")
    records = _records(TASKS[task][0])
    if task in SPECBENCH:
        records = [r for r in records if r["category"] in SPECBENCH[task]]
    prompts = [_edit(i, r) if task == "edits" else _prompt(task, r) for i, r in enumerate(records)]
    prompts = {"calib": prompts[:CALIB], "test": prompts[CALIB:], "all": prompts}[split]
    return prompts if n is None else prompts[:n]


def load_prompt_file(path) -> list[str]:
    """Prompts from a JSONL file: each line an object with a `prompt` string or a `turns` list (first turn),
    and optionally a `prediction` string (the output its user expects: `PredictedPrompt`)."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"prompt file {p} does not exist: give a JSONL file with a 'prompt' or 'turns' field per line"
        )
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p} line {n} is not JSON ({e}): write one object per line") from e
        text = rec.get("prompt") if isinstance(rec, dict) else None
        if text is None and isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"]:
            text = rec["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{p} line {n} has no non-empty 'prompt' string or 'turns' list: add one")
        prediction = rec.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise DataError(f"{p} line {n}: 'prediction' must be a string (the output you expect)")
        out.append(text if prediction is None else PredictedPrompt(text, prediction))
    if not out:
        raise DataError(f"prompt file {p} holds no prompts")
    return out
