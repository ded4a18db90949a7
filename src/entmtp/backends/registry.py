"""The backends an engine can be built on, by name: what `build` asks of each before and while loading.

`build` (build/) never compares a backend's name: it asks the registry which backends can decode a spec
(`fits`), which (backend, dtype) candidates each offers (`candidates`), loads the chosen one (`load`) and asks
whether it steps batches (`batchable`). Each backend answers in its own file, a `Backend` (backend.py):

  transformers  backends/transformers.py: any Hugging Face causal LM in PyTorch (the reference; CUDA too).
  llama-cpp     backends/gguf.py: a GGUF file on llama.cpp's CPU kernels (backends/llama_cpp.py runs it).

Adding a backend is its file, with a `Backend` subclass, and one line in `REGISTRY`. A candidate is named
"backend/dtype[:format]" (`split`): the dtype the engine computes in (the heads' on llama.cpp), and a
weights format the backend writes the embedded model in, where it offers several.
"""

from __future__ import annotations

from .backend import Backend
from .gguf import LLAMA_CPP
from .transformers import TRANSFORMERS

REGISTRY: dict[str, Backend] = {b.name: b for b in (TRANSFORMERS, LLAMA_CPP)}  # the first: the default
BACKENDS = ("auto", *REGISTRY)  # `auto`: measured per machine (build/)
DEFAULT = next(iter(REGISTRY.values()))  # what an unmeasured `auto` loads


def backend_of(model) -> Backend:
    """The backend that loaded `model`."""
    return next((b for b in REGISTRY.values() if b is not DEFAULT and b.owns(model)), DEFAULT)


def split(cand: str) -> tuple[str, str]:
    """A candidate "backend/dtype[:format]" as (backend, dtype)."""
    name, _, dtype = cand.partition("/")
    return name, dtype.partition(":")[0]


def name_of(spec) -> str:
    """The candidate a concrete `spec` is ("backend/dtype[:format]"): what `at` made it from."""
    return f"{spec.backend}/{spec.dtype}" + (f":{spec.gguf_format}" if spec.gguf_format else "")


def at(spec, cand: str):
    """`spec` with candidate `cand`'s backend, dtype and weights format."""
    name, dtype = split(cand)
    return REGISTRY[name].at(spec, dtype, cand.partition(":")[2])
