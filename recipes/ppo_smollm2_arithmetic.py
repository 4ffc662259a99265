"""PPO on a verifiable reward on CPU: SmolLM2-135M-Instruct + LoRA learns two-number addition, scored right or wrong.

What it does:
  - task: "What is 17 + 8? Reply with the number only." for a, b in 1..25 (625 prompts): 256 held out, 369 trained
    on (`build_datasets`). Sampled at temperature 0.7, the model starts about 1 in 5 right (it answers "17 + 8 = 26",
    "The answer is 25.", or rambles);
  - reward (`correct`, TRL's reward-function convention: `completions` and the dataset's `answer` column): 1.0 if
    the last number in the completion is the sum, else 0.0 — a verifiable reward, no reward model;
  - policy: SmolLM2-135M-Instruct with a LoRA adapter (r=8), its reference the same model with the adapter off;
    value model: SmolLM2-135M with a fresh 1-output head, its top 2 decoder layers trained (as the quickstart);
  - held-out accuracy (`held_out_accuracy`): the 256 held-out prompts, one completion each sampled at the training
    temperature from a fixed seed, scored by `correct` — before and after training.

Run it (figures measured: docs/results.md, "Verifiable rewards"; the first run also converts the model once, ~20 s):

    python recipes/ppo_smollm2_arithmetic.py --output_dir runs/arithmetic
    python recipes/ppo_smollm2_arithmetic.py --max_train_seconds 300         # stop after 5 minutes of training
    python recipes/ppo_smollm2_arithmetic.py --num_generations 4 --dynamic_sampling true --lam_value 1.0 \\
        --clip_ratio_high 0.28                                                   # VAPO-style (docs/ppo-variants.md)

Every `trl_ext.PPOConfig`, `trl.ModelConfig` and `ScriptArguments` field is a flag; the GRPO-style knobs
(`--num_generations`, `--group_advantage_weight`, `--dynamic_sampling`, `--beta`, `--entropy_coef`,
`--overlong_buffer_len`, ...) included. `benchmarks/verifiable_vs_grpo.py` runs this task against TRL's GRPOTrainer.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback
from trl import ModelConfig, get_peft_config

from trl_ext import PPOConfig
from trl_ext.scripts import CPU_DEFAULTS, LORA_DEFAULTS, load_dtype, parse_args

LOW, HIGH = 1, 25  # the operands' range
HELD_OUT = 256  # prompts held out for the accuracy
QUESTION = "What is {a} + {b}? Reply with the number only."


def last_number(text: str) -> int | None:
    """The last integer in a completion ("17 + 8 = 25." -> 25), or None."""
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def correct(completions, answer, **kwargs) -> list[float]:
    """TRL's reward-function convention: 1.0 where the completion's last number is the answer, else 0.0.
    Conversational completions ([{"role": "assistant", "content": ...}]) or plain strings."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(last_number(t) == int(a)) for t, a in zip(texts, answer)]


def build_datasets(seed: int = 0):
    """(train, held_out) prompt datasets: every (a, b) in LOW..HIGH, shuffled by `seed`, the first HELD_OUT held out.
    Columns: `prompt` (one user turn, rendered with the chat template by the trainer) and `answer` (the sum)."""
    from datasets import Dataset

    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)

    def rows(chunk):
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION.format(a=a, b=b)}]
                                             for a, b in chunk],
                                  "answer": [a + b for a, b in chunk]})

    return rows(pairs[HELD_OUT:]), rows(pairs[:HELD_OUT])


def held_out_accuracy(policy, tokenizer, held_out, temperature: float, max_new_tokens: int, seed: int = 0,
                      batch_size: int = 64) -> float:
    """The share of `held_out` prompts whose completion, sampled at `temperature` (HF generate, torch's RNG seeded
    by `seed` inside and restored after), `correct` scores 1. The same prompts and seed for every model compared."""
    import torch

    prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
               for p in held_out["prompt"]]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    right = 0.0
    was_training = policy.training
    policy.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(policy.device)
                out = policy.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                      top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                right += sum(correct(texts, held_out["answer"][start : start + batch_size]))
    finally:
        tokenizer.padding_side = side
        policy.train(was_training)
    return right / len(prompts)


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig or ModelConfig fields."""

    max_train_seconds: float | None = field(
        default=None, metadata={"help": "Stop training after this many seconds (checked after each PPO step)."})
    eval_before: bool = field(default=True, metadata={"help": "Measure the held-out accuracy before training too."})
    held_out_size: int = field(default=HELD_OUT, metadata={"help": f"Held-out prompts evaluated (at most {HELD_OUT})."})
    write_datasets: str | None = field(default=None, metadata={
        "help": "Write the train and held-out prompts to this folder (train.jsonl, test.jsonl) and exit: a dataset "
                "for `trl-ext ppo --dataset_name FOLDER` (README, \"From GRPO to PPO\")."})


# 40 PPO steps of 8 completions of at most 16 tokens, temperature 0.7 (at 1.0 the model's answers are near-random),
# 2 PPO epochs. Learning rate 3e-4: at the quickstart's 1e-3 the policy left the reference by 10-20 nats within 15
# steps and the training score fell to 0 (measured once each, plain and with a group baseline).
RECIPE_DEFAULTS = dict(
    **CPU_DEFAULTS,
    value_trainable_layers=2,  # the critic passed below: its top 2 decoder layers, final norm and head trained
    output_dir="runs/arithmetic",
    total_episodes=320,
    per_device_train_batch_size=8,
    num_mini_batches=1,
    num_ppo_epochs=2,
    response_length=16,
    temperature=0.7,
    learning_rate=3e-4,
    kl_coef=0.05,
    alarm_profile="verifiable",  # a right-or-wrong score (docs/metrics-and-alarms.md)
    **LORA_DEFAULTS,
)


class TimeBudget(TrainerCallback):
    """Stops training once `seconds` have passed since training began (checked after each PPO step; None: never)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds is not None and time.perf_counter() - self.start >= self.seconds:
            control.should_training_stop = True


def build_trainer(script_args, args, model_args, reward=correct, callbacks=(), **trainer_kwargs):
    """The recipe's PPOTrainer (policy, reference, critic, rewards, prompts) and the held-out prompts.
    `trainer_kwargs`: more PPOTrainer arguments (the multi-turn recipe's environment_factory)."""
    dtype = load_dtype(model_args, args)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.scripts import load_tokenizer

    set_seed(args.seed)  # the value model's new score head is drawn here, before the trainer seeds anything
    model_path = model_args.model_name_or_path or str(smollm2_path())
    tokenizer = load_tokenizer(model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    value_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=dtype)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    train_dataset, held_out = build_datasets()
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                         train_dataset=train_dataset, value_model=value_model, peft_config=get_peft_config(model_args),
                         callbacks=[TimeBudget(script_args.max_train_seconds), *callbacks], **trainer_kwargs)
    return trainer, held_out


def main(argv: list[str] | None = None) -> dict:
    script_args, args, model_args = parse_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)
    if script_args.write_datasets:
        files = {}
        for split, dataset in zip(("train", "test"), build_datasets()):
            files[split] = str(Path(script_args.write_datasets) / f"{split}.jsonl")
            dataset.to_json(files[split])
            print(f"[recipe] {len(dataset)} {split} prompts written to {files[split]}")
        return files
    trainer, held_out = build_trainer(script_args, args, model_args)
    held_out = held_out.select(range(min(script_args.held_out_size, len(held_out))))
    policy, tokenizer = trainer.unwrapped.policy, trainer.processing_class
    accuracy = {}
    if script_args.eval_before:
        accuracy["before"] = held_out_accuracy(policy, tokenizer, held_out, args.temperature, args.response_length)
    start = time.time()
    trainer.train()
    wall = time.time() - start
    accuracy["after"] = held_out_accuracy(policy, tokenizer, held_out, args.temperature, args.response_length)
    trainer.save_model(args.output_dir)
    summary = {"accuracy_before": accuracy.get("before"), "accuracy_after": accuracy["after"], "wall_s": wall,
               "steps": trainer.state.global_step, "episodes": trainer.state.episode}
    if trainer.is_world_process_zero():
        before = f"{accuracy['before']:.3f} -> " if "before" in accuracy else ""
        print(f"[recipe] held-out accuracy ({len(held_out)} prompts, temperature {args.temperature}): {before}"
              f"{accuracy['after']:.3f} after {trainer.state.global_step} steps ({trainer.state.episode} completions) "
              f"in {wall:.0f} s; adapter in {args.output_dir}", flush=True)
    return summary


if __name__ == "__main__":
    main()
