"""The llama.cpp build entmtp runs: llama-cpp-python 0.3.36 from its sdist with entmtp's patch, built once per
CPU and kept.

`make setup` runs `python -m entmtp.backends.llama_build`:
1. the sdist, from pip (kept in the cache; its sha256 checked against `SDIST_SHA256`);
2. `patches/llama-cpp-python-0.3.36-entmtp.patch` applied to its vendored llama.cpp, kernels for a speculative
   step's few drafted tokens and one fix:
   - AMX (ggml-cpu/amx/mmq.cpp), `ggml_tile_config_init`: the tile configuration off the stack, and each thread
     asks for the AMX tile-data permission; without it 0.3.36 segfaults on some AMX Xeons once a decode holds
     two tokens (backends/amx.py);
   - AMX: a few rows of Q4_1 or Q8_0 weights (2 to 6 and 2 to 3) by the one-row kernels' arithmetic, each block
     of weights unpacked once for all the rows, instead of the AMX tiles, which pad the rows to 16 and unpack
     every block into tiles: a 2-token decode of the shipped Q4_1 model costs ~1.25x a 1-token one instead of
     ~1.5x, 4 tokens ~1.5x instead of ~1.8x (docs/results/llama-cpp-rows);
   - every AVX2 CPU (ggml-cpu/llamafile/sgemm.cpp): Q4_1 weights times 2 or more columns by tiles of up to 4
     weight rows by 4 columns, each block of weights unpacked once per tile, where llama.cpp's generic path
     (the one CPUs without AMX run) takes one row's dot product with one column at a time; each column's
     result bit for bit the one-column kernel's (tests/test_llama_kernels.py); on the AMX Xeon with its repacked
     weights off, 8 tokens ~2x a 1-token decode instead of ~2.8x (docs/results/llama-cpp-rows);
   - every CPU (ggml-cpu/ops.cpp, `set_rows`): a step's values reach the transposed V cache (flash attention
     off) by the thread that owns each destination cache line, not by halves of the tokens, which had two
     threads write every line (8- and 16-token decodes 4-9% faster with 2 threads); up to 16 threads, past
     which every thread's reading of every row's index would outweigh the lines' traffic;
   - every decode (src/llama-batch.cpp, the batch's checks): the check that sequences a token shares hold the
     same positions walks the sequences of the batch, and only where a token has several, instead of every
     pair of the context's 256 (entmtp's contexts hold 256 for trees and batches; llama-cpp-python's one):
     ~0.05 ms of every decode, ~0.7% of a one-token step of the shipped model on 2 cores (perf);
3. a record of the build (`llama_cpp/entmtp_build.json`: version, the sdist's and the patch's sha256) written
   into the package, so that the runtime can say which build runs and the AMX canary's verdict is keyed by it;
4. `pip wheel` (llama.cpp compiled for this CPU: GGML_NATIVE), the wheel kept in the cache under a key of the
   sources, the CMake arguments and this CPU, so that the next `make setup` installs it in seconds;
5. `pip install` of the wheel.

The AMX parts compile only for a CPU with AMX, the Q4_1 tiles for one with AVX2; a one-token decode runs
llama.cpp's own kernels everywhere, and `make setup` takes the same path on every CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

from ..errors import EntMTPError

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PATCH = Path(__file__).with_name("patches") / f"llama-cpp-python-{VERSION}-entmtp.patch"
RECORD = "entmtp_build.json"  # in the installed llama_cpp package
CMAKE_ARGS = "-DLLAVA_BUILD=OFF"  # no multimodal library


class BuildError(EntMTPError):
    """The patched llama-cpp-python could not be built: the message names the step and the fix."""


# ---- what runs: the installed package's record --------------------------------------------------------------


def patch_sha256() -> str:
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()


def build_record() -> dict | None:
    """The installed llama-cpp-python's build record ({"version", "sdist_sha256", "patch", "patch_sha256"}),
    read without loading llama.cpp; None where llama-cpp-python is missing or was built without the record
    (pip's own build)."""
    spec = find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    try:
        record = json.loads((Path(spec.origin).parent / RECORD).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def build_tag() -> str:
    """A short name of the build that runs, for cache keys: "entmtp-<patch sha256, 12>" or "stock"."""
    record = build_record()
    if record and record.get("patch_sha256"):
        return f"entmtp-{str(record['patch_sha256'])[:12]}"
    return "stock"


def describe_build() -> str:
    """The build in words, for the plan, the bench and doctor."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("llama-cpp-python")
    except PackageNotFoundError:
        return "llama-cpp-python not installed"
    tag = build_tag()
    if tag == "stock":
        return f"llama-cpp-python {installed} (pip's build, without entmtp's patch)"
    return f"llama-cpp-python {installed} (entmtp's build: patch {tag.removeprefix('entmtp-')[:8]})"


# ---- the build ---------------------------------------------------------------------------------------------


def build_dir() -> Path:
    from ..model import cache_dir

    return cache_dir() / "llama-cpp-python"


def cpu_signature() -> dict:
    """What a native build depends on: the CPU's name and every flag /proc/cpuinfo lists (GGML_NATIVE compiles
    for exactly these), and the platform."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name" and not name:
                name = value.strip()
            elif field.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        name = platform.processor()
    return {"cpu": name, "flags": flags, "machine": platform.machine(), "system": platform.system()}


def wheel_key(cmake_args: str = CMAKE_ARGS) -> str:
    """The wheel cache's key: the sources (sdist and patch), the CMake arguments and this CPU."""
    from ..machine import digest

    return digest(
        {"version": VERSION, "sdist": SDIST_SHA256, "patch": patch_sha256(), "cmake_args": cmake_args,
         **cpu_signature()}
    )  # fmt: skip


def cached_wheel(cmake_args: str = CMAKE_ARGS) -> Path | None:
    folder = build_dir() / f"wheel-{wheel_key(cmake_args)}"
    wheels = sorted(folder.glob("llama_cpp_python-*.whl")) if folder.is_dir() else []
    return wheels[0] if wheels else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sdist(path: Path) -> Path:
    got = sha256_file(path)
    if got != SDIST_SHA256:
        raise BuildError(
            f"{path.name} has sha256 {got}, not llama-cpp-python {VERSION}'s {SDIST_SHA256}: delete it and "
            "run `make setup` again (the download was changed or cut short)"
        )
    return path


def fetch_sdist() -> Path:
    """llama-cpp-python's sdist, checked: the cached copy, else pip's download (kept)."""
    folder = build_dir()
    kept = folder / SDIST
    if kept.is_file():
        return check_sdist(kept)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
             "--no-binary", ":all:", "-q", "-d", tmp],
            f"download llama-cpp-python {VERSION}'s sdist with pip (check the network or pip's index)",
        )  # fmt: skip
        got = Path(tmp) / SDIST
        if not got.is_file():
            raise BuildError(f"pip's download of llama-cpp-python {VERSION} holds no {SDIST}")
        check_sdist(got)
        os.replace(got, kept)
    return kept


def apply_patch(source: Path, patch: Path = PATCH) -> None:
    """Apply `patch` to the unpacked sdist `source` (all or nothing: a dry run first)."""
    if shutil.which("patch") is None:
        raise BuildError(
            "the `patch` program is missing: install it (apt install patch) and run make setup again"
        )
    for dry in (True, False):
        done = subprocess.run(
            [
                "patch",
                "-p1",
                "--forward",
                "--batch",
                "--silent",
                *(["--dry-run"] if dry else []),
                "-i",
                str(patch),
            ],
            cwd=source,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            why = (done.stdout + done.stderr).strip().splitlines()[:1] or ["no message"]
            raise BuildError(
                f"entmtp's patch ({patch.name}) does not apply to llama-cpp-python {VERSION}'s source "
                f"({why[0]}): the sdist is not {VERSION} as released"
            )


def unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (source,) = [p for p in into.iterdir() if p.is_dir()]
    return source


def write_record(source: Path) -> dict:
    record = {
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "patch": PATCH.name,
        "patch_sha256": patch_sha256(),
    }
    (source / "llama_cpp" / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record


def build_wheel(cmake_args: str = CMAKE_ARGS, say=print) -> Path:
    """The patched wheel for this CPU: the cached one, else built (minutes) and kept. A failed build leaves
    nothing in the cache."""
    kept = cached_wheel(cmake_args)
    if kept is not None:
        say(f"llama-cpp-python {VERSION} with entmtp's patch: the wheel built before for this CPU")
        return kept
    sdist = fetch_sdist()
    folder = build_dir() / f"wheel-{wheel_key(cmake_args)}"
    build_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir(), prefix=".build-") as tmp:
        source = unpack(sdist, Path(tmp) / "src")
        apply_patch(source)
        write_record(source)
        out = Path(tmp) / "wheel"
        say(f"building llama-cpp-python {VERSION} with entmtp's patch for this CPU (a few minutes, once)")
        env = {**os.environ, "CMAKE_ARGS": cmake_args}
        _run(
            [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)],
            f"build llama-cpp-python {VERSION} (it needs a C++ compiler and CMake >= 3.21)",
            env=env,
            progress="compiling llama.cpp",
        )
        (wheel,) = out.glob("llama_cpp_python-*.whl")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        shutil.move(wheel, staged / wheel.name)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staged, folder)
    return folder / wheel.name


def install(wheel: Path) -> None:
    """Install `wheel` over whatever llama-cpp-python is there, then its missing requirements (none of the
    installed ones is upgraded)."""
    _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        "install it",
    )
    _run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], "install its requirements")


def _run(cmd: list[str], what: str, *, env=None, progress: str | None = None) -> None:
    """Run `cmd`; on failure a BuildError naming `what` and the output's last lines. `progress`: a spinner
    with the time spent, for the long steps."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        if progress is None:
            proc.wait()
        else:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            with Progress(*columns, transient=True) as bar:
                bar.add_task(progress, total=None)
                while proc.poll() is None:
                    time.sleep(0.5)
        if proc.returncode != 0:
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-15:])
            raise BuildError(
                f"could not {what}: {' '.join(cmd[:4])} ... exited with {proc.returncode}\n{tail}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m entmtp.backends.llama_build",
        description=f"Build llama-cpp-python {VERSION} with entmtp's patch for this CPU (kept), and install it.",
    )
    parser.add_argument("--cmake-args", default=CMAKE_ARGS, help=f"CMake arguments (default: {CMAKE_ARGS})")
    parser.add_argument(
        "--no-install", action="store_true", help="build (or find) the wheel and print its path"
    )
    args = parser.parse_args(argv)
    try:
        wheel = build_wheel(args.cmake_args)
        if args.no_install:
            print(wheel)
        else:
            install(wheel)
            print(f"installed {wheel.name} ({PATCH.name} applied)")
    except BuildError as e:
        print(f"entmtp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
