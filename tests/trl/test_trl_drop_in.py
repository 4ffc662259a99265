"""TRL's own PPO tests and example scripts with only the import line changed (issue 12, item 9), on offline
stand-ins of TRL's tiny test models and datasets (tests/trl/trl_standins.py).

- `TestPPOTrainer` follows TRL 1.12's tests/experimental/test_ppo_trainer.py (`test_basic_training`,
  `test_peft_training`): the same models, tokenizer setup (left padding, `[PAD]` added: an id the models do not
  have), dataset preparation (EOS appended), config and assertions.
- The example scripts in tests/scripts/trl_examples/ follow TRL 1.12's examples/scripts/ppo/ppo.py and ppo_tldr.py;
  they are written with TRL's import, which the tests replace by trl_ext's (and run unchanged on TRL, with
  `--bf16 False` as TRL needs on a CPU, as a check that they are valid TRL scripts).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl_standins
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ext import PPOConfig, PPOTrainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "scripts" / "trl_examples"
TRL_IMPORT = "from trl.experimental.ppo import PPOConfig, PPOTrainer"
OUR_IMPORT = "from trl_ext import PPOConfig, PPOTrainer"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return trl_standins.build(tmp_path_factory.mktemp("standins"))


class TestPPOTrainer:
    """TRL 1.12's TestPPOTrainer on the stand-ins."""

    @pytest.fixture(autouse=True)
    def setup(self, standins, tmp_path):
        self.tmp_dir = str(tmp_path)
        self.model = AutoModelForCausalLM.from_pretrained(standins["causal_lm"], dtype="float32")
        self.ref_model = AutoModelForCausalLM.from_pretrained(standins["causal_lm"])
        self.tokenizer = AutoTokenizer.from_pretrained(standins["causal_lm"], padding_side="left")
        self.tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        assert self.tokenizer.pad_token_id >= self.model.config.vocab_size  # outside the embedding table
        self.value_model = AutoModelForSequenceClassification.from_pretrained(standins["sequence_cls"], num_labels=1)
        self.reward_model = AutoModelForSequenceClassification.from_pretrained(standins["sequence_cls"], num_labels=1)
        raw_dataset = load_dataset(standins["zen"], "standard_prompt_only")

        def tokenize(example, tokenizer):
            tokenized = tokenizer(text=example["prompt"])
            if tokenizer.eos_token_id is not None and tokenized["input_ids"][-1] != tokenizer.eos_token_id:
                tokenized["input_ids"] = tokenized["input_ids"] + [tokenizer.eos_token_id]
                tokenized["attention_mask"] = tokenized["attention_mask"] + [1]
            return tokenized

        self.raw_dataset = raw_dataset.map(tokenize, fn_kwargs={"tokenizer": self.tokenizer}, remove_columns="prompt")

    def _initial(self):
        return ({n: p.clone().detach() for n, p in self.value_model.named_parameters()},
                {n: p.clone().detach() for n, p in self.model.named_parameters()})

    def test_basic_training(self):
        initial_critic, initial_policy = self._initial()
        training_args = PPOConfig(output_dir=self.tmp_dir, per_device_train_batch_size=4, per_device_eval_batch_size=2,
                                  num_ppo_epochs=2, report_to="none")
        trainer = PPOTrainer(args=training_args, processing_class=self.tokenizer, model=self.model,
                             ref_model=self.ref_model, reward_model=self.reward_model, value_model=self.value_model,
                             train_dataset=self.raw_dataset["train"], eval_dataset=self.raw_dataset["test"])
        trainer.train()
        assert any(not torch.equal(initial_critic[n], p.to("cpu"))
                   for n, p in trainer.model.value_model.named_parameters()), "critic weights were not updated"
        assert any(not torch.equal(initial_policy[n], p.to("cpu"))
                   for n, p in trainer.model.policy.named_parameters()), "policy weights were not updated"

    def test_peft_training(self):
        from peft import LoraConfig

        initial_critic, _ = self._initial()
        training_args = PPOConfig(output_dir=self.tmp_dir, per_device_train_batch_size=4, per_device_eval_batch_size=2,
                                  num_ppo_epochs=2, report_to="none")
        peft_config = LoraConfig(r=32, lora_alpha=16, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
        trainer = PPOTrainer(args=training_args, processing_class=self.tokenizer, model=self.model, ref_model=None,
                             reward_model=self.reward_model, value_model=self.value_model,
                             train_dataset=self.raw_dataset["train"], eval_dataset=self.raw_dataset["test"],
                             peft_config=peft_config)
        trainer.train()
        assert any(n in initial_critic and not torch.equal(initial_critic[n], p.to("cpu"))
                   for n, p in trainer.model.value_model.named_parameters()), "critic weights were not updated"
        assert any("lora" in n.lower() and p.requires_grad and not torch.allclose(p, torch.zeros_like(p))
                   for n, p in trainer.model.policy.named_parameters()), "policy LoRA weights were not updated"


def example(name: str, tmp_path: Path, trl_ext: bool) -> Path:
    """The example script, with trl_ext's import line (or TRL's, unchanged)."""
    source = (EXAMPLES / name).read_text()
    assert source.count(TRL_IMPORT) == 1
    script = tmp_path / name
    script.write_text(source.replace(TRL_IMPORT, OUR_IMPORT) if trl_ext else source)
    return script


def run_example(script: Path, flags: list[str], tmp_path: Path):
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)] + flags, capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)


def ppo_flags(s, out, peft):
    return ["--dataset_name", s["descriptiveness"], "--dataset_train_split", "descriptiveness", "--output_dir", out,
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--total_episodes", "16",
            "--model_name_or_path", s["causal_lm"], "--sft_model_path", s["causal_lm"], "--reward_model_path",
            s["sequence_cls"], "--missing_eos_penalty", "1.0", "--response_length", "16", "--report_to", "none",
            "--num_sample_generations", "2"] + (["--use_peft", "--lora_target_modules", "q_proj", "v_proj"] * peft)


def tldr_flags(s, out, peft):
    return ["--dataset_name", s["tldr"], "--dataset_test_split", "validation", "--output_dir", out,
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--total_episodes", "16",
            "--model_name_or_path", s["causal_lm"], "--sft_model_path", s["causal_lm"], "--reward_model_path",
            s["sequence_cls"], "--missing_eos_penalty", "1.0", "--stop_token", "eos", "--response_length", "12",
            "--eval_strategy", "steps", "--eval_steps", "2", "--local_rollout_forward_batch_size", "2",
            "--report_to", "none"] + (["--use_peft"] * peft)


FLAGS = {"ppo.py": ppo_flags, "ppo_tldr.py": tldr_flags}


@pytest.mark.slow
@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
@pytest.mark.parametrize("name", ["ppo.py", "ppo_tldr.py"])
def test_trls_example_scripts_run_with_only_the_import_changed(standins, tmp_path, name, peft):
    out = tmp_path / "out"
    proc = run_example(example(name, tmp_path, trl_ext=True), FLAGS[name](standins, str(out), peft), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "EXAMPLE DONE" in proc.stdout
    assert "[sample]" in proc.stdout  # generate_completions printed completions of the eval prompts
    saved = "adapter_model.safetensors" if peft else "model.safetensors"
    assert (out / saved).exists()
    assert (out / "metrics.jsonl").exists()
    if name == "ppo_tldr.py":  # evaluated every 2 steps on the validation split
        assert '"eval/win_rate_vs_ref"' in (out / "metrics.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.trl_ppo
def test_the_example_scripts_are_valid_trl_scripts(standins, tmp_path):
    """Unchanged, on TRL 1.12's own trainer, they run too: what runs on ours is what runs on TRL. (TRL needs
    `--bf16 False` on a machine without a GPU; its unset bf16 raises there.)"""
    for name in FLAGS:
        flags = FLAGS[name](standins, str(tmp_path / f"out-{name}"), False) + ["--bf16", "False"]
        proc = run_example(example(name, tmp_path, trl_ext=False), flags, tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "EXAMPLE DONE" in proc.stdout


def test_a_checkpoint_writes_trls_model_card(standins, tmp_path):
    """TRL writes output_dir/README.md (its model card) with every checkpoint; so does trl_ext."""
    tok = AutoTokenizer.from_pretrained(standins["causal_lm"], padding_side="left")
    dataset = load_dataset(standins["zen"], "standard_prompt_only", split="train").map(
        lambda row: {"input_ids": tok(row["prompt"])["input_ids"]}, remove_columns=["prompt"])
    args = PPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, total_episodes=4,
                     response_length=4, num_ppo_epochs=1, report_to="none", save_strategy="steps", save_steps=1,
                     num_sample_generations=0, bf16=False)
    trainer = PPOTrainer(args=args, processing_class=tok,
                         model=AutoModelForCausalLM.from_pretrained(standins["causal_lm"]),
                         ref_model=None, reward_model=AutoModelForSequenceClassification.from_pretrained(
                             standins["sequence_cls"], num_labels=1),
                         value_model=AutoModelForSequenceClassification.from_pretrained(standins["sequence_cls"],
                                                                                        num_labels=1),
                         train_dataset=dataset)
    trainer.train()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "model_name: run" in card and "PPO" in card and "trl" in card
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
