"""One way to build an engine: `EngineSpec` names what is wanted, `build` resolves it once.

Every face (the CLI's generate / chat / serve, the bench, library users) goes through here: model and dtype,
heads, a static tree or a scheduling policy from a profile, prompt lookup, and this machine's cost curve
(costs/). Every name is checked before a model loads. Building is two steps, so that a bench can load once
and compose each of its methods exactly as `generate` does:

  load     `load(spec) -> Loaded` (loaded.py): the model and tokenizer, the heads bound, moved and packed for
           it (once, before any probe times them), and the costs measured on that pair (the curve; the
           surface of batched steps when asked). A `Loader` keeps what it loaded, for the next spec on the
           same model.
  compose  `compose(loaded, spec) -> Composed` (composed.py): one policy per acceptance rule, the prompt-lookup
           branch wrapped around each once, and why; `assemble` hands them to an `Engine`, which coerces
           nothing. The offline commands (calibrate, eval-heads), which load their own heads and decode one
           fixed tree, take the same last step: `fixed(given(model, tokenizer, heads), tree)`.

`build(spec)` loads and composes each (backend, dtype) candidate and keeps the fastest (choose.py), and says
why (`Plan`, plan.py); spec.py holds `EngineSpec` and its checks. What each backend offers and how it loads
is its own (backends/registry.py). Each rule lives in one place:

  backend  `auto`: on a CPU, with llama-cpp-python installed and a GGUF to run (the embedded model's, or
           `--model X.gguf`), both transformers and llama.cpp are candidates, measured like dtypes; else
           transformers. A named backend is used as it is (backends/registry.py). Requests are routed by
           prompt length (routing.py) between the kept candidate and the other backend's best only where
           the two decode the same weights, or where `mixed_weights` allows formats to mix.
  weights  A named dtype names the weights on every backend: transformers in that dtype, llama.cpp on a GGUF
           of that dtype (the embedded model's written once from its own file; a user's GGUF must be of it),
           so that `--dtype float32` decodes float32 weights whichever backend runs. `auto`: on CUDA bf16
           where supported (else fp16); on a CPU, each candidate (transformers in bf16 and float32,
           llama.cpp on the GGUF as given, e.g. the embedded Q4_1) is loaded and its cost curve measured
           (once: cached), and the one with the most expected tokens/s is kept (the choice is cached too):
           one weights format per engine, which the plan names. The heads on llama.cpp compute in the named
           dtype, or (auto) bf16 where the CPU has native bf16.
  heads    `None`: the shipped heads if any; `none`: plain decoding (or prompt lookup with `lookup`).
  policy   `--tree` alone: that static tree. Otherwise a policy from a profile (default: the shipped `mixed`
           profile and the policy it recommends), built on this machine's cost curve. When no bank tree is
           expected to beat a plain step here, the engine decodes plain steps (no heads' probe either):
           never slower than plain decoding by construction, up to the curve's accuracy.
  costs    measured here unless `probe=False` (or ENTMTP_NO_PROBE=1): then nothing is measured (or corrected),
           and the curve is this machine's cached one if it was measured before, else the profile's stored
           latencies, and a lookup branch is sized on `costs.CPU_COST` (another machine's: the plan says so).

Expected tokens/s of a (dtype, policy) pair: the best bank tree's simulated tokens per step on the profile's
calibration positions over its step cost on this curve (plain decoding: 1 / the plain step).
"""

from .choose import build, build_engine, route_between, same_tokenizer
from .composed import Composed, assemble, compose, fixed
from .loaded import Loaded, Loader, given, load, load_base
from .plan import Built, Plan
from .spec import DTYPE_CHOICES, EngineSpec, candidates, check_spec

__all__ = [
    "DTYPE_CHOICES", "Built", "Composed", "EngineSpec", "Loaded", "Loader", "Plan", "assemble", "build",
    "build_engine", "candidates", "check_spec", "compose", "fixed", "given", "load", "load_base", "route_between",
    "same_tokenizer",
]  # fmt: skip
