"""Peer decoders for the benchmark: what a user would otherwise run instead of entmtp, fed the same prompt token
ids as the Engine and reporting the same `Result` (no per-step records, prefill time unknown).

`HFGenerate` is transformers' `model.generate`, plain or with prompt lookup decoding, pinned to plain greedy or
plain temperature sampling whatever the model's `generation_config` says. `LlamaCppPlain` is plain decoding of
a GGUF file through llama-cpp-python, when it is installed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..accept import Sampling
from ..backends.llama_cpp import LLAMA_CPP_HINT
from ..errors import EntMTPError
from ..model import check_request, context_window, embedded_gguf, eos_token_ids
from ..records import Result

PEERS = ("hf-generate", "hf-prompt-lookup", "llama-cpp", "llama-cpp-amx")  # the bench's names for them
LLAMA_PEERS = (
    "llama-cpp",
    "llama-cpp-amx",
)  # llama-cpp-python's plain decoding: they decode their own weights

# Generation settings that change the output but whose only "off" value is None: transformers fills None from
# the model's own generation_config, so an explicit GenerationConfig cannot switch them off.
_NO_OFF_SWITCH = (
    "sequence_bias",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "min_p",
    "top_h",
    "watermarking_config",
    "stop_strings",
    "max_time",
    "dola_layers",
    "assistant_early_exit",
    "prompt_lookup_num_tokens",
    "penalty_alpha",
    "constraints",
    "force_words_ids",
)


class PeerUnavailable(EntMTPError):
    """A peer decoder's backend is not installed."""


def check_peers(names: list[str]) -> None:
    """Raise EntMTPError naming the first name that is no peer."""
    for p in names:
        if p not in PEERS:
            raise EntMTPError(f"unknown peer {p!r}: use {', '.join(PEERS)}")


def build_peers(names: list[str], model, tokenizer, embedded: bool = True) -> dict:
    """Peer decoders by name; an optional one that is not installed is skipped with its install hint, and
    llama-cpp, which plays the embedded model's GGUF, is skipped when another model is benchmarked."""
    out: dict = {}
    for name in names:
        if name == "hf-generate":
            out[name] = HFGenerate(model, tokenizer)
        elif name == "hf-prompt-lookup":
            out[name] = HFGenerate(model, tokenizer, prompt_lookup_tokens=10)
        elif not embedded:
            print(f"entmtp: skipping peer {name}: it decodes the embedded model's GGUF, not --model")
        else:
            try:
                out[name] = LlamaCppPlain(
                    n_threads=torch.get_num_threads(), as_patched=name == "llama-cpp-amx"
                )
            except PeerUnavailable as e:
                print(f"entmtp: skipping peer {name}: {e}")
    if "llama-cpp" in out and "llama-cpp-amx" not in names and _amx_differs():
        try:  # the strongest baseline of a run on an AMX CPU: the patched build's own plain decoding
            out["llama-cpp-amx"] = LlamaCppPlain(n_threads=torch.get_num_threads(), as_patched=True)
        except PeerUnavailable as e:
            print(f"entmtp: skipping peer llama-cpp-amx: {e}")
    return out


def _amx_differs() -> bool:
    """Whether pip's llama-cpp-python and entmtp's patched build decode differently here: on a CPU with AMX
    when the patched build is installed (elsewhere the patch compiles nothing)."""
    from ..backends.amx import has_amx
    from ..backends.llama_build import build_tag

    return has_amx() and build_tag() != "stock"


@dataclass(frozen=True, eq=False)
class HFGenerate:
    """transformers' `model.generate` on token ids: greedy at temperature 0, else plain temperature sampling
    (no top-k / top-p / repetition penalty). `prompt_lookup_tokens` turns on prompt lookup decoding
    (`prompt_lookup_num_tokens`, matching n-grams of up to `max_matching_ngram` tokens)."""

    model: PreTrainedModel
    tokenizer: object
    prompt_lookup_tokens: int | None = None
    max_matching_ngram: int = 2

    def __post_init__(self) -> None:
        if self.prompt_lookup_tokens is not None and self.prompt_lookup_tokens < 1:
            raise EntMTPError(
                f"prompt_lookup_tokens must be >= 1 (or None for plain generate), got {self.prompt_lookup_tokens}"
            )
        if self.max_matching_ngram < 1:
            raise EntMTPError(f"max_matching_ngram must be >= 1, got {self.max_matching_ngram}")
        model_config = getattr(self.model, "generation_config", None)
        fixed = [k for k in _NO_OFF_SWITCH if getattr(model_config, k, None) is not None]
        if fixed:
            raise EntMTPError(
                f"the model's generation_config sets {', '.join(fixed)}, which transformers' generate cannot be "
                "told to ignore: clear them (e.g. model.generation_config.<name> = None) to compare plain decoding"
            )

    @property
    def name(self) -> str:
        return "hf-generate" if self.prompt_lookup_tokens is None else "hf-prompt-lookup"

    def generation_config(self, max_new_tokens: int, temperature: float) -> GenerationConfig:
        """Every knob that changes the output set explicitly (None would be filled from the model's config)."""
        eos = sorted(eos_token_ids(self.model, self.tokenizer))
        sampling = (
            dict(do_sample=True, temperature=temperature, top_k=0)
            if temperature > 0
            else dict(do_sample=False, temperature=1.0, top_k=50)  # neutral values: no "unused flag" warnings
        )
        lookup = (
            dict(
                prompt_lookup_num_tokens=self.prompt_lookup_tokens,
                max_matching_ngram_size=self.max_matching_ngram,
            )
            if self.prompt_lookup_tokens is not None
            else {}
        )
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,  # overrides any min_length of the model's config
            eos_token_id=eos or None,
            pad_token_id=self._pad_id(eos),
            num_beams=1,
            num_return_sequences=1,
            top_p=1.0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0,
            guidance_scale=1.0,
            renormalize_logits=False,
            remove_invalid_values=False,
            use_cache=True,
            use_mtp=False,
            output_scores=False,
            return_dict_in_generate=False,
            **sampling,
            **lookup,
        )

    def _pad_id(self, eos: list[int]) -> int:
        for value in (
            getattr(self.tokenizer, "pad_token_id", None),
            getattr(getattr(self.model, "generation_config", None), "pad_token_id", None),
        ):
            if isinstance(value, int):
                return value
        return eos[0] if eos else 0

    def generate(
        self, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> Result:
        """Generate from prompt token ids. `seed` seeds torch's global generator (torch.manual_seed)."""
        ids = list(ids)
        _check_request(ids, max_new_tokens, temperature, context_window(self.model))
        config = self.generation_config(max_new_tokens, temperature)
        eos = set(eos_token_ids(self.model, self.tokenizer))
        t0 = time.perf_counter()
        with torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            prompt = torch.tensor([ids], device=self.model.device)
            out = self.model.generate(
                prompt, attention_mask=torch.ones_like(prompt), generation_config=config
            )
        new, finish = _cut(out[0, len(ids) :].tolist(), eos, max_new_tokens)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        rule = Sampling(temperature).rule  # plain decoding's draws: the reference distribution
        return Result(text, new, len(ids), [], time.perf_counter() - t0, 0.0, finish, acceptance=rule)


def _check_request(ids: list[int], max_new_tokens: int, temperature: float, window: int) -> None:
    """The lengths, checked as the Engine checks them (model.check_request), then the temperature."""
    check_request(len(ids), max_new_tokens, window)
    if temperature < 0:
        raise EntMTPError(f"temperature must be >= 0 (0 = greedy), got {temperature}")


def _cut(new: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    """New tokens up to and including the first EOS (anything after it is padding), at most max_new_tokens."""
    for i, tok in enumerate(new[:max_new_tokens]):
        if tok in eos:
            return new[: i + 1], "eos"
    return new[:max_new_tokens], "length"


def _import_llama_cpp():
    from ..backends.llama_cpp import LlamaCppError, import_llama_cpp

    try:
        return import_llama_cpp()
    except LlamaCppError as e:
        raise PeerUnavailable(f"llama.cpp peer needs llama-cpp-python: {LLAMA_CPP_HINT}") from e


def llama_cpp_available() -> bool:
    from ..backends.llama_cpp import available

    return available()


def _flash_attention(path: Path, threads: int, repacked: bool) -> bool:
    """The backend's flash-attention setting for this file (backends/attention.py): the cached verdict for its
    shapes, else timed on a runtime loaded as the backend loads it."""
    from ..backends.attention import verdict
    from ..backends.llama_cpp import N_BATCH, Runtime, gguf_attention_shapes

    known = verdict(gguf_attention_shapes(path), threads, repacked)
    if known is None:
        known = Runtime(path, threads=threads, n_ctx=N_BATCH, extra_bufts=repacked).flash_attn
    return known


@contextlib.contextmanager
def _extra_bufts(llama_cpp, on: bool):
    """llama-cpp-python's `Llama` with llama.cpp's extra buffer types (repacked weights) on or off; `Llama`
    takes no such option, so its default parameters are wrapped while it loads."""
    if on:
        yield
        return
    low = llama_cpp.llama_cpp  # the module `Llama` reads its defaults from
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCppPlain:
    """Plain decoding of a GGUF file (default: the embedded model's) through llama-cpp-python: greedy at
    temperature 0, else plain temperature sampling (no top-k / top-p / min-p / repetition penalty).

    Two peers. `llama-cpp` is llama-cpp-python as `pip install` gets it: on a CPU with AMX, llama.cpp's repacked
    weights off, since pip's 0.3.36 build crashes with them there (backends/amx.py; where the stock build would
    not crash, this peer understates it, and `llama-cpp-amx` is the row to compare with). `llama-cpp-amx`
    (`as_patched`): entmtp's patched build with the repacked weights on wherever its canary passes, the
    strongest plain decoding on such a CPU; it exists only where the two differ (a CPU with AMX, the patched
    build installed). `settings` says which build and weights each decoded."""

    def __init__(
        self,
        gguf_path: str | Path | None = None,
        n_threads: int | None = None,
        n_ctx: int = 0,
        *,
        as_patched: bool = False,
    ):
        from ..backends.amx import extra_bufts_forced, extra_bufts_safe, has_amx
        from ..backends.llama_build import build_tag, describe_build

        llama_cpp = _import_llama_cpp()
        path = Path(gguf_path) if gguf_path is not None else embedded_gguf()
        if not path.is_file():
            raise EntMTPError(f"GGUF file {path} does not exist: pass the path of a .gguf model file")
        self.path, self.name = path, "llama-cpp-amx" if as_patched else "llama-cpp"
        patched = build_tag() != "stock"
        if as_patched and not (patched and has_amx()):
            why = (
                "no AMX on this CPU, where the patch compiles nothing"
                if patched
                else "pip's build is installed"
            )
            raise PeerUnavailable(f"llama-cpp-amx decodes as llama-cpp here ({why})")
        if has_amx() and patched and not as_patched:
            repacked, how = (
                False,
                "repacked weights off, as pip's build runs them on an AMX CPU (it crashes with them)",
            )
        else:
            repacked = extra_bufts_safe(path)
            why = "ENTMTP_LLAMA_EXTRA_BUFTS=0" if extra_bufts_forced() is False else "the AMX canary crashed"
            how = "repacked weights " + ("on" if repacked else f"off ({why})")
        # the backend's settings (backends/llama_cpp.py), so that this is its plain decoding without entmtp's
        # loop: its attention kernel, timed as the faster here (same rounding, same greedy tokens), and one
        # thread count for prefill and decode (`Llama` would prefill on every core); n_ctx 0: the model's
        # context window, as the backend's
        flash = _flash_attention(path, n_threads or torch.get_num_threads(), repacked)
        self.settings = f"{describe_build()}; {how}; flash attention {'on' if flash else 'off'}"
        with _extra_bufts(llama_cpp, repacked):
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                flash_attn=flash,
                verbose=False,
            )
        self.n_ctx = self.llm.n_ctx()
        self.eos_ids = {self.llm.token_eos()}

    def generate(
        self, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> Result:
        ids = list(ids)
        _check_request(ids, max_new_tokens, temperature, self.n_ctx)
        t0 = time.perf_counter()
        if seed is not None:
            self.llm.set_seed(seed)
        self.llm.reset()  # no KV reuse from an earlier call: every call pays its own prefill
        new: list[int] = []
        finish = "length"
        tokens = self.llm.generate(
            ids,
            temp=temperature,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            typical_p=1.0,
            repeat_penalty=1.0,
            reset=True,
        )
        for tok in tokens:
            new.append(int(tok))
            if tok in self.eos_ids:
                finish = "eos"
                break
            if len(new) == max_new_tokens:
                break
        tokens.close()
        text = self.llm.detokenize([t for t in new if t not in self.eos_ids]).decode(
            "utf-8", errors="replace"
        )
        rule = Sampling(temperature).rule  # plain decoding's draws: the reference distribution
        return Result(text, new, len(ids), [], time.perf_counter() - t0, 0.0, finish, acceptance=rule)
