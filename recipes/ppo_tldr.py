"""PPO on TL;DR summarisation for 1-8B models on GPUs: the recipe of Huang et al. (2024), run with trl_ext.

Reddit posts ("SUBREDDIT: ... TITLE: ... POST: ... TL;DR:") are the prompts; the policy starts from a supervised
(SFT) summariser, a reward model trained on human preferences scores its summaries, and PPO raises that score under a
KL penalty towards the SFT model. The defaults reproduce the 1B setting of

    [H] S. Huang, M. Noukhovitch, A. Hosseini, K. Rasul, W. Wang, L. Tunstall. "The N+ Implementation Details of RLHF
        with PPO: A Case Study on TL;DR Summarization", 2024, arXiv:2403.17031. Values read from its code,
        github.com/vwxyzjn/summarize_from_feedback_details: `summarize_from_feedback_details/ppo_left_padding_new.py`
        (`Args`, `PpoHParams`) and `sbatches/ppo_left_padding.sbatch` (batch sizes per model size);
    [T] TRL's own version of this recipe, `examples/scripts/ppo/ppo_tldr.py` (models, dataset, launch lines), and
        TRL 1.12's `PPOConfig` defaults, which follow [H].

Defaults (each row is checked by tests/recipes/test_gpu_recipes.py against what the parser gives):

| flag | default | source |
|---|---|---|
| `--sft_model_path` | `cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr` | [T]; [H]'s SFT checkpoint for Pythia-1B |
| `--reward_model_path` | `cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr` | [T]; [H]'s reward model for Pythia-1B |
| `--model_name_or_path` | `EleutherAI/pythia-1b-deduped` | [T]: the tokenizer comes from the base model |
| `--dataset_name` | `trl-lib/tldr` | [T] (`prompt` column: Reddit posts ending in "TL;DR:") |
| `--dataset_test_split` | `validation` | [T] |
| `--lora_target_modules` | `all-linear` | with `--use_peft`: LoRA on every linear layer (QLoRA's choice) |
| `--learning_rate` | `3e-6` | [H] `lr = 3e-6`; [T] |
| `--lr_scheduler_type` | `linear` | [H] `lrnow = frac * args.lr`: linear decay to 0, no warmup |
| `--adam_epsilon` | `1e-5` | [H] `eps = 1e-5` (AdamW) |
| `--total_episodes` | `1000000` | [H] `total_episodes = 1000000`; [T]'s multi-GPU launch line |
| `--per_device_train_batch_size` | `16` | [H] sbatch, Pythia-1B: `local_micro_batch_size=16` |
| `--gradient_accumulation_steps` | `4` | [H] sbatch, Pythia-1B: 8 GPUs x 16 x 4 = 512 rollouts per PPO batch |
| `--num_mini_batches` | `1` | [H] `nminibatches = 1` |
| `--num_ppo_epochs` | `4` | [H] `noptepochs = 4` |
| `--local_rollout_forward_batch_size` | `64` | [H] sbatch, Pythia-1B |
| `--response_length` | `53` | [H] `response_length = 53` (the SFT summaries' length cap) |
| `--temperature` | `0.7` | [H] `temperature = 0.7` |
| `--stop_token` | `eos` | [H] `truncate_token = "eos"`; [T] `--stop_token eos` |
| `--missing_eos_penalty` | `1.0` | the "EOS trick": [H] `non_eos_penalty=True`, `penalty_reward_value=-1`; [T] |
| `--kl_coef` | `0.05` | [H] `kl_coef = 0.05` |
| `--kl_estimator` | `k1` | [H] `kl = logprobs - ref_logprobs` |
| `--whiten_rewards` | `False` | [H]'s released `..._nowhiten_reward__tldr` runs (script default True) |
| `--vf_coef` | `0.1` | [H] `vf_coef = 0.1` |
| `--cliprange` | `0.2` | [H] `cliprange = 0.2` |
| `--cliprange_value` | `0.2` | [H] `cliprange_value = 0.2` |
| `--gamma` | `1.0` | [H] `gamma = 1` |
| `--lam` | `0.95` | [H] `lam = 0.95` |
| `--max_prompt_length` | `512` | [T] drops prompts over 512 tokens; [H]'s queries are cut to 512 tokens |
| `--prompt_truncation` | `drop` | [T] (filters them out rather than cutting them) |
| `--eval_strategy` | `steps` | [T] `--eval_strategy steps --eval_steps 100` |
| `--eval_steps` | `100` | [T] |
| `--ds3_gather_for_generation` | `True` | TRL's default (ZeRO-3: docs/scale-out.md) |
| value model | a second copy of the reward model, head kept | [H] `ScalarModel.from_pretrained(rm_path)`; [T] |
| reference policy | a frozen copy of the SFT model (with `--use_peft`: the policy with its adapter off) | [H], [T] |

Differences from [H] worth knowing: [H] *replaces* the score of a summary without EOS by -1, trl_ext (like TRL)
*subtracts* `missing_eos_penalty` from it. [H] samples all 53 tokens and cuts after the first EOS; trl_ext stops at the
EOS, which gives the same responses, masks and scores. [H] pads with a new `[PAD]` token; this recipe pads with EOS
when the tokenizer has no pad token (trl_ext builds masks from positions, never from `== pad_token_id`, so pad == EOS
is safe). `--critic_warmup_steps` (trl_ext) is 0, as in [H].

Run it (see recipes/accelerate_configs/README.md for every launch mode):

    python recipes/ppo_tldr.py --output_dir runs/ppo-tldr                                  # one GPU
    accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero2.yaml recipes/ppo_tldr.py \\
        --output_dir runs/ppo-tldr                                                          # 8 GPUs, ZeRO-2

Arguments: TRL's `ScriptArguments` (the dataset), `ModelConfig` (the tokenizer's `--model_name_or_path`, `--dtype`,
`--use_peft` with `--lora_r`/`--lora_alpha`/..., `--load_in_4bit`; turned into configs by TRL's `get_peft_config`
and `get_quantization_config`, whose 4-bit compute dtype is `--dtype`) and `trl_ext.PPOConfig`, parsed by TRL's
`TrlParser` (`--config run.yaml` works).

Models and data by name come from the Hugging Face Hub; local folders and data files work too (`--sft_model_path
/path`, `--dataset_name /path/prompts.jsonl` with a `prompt` column, a folder of `train.jsonl` + `validation.jsonl`, or
a `save_to_disk` folder). Offline and not cached, the recipe stops with one message naming what failed and the fixes
(`trl_ext.scripts.hub_load`).

Precision: `--dtype bfloat16 --bf16 true` (A100, RTX 30xx and newer) or `--dtype float16 --fp16 true` (T4, V100)
loads the reward model (and with `--use_peft` the policy's frozen base) in that dtype and what trains whole (the
policy without `--use_peft`, the value model) in float32, computing in bf16/fp16 under autocast; fp16 scales the loss
with a GradScaler. 7-8B models on one GPU do not fit this recipe's layout (a full-size critic is trained beside a
full-size reward model): use `recipes/ppo_qlora_7b.py`, one shared 4-bit base (docs/qlora-and-memory.md).

It writes to `--output_dir`: the policy (or its LoRA adapter), the tokenizer, metrics.jsonl and samples.jsonl. Other
model sizes, fewer GPUs, ZeRO-3 and mixed precision: docs/scale-out.md.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config, get_quantization_config
from trl import ScriptArguments as TRLScriptArguments

from trl_ext import PPOConfig, get_kbit_device_map
from trl_ext.monitoring.report import run_summary
from trl_ext.scripts import HubUnavailableError, hub_load, load_dtype, load_prompt_splits, load_tokenizer
from trl_ext.scripts import parse_args as parse_recipe_args


@dataclass
class ScriptArguments(TRLScriptArguments):
    """TRL's dataset arguments, and what this recipe adds. The SFT policy and the reward model are PPOConfig's own
    `--sft_model_path` and `--reward_model_path` (as in TRL)."""

    value_model_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder the value model starts from. Unset: "
                                "--reward_model_path (Huang et al.: the critic starts as a copy of the reward model)."})
    reward_tokenizer_path: str | None = field(
        default=None, metadata={"help": "Tokenizer of a reward model that does not share the policy's tokenizer (the "
                                "text is then re-tokenized for it). Unset: the reward model reads the policy's ids."})
    eval_samples: int = field(
        default=256, metadata={"help": "Evaluate on the first N prompts of the test split (each eval samples from the "
                               "policy and the reference for every one); -1: all of them."})


# Huang et al. (2024) / TRL's ppo_tldr.py: every value, with its source, is in the table of the module docstring.
RECIPE_DEFAULTS = dict(
    output_dir="runs/ppo-tldr",
    sft_model_path="cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr",
    reward_model_path="cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr",
    model_name_or_path="EleutherAI/pythia-1b-deduped",
    dataset_name="trl-lib/tldr",
    dataset_test_split="validation",
    lora_target_modules="all-linear",
    learning_rate=3e-6,
    lr_scheduler_type="linear",
    adam_epsilon=1e-5,
    total_episodes=1_000_000,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,
    num_mini_batches=1,
    num_ppo_epochs=4,
    local_rollout_forward_batch_size=64,
    response_length=53,
    temperature=0.7,
    stop_token="eos",
    missing_eos_penalty=1.0,
    kl_coef=0.05,
    kl_estimator="k1",
    whiten_rewards=False,
    vf_coef=0.1,
    cliprange=0.2,
    cliprange_value=0.2,
    gamma=1.0,
    lam=0.95,
    max_prompt_length=512,
    prompt_truncation="drop",
    eval_strategy="steps",
    eval_steps=100,
    ds3_gather_for_generation=True,
    logging_steps=1,
    report_to="none",
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelConfig]:
    """Command line (and `--config` YAML) -> (ScriptArguments, trl_ext.PPOConfig, trl.ModelConfig)."""
    script_args, args, model_args = parse_recipe_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS,
                                                      argv)
    if model_args.load_in_4bit and not model_args.use_peft:
        raise ValueError("--load_in_4bit quantizes the policy, which can then only train through an adapter: add "
                         "--use_peft (or drop --load_in_4bit).")
    if script_args.eval_samples == 0 or script_args.eval_samples < -1:
        raise ValueError(f"--eval_samples {script_args.eval_samples} must be a positive number of prompts, or -1 for "
                         "all of them (use --eval_strategy no to skip evaluation).")
    return script_args, args, model_args


def load_models(args: PPOConfig, script_args: ScriptArguments, model_args: ModelConfig, pad_token_id: int):
    """(SFT policy, reward model, value model). The value model is a second copy of the reward model loaded from disk
    rather than deep-copied, so that ZeRO-3's partitioned loading works for it too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # --dtype for what stays frozen (the reward model, a LoRA policy's base); what trains whole (the policy without
    # --use_peft, the value model) in float32: mixed precision computes in bf16/fp16 under autocast over fp32 weights
    # (fp16 weights stop the GradScaler; bf16 AdamW steps lose updates smaller than bf16's resolution)
    frozen_dtype = load_dtype(model_args, args)
    trained_dtype = torch.float32 if frozen_dtype in (torch.bfloat16, torch.float16) else frozen_dtype
    common = dict(attn_implementation=model_args.attn_implementation, revision=model_args.model_revision,
                  trust_remote_code=args.trust_remote_code)
    quantization = get_quantization_config(model_args)
    policy_kwargs = dict(common, quantization_config=quantization,
                         dtype=frozen_dtype if model_args.use_peft else trained_dtype)
    if quantization is not None:
        policy_kwargs["device_map"] = get_kbit_device_map()  # each process its own GPU (None on CPU)
    policy = hub_load("SFT policy", args.sft_model_path, lambda: AutoModelForCausalLM.from_pretrained(
        args.sft_model_path, **policy_kwargs), "--sft_model_path")
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)  # the trainer sets it

    def scalar_model(what: str, name: str, flag: str, dtype):
        model = hub_load(what, name, lambda: AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=1, dtype=dtype, **common), flag)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = pad_token_id
        return model

    reward_model = scalar_model("reward model", args.reward_model_path, "--reward_model_path", frozen_dtype)
    value_flag = "--value_model_path" if script_args.value_model_path else "--reward_model_path"
    value_model = scalar_model("value model", script_args.value_model_path or args.reward_model_path, value_flag,
                               trained_dtype)
    return policy, reward_model, value_model


def main(argv: list[str] | None = None) -> dict:
    from transformers import set_seed

    script_args, args, model_args = parse_args(argv)
    set_seed(args.seed)  # anything drawn while building (new heads, LoRA matrices) follows the seed

    # tokenizer and prompts first: they fail fast, before gigabytes of weights are read
    tokenizer_flag = "--model_name_or_path" if model_args.model_name_or_path else "--sft_model_path"
    tokenizer = load_tokenizer(model_args.model_name_or_path or args.sft_model_path, args.trust_remote_code,
                               tokenizer_flag)
    train_dataset, eval_dataset = load_prompt_splits(script_args, args.eval_strategy != "no",
                                                     script_args.eval_samples)
    policy, reward_model, value_model = load_models(args, script_args, model_args, tokenizer.pad_token_id)
    reward = reward_model
    if script_args.reward_tokenizer_path:
        reward = (reward_model, load_tokenizer(script_args.reward_tokenizer_path, args.trust_remote_code,
                                               "--reward_tokenizer_path"))

    from trl_ext import PPOTrainer

    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # a frozen copy of the SFT policy; with --use_peft the policy with its adapter disabled
        reward_model=reward,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    if trainer.is_world_process_zero():
        print(f"[recipe] PPO on TL;DR: {args.num_total_batches} steps x {args.batch_size} rollouts "
              f"({args.world_size} process(es)), policy {args.sft_model_path}, reward {args.reward_model_path}, "
              f"lr={args.learning_rate}, kl_coef={args.kl_coef}, device={trainer.accelerator.device} "
              f"-> {args.output_dir}", flush=True)

    start = time.time()
    trainer.train()
    wall = time.time() - start
    trainer.save_model(args.output_dir)
    summary = {**run_summary(trainer.state.log_history), "wall_s": wall}
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        print(f"[recipe] done: {summary['steps']} steps in {wall:.0f} s; mean score {summary['first_score']:+.3f} -> "
              f"{summary['last_score']:+.3f}, KL {summary['last_kl']:.3f}; model and metrics.jsonl in "
              f"{args.output_dir}", flush=True)
    return summary


if __name__ == "__main__":
    try:
        main()
    except HubUnavailableError as error:
        sys.exit(f"[recipe] error: {error}")  # the message says what and how to fix it; no traceback
