"""QLoRA PPO of a 7-8B model on one GPU (24, 16 or 12 GB), from a recipe config of recipes/qlora_7b/.

    python recipes/ppo_qlora_7b.py --config recipes/qlora_7b/shared_16gb.yaml \\
        --model_name_or_path mistralai/Mistral-7B-Instruct-v0.2 --reward_adapter runs/rm-adapter \\
        --dataset_name trl-lib/tldr --output_dir runs/qlora-7b

1. `--config` is a YAML of `trl_ext.tools.memory.PlanConfig` fields, the file `trl-ext estimate-memory` reads, mapped
   onto PPOConfig, the BitsAndBytesConfig and the LoraConfig by `trl_ext.scripts.qlora.parse_plan_args` (its docstring
   has the mapping). Every plan key is a flag too, and the command line wins (`--response_length 128`, `--lora_r 8`,
   `--compute_dtype fp16`); so is any PPOConfig field (`--learning_rate`, `--kl_coef`).
2. Before loading anything it prints the planner's estimate for this config and the model's shape (its config.json),
   and on a CUDA machine whether it fits the GPU's free memory (`trl_ext.scripts.qlora.report_memory_plan`).
3. It loads the model(s) and trains:
   - `layout: shared`: one 4-bit base (`trl_ext.models.build_shared_base`): the policy and critic are LoRA adapters
     of it, the reference is the base with adapters disabled, the value head is a fp32 linear on its hidden states;
     the reward is a frozen adapter (`--reward_adapter`), a separate 4-bit reward model (`--reward_model_path`) or a
     built-in function (`--reward_function vader`, for smoke tests);
   - `layout: separate`: policy = 4-bit base + LoRA (reference = its adapter disabled), critic = its own 4-bit
     sequence-classification model (`--value_model_path`, default the policy's base) to which trl_ext gives LoRA on
     every linear layer and a trained fp32 score head, reward = a 4-bit reward model (`--reward_model_path`, or the
     base + `--reward_adapter`) or `--reward_function`.
4. It saves the trained adapters and heads to `--output_dir` and prints `torch.cuda.max_memory_allocated()` next to
   the planner's estimate (also in `output_dir/memory.json`).

`--reward_adapter` is the folder peft's `save_pretrained` wrote for a LoRA sequence-classification model on the same
base (TRL's RewardTrainer with `peft_config=LoraConfig(task_type="SEQ_CLS", ...)`). Prompts: TRL's dataset arguments
(`--dataset_name`: a hub dataset, a local data file with a `prompt` column, or a folder; default the 80 shipped opinion
prompts), read by `trl_ext.scripts.load_prompt_splits`; text prompts are rendered with the chat template when the
tokenizer has one (`--prompt_format auto`). Outputs: shared: `policy/`, `critic/` (peft adapters),
`value_head.safetensors`; separate: the policy adapter at the top level and `critic/`; both: the tokenizer,
metrics.jsonl, samples.jsonl, memory.json.

Status: run end to end on CPU only, on a tiny random Llama in nf4 (tests/recipes/test_qlora_recipe.py); not yet run on a
GPU or on a 7B model (see recipes/qlora_7b/README.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl import ScriptArguments as TRLScriptArguments

from trl_ext import PPOConfig
from trl_ext.monitoring.report import run_summary
from trl_ext.scripts import HubUnavailableError, load_prompt_splits, load_tokenizer
from trl_ext.scripts.qlora import build_models, parse_plan_args, report_memory_plan, size
from trl_ext.scripts.sentiment import PROMPTS_FILE, vader_reward
from trl_ext.tools.memory import PlanConfig

MEMORY_FILE = "memory.json"
REWARD_FUNCTIONS: dict[str, Callable] = {"vader": vader_reward}


@dataclass
class ScriptArguments(TRLScriptArguments):
    """TRL's dataset arguments and the recipe's own. The plan keys (layout ... lora_target_modules) default to the
    YAML's values; given on the command line, they win."""

    config: str | None = field(
        default=None, metadata={"help": "Recipe config: recipes/qlora_7b/{shared_24gb,shared_16gb,shared_12gb,"
                                "separate_24gb}.yaml or your own file of trl_ext.tools.memory.PlanConfig fields."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder of the model PPO starts from (an SFT/instruct "
                                "model), with its tokenizer. Required."})
    reward_adapter: str | None = field(
        default=None, metadata={"help": "Folder of a LoRA sequence-classification reward adapter trained on the same "
                                "base (peft save_pretrained of RewardTrainer's model): the reward, frozen."})
    reward_function: str | None = field(
        default=None, metadata={"help": "A built-in reward function instead of a reward model: 'vader' (positive "
                                "sentiment of the completion, needs vaderSentiment). For smoke tests."})
    reward_tokenizer_path: str | None = field(
        default=None, metadata={"help": "Tokenizer of a --reward_model_path that does not share the policy's "
                                "tokenizer (the text is re-tokenized for it)."})
    value_model_path: str | None = field(
        default=None, metadata={"help": "layout separate: the model the critic starts from (e.g. the reward model). "
                                "Unset: --model_name_or_path with a fresh, zeroed value head."})
    eval_samples: int = field(default=64, metadata={"help": "Evaluate on the first N prompts of the test split."})
    prompt_format: str = field(
        default="auto", metadata={"help": "Text prompts: 'chat' (one user message, rendered with the chat template), "
                                  "'text' (as is), 'auto' (chat if the tokenizer has a chat template)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha. Unset: 2 x lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. 'sdpa', 'flash_attention_2'."})
    # plan keys (unset: the YAML's value)
    layout: str | None = field(default=None, metadata={"help": "'shared' or 'separate' (YAML: layout)."})
    base_dtype: str | None = field(default=None, metadata={"help": "nf4, fp4, int8, bf16, fp16, fp32 (YAML)."})
    bnb_4bit_use_double_quant: bool | None = field(default=None, metadata={"help": "Double quantization (YAML)."})
    compute_dtype: str | None = field(
        default=None, metadata={"help": "bf16, fp16 or fp32: bnb_4bit_compute_dtype and PPOConfig bf16/fp16 (YAML). "
                                "fp16 on GPUs without bf16 (T4, V100); fp32 for CPU smoke runs."})
    lora_r: int | None = field(default=None, metadata={"help": "LoRA rank (YAML)."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "'all-linear' or comma-separated names, e.g. 'q_proj,v_proj' (YAML)."})



# Not tuned on a 7B (no GPU run yet): the learning rate is ~10x the full-model rate of Huang et al. (2024), as usual
# for LoRA; the rest are trl_ext's/TRL's defaults made explicit.
RECIPE_DEFAULTS = dict(
    output_dir="runs/ppo-qlora-7b",
    sft_model_path=None,  # TRL's default names a hub model; this recipe takes --model_name_or_path
    reward_model_path=None,
    learning_rate=3e-5,
    total_episodes=10_000,
    num_ppo_epochs=4,
    kl_coef=0.05,
    temperature=0.7,
    missing_eos_penalty=1.0,
    value_head_init="zero",
    eval_strategy="no",
    save_strategy="steps",
    save_steps=100,
    logging_steps=1,
    report_to="none",
    dataset_name=str(PROMPTS_FILE),
    dataset_test_split="validation",
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, PlanConfig]:
    """Command line + the YAML -> (ScriptArguments, trl_ext.PPOConfig, the PlanConfig of this run)."""
    script_args, args, plan = parse_plan_args(ScriptArguments, RECIPE_DEFAULTS, argv)
    if not script_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required: the hub name or local folder of the model to train "
                         "(e.g. mistralai/Mistral-7B-Instruct-v0.2).")
    if args.sft_model_path:
        raise ValueError(f"--sft_model_path {args.sft_model_path!r}: this recipe takes the model as "
                         "--model_name_or_path.")
    rewards = {"--reward_adapter": script_args.reward_adapter, "--reward_model_path": args.reward_model_path,
               "--reward_function": script_args.reward_function}
    given = [flag for flag, value in rewards.items() if value]
    if len(given) != 1:
        raise ValueError(f"Give exactly one reward: --reward_adapter FOLDER (a LoRA reward adapter on the same base), "
                         f"--reward_model_path NAME (a reward model) or --reward_function vader; got "
                         f"{', '.join(given) or 'none'}.")
    adapter = script_args.reward_adapter
    if adapter and not os.path.isfile(os.path.join(os.path.expanduser(adapter), "adapter_model.safetensors")):
        raise FileNotFoundError(f"--reward_adapter {adapter!r} is not a folder holding adapter_model.safetensors: pass "
                                "the folder peft's save_pretrained wrote for a LoRA sequence-classification reward "
                                "model on the same base (e.g. trainer.model.save_pretrained(FOLDER) after TRL's "
                                "RewardTrainer with peft_config=LoraConfig(task_type='SEQ_CLS', ...)).")
    if script_args.reward_function and script_args.reward_function not in REWARD_FUNCTIONS:
        raise ValueError(f"--reward_function {script_args.reward_function!r} is not one of "
                         f"{sorted(REWARD_FUNCTIONS)}.")
    if script_args.prompt_format not in ("auto", "chat", "text"):
        raise ValueError(f"--prompt_format {script_args.prompt_format!r} is not one of 'auto', 'chat', 'text'.")

    if script_args.value_model_path and plan.layout == "shared":
        raise ValueError("--value_model_path is for layout separate; with a shared base the critic is an adapter of "
                         "it. Use --layout separate, or drop --value_model_path.")
    return script_args, args, plan


def prompt_datasets(script_args: ScriptArguments, args: PPOConfig, tokenizer):
    """(train, eval or None): `prompt` columns (or `input_ids`); text prompts become one user message when the
    tokenizer has a chat template (--prompt_format auto) or always (chat)."""
    train, test = load_prompt_splits(script_args, args.eval_strategy != "no", script_args.eval_samples)
    chat = script_args.prompt_format == "chat" or (script_args.prompt_format == "auto"
                                                   and getattr(tokenizer, "chat_template", None))

    def as_chat(ds):
        if ds is None or not chat or "prompt" not in ds.column_names or not isinstance(ds[0]["prompt"], str):
            return ds
        return ds.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})

    return as_chat(train), as_chat(test)



def build_trainer(script_args: ScriptArguments, args: PPOConfig, plan: PlanConfig):
    """Tokenizer, prompts, models -> a trl_ext.PPOTrainer."""
    from trl_ext import PPOTrainer

    tokenizer = load_tokenizer(script_args.model_name_or_path, args.trust_remote_code)
    train_dataset, eval_dataset = prompt_datasets(script_args, args, tokenizer)  # fail fast, before the weights
    models = build_models(script_args, args, plan, tokenizer, REWARD_FUNCTIONS.get(script_args.reward_function))
    return PPOTrainer(args=args, processing_class=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      **models)


def save(trainer, args: PPOConfig) -> None:
    """The trained parts: shared -> policy/, critic/, value_head.safetensors; separate -> the policy adapter and
    critic/ (its LoRA and score head). The tokenizer with them."""
    trainer.save_model(args.output_dir)
    if trainer.shared is None and trainer.is_world_process_zero():
        trainer.unwrapped.value_model.save_pretrained(os.path.join(args.output_dir, "critic"))
        trainer.processing_class.save_pretrained(args.output_dir)


def run(script_args: ScriptArguments, args: PPOConfig, plan: PlanConfig,
        on_built: Callable[[Any], None] | None = None) -> dict:
    """Print the memory plan, build, train, save; returns the summary. `on_built(trainer)` runs before training."""
    import torch
    from transformers import set_seed

    figures = report_memory_plan(script_args, plan)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    set_seed(args.seed)  # value heads and LoRA matrices are drawn while building, before the trainer seeds anything
    trainer = build_trainer(script_args, args, plan)
    print(f"[recipe] QLoRA PPO ({plan.layout} layout): {args.num_total_batches} steps x {args.batch_size} rollouts, "
          f"{script_args.model_name_or_path}, reward "
          f"{script_args.reward_adapter or args.reward_model_path or script_args.reward_function}, "
          f"lr={args.learning_rate}, kl_coef={args.kl_coef}, device={trainer.accelerator.device} -> {args.output_dir}",
          flush=True)
    if on_built is not None:
        on_built(trainer)
    start = time.time()
    trainer.train()
    wall = time.time() - start
    save(trainer, args)

    measured = torch.cuda.max_memory_allocated() if cuda else None
    summary = {"layout": plan.layout, **run_summary(trainer.state.log_history), "wall_s": wall,
               "measured_max_memory_allocated": measured, **figures}
    peak = figures.get("plan_peak_bytes")
    if measured is not None:
        vs = f"; planner's peak {size(peak)} (measured/planned {measured / peak:.2f})" if peak else ""
        memory = f"torch.cuda.max_memory_allocated {size(measured)}{vs}"
    else:
        memory = "no CUDA: GPU memory not measured" + (f" (planner's peak on a GPU: {size(peak)})" if peak else "")
    with open(os.path.join(args.output_dir, MEMORY_FILE), "w") as fh:
        json.dump({"config": script_args.config, "plan": dataclasses.asdict(plan), **summary}, fh, indent=1,
                  default=str)
    print(f"[recipe] done: {summary['steps']} steps in {wall:.0f} s; mean score {summary['first_score']:+.3f} -> "
          f"{summary['last_score']:+.3f}, KL {summary['last_kl']:.3f}; {memory}; adapters in {args.output_dir}",
          flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    script_args, args, plan = parse_args(argv)
    return run(script_args, args, plan)


if __name__ == "__main__":
    try:
        parsed = parse_args()
    except (ValueError, FileNotFoundError) as error:  # a bad flag or config: the message names it and the fix
        sys.exit(f"[recipe] error: {error}")
    try:
        run(*parsed)
    except HubUnavailableError as error:
        sys.exit(f"[recipe] error: {error}")  # the message says what and how to fix it; no traceback
