"""What to build (`EngineSpec`), checked before anything loads, and the candidates it names."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.registry import BACKENDS, DEFAULT, REGISTRY, at
from ..errors import EntMTPError
from ..lookup import Lookup, add_lookup_arguments, lookup_from_args
from ..model import DTYPES
from ..scheduler.policies import POLICIES
from ..scheduler.profiles import PROFILE_TASKS
from ..settings import setting
from ..shipped import HEAD_KINDS, default_heads

DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class EngineSpec:
    """What to build. Defaults are what `entmtp generate` does with no options. Each field but the generation's
    own two (temperature, acceptance: `GenerationOptions`' flags) is a flag of generate, chat and serve,
    made from its `setting` (settings.py; engine_args.py)."""

    model: str | None = setting(
        None, help="Hugging Face model id, local path or .gguf file (default: embedded SmolLM2)"
    )
    backend: str = setting(
        "auto",
        choices=BACKENDS,
        help="what runs the base model: transformers (PyTorch) or llama-cpp (llama.cpp's CPU kernels on a "
        "GGUF file, through llama-cpp-python); auto (default): on a CPU with llama-cpp-python installed, "
        "the one with the most expected tokens/s on this machine's measured step costs (cached)",
    )
    dtype: str = setting(
        "auto",
        choices=DTYPE_CHOICES,
        help="the weights' format on whichever backend runs (llama.cpp: a GGUF of that dtype, written once "
        "from the embedded model's). auto (default): on a CPU, the format with the most expected tokens/s on "
        "this machine's measured step costs (bf16 or float32 on transformers, the GGUF as given on "
        "llama.cpp; measured once and cached); bf16 on CUDA. float32: output identical to plain decoding, "
        "token for token",
    )
    device: str = setting("cpu", help="cpu or cuda[:N] (default cpu)")
    threads: int | None = setting(
        None,
        help="CPU threads of torch and of llama.cpp (default: torch's choice; under serve --ray: 1 a replica)",
    )
    heads: str | None = setting(
        None, help=f"{' | '.join(HEAD_KINDS)} | none | PATH (default: shipped heads, if any)"
    )
    tree: str | None = setting(
        None,
        help='a static tree: name (see `entmtp trees`) or JSON file of paths; "L0" elements are prompt-lookup '
        'nodes, e.g. [[0], [0, "L0"], ["L0"]] (default: the scheduler, see --policy)',
    )
    policy: str | None = setting(
        None,
        choices=POLICIES,
        help="tree scheduling policy (default: the one the profile recommends; static = the profile's EntMTP*)",
    )
    profile: str | None = setting(
        None,
        help=f"scheduler profile: {' | '.join(PROFILE_TASKS)} (shipped) or a JSON file from `entmtp calibrate` "
        "(default: mixed)",
    )
    # lookup.py; "auto" (the default, as `entmtp generate`'s): lookup drafts with the scheduled default (heads
    # and no tree), none for --heads none or a named tree; None: none; a Lookup: these
    lookup: Lookup | None | str = setting("auto", add=add_lookup_arguments, read=lookup_from_args)
    temperature: float = 0.0  # with `acceptance`, picks the profile's section (Profile.mode_for)
    acceptance: str = "auto"  # auto | greedy | sample | typical | gumbel (accept.Sampling)
    probe: bool = setting(
        True,
        help="do not measure this machine's step costs (~10-20 s, once): read them from the cost cache if they "
        "were measured before, else use the profile's stored latencies (also: ENTMTP_NO_PROBE=1)",
    )
    pack: bool = setting(
        True,
        help="on a CPU in bfloat16, leave the linear layers unpacked (packing: same outputs, faster steps)",
    )
    graphs: bool = setting(
        True, help="on CUDA, verify eagerly instead of replaying one captured CUDA graph per tree size"
    )
    draft_int8: bool = setting(
        True,
        help="on a CPU in bfloat16, draft from the heads' own bf16 weights instead of int8 copies of them "
        "(int8: the same outputs, about half the bytes a draft reads; heads/int8.py)",
    )
    suffix_cache: int = setting(
        0,
        flag="--suffix-cache",
        metavar="MB",
        help="draft from what earlier requests wrote (suffix.py, arctic-inference's suffix tree), in a cache of "
        "at most MB megabytes; lossless like every draft (default: 0, off)",
    )
    mixed_weights: bool = setting(
        False,
        help="with --dtype auto: route each request by its prompt length between backends even where they "
        "decode different weights (llama.cpp's Q4_1 GGUF for short prompts, transformers' bf16 for long "
        "ones), so that two requests may decode different numerics (default: off, one weights format per "
        "engine, routed only between backends that decode the same weights)",
    )
    gguf_as_given: bool = False  # llama.cpp runs the GGUF file as it is (`build` sets it for --dtype auto)
    gguf_format: str = (
        ""  # llama.cpp runs the embedded model written in this format (Q8_0, F16, BF16: `build`
    )
    # measures them under --dtype auto where AMX's kernels run; "" the file as given, or --dtype's)
    kv: str = setting(
        "auto",
        choices=("auto", "dynamic"),
        help="the KV cache: auto (default: preallocated where the model allows it) or dynamic "
        "(transformers' DynamicCache)",
    )

    def __post_init__(self):
        if isinstance(self.lookup, str):  # "auto": `entmtp generate`'s rule (lookup.lookup_from_args)
            if self.lookup != "auto":
                raise EntMTPError(f"lookup must be a Lookup, None or 'auto', got {self.lookup!r}")
            on = self.heads != "none" and self.tree is None
            object.__setattr__(self, "lookup", Lookup() if on else None)


def check_spec(spec: EngineSpec) -> None:
    """Every name in `spec` that can be checked before a model loads."""
    if spec.dtype not in DTYPE_CHOICES:
        raise EntMTPError(f"unknown dtype {spec.dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
    if spec.policy is not None and spec.policy not in POLICIES:
        raise EntMTPError(f"unknown policy {spec.policy!r}: use one of {', '.join(POLICIES)}")
    if spec.backend not in BACKENDS:
        raise EntMTPError(f"unknown backend {spec.backend!r}: use one of {', '.join(BACKENDS)}")
    if spec.suffix_cache < 0:
        raise EntMTPError(f"--suffix-cache is megabytes (0: off), got {spec.suffix_cache}")
    if spec.suffix_cache:
        from ..suffix import arctic

        arctic()  # not installed: one line that says how
    if spec.backend in REGISTRY:
        REGISTRY[spec.backend].check(spec)  # e.g. llama.cpp not installed, or no GGUF to run: one line each
    if spec.mixed_weights and spec.dtype != "auto":
        raise EntMTPError(
            f"--mixed-weights routes between weights formats, and --dtype {spec.dtype} names one: drop one of them"
        )
    if spec.kv not in ("auto", "dynamic"):
        raise EntMTPError(f"unknown kv cache {spec.kv!r}: use 'auto' or 'dynamic'")
    if spec.tree is not None:
        from ..tree import load_tree

        load_tree(spec.tree)  # a bad name or file fails here, with the tree module's message


def backends_for(spec: EngineSpec) -> list[str]:
    """The backends `build` measures for `spec`: the named one, or (auto) each that can decode it here."""
    if spec.backend != "auto":
        return [spec.backend]
    return [name for name, backend in REGISTRY.items() if backend is DEFAULT or backend.fits(spec)]


def candidates(spec: EngineSpec, probe: bool) -> list[str]:
    """ "backend/dtype[:format]" candidates `build` measures (one: nothing to compare). Without a probe an
    `auto` backend is the default one, unmeasured."""
    names = backends_for(spec) if probe or spec.backend != "auto" else [DEFAULT.name]
    return [c for name in names for c in REGISTRY[name].candidates(spec, probe)]


def heads_spec(spec: EngineSpec) -> str:
    return spec.heads if spec.heads is not None else default_heads()


def concrete(spec: EngineSpec) -> EngineSpec:
    """`spec` with an `auto` backend or dtype made the unmeasured default (`candidates` without a probe)."""
    if "auto" not in (spec.backend, spec.dtype):
        return spec
    return at(spec, candidates(spec, probe=False)[0])


def base_key(spec: EngineSpec) -> tuple:
    """What tells one loaded base model from another."""
    return (spec.model, spec.backend, spec.dtype, spec.device, spec.pack, spec.threads, spec.gguf_as_given,
            spec.gguf_format)  # fmt: skip
