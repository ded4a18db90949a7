"""The llama.cpp build entmtp runs (backends/llama_build.py): llama-cpp-python 0.3.36's sdist, checked by hash,
with entmtp's patch applied and recorded in the installed package; the wheel kept per sources, CMake
arguments and CPU; the AMX canary's verdict keyed by the build; the bench's peers saying which build each ran."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from entmtp.backends import llama_build
from entmtp.backends.llama_build import (
    PATCH,
    SDIST_SHA256,
    VERSION,
    BuildError,
    apply_patch,
    build_record,
    build_wheel,
    check_sdist,
    patch_sha256,
    wheel_key,
)

MMQ = "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
SGEMM = "vendor/llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp"
OPS = "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"
BATCH = "vendor/llama.cpp/src/llama-batch.cpp"
AMX_XEON = {"name": "Xeon", "flags": ["avx512f", "amx_bf16", "amx_int8", "amx_tile"]}
PASS = "print('ok')"  # a canary whose child exits cleanly
CRASH = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"  # one that dies like the AMX fault


def unpacked(into: Path) -> None:
    """The pinned sdist's four files the patch changes, at their paths under `into` (the patch's -p1 root)."""
    sdist = llama_build.fetch_sdist()  # kept by make setup; else downloaded and checked
    with tarfile.open(sdist) as tar:
        for path in (MMQ, SGEMM, OPS, BATCH):
            data = tar.extractfile(tar.getmember(f"llama_cpp_python-{VERSION}/{path}")).read()
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            (into / path).write_bytes(data)


@pytest.mark.slow
def test_the_patch_applies_to_the_pinned_sdist_and_changes_only_what_it_names(tmp_path):
    """In mmq.cpp (AMX) it removes only the tile configuration's lines (its row kernels are additions); in
    sgemm.cpp it only adds: the Q4_1 tiles and their case; in ops.cpp it changes only how set_rows shares its
    rows among threads (one-element rows by destination cache line, up to 16 threads); in llama-batch.cpp only
    which pairs of sequences the check of coupled ones walks (those of the batch, where a token has several)."""
    unpacked(tmp_path)
    original = (tmp_path / MMQ).read_text()
    original_sgemm = (tmp_path / SGEMM).read_text()
    original_ops = (tmp_path / OPS).read_text()
    original_batch = (tmp_path / BATCH).read_text()
    apply_patch(tmp_path)
    batch = (tmp_path / BATCH).read_text()
    assert Counter(original_batch.splitlines()) - Counter(batch.splitlines()) == Counter(
        [
            "    if (mem) {",
            "        for (uint32_t s0 = 0; s0 < n_seq_max; ++s0) {",
            "            for (uint32_t s1 = 0; s1 < n_seq_max; ++s1) {",
        ]
    )
    assert "    if (mem && has_cpl) {" in batch and "for (const llama_seq_id s1 : seq_id_unq) {" in batch
    ops = (tmp_path / OPS).read_text()
    removed = Counter(original_ops.splitlines()) - Counter(ops.splitlines())  # lines other ops share too
    assert removed == Counter(
        ["    const int64_t dr = (nr + nth - 1)/nth;", "    const int64_t ir0 = dr*ith;"]
    )
    changed = ops[ops.index("static void ggml_compute_forward_set_rows_impl(") :].split("\n}\n")[0]
    assert "const bool scatter = nc == 1 && nth > 1 && nth <= 16;" in changed
    assert "% nth != (uintptr_t) ith" in changed
    assert len(ops.splitlines()) - len(original_ops.splitlines()) == 11  # nothing beyond set_rows'
    sgemm = (tmp_path / SGEMM).read_text()
    assert [line for line in original_sgemm.splitlines() if line not in sgemm.splitlines()] == []
    for added in ("class tinyBLAS_Q4_1_AVX2 {", "    case GGML_TYPE_Q4_1: {"):
        assert added in sgemm and added not in original_sgemm
    patched = (tmp_path / MMQ).read_text()
    removed = [line for line in original.splitlines() if line not in patched.splitlines()]
    # the stack copy, and the once-per-thread flag that skipped the load; nothing else
    once = ["    static thread_local bool done = false;", "    if (done) {", "    done = true;"]
    assert removed == [*once[:2], "    alignas(64) tile_config_t tc = {};", once[2]]
    body = patched[patched.index("inline void ggml_tile_config_init") :].split("\n}\n")[0]
    assert "alignas(64) static thread_local tile_config_t tc;" in body
    assert "syscall(SYS_arch_prctl, 0x1023, 18);" in body  # ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    assert body.index('asm volatile("" ::: "memory");') < body.index("_tile_loadconfig(&tc);")
    # loaded on every call: another library's TILERELEASE on the thread (oneDNN's) clears it between calls
    assert "return;" not in body and "_tile_loadconfig(&tc);" in body.split("\n")[-1]
    with pytest.raises(BuildError, match=f"does not apply to llama-cpp-python {VERSION}'s source"):
        apply_patch(tmp_path)  # already applied: all or nothing, and it says so
    assert (tmp_path / MMQ).read_text() == patched


def test_a_source_that_is_not_the_release_is_refused_before_anything_is_changed(tmp_path):
    source = tmp_path / MMQ
    source.parent.mkdir(parents=True)
    text = "inline void ggml_tile_config_init(void) {\n    alignas(64) tile_config_t tc = {};\n}\n"
    source.write_text(text)
    with pytest.raises(BuildError, match="the sdist is not 0.3.36 as released"):
        apply_patch(tmp_path)
    assert source.read_text() == text


def test_an_sdist_of_another_hash_is_refused_with_the_fix(tmp_path):
    fake = tmp_path / llama_build.SDIST
    fake.write_bytes(b"not the release")
    with pytest.raises(BuildError, match=f"not llama-cpp-python {VERSION}'s {SDIST_SHA256}: delete it"):
        check_sdist(fake)


def test_the_installed_llama_cpp_python_is_the_patched_build_and_records_it():
    """`make setup` installs the patched build, and the package says so (read without loading llama.cpp)."""
    pytest.importorskip("llama_cpp", reason="the llama-cpp extra is not installed (make setup installs it)")
    record = build_record()
    assert record is not None, "llama-cpp-python without entmtp's build record: run make setup"
    assert record == {
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "patch": PATCH.name,
        "patch_sha256": patch_sha256(),
    }
    assert llama_build.build_tag() == f"entmtp-{patch_sha256()[:12]}"
    assert "entmtp's build: patch" in llama_build.describe_build()


def test_the_wheel_is_kept_per_sources_cmake_arguments_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    key = wheel_key()
    assert wheel_key("-DLLAVA_BUILD=OFF -DGGML_AVX512=OFF") != key
    cpu = llama_build.cpu_signature()
    monkeypatch.setattr(llama_build, "cpu_signature", lambda: {**cpu, "flags": cpu["flags"] + " amx_tile"})
    assert wheel_key() != key  # a native build is for this CPU only
    monkeypatch.undo()
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    other = tmp_path / "other.patch"
    other.write_text(PATCH.read_text() + "\n")
    monkeypatch.setattr(llama_build, "PATCH", other)
    assert wheel_key() != key
    monkeypatch.setattr(llama_build, "PATCH", PATCH)
    # a kept wheel is installed as it is: nothing is downloaded or built
    kept = (
        tmp_path
        / "llama-cpp-python"
        / f"wheel-{key}"
        / f"llama_cpp_python-{VERSION}-py3-none-linux_x86_64.whl"
    )
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"wheel")

    def no_download():
        raise AssertionError("downloaded although a wheel is kept")

    monkeypatch.setattr(llama_build, "fetch_sdist", no_download)
    said = []
    assert build_wheel(say=said.append) == kept
    assert "built before for this CPU" in said[0]


def test_a_failed_build_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    """An sdist whose source the patch does not fit: a BuildError, and no wheel folder or scratch left."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    sdist = tmp_path / "fake.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        data = b"inline void ggml_tile_config_init(void) {}\n"
        info = tarfile.TarInfo(f"llama_cpp_python-{VERSION}/{MMQ}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(llama_build, "fetch_sdist", lambda: sdist)
    with pytest.raises(BuildError, match="does not apply"):
        build_wheel(say=lambda _: None)
    assert list((tmp_path / "llama-cpp-python").iterdir()) == []


def test_the_canary_verdict_of_another_build_is_never_reused(monkeypatch, tmp_path):
    """On an AMX CPU the verdict is cached per build: pip's build crashed, the patched build is tried afresh
    (and passes), and going back to pip's build finds its own verdict without running a canary."""
    from entmtp import machine
    from entmtp.backends import amx
    from entmtp.model import embedded_gguf

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(machine, "cpu_info", lambda: AMX_XEON)
    path = embedded_gguf()
    runs, real = [], amx.run_canary
    monkeypatch.setattr(amx, "run_canary", lambda p, c: runs.append(c) or real(p, c))
    tag = {"now": "stock"}
    monkeypatch.setattr(llama_build, "build_tag", lambda: tag["now"])
    said = []
    assert not amx.extra_bufts_safe(path, say=said.append, canary=CRASH)
    assert "make setup" in said[0]  # pip's build: the fix is entmtp's build
    tag["now"] = "entmtp-0123456789ab"
    assert amx.extra_bufts_safe(path, say=said.append, canary=PASS)  # tried again for the new build
    tag["now"] = "stock"
    assert not amx.extra_bufts_safe(path, say=said.append, canary=PASS)  # its own verdict, cached
    verdicts = json.loads((tmp_path / "llama-amx.json").read_text())
    assert sorted(v["build"] for v in verdicts.values()) == ["entmtp-0123456789ab", "stock"]
    assert runs == [CRASH, PASS]  # the third verdict was read, not measured


@pytest.mark.slow
def test_on_an_amx_cpu_the_bench_runs_pips_plain_decoding_and_the_patched_builds_beside_it(
    monkeypatch, tmp_path, capsys
):
    """`llama-cpp` is llama-cpp-python as pip's build runs on an AMX CPU (repacked weights off: it crashes with
    them); the patched build's own plain decoding joins it as `llama-cpp-amx`, the run's strongest baseline;
    each says which build and settings it ran."""
    pytest.importorskip("llama_cpp", reason="the llama-cpp extra is not installed (make setup installs it)")
    from entmtp import machine
    from entmtp.bench.peers import build_peers

    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_LLAMA_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(llama_build, "build_tag", lambda: "entmtp-0123456789ab")
    monkeypatch.setattr(machine, "cpu_info", lambda: AMX_XEON)
    peers = build_peers(["llama-cpp"], None, None)
    assert list(peers) == ["llama-cpp", "llama-cpp-amx"]
    assert not peers["llama-cpp"].llm.model_params.use_extra_bufts
    assert "repacked weights off, as pip's build runs them" in peers["llama-cpp"].settings
    assert peers["llama-cpp-amx"].llm.model_params.use_extra_bufts  # its canary passed
    assert "; repacked weights on; flash attention " in peers["llama-cpp-amx"].settings  # both said
    assert [p.name for p in peers.values()] == ["llama-cpp", "llama-cpp-amx"]

    # without AMX the patched build is pip's build: one row, and the other is skipped with the reason
    monkeypatch.setattr(machine, "cpu_info", lambda: {"name": "EPYC", "flags": ["avx2", "avx512f"]})
    peers = build_peers(["llama-cpp", "llama-cpp-amx"], None, None)
    assert list(peers) == ["llama-cpp"] and peers["llama-cpp"].llm.model_params.use_extra_bufts
    assert "skipping peer llama-cpp-amx: llama-cpp-amx decodes as llama-cpp here (no AMX on this CPU" in (
        capsys.readouterr().out
    )

    # the repacked weights turned off by hand are said to be, not blamed on the canary
    monkeypatch.setenv("ENTMTP_LLAMA_EXTRA_BUFTS", "0")
    peers = build_peers(["llama-cpp"], None, None)
    assert "; repacked weights off (ENTMTP_LLAMA_EXTRA_BUFTS=0);" in peers["llama-cpp"].settings
