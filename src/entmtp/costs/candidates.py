"""The candidate `build` chose on this machine for a spec ("backend/dtype[:format]"), and the second one its
requests are routed to, cached beside the cost curves (dtype-choices.json): a choice is measured once."""

from __future__ import annotations

import json

import torch

from ..files import write_text_atomic
from ..machine import cpu_info, digest
from .cache import costs_dir


def route_key(choice_key: str | None) -> str | None:
    """Where the route's second candidate is cached beside the choice (absent in a cache from before routing:
    then every candidate is loaded again, on its cached curve, to find it)."""
    return None if choice_key is None else f"route:{choice_key}"


def choices_path():
    return costs_dir() / "dtype-choices.json"


def choice_key(spec, heads_spec: str) -> str:
    cpu = cpu_info()
    return digest(
        {
            "cpu": cpu,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": spec.model,
            "backend": spec.backend,
            "dtype": spec.dtype,
            "mixed_weights": spec.mixed_weights,
            "heads": heads_spec,
            "tree": spec.tree,
            "policy": spec.policy,
            "profile": spec.profile,
            "pack": spec.pack,
            "temperature": spec.temperature > 0,
        }
    )


def read_choices(say) -> dict:
    """The cached choices (an empty cache where the file is missing; one line to `say` naming a file that
    cannot be used, which is then written afresh)."""
    path = choices_path()
    try:
        choices = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # JSON and Unicode errors are ValueErrors
        say(f"{path} is unreadable ({type(e).__name__}): measuring again, and writing it afresh")
        return {}
    if not isinstance(choices, dict) or not all(isinstance(v, str) for v in choices.values()):
        say(f"{path} holds no choices (not a JSON object of names): measuring again, and writing it afresh")
        return {}
    return choices


def save_choices(new: dict[str, str]) -> None:
    """`new` choices into the cache file, beside those another process may have written since it was read
    (read again, silently: a file that could not be used was named when it was read first)."""
    choices = read_choices(say=lambda m: None) | new
    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(choices, indent=1) + "\n")
