"""The three-stage RLHF pipeline on CPU: preference data, a learned reward model, PPO against it, a gold judge.

The gold scorer is VADER sentiment (`trl_ext.scripts.sentiment.vader_reward`, in [-1, 1]). It plays the part of the
human labellers: it ranks samples in stage 1 and judges the policy in stage 3, but PPO never trains on it. PPO trains on
a reward model learned from its rankings, so the run shows what InstructGPT's pipeline shows at scale (Gao et al. 2022,
"Scaling laws for reward model overoptimization"): the proxy reward keeps rising with the KL to the reference while
the gold reward rises less, stalls or falls.

Stage 1, preference data (`trl_ext.scripts.preferences`): SmolLM2-135M-Instruct samples `samples_per_prompt`
  completions for each shipped opinion prompt (64 train, 16 held out), rendered and sampled as PPOTrainer does; VADER
  ranks them into TRL preference rows (pairs whose gold scores differ by more than `preference_margin`).
Stage 2, reward model: `trl.RewardTrainer` trains SmolLM2 as a 1-output classifier with a LoRA adapter on the train
  pairs, reading them as PPO's scorer does (`trl_ext.scripts.preferences.train_reward_model` says how); merged
  and saved.
Stage 3, PPO: `trl_ext.PPOTrainer` with a LoRA policy against the learned RM, the critic a copy of the RM
  (`value_model_init="reward_model"`, head kept, its top `--value_trainable_layers` decoder layers trained); every
  `eval_steps` steps (and once before training) the held-out prompts are scored by the RM (eval/score: proxy)
  and by VADER (eval/gold_score: gold), next to the reference's.

It writes to `--output_dir` (default `runs/three-stage`): preferences_{train,test}.jsonl, reward_trainer_log.jsonl,
reward_model/, metrics.jsonl, proxy_vs_gold.png, dashboard.png, summary.json (with the evaluation table) and the
policy's LoRA adapter. Run it (time and results: docs/results.md; the first run converts the model once, ~20 s):

    python recipes/ppo_three_stage.py --output_dir runs/three-stage

Every `trl_ext.PPOConfig`, `trl.ModelConfig` and `ScriptArguments` field is a flag (`--total_episodes 320`,
`--lora_r 16`, `--rm_epochs 3`), and `--config run.yaml` reads them from YAML. The shortened run of the tests takes ~1
minute:

    python recipes/ppo_three_stage.py --output_dir /tmp/three-stage-quick --max_train_prompts 16 \\
        --max_test_prompts 4 --samples_per_prompt 2 --response_length 12 --rm_epochs 1 --total_episodes 8 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --num_mini_batches 1 --num_ppo_epochs 1 \\
        --eval_steps 1 --write_report false
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, get_peft_config

from trl_ext import PPOConfig
from trl_ext.scripts import CPU_DEFAULTS, LORA_DEFAULTS
from trl_ext.scripts import parse_args as parse_recipe_args
from trl_ext.scripts.preferences import PAIRINGS

PLOT_FILE, SUMMARY_FILE, PAIRS_FILE = "proxy_vs_gold.png", "summary.json", "preferences_{split}.jsonl"
RM_DIR, RM_LOG_FILE = "reward_model", "reward_trainer_log.jsonl"
RM_INPUTS = ("sampled_ids", "text")
# Files of an earlier run into the same folder that this run rewrites
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "dashboard.png", PLOT_FILE, SUMMARY_FILE, RM_LOG_FILE,
             PAIRS_FILE.format(split="train"), PAIRS_FILE.format(split="test"))


def option(default, help: str):
    """A dataclass field with its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig fields. Stage 1 samples with PPOConfig's `response_length`,
    `temperature` and `seed`, so the RM is trained on text like the text PPO starts from."""

    # Stage 1: preference data
    samples_per_prompt: int = option(4, "Completions sampled per prompt (K) to rank with the gold scorer; >= 2.")
    preference_margin: float = option(0.2, "Pair two completions of a prompt only if their gold (VADER, in [-1, 1]) "
                                      "scores differ by more than this (ties are always dropped).")
    pairing: str = option("all", "'all': every pair of a prompt's completions that passes the margin; 'best_worst': "
                          "only the best against the worst.")
    max_train_prompts: int = option(0, "Use only the first N train prompts (0: all 64).")
    max_test_prompts: int = option(0, "Use only the first N test prompts (0: all 16).")
    sample_batch_size: int = option(64, "Sequences per generate() call in stage 1.")
    # Stage 2: reward model
    rm_epochs: float = option(1.0, "RewardTrainer epochs over the train pairs.")
    rm_learning_rate: float = option(1e-3, "RewardTrainer learning rate (LoRA + head).")
    rm_batch_size: int = option(8, "Preference pairs per RewardTrainer step.")
    rm_lora_r: int = option(16, "LoRA rank of the reward model.")
    rm_lora_alpha: int = option(32, "LoRA alpha of the reward model.")
    rm_lora_layers: int = option(-1, "Put the RM's LoRA only on its top N decoder layers (-1: all layers).")
    rm_center_rewards_coefficient: float | None = option(0.01, "RewardConfig.center_rewards_coefficient (pulls the "
                                                         "RM's scores towards 0; Eisenstein et al. 2023); None: off.")
    rm_inputs: str = option("sampled_ids", "'sampled_ids': the RM trains on the sampled token ids (what PPO's scorer "
                            "reads); 'text': RewardTrainer re-tokenizes prompt + completion and appends EOS to each.")
    rm_pad_token: str = option("<|endoftext|>", "Pad token of the RM (must differ from EOS, so the classifier pools "
                               "at the final EOS).")
    # Stage 3: PPO (the policy's LoRA: trl.ModelConfig's --lora_r, --lora_alpha, --lora_target_modules, also the RM's)
    # Everything
    num_threads: int = option(0, "torch.set_num_threads (0: torch's default). On a CPU shared with other jobs, 1 can "
                              "be several times faster than oversubscribed threads.")
    write_report: bool = option(True, "Also write the `trl-ext report` dashboard.png.")

    def __post_init__(self):  # bad values stop here, before any model loads
        rules = [("samples_per_prompt", self.samples_per_prompt >= 2, "must be >= 2 (a pair needs 2 completions)"),
                 ("pairing", self.pairing in PAIRINGS, f"is not one of {PAIRINGS}"),
                 ("rm_inputs", self.rm_inputs in RM_INPUTS, f"is not one of {RM_INPUTS}"),
                 ("preference_margin", self.preference_margin >= 0, "must be >= 0 (a gold-score difference)"),
                 ("rm_epochs", self.rm_epochs > 0, "must be > 0")]
        rules += [(n, getattr(self, n) >= 0, "must be >= 0 (0: all/default)")
                  for n in ("max_train_prompts", "max_test_prompts", "num_threads")]
        rules += [(n, getattr(self, n) >= 1, "must be >= 1")
                  for n in ("sample_batch_size", "rm_batch_size", "rm_lora_r")]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule}.")


# Stage 3: 20 PPO steps of 16 rollouts (5 passes over the 64 train prompts). Time and results: docs/results.md.
RECIPE_DEFAULTS = dict(
    **CPU_DEFAULTS,
    output_dir="runs/three-stage",
    total_episodes=320,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,  # 16 rollouts per PPO step
    num_mini_batches=2,
    num_ppo_epochs=2,
    response_length=32,
    temperature=1.0,
    learning_rate=1e-3,
    kl_coef=0.05,
    **LORA_DEFAULTS,
    value_model_init="reward_model",  # the critic starts as a copy of the learned RM (InstructGPT)
    value_head_init="keep",  # ... head included: V(prefix) starts as the RM's score of the prefix
    eval_strategy="steps",
    eval_steps=4,
    per_device_eval_batch_size=16,
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelConfig]:
    script_args, args, model_args = parse_recipe_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)
    if args.eval_strategy == "no":
        raise ValueError("eval_strategy='no': this recipe's output is the held-out proxy-vs-gold evaluation; use "
                         "--eval_strategy steps with --eval_steps N.")
    if model_args.dtype not in ("float32", "auto", None):  # the RM stage (TRL's RewardTrainer) and PPO load float32
        raise ValueError(f"--dtype {model_args.dtype}: this recipe loads and trains every model in float32; drop "
                         "--dtype (the quickstart, recipes/ppo_smollm2_sentiment.py, takes --dtype bfloat16 --bf16 "
                         "true).")
    return script_args, args, model_args


def main(argv: list[str] | None = None) -> dict:
    wall_start = time.time()
    s, args, model_args = parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.monitoring.callbacks import append_jsonl
    from trl_ext.monitoring.report import format_proxy_gold_table, plot_proxy_vs_gold, proxy_gold_table, run_summary
    from trl_ext.scripts import clear_run_files, load_tokenizer, write_json
    from trl_ext.scripts.preferences import evaluate_reward_model, preference_data, train_reward_model
    from trl_ext.scripts.sentiment import load_prompts, prompt_dataset, vader_reward

    if s.num_threads:
        torch.set_num_threads(s.num_threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if removed := clear_run_files(out, RUN_FILES):
        print(f"[three-stage] removed {', '.join(removed)} of an earlier run in {out}", flush=True)
    model_path = model_args.model_name_or_path or str(smollm2_path())  # the first call converts the GGUF file (~20 s)
    tokenizer = load_tokenizer(model_path)  # SmolLM2 pads with its EOS token <|im_end|>
    policy = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompts = {"train": load_prompts("train")[:s.max_train_prompts or None],
               "test": load_prompts("test")[:s.max_test_prompts or None]}
    stage_s, K = {}, s.samples_per_prompt

    # 1. preference data: the policy's own samples, ranked by the gold scorer
    t0 = time.time()
    set_seed(args.seed)
    sampled, pairs = preference_data(policy, tokenizer, prompts, K, args, vader_reward, s.preference_margin, s.pairing,
                                     s.sample_batch_size)
    columns = ("prompt", "chosen", "rejected", "gold_chosen", "gold_rejected")
    for split, split_pairs in pairs.items():
        append_jsonl(out / PAIRS_FILE.format(split=split), [{k: p[k] for k in columns} for p in split_pairs])
    rows = sampled["train"]["rows"] + sampled["test"]["rows"]
    stopped_rate, gold_mean = sum(r["stopped"] for r in rows) / len(rows), sum(r["gold"] for r in rows) / len(rows)
    stage_s["1_preferences"] = time.time() - t0
    print(f"[three-stage] stage 1 (preference data): {len(rows)} completions of up to {args.response_length} tokens "
          f"({K} per prompt, {stopped_rate:.0%} stopped), gold mean {gold_mean:+.3f}; {len(pairs['train'])} train / "
          f"{len(pairs['test'])} held-out pairs in {stage_s['1_preferences']:.0f} s", flush=True)

    # 2. reward model: RewardTrainer + LoRA, merged
    t0 = time.time()
    reward_model, rm_tokenizer, trl_eval, rm_log = train_reward_model(model_path, pairs["train"], pairs["test"], s,
                                                                      args.seed, out, model_args.lora_target_modules)
    reward_model.save_pretrained(out / RM_DIR)
    rm_tokenizer.save_pretrained(out / RM_DIR)
    append_jsonl(out / RM_LOG_FILE, rm_log)  # (RUN_FILES were cleared at the start)
    rm = evaluate_reward_model(reward_model, tokenizer, sampled, pairs, trl_eval, rm_log)
    stage_s["2_reward_model"] = time.time() - t0
    print(f"[three-stage] stage 2 (reward model): {len(rm_log)} RewardTrainer steps, loss {rm['rm_first_loss']:.3f} "
          f"-> {rm['rm_last_loss']:.3f}; held-out pair accuracy {rm['rm_pair_accuracy']:.3f} (read as PPO reads it; "
          f"TRL's eval accuracy {rm['rm_trl_eval_accuracy']:.3f}), train {rm['rm_train_pair_accuracy']:.3f}, Pearson "
          f"r(RM, gold) on held-out samples {rm['rm_gold_pearson']:.3f}; saved to {out / RM_DIR} in "
          f"{stage_s['2_reward_model']:.0f} s", flush=True)

    # 3. PPO against the learned RM; the critic starts as a copy of it; VADER judges on held-out prompts
    t0 = time.time()
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy,
                         ref_model=None,  # the policy with its adapter disabled is the reference
                         reward_model=reward_model,  # shares the policy's tokenizer: read at the last real token
                         train_dataset=prompt_dataset("train").select(range(len(prompts["train"]))),
                         value_model=None,  # built from the RM (value_model_init)
                         eval_dataset=prompt_dataset("test").select(range(len(prompts["test"]))),
                         eval_reward=vader_reward,  # gold: evaluation only
                         peft_config=get_peft_config(model_args))
    print(f"[three-stage] stage 3 (PPO): {args.num_total_batches} steps x {args.batch_size} rollouts against the "
          f"learned RM, critic from the RM ({args.value_model_init}, head {args.value_head_init}), "
          f"response_length={args.response_length}, lr={args.learning_rate}, kl_coef={args.kl_coef}; held-out "
          f"eval (proxy + gold) before training and every {args.eval_steps} steps", flush=True)
    before = trainer.evaluate_policy()  # step 0: policy == reference, KL 0
    trainer.train()
    trainer.save_model(str(out))  # the policy's LoRA adapter
    tokenizer.save_pretrained(out)
    stage_s["3_ppo"] = time.time() - t0

    # 4. output: table, plot, dashboard, summary
    table = proxy_gold_table(trainer.state.log_history, before)
    train = run_summary(trainer.state.log_history)
    plot_proxy_vs_gold(table, out / PLOT_FILE, title=f"three-stage RLHF: {out.name}")
    if s.write_report:
        from trl_ext.monitoring.report import report

        report(out)  # writes dashboard.png
    peak, first, last = max(table, key=lambda r: r["gold_gain"]), table[0], table[-1]
    summary = {
        "wall_s": time.time() - wall_start, "stage_s": stage_s, "ppo_steps": train["steps"],
        "s_per_ppo_step": stage_s["3_ppo"] / max(1, train["steps"]), "samples_per_prompt": K,
        "preference_margin": s.preference_margin, "train_pairs": len(pairs["train"]), "test_pairs": len(pairs["test"]),
        "stopped_rate": stopped_rate, "gold_mean_samples": gold_mean, **rm,
        "first_eval_step": first["step"], "last_eval_step": last["step"],
        **{f"{k}_start": first[k] for k in ("kl", "proxy", "gold")},
        **{f"{k}_end": last[k] for k in ("kl", "proxy", "gold")},
        "proxy_gain_end": last["proxy_gain"], "gold_gain_end": last["gold_gain"],
        "gold_gain_peak": peak["gold_gain"], "gold_gain_peak_step": peak["step"],
        "train_score_first": train["first_score"], "train_score_last": train["last_score"],
        "train_kl_last": train["last_kl"],
        "eval_table": table, "output_dir": str(out),
        "files": [str(out / name) for name in RUN_FILES + (RM_DIR, "adapter_model.safetensors")
                  if (out / name).exists() or name == SUMMARY_FILE],
    }
    write_json(out / SUMMARY_FILE, summary)
    print(format_proxy_gold_table(table), flush=True)
    t = stage_s
    print(f"[three-stage] done in {summary['wall_s']:.0f} s: stage 1 {t['1_preferences']:.0f} s, stage 2 "
          f"{t['2_reward_model']:.0f} s, stage 3 {t['3_ppo']:.0f} s ({train['steps']} PPO steps); held out: gold gain "
          f"over the reference {last['gold_gain']:+.3f} at KL {last['kl']:.2f} (peak {peak['gold_gain']:+.3f} at step "
          f"{peak['step']}), proxy gain {last['proxy_gain']:+.3f}; files: {', '.join(summary['files'])}", flush=True)
    return summary


if __name__ == "__main__":
    main()
