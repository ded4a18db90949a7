"""What `build` asks of a backend (registry.py names them): its candidates, how it loads, why it does not fit."""

from __future__ import annotations

from dataclasses import replace


class Backend:
    """One backend as `build` sees it (the `Base` protocol, backends/__init__.py, is what the engine sees)."""

    name: str
    words: str  # the name in prose ("llama.cpp")
    torch_model: bool  # whether its model is a torch module whose weights, cache and dtype torch holds

    def available(self) -> bool:
        """Whether it can run here at all (its library installed)."""
        return True

    def check(self, spec) -> None:
        """Raise `EntMTPError` for what `spec` asks of this backend that it cannot do (before a model loads)."""

    def fits(self, spec) -> bool:
        """Whether `backend auto` measures this backend for `spec` (device, model file, dtype)."""
        return True

    def why_not(self, spec) -> str:
        """Why `fits(spec)` is False, in words for the plan."""
        return ""

    def candidates(self, spec, probe: bool) -> list[str]:
        """The "name/dtype[:format]" candidates `build` measures on this backend (one without `probe`)."""
        raise NotImplementedError

    def at(self, spec, dtype: str, fmt: str):
        """`spec` made concrete for one of this backend's candidates."""
        return replace(
            spec,
            backend=self.name,
            dtype=dtype,
            gguf_as_given=spec.gguf_as_given and not fmt,
            gguf_format=fmt,
        )

    def load(self, spec):
        """(model, tokenizer) for a concrete `spec` (backend and dtype named)."""
        raise NotImplementedError

    def batchable(self, spec, model) -> bool:
        """Whether an engine on `model` can step a continuous batch (else a server serves one at a time)."""
        return False

    def owns(self, model) -> bool:
        """Whether `model` was loaded by this backend (the default backend owns every model no other claims)."""
        return False

    def base(self, model, *, hidden_state_offset: int, kv: str, full_hidden: bool, hidden_state_norm: bool):
        """The engine's view of `model` (the `Base` protocol, backends/__init__.py); see `base_for`."""
        raise NotImplementedError

    def weights_format(self, model) -> str | None:
        """The format of the weights `model` computes with, comparable across backends (see
        backends.weights_format); None: not known."""
        return None

    def describe_weights(self, model) -> str:
        """The weights in words (the plan, the server's log, the bench)."""
        return f"{self.weights_format(model) or 'unknown'} on {self.words}"

    def describe_kernels(self, model) -> str:
        """Its build and kernels in words where they matter ("": nothing to say)."""
        return ""

    def only_reason(self, spec) -> str:
        """Why a lone candidate on this backend has the weights it has, for the plan."""
        return "the only candidate"

    def heads_note(self, spec) -> str:
        """Where the heads compute in another dtype than the weights: why ("" where they are the same)."""
        return ""

    def cost_key(self, model) -> dict:
        """What besides the model and heads tells one of its cost curves from another (costs/cache.py)."""
        return {}
