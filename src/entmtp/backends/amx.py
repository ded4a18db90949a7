"""Whether llama.cpp's repacked weights may be used on this CPU: on a CPU with AMX, ask a child process.

llama.cpp's extra buffer types repack a GGUF's weights for the CPU's fastest kernels: on a Xeon with AMX, its
tile (TMUL) kernels. llama-cpp-python 0.3.36 segfaults there on some machines once a decode holds two tokens or
more (a one-token decode takes an AVX512-VNNI path and works): seen on a 2-core Xeon of our pool. The likely
cause, from llama.cpp's source and tracker: `ggml_tile_config_init` (ggml-cpu/amx/mmq.cpp) builds the tile
configuration on the stack and passes it to `_tile_loadconfig`, whose store the compiler may drop, so the first
tile instruction runs on an invalid configuration (llama.cpp PR #26954, open; issue #20824, a segfault in
`ggml_backend_amx_mul_mat` that happens on one machine and not another). Whether a given build crashes on a
given machine cannot be read off the flags.

A second fault, seen on a 2-core Xeon (Sapphire Rapids class) in entmtp's own process: llama.cpp configures
each thread's tiles once and keeps a flag that it did, but PyTorch's oneDNN runs its bf16 matmuls (the heads')
with AMX on the same OpenMP threads and ends each kernel with TILERELEASE, which clears the configuration; the
next llama.cpp tile instruction then faults (SIGILL in `tilezero`, from a decode of two tokens or more after
the heads ran). entmtp's patch also loads the configuration on every call.

So on a CPU with an `amx*` flag, a child process loads the model with the repacked weights and decodes one,
two and 64 tokens, then 64 more, with a PyTorch bf16 matmul on the same threads before each (the canary). If
it exits cleanly the AMX kernels are used; if it dies (or hangs) they stay off, and one line says why.
The verdict is cached per CPU, llama-cpp-python version and model file, so the
canary runs once. The build is part of the key (`llama_build.build_tag`: entmtp's patched build, which `make setup`
installs and which fixes the fault, or pip's own), so a changed build is tried again and a verdict of another build
is never reused. On CPUs without AMX the repacked weights are used, as llama.cpp does by default.
`ENTMTP_LLAMA_EXTRA_BUFTS=1` or `0` decides instead of all this.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from .. import console

CANARY_TIMEOUT_S = 180.0

# The child: for each file named, load it with the repacked weights on, then decode 1, 2, 64 and 64 tokens,
# PyTorch's AMX work before each. Exit 0: the kernels ran on every file.
CANARY = """
import os, sys
import torch  # first, as in entmtp's own process: PyTorch and llama.cpp then share one OpenMP thread pool
import llama_cpp.llama_cpp as lib
quiet = lib.llama_log_callback(lambda level, text, data: None)  # kept referenced: llama.cpp calls it
lib.llama_log_set(quiet, None)
lib.llama_backend_init()
threads = max(2, min(os.cpu_count() or 2, 8))  # worker threads run tile code too
torch.set_num_threads(threads)
x, w = torch.randn(64, 576, dtype=torch.bfloat16), torch.randn(576, 576, dtype=torch.bfloat16)
for path in sys.argv[1:]:
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, True
    model = lib.llama_model_load_from_file(path.encode(), mp)
    assert model, "could not load the model"
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 128, 128
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, cp)
    assert ctx, "could not make a context"
    batch = lib.llama_batch_init(128, 0, 1)
    pos = 0
    for n in (1, 2, 64, 64):
        # PyTorch's own AMX work on the same threads between decodes (the heads' matmuls: oneDNN ends its tile
        # kernels with TILERELEASE, which clears the tile configuration llama.cpp's kernels then need)
        torch.nn.functional.linear(x, w)
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 1 + i, pos + i, 1, i == n - 1
            batch.seq_id[i][0] = 0
        assert lib.llama_decode(ctx, batch) == 0, f"llama_decode of {n} tokens failed"
        pos += n
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
print("ok")
"""


def has_amx(flags=None) -> bool:
    from ..machine import cpu_info

    return any(f.startswith("amx") for f in (cpu_info()["flags"] if flags is None else flags))


def extra_bufts_safe(path: str | os.PathLike[str] | None = None, *, say=None, canary: str = CANARY) -> bool:
    """Whether llama.cpp's extra buffer types (weights repacked for the CPU's kernels) are used for the GGUF
    file `path` here: yes on a CPU without AMX; with AMX, what the cached canary found for this file (no
    `path`: no, as nothing can be tried). `say(str)`: the one line when the canary keeps them off (default:
    stderr). `ENTMTP_LLAMA_EXTRA_BUFTS=1` or `0` decides instead."""
    forced = extra_bufts_forced()
    if forced is not None:
        return forced
    if not has_amx():
        return True
    if path is None:
        return False
    works, why = canary_verdict(Path(path), canary)
    if not works:
        from .llama_build import build_tag, describe_build

        fix = (
            "`python -m entmtp.backends.llama_build` (make setup) installs the build with entmtp's patch for it"
            if build_tag() == "stock"
            else "ENTMTP_LLAMA_EXTRA_BUFTS=1 forces them"
        )
        (say or console.say)(
            f"llama.cpp's AMX kernels crashed a test decode on this CPU ({why}, {describe_build()}): its "
            f"repacked weights stay off (a known llama.cpp fault, PR #26954; {fix})"
        )
    return works


def canary_verdict(path: Path, canary: str = CANARY) -> tuple[bool, str]:
    """(whether the repacked weights ran `path` in a child process, how it ended), cached."""
    return canary_verdicts([path], canary)[0]


def canary_verdicts(paths: list[Path], canary: str = CANARY) -> list[tuple[bool, str]]:
    """`canary_verdict` of each of `paths`, the ones not cached tried in one child process (its start, mostly
    `import torch`, is most of a canary's ~1.5 s); where that child fails, each is tried alone, so a verdict is
    always its own file's."""
    from ..files import read_json_or_empty, write_text_atomic
    from .llama_build import build_tag

    cache = _verdicts_path()
    keys = [_key(p) for p in paths]
    verdicts = read_json_or_empty(cache)
    todo = [(p, k) for p, k in zip(paths, keys, strict=True) if k not in verdicts]
    if todo:
        together = len(todo) > 1 and run_canary([p for p, _ in todo], canary)[0]
        found = (
            {k: (True, f"a clean exit (with {len(todo)} files in one child)") for _, k in todo}
            if together
            else {k: run_canary(p, canary) for p, k in todo}
        )
        for p, k in todo:
            verdicts[k] = {"works": found[k][0], "how": found[k][1], "file": str(p), "build": build_tag()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache, json.dumps(verdicts, indent=1) + "\n")
    return [(verdicts[k]["works"], verdicts[k]["how"]) for k in keys]


def prewarm(paths: list[str | os.PathLike[str]], canary: str = CANARY) -> None:
    """On a CPU with AMX (and no ENTMTP_LLAMA_EXTRA_BUFTS), the canary's verdicts of the files of `paths` that
    exist, in one child: a first run under --dtype auto loads four formats of one model, each else tried in a
    child of its own."""
    if extra_bufts_forced() is not None or not has_amx():
        return
    canary_verdicts([Path(p) for p in paths if Path(p).is_file()], canary)


def run_canary(path: Path | list[Path], canary: str = CANARY) -> tuple[bool, str]:
    """Run `canary` on `path` (or on each of a list of paths, in one child) in a child Python: (exited
    cleanly, how it ended)."""
    paths = path if isinstance(path, list) else [path]
    try:
        done = subprocess.run(
            [sys.executable, "-c", canary, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=CANARY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer in {CANARY_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return True, "a clean exit"
    if done.returncode < 0:
        return False, f"killed by {signal.Signals(-done.returncode).name}"
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return False, f"exit code {done.returncode}: {last[:200]}"


def extra_bufts_forced() -> bool | None:
    """What `ENTMTP_LLAMA_EXTRA_BUFTS=1` or `0` decides; None where it is not set to either."""
    forced = os.environ.get("ENTMTP_LLAMA_EXTRA_BUFTS", "").strip()
    return forced == "1" if forced in ("0", "1") else None


def _key(path: Path) -> str:
    from ..machine import cpu_info, digest
    from .llama_build import build_tag

    try:
        import llama_cpp

        version = llama_cpp.__version__
    except ImportError:  # the canary then fails, and says so
        version = None
    stat = path.stat()
    return digest(
        {"cpu": cpu_info(), "llama_cpp": version, "build": build_tag(), "file": str(path.resolve()),
         "size": stat.st_size, "mtime": int(stat.st_mtime)}
    )  # fmt: skip


def _verdicts_path() -> Path:
    from ..model import cache_dir

    return cache_dir() / "llama-amx.json"
