"""Offline stand-ins for what TRL's own PPO tests and example scripts download from the hub, written for these
tests (no hub here): tiny Qwen2 models in a local folder each, and local dataset folders that `load_dataset` reads by
path, with the splits and columns TRL's names have.

    paths = build(folder)
    paths["causal_lm"]        # for trl-internal-testing/tiny-Qwen2ForCausalLM-2.5
    paths["sequence_cls"]     # for trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5
    paths["zen"]              # for trl-internal-testing/zen (config "standard_prompt_only": train, test)
    paths["descriptiveness"]  # for trl-internal-testing/descriptiveness-sentiment-trl-style (split "descriptiveness")
    paths["tldr"]             # for trl-lib/tldr (splits "train", "validation")

The tokenizer is a byte-level BPE trained here on the stand-in texts, with Qwen2.5's special tokens and pad token
`<|endoftext|>`; each model's `vocab_size` equals the tokenizer's length, so a `[PAD]` added to the tokenizer (as
TRL's tests and scripts do) gets an id the models do not have — the case where feeding a pad id to a model fails.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def zen_lines() -> list[str]:
    """The Zen of Python, from the standard library (`this`)."""
    import this  # noqa: F401  (prints it once; the text is this.s, rot13)

    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


def _prompts() -> dict[str, list[str]]:
    zen = zen_lines()
    prompt_only = [" ".join(line.split()[:-1]) for line in zen]  # each aphorism without its last word
    subjects = ["The old house", "A quiet street", "The morning train", "Her red bicycle", "The river bank",
                "A small cafe", "The mountain road", "His first concert", "The garden wall", "A winter night"]
    verbs = ["stood near", "looked over", "waited by", "rolled past", "opened onto", "faded behind"]
    descriptive = [f"{s} {v} the {w}" for s in subjects for v in verbs[:4] for w in ("hill", "sea")][:64]
    posts = [f"SUBREDDIT: r/advice\nTITLE: {s.lower()} question\nPOST: {line}\nTL;DR:"
             for s, line in zip(subjects * 4, zen * 2)]
    return {"prompt_only": prompt_only, "descriptive": descriptive, "tldr": posts[:40]}


def _tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write_dataset(folder: Path, configs: dict[str, dict[str, list[dict]]]) -> None:
    """A dataset folder: one jsonl file per split, and a README whose YAML header names the configs and splits."""
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}"] + (["  default: true"] if len(configs) == 1 else []) + ["  data_files:"]
        for split, rows in splits.items():
            path = folder / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            lines += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    note = "Offline stand-in written by tests/trl/trl_standins.py."
    (folder / "README.md").write_text("\n".join(lines + ["---", note, ""]))


def build(folder) -> dict[str, str]:
    """Write the stand-ins under `folder` (once; reused if present) and return their paths."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    folder = Path(folder)
    paths = {name: str(folder / name) for name in ("causal_lm", "sequence_cls", "zen", "descriptiveness", "tldr")}
    if (folder / "done").exists():
        return paths
    prompts = _prompts()
    tok = _tokenizer(prompts["prompt_only"] + prompts["descriptive"] + prompts["tldr"] + zen_lines())
    config = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                  tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(paths["causal_lm"])
    torch.manual_seed(1)
    Qwen2ForSequenceClassification(Qwen2Config(**config, num_labels=1)).save_pretrained(paths["sequence_cls"])
    for name in ("causal_lm", "sequence_cls"):
        tok.save_pretrained(paths[name])

    zen = [{"prompt": p} for p in prompts["prompt_only"]]
    _write_dataset(Path(paths["zen"]), {"standard_prompt_only": {"train": zen[:-2], "test": zen[-2:]}})
    descriptive = [{"prompt": p, "sample2": "", "sample3": ""} for p in prompts["descriptive"]]
    _write_dataset(Path(paths["descriptiveness"]), {"default": {"descriptiveness": descriptive}})
    tldr = [{"prompt": p, "completion": " a summary."} for p in prompts["tldr"]]
    _write_dataset(Path(paths["tldr"]), {"default": {"train": tldr[:32], "validation": tldr[32:]}})
    (folder / "done").write_text("")
    return paths
