"""llama.cpp's flash attention is on or off as it decodes faster on this CPU: both timed once, the verdict
cached per model shapes, threads and weights' layout; the environment decides instead (backends/attention.py)."""

import pytest

pytest.importorskip("llama_cpp")

from entmtp.backends import attention  # noqa: E402
from entmtp.backends.attention import (  # noqa: E402
    CHAIN,
    CONTEXTS,
    ENV,
    attention_shapes,
    flash_attention,
    measure,
    verdict,
)
from entmtp.model import embedded_gguf  # noqa: E402


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    return tmp_path


def timed(on: float, off: float, calls: list):
    def fake(lib, model, params):
        calls.append((on, off))
        return {"on": on, "off": off, "rows": []}

    return fake


SMOLLM2 = {"layers": 30, "heads": 9, "kv_heads": 3, "width": 576}  # the embedded model's attention


def test_the_faster_setting_is_kept_and_timed_once_per_shapes_threads_and_weights(own_cache, monkeypatch):
    path, calls, said = SMOLLM2, [], []
    monkeypatch.setattr(attention, "measure", timed(10.0, 4.0, calls))
    assert verdict(path, 2, True) is None  # nothing timed yet
    assert flash_attention(None, None, path, 2, None, repacked=True, say=said.append) is False
    assert flash_attention(None, None, path, 2, None, repacked=True, say=said.append) is False
    assert len(calls) == 1 and verdict(path, 2, True) is False  # the second read the cache
    assert any("off" in line and ENV in line for line in said)  # says which, and how to decide instead
    monkeypatch.setattr(attention, "measure", timed(3.0, 4.0, calls))  # flash attention the faster
    assert flash_attention(None, None, path, 3, None, repacked=True, say=said.append) is True
    assert flash_attention(None, None, path, 2, None, repacked=False, say=said.append) is True
    assert len(calls) == 3 and verdict(path, 2, True) is False  # each its own verdict, the first kept
    deeper = {**SMOLLM2, "layers": 32}
    assert verdict(deeper, 2, True) is None and flash_attention(None, None, deeper, 2, None, repacked=True)
    assert len(calls) == 4  # another model: timed
    assert (own_cache / "llama-attention.json").is_file()


def test_every_format_of_one_model_shares_a_verdict(own_cache, monkeypatch):
    """The weights' format moves both settings' steps alike, so the Q4_1 file and the same model written in
    another format (the candidates of `--dtype auto` on an AMX CPU) read one verdict: the shapes come from the
    loaded model, and the bench's peer reads them from the file's header."""
    from entmtp.backends.llama_cpp import Runtime, gguf_attention_shapes

    monkeypatch.setenv(ENV, "0")  # no timing at load
    rt = Runtime(embedded_gguf(), threads=2, n_ctx=512)
    assert attention_shapes(rt.lib, rt.model) == gguf_attention_shapes(embedded_gguf()) == SMOLLM2


@pytest.mark.parametrize("value, on", [("1", True), ("0", False)])
def test_the_environment_decides_without_timing(own_cache, monkeypatch, value, on):
    monkeypatch.setenv(ENV, value)
    monkeypatch.setattr(attention, "measure", None)  # called: a TypeError
    assert flash_attention(None, None, SMOLLM2, 2, None, repacked=True) is on
    assert not (own_cache / "llama-attention.json").exists()


def test_both_settings_are_timed_on_the_loaded_model_at_each_context_and_size(own_cache, monkeypatch):
    from entmtp.backends.llama_cpp import Runtime

    monkeypatch.setenv(ENV, "0")  # the runtime's own context: no timing at load
    rt = Runtime(embedded_gguf(), threads=2, n_ctx=512)
    ms = measure(rt.lib, rt.model, rt._flash_params)
    rows = ms["rows"]
    assert [(r["context"], r["tokens"]) for r in rows] == [(c, n) for c in CONTEXTS for n in (1, CHAIN)]
    assert all(r["on_ms"] > 0 and r["off_ms"] > 0 for r in rows)
    assert ms["on"] == pytest.approx(sum(r["on_ms"] for r in rows))
    assert ms["off"] == pytest.approx(sum(r["off_ms"] for r in rows))
    # a verified chain costs more than one token, with either kernel (the steps timed are the ones named)
    for c in CONTEXTS:
        one, chain = (next(r for r in rows if (r["context"], r["tokens"]) == (c, n)) for n in (1, CHAIN))
        assert chain["on_ms"] > one["on_ms"] and chain["off_ms"] > one["off_ms"]


def test_a_setting_that_is_neither_1_nor_0_is_named_with_the_fix(own_cache, monkeypatch):
    from entmtp.errors import EntMTPError

    monkeypatch.setenv(ENV, "yes")
    monkeypatch.setattr(attention, "measure", None)  # never reached
    with pytest.raises(EntMTPError, match=r"ENTMTP_LLAMA_FLASH_ATTN='yes': give 1 .* or 0 .*unset it"):
        flash_attention(None, None, SMOLLM2, 2, None, repacked=True)
