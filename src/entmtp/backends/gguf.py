"""The llama.cpp backend as `build` sees it: which GGUF file a spec decodes, in which formats, and whether
llama.cpp can run it here (backends/llama_cpp.py runs it; backends/amx.py and llama_build.py build and check
its kernels)."""

from __future__ import annotations

from dataclasses import replace

from ..console import say
from ..errors import EntMTPError
from ..machine import auto_dtype, native_bf16
from ..model import DTYPES, is_embedded, is_gguf
from .backend import Backend

GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # float GGUF types as dtypes


class LlamaCpp(Backend):
    name = "llama-cpp"
    words = "llama.cpp"
    torch_model = False

    def available(self) -> bool:
        from .llama_cpp import available

        return available()

    def check(self, spec) -> None:
        from .llama_cpp import import_llama_cpp

        import_llama_cpp()  # not installed: one line that says how
        if not (is_embedded(spec.model) or is_gguf(spec.model)):
            raise EntMTPError(
                f"--backend llama-cpp runs GGUF files: give --model FILE.gguf (not {spec.model!r}), or "
                "omit --model for the embedded model's GGUF"
            )
        if not spec.device.startswith("cpu"):
            raise EntMTPError("--backend llama-cpp runs on the CPU here: drop --device, or use transformers")

    def fits(self, spec) -> bool:
        gguf = is_embedded(spec.model) or is_gguf(spec.model)
        return spec.device.startswith("cpu") and gguf and self.available() and gguf_fits_dtype(spec)

    def why_not(self, spec) -> str:
        from .llama_cpp import LLAMA_CPP_HINT

        if not spec.device.startswith("cpu"):
            return "llama.cpp runs on the CPU only here"
        if not self.available():
            return f"llama-cpp-python is not installed ({LLAMA_CPP_HINT})"
        if is_gguf(spec.model) and not gguf_fits_dtype(spec):
            return f"llama.cpp would decode other weights than --dtype {spec.dtype} names (the GGUF's own)"
        return "llama.cpp needs a GGUF model" if spec.model else "nothing measured (--no-probe)"

    def candidates(self, spec, probe: bool) -> list[str]:
        heads_dtype = spec.dtype if spec.dtype != "auto" else auto_dtype("cpu")
        first = f"{self.name}/{heads_dtype}"
        return [first, *(f"{first}:{fmt}" for fmt in gguf_formats(spec))] if probe else [first]

    def at(self, spec, dtype: str, fmt: str):
        as_given = spec.gguf_as_given or spec.dtype == "auto"  # `auto`: the file as given
        return replace(
            spec, backend=self.name, dtype=dtype, gguf_as_given=as_given and not fmt, gguf_format=fmt
        )

    def load(self, spec):
        """The GGUF file `spec` names on llama.cpp (`spec.model` a .gguf, else the embedded model's GGUF with
        its converted tokenizer)."""
        from ..model import embedded_model_dir
        from .llama_cpp import load_gguf

        if spec.gguf_format:
            path = embedded_in_format(spec.gguf_format)
        else:
            path = gguf_for(spec.model, None if spec.gguf_as_given else spec.dtype)
        tokenizer_dir = str(embedded_model_dir()) if is_embedded(spec.model) else None
        return load_gguf(path, dtype=DTYPES[spec.dtype], threads=spec.threads, tokenizer_dir=tokenizer_dir)

    def owns(self, model) -> bool:
        from .llama_cpp import LlamaCppModel

        return isinstance(model, LlamaCppModel)

    def base(self, model, *, hidden_state_offset: int, kv: str, full_hidden: bool, hidden_state_norm: bool):
        """llama.cpp gives the last layer's hidden states, normed (`hidden_state_norm`, `kv`: transformers')."""
        return model.entmtp_base(hidden_state_offset=hidden_state_offset, full_hidden=full_hidden)

    def weights_format(self, model) -> str | None:
        return GGUF_DTYPES.get(model.weights, model.weights)  # a float GGUF's as a dtype, else its type

    def describe_weights(self, model) -> str:
        name = getattr(getattr(model, "path", None), "name", "?")
        if model.weights in GGUF_DTYPES:
            return f"{GGUF_DTYPES[model.weights]} ({model.weights} GGUF {name}) on llama.cpp"
        return f"{model.weights} GGUF ({name}) on llama.cpp"

    def describe_kernels(self, model) -> str:
        """The build and whether its AMX kernels run: "llama-cpp-python 0.3.36 (entmtp's build: patch
        1a2b3c4d); AMX kernels in use"."""
        from .amx import has_amx
        from .llama_build import describe_build

        if not has_amx():
            kernels = "no AMX on this CPU"
        elif model.runtime.extra_bufts:
            kernels = "AMX kernels in use"
        else:
            kernels = "AMX kernels off (repacked weights off)"
        return f"{describe_build()}; {kernels}"

    def only_reason(self, spec) -> str:
        return "the GGUF file as given: --dtype names float weights"

    def heads_note(self, spec) -> str:
        if not (spec.gguf_as_given or spec.gguf_format):
            return "as asked"
        return "native bf16 on this CPU" if native_bf16() else "no native bf16 on this CPU"

    def cost_key(self, model) -> dict:
        """llama.cpp runs its own kernels: each build, weights format and repacking its own curve."""
        from .llama_build import build_tag

        runtime = getattr(model, "runtime", None)
        return {
            "backend": self.name,
            "weights": self.weights_format(model),  # Q4_1, Q8_0, float16...
            "build": build_tag(),  # entmtp's patched llama-cpp-python or pip's
            "repacked": bool(getattr(runtime, "extra_bufts", False)),  # AMX's kernels
            # llama.cpp's flash-attention kernel on or off (attention.py)
            "flash_attention": bool(getattr(runtime, "flash_attn", False)),
        }


LLAMA_CPP = LlamaCpp()


def gguf_for(model: str | None, dtype: str | None) -> str:
    """The GGUF file llama.cpp runs for `model` (None: the embedded model): the file as given (`dtype` None),
    else one whose weights are `dtype`'s: the embedded model's written once in that dtype from its own file
    (llama_cpp.embedded_gguf_in), a user's file when it is of that dtype (else a clear error)."""
    from ..model import embedded_gguf
    from .llama_cpp import FLOAT_GGUF_TYPES, embedded_gguf_in, gguf_weights

    if is_embedded(model):
        return str(embedded_gguf() if dtype is None else embedded_gguf_in(dtype))
    held = gguf_weights(model) if dtype is not None else None  # the file's type, read once
    if dtype is not None and held != FLOAT_GGUF_TYPES.get(dtype):
        raise EntMTPError(
            f"{model} holds {held} weights and --dtype {dtype} names {dtype} weights: drop --dtype (llama.cpp "
            f"runs the file as it is), or give a GGUF of {dtype} weights"
        )
    return model


def embedded_in_format(fmt: str) -> str:
    """The embedded model's GGUF written in `fmt` (written once, checked by loading its header); a file that
    cannot be written or read: one line, and the shipped Q4_1 file."""
    from ..model import embedded_gguf
    from .llama_cpp import embedded_gguf_as, read_gguf

    try:
        path = embedded_gguf_as(fmt)
        read_gguf(path)
        return str(path)
    except (OSError, EntMTPError, ValueError) as e:
        say(
            f"the embedded model's {fmt} GGUF could not be written or read ({e}): llama.cpp decodes the "
            f"shipped Q4_1 file instead (delete the file named there to have it written again)"
        )
        return str(embedded_gguf())


def gguf_formats(spec) -> tuple[str, ...]:
    """The other formats llama.cpp's candidates decode the embedded model in under --dtype auto: on a CPU whose
    AMX kernels run (a float or 8-bit format's batch curve is flatter there, so trees may pay), each of
    WRITTEN_FORMATS, measured like a dtype; elsewhere none (the Q4_1 file as given)."""
    from ..model import embedded_gguf
    from .amx import extra_bufts_safe, has_amx, prewarm
    from .llama_cpp import WRITTEN_FORMATS, embedded_gguf_path

    if spec.dtype != "auto" or not is_embedded(spec.model) or not has_amx():
        return ()
    prewarm([embedded_gguf(), *(embedded_gguf_path(f) for f in WRITTEN_FORMATS)])  # the files written before
    return WRITTEN_FORMATS if extra_bufts_safe(embedded_gguf()) else ()


def gguf_fits_dtype(spec) -> bool:
    """Whether llama.cpp can decode the weights `spec.dtype` names: any GGUF under `auto` (as given), the
    embedded model's in any float dtype (written from it), a user's file only in its own float type."""
    if spec.dtype == "auto" or is_embedded(spec.model):
        return True
    from .llama_cpp import FLOAT_GGUF_TYPES, LlamaCppError, gguf_weights

    try:
        return gguf_weights(spec.model) == FLOAT_GGUF_TYPES.get(spec.dtype)
    except LlamaCppError:
        return True  # a bad file: loading it says so
