"""PPO scripts as users wrote them for TRL's PPOTrainer, run with trl_ext's import line (issue 27).

tests/scripts/user_scripts/ppo_training.py follows four public projects' scripts; each command line below is one of
them, cut to tiny sizes on the offline stand-ins (tests/trl/trl_standins.py): a chat-template dataset with a tokenizer
that pads on the right, `missing_eos_penalty=0.0`, `num_ppo_epochs=4` with gradient accumulation; a policy the user
wrapped in LoRA with a full reference and an eval split evaluated every step; a 4-bit (nf4 on CPU) base with the LoRA
adapter of an SFT checkpoint and a frozen 4-bit reference; a rule-based reward module. Under trl 1.12 the same
command lines also run on TRL's own trainer, unchanged: what it runs, trl_ext runs; the rule-based reward TRL
cannot score (AttributeError), trl_ext does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl_standins
from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorWithPadding

from trl_ext import SIMPLE_CHAT_TEMPLATE, PPOConfig, PPOTrainer, get_kbit_device_map
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "user_scripts" / "ppo_training.py"
TRL_IMPORT = "from trl.experimental.ppo import PPOConfig, PPOTrainer"
OUR_IMPORT = "from trl_ext import PPOConfig, PPOTrainer"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """The stand-ins, plus a 64-wide causal LM (bitsandbytes' 64-value blocks) and an SFT LoRA adapter of it."""
    folder = tmp_path_factory.mktemp("standins")
    paths = trl_standins.build(folder)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = AutoTokenizer.from_pretrained(paths["causal_lm"])
    config = Qwen2Config.from_pretrained(paths["causal_lm"])
    config.update(dict(hidden_size=64, intermediate_size=128))
    torch.manual_seed(2)
    base = AutoModelForCausalLM.from_config(config)
    paths["causal_lm_64"] = str(folder / "causal_lm_64")
    base.save_pretrained(paths["causal_lm_64"])
    tok.save_pretrained(paths["causal_lm_64"])
    sft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in sft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # a trained adapter is not zero
    paths["sft_adapter"] = str(folder / "sft_adapter")
    sft.save_pretrained(paths["sft_adapter"])
    return paths


def common(s, out):
    return ["--dataset_name", s["zen"], "--dataset_config", "standard_prompt_only", "--dataset_train_split", "train",
            "--model_name_or_path", s["causal_lm"], "--reward_model_path", s["sequence_cls"], "--output_dir", out,
            "--response_length", "8", "--total_episodes", "8", "--num_sample_generations", "0", "--report_to", "none",
            "--learning_rate", "1e-4"]


SCRIPTS = {
    # a domain fine-tune: chat template, right-padding tokenizer, 0.0 penalty as logged, 4 epochs, accumulation 4
    "chat_template": lambda s: ["--chat", "--missing_eos_penalty", "0.0", "--num_ppo_epochs", "4",
                                "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4"],
    # a course project: the policy wrapped in LoRA by the script, a full reference, an eval split every step
    "lora_wrapped": lambda s: ["--policy", "lora_wrapped", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
                               "--missing_eos_penalty", "0.0", "--eval_samples", "4", "--eval_strategy", "steps",
                               "--eval_steps", "1", "--per_device_eval_batch_size", "2",
                               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"],
    # a course project: a 4-bit base with its SFT adapter, a frozen 4-bit reference, accumulation 8
    "sft_adapter_4bit": lambda s: ["--policy", "sft_adapter", "--sft_adapter_path", s["sft_adapter"],
                                   "--model_name_or_path", s["causal_lm_64"], "--load_in_4bit", "--dtype", "float32",
                                   "--num_ppo_epochs", "4", "--per_device_train_batch_size", "1",
                                   "--gradient_accumulation_steps", "8"],
    # a rule-based reward module (a PreTrainedModel with no backbone returning logits (B, 1))
    "rule_reward": lambda s: ["--reward", "rule", "--missing_eos_penalty", "1.0", "--per_device_train_batch_size",
                              "4"],
}


def run(s, tmp_path, name, trl_ext: bool, extra=()):
    source = SCRIPT.read_text()
    assert source.count(TRL_IMPORT) == 1
    script = tmp_path / "ppo_training.py"
    script.write_text(source.replace(TRL_IMPORT, OUR_IMPORT) if trl_ext else source)
    out = tmp_path / "out"
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)] + common(s, str(out)) + SCRIPTS[name](s) + list(extra),
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    return proc, out


def moved(stdout: str) -> int:
    line = next(line for line in stdout.splitlines() if line.startswith("POLICY MOVED"))
    return int(line.split()[2])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_users_ppo_scripts_run_with_only_the_import_changed(standins, tmp_path, name):
    proc, out = run(standins, tmp_path, name, trl_ext=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SCRIPT DONE" in proc.stdout
    assert moved(proc.stdout) > 0, proc.stdout[-2000:]  # the policy (or its adapter) trained
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in logs if "objective/scores" in row]
    assert train and all(torch.isfinite(torch.tensor(row["objective/scores"])) for row in train)
    if name == "lora_wrapped":  # evaluated at every step on the held-out split
        assert sum("eval/win_rate_vs_ref" in row for row in logs) == len(train)
    if name == "sft_adapter_4bit":
        assert (out / "adapter_model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.trl_ppo
def test_the_same_command_lines_on_trls_own_trainer(standins, tmp_path):
    """TRL 1.12 runs the first three (it needs --bf16 False without a GPU) and cannot score the rule-based module:
    its get_reward looks for a backbone the module does not have."""
    for name in SCRIPTS:
        (tmp_path / name).mkdir()
        proc, _ = run(standins, tmp_path / name, name, trl_ext=False, extra=["--bf16", "False"])
        if name == "rule_reward":
            assert proc.returncode != 0 and "AttributeError" in proc.stderr, proc.stderr[-2000:]
        else:
            assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
            assert "SCRIPT DONE" in proc.stdout


def test_a_right_padding_tokenizer_still_gets_left_padded_prompts(standins, tmp_path):
    """A Qwen-style tokenizer pads on the right when no side is set. TRL 1.12's collator (DataCollatorWithPadding)
    pads on the tokenizer's side, so generation starts after pad tokens; trl_ext's rollout batches are left-padded."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = AutoTokenizer.from_pretrained(standins["causal_lm"])
    assert tok.padding_side == "right"
    rows = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in ("Beautiful is better than ugly", "Flat", "Sparse is better than dense, and it")]
    dataset = Dataset.from_dict({"input_ids": [tok(r, add_special_tokens=False)["input_ids"] for r in rows]})
    trls = DataCollatorWithPadding(tok)([{"input_ids": ids} for ids in dataset["input_ids"]])
    assert (trls["attention_mask"][:, -1] == 0).any()  # right-padded: pads after the prompt, where generation starts
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, total_episodes=3, response_length=4,
                     num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False)
    trainer = PPOTrainer(args=args, processing_class=tok,
                         model=AutoModelForCausalLM.from_pretrained(standins["causal_lm"]), ref_model=None,
                         reward_model=AutoModelForSequenceClassification.from_pretrained(standins["sequence_cls"],
                                                                                         num_labels=1),
                         value_model=AutoModelForSequenceClassification.from_pretrained(standins["sequence_cls"],
                                                                                        num_labels=1),
                         train_dataset=dataset)
    batch = next(iter(trainer.dataloader))
    mask = batch["attention_mask"].bool()
    assert (~mask).any() and mask[:, -1].all()  # padded, and on the left: every prompt ends at the last column
    for ids, row in zip(batch["input_ids"], mask):
        assert ids[row].tolist() in dataset["input_ids"]


def test_a_rule_based_reward_module_cannot_start_the_critic(tmp_path):
    tok = tiny_tokenizer()

    class Rule(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return attention_mask.sum(1).float()

    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=4,
                     num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     value_model_init="reward_model")
    with pytest.raises(ValueError, match="has no `score` head.*value_model_init='policy'"):
        PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None, reward_model=Rule(),
                   value_model=None, train_dataset=tiny_prompt_dataset(tok, 4))


def test_the_helpers_trl_removed_are_here_under_their_names():
    """get_kbit_device_map: TRL's result (None without a GPU; this process's index with one). SIMPLE_CHAT_TEMPLATE
    renders TRL's 'User: ...' form."""
    expected = {"": 0} if torch.cuda.is_available() else None
    assert get_kbit_device_map() == expected
    tok = tiny_tokenizer()
    tok.chat_template = SIMPLE_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "User: hi\n\nAssistant: yes\n\nAssistant:"


def test_the_porting_guides_replacements_exist():
    """Every `from trl_ext import ...` and trl_ext.PPOConfig field the guide in docs/versions.md names is there."""
    import dataclasses
    import re

    import trl_ext

    guide = (ROOT / "docs" / "versions.md").read_text().split("## Porting a PPO script to trl_ext")[1]
    names = {n.strip() for line in re.findall(r"from trl_ext import ([\w, ]+)", guide) for n in line.split(",")}
    assert {"PPOConfig", "PPOTrainer", "SIMPLE_CHAT_TEMPLATE", "get_kbit_device_map"} <= names
    for name in names:
        assert getattr(trl_ext, name) is not None
    assert "training_args.trust_remote_code" in guide
    assert "trust_remote_code" in {f.name for f in dataclasses.fields(PPOConfig)}
