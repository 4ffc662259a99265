"""The three-stage RLHF pipeline on CPU: preference data, a learned reward model, PPO against it, a gold judge.

The gold scorer is VADER sentiment (`sentiment.vader_reward`: the compound score of the completion, in [-1, 1]). It
plays the part of the human labellers: it ranks samples in stage 1 and judges the policy in stage 3, but PPO never
trains on it. PPO trains on a reward model learned from the gold scorer's rankings, so the run shows what InstructGPT's
pipeline shows at scale (Gao et al. 2022, "Scaling laws for reward model overoptimization"): the proxy reward keeps
rising with the KL to the reference while the gold reward rises less, stalls or falls.

Stage 1, preference data: the policy (SmolLM2-135M-Instruct, `trl_ext.embedded.smollm2_path()`) samples
  `samples_per_prompt` completions for each opinion prompt of `recipes/data/opinion_prompts.jsonl` (64 "train",
  16 held-out "test", rendered with the chat template exactly as PPOTrainer renders them, sampled with trl_ext's PPO
  sampler at the PPO `response_length` and `temperature`), VADER scores them, and `build_preference_pairs` pairs
  completions of the same prompt whose gold scores differ by more than `preference_margin` (ties dropped). The pairs
  are a TRL preference dataset: "prompt"/"chosen"/"rejected" text, plus "chosen_ids"/"rejected_ids" (see below).
Stage 2, reward model: `trl.RewardTrainer` trains SmolLM2 as a sequence classifier (`num_labels=1`) with a LoRA adapter
  (`LoraConfig(task_type="SEQ_CLS")`; the `score` head is trained in full) on the train pairs (Bradley-Terry loss).
  The adapter is merged (`merge_and_unload`) and the RM saved to `output_dir/reward_model`. Reported: pair accuracy on
  the held-out pairs (from the "test" prompts) as PPO reads the RM, TRL's own eval accuracy, and the correlation of
  RM and gold scores on the held-out samples.
Stage 3, PPO: `trl_ext.PPOTrainer` with a LoRA policy (reference = adapter disabled) against the learned RM, the
  critic initialised from the RM (`value_model_init="reward_model"`, head kept: V starts as the RM's reading of each
  prefix; only its top `value_trainable_layers` layers train). Every `eval_steps` steps (and once before training),
  `PPOTrainer.evaluate_policy` samples policy and reference completions for the held-out prompts and scores both with
  the RM (eval/score: proxy) and with VADER (eval/gold_score: gold), with eval/kl the policy's KL to the reference.

Two details make the RM read text the way PPO's scorer does (`trl_ext/rewards.py`, kind (a): the RM's score at the last
real token of prompt + response, the `<|im_end|>` stop token when the response stopped):
  - By default (`rm_inputs="sampled_ids"`) the RM trains on the sampled token ids themselves (TRL's pre-tokenized
    preference columns `chosen_ids`/`rejected_ids`). TRL's text path (`rm_inputs="text"`) re-tokenizes prompt +
    completion and appends EOS to every completion, also to those cut off at `response_length`, which PPO reads at
    their last token without an EOS; with `response_length=32` most of SmolLM2's reviews are cut off.
  - The RM pads with `rm_pad_token` (`<|endoftext|>`), not with EOS. A transformers sequence classifier pools at the
    last token that is not `config.pad_token_id`; with pad == EOS (`<|im_end|>`) it would read the token *before* the
    final `<|im_end|>` during RM training, while PPO reads the `<|im_end|>` itself.

It writes to `--output_dir` (default `runs/three-stage`):
  preferences_train.jsonl, preferences_test.jsonl   the pairs (prompt, chosen, rejected, their gold scores)
  reward_trainer_log.jsonl                          RewardTrainer's log lines (loss, accuracy, margin per step)
  reward_model/                                     the merged RM (safetensors) and its tokenizer (pad <|endoftext|>)
  metrics.jsonl                                     PPO metrics per step; eval/* on evaluation steps
  proxy_vs_gold.png                                 proxy and gold reward gains over the reference against KL
  dashboard.png                                     the `trl-ext report` dashboard
  summary.json                                      the summary below, with the evaluation table
  adapter_config.json, adapter_model.safetensors    the PPO policy's LoRA adapter

Run it (time and results measured: docs/results.md; the first run also converts the model once, ~20 s):

    python recipes/ppo_three_stage.py --output_dir runs/three-stage

Every `trl_ext.PPOConfig` field is a flag (`--total_episodes 320`, `--kl_coef 0.1`, `--eval_steps 4`, ...), as are the
fields of `ScriptArguments` below (`--samples_per_prompt 4`, `--rm_epochs 3`, `--rm_learning_rate 5e-4`, ...). A
shortened end-to-end run (what the tests run, ~1 minute):

    python recipes/ppo_three_stage.py --output_dir /tmp/three-stage-quick --max_train_prompts 16 \\
        --max_test_prompts 4 --samples_per_prompt 2 --response_length 12 --rm_epochs 1 --total_episodes 8 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --num_mini_batches 1 --num_ppo_epochs 1 \\
        --eval_steps 1 --write_report false
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
from transformers import HfArgumentParser  # noqa: E402

from trl_ext import PPOConfig  # noqa: E402

METRICS_FILE = "metrics.jsonl"  # trl_ext.callbacks.METRICS_FILE
DASHBOARD_FILE = "dashboard.png"  # trl_ext.report.DASHBOARD_FILE
PLOT_FILE = "proxy_vs_gold.png"
SUMMARY_FILE = "summary.json"
RM_DIR = "reward_model"
RM_LOG_FILE = "reward_trainer_log.jsonl"
PAIRS_FILE = "preferences_{split}.jsonl"
PAIRINGS = ("all", "best_worst")
RM_INPUTS = ("sampled_ids", "text")
# Files of an earlier run into the same folder that this run rewrites (metrics.jsonl is appended to by the trainer,
# so a stale one would mix two runs).
_RUN_FILES = (METRICS_FILE, "samples.jsonl", DASHBOARD_FILE, PLOT_FILE, SUMMARY_FILE, RM_LOG_FILE,
              PAIRS_FILE.format(split="train"), PAIRS_FILE.format(split="test"))


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig fields. Stage 1 samples with PPOConfig's `response_length`,
    `temperature` and `seed`, so the RM is trained on text like the text PPO starts from."""

    # Stage 1: preference data
    samples_per_prompt: int = field(
        default=4, metadata={"help": "Completions sampled per prompt (K) to rank with the gold scorer; >= 2."})
    preference_margin: float = field(
        default=0.2,
        metadata={"help": "Pair two completions of a prompt only if their gold (VADER) scores differ by more than "
                  "this (ties are always dropped). VADER scores lie in [-1, 1]."},
    )
    pairing: str = field(
        default="all",
        metadata={"help": "'all': every pair of a prompt's completions that passes the margin (up to K(K-1)/2 per "
                  "prompt); 'best_worst': only the best against the worst."},
    )
    max_train_prompts: int = field(default=0, metadata={"help": "Use only the first N train prompts (0: all 64)."})
    max_test_prompts: int = field(default=0, metadata={"help": "Use only the first N test prompts (0: all 16)."})
    sample_batch_size: int = field(default=64, metadata={"help": "Sequences per generate() call in stage 1."})
    # Stage 2: reward model
    rm_epochs: float = field(default=1.0, metadata={"help": "RewardTrainer epochs over the train pairs."})
    rm_learning_rate: float = field(default=1e-3, metadata={"help": "RewardTrainer learning rate (LoRA + head)."})
    rm_batch_size: int = field(default=8, metadata={"help": "Preference pairs per RewardTrainer step."})
    rm_lora_r: int = field(default=16, metadata={"help": "LoRA rank of the reward model."})
    rm_lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha of the reward model."})
    rm_lora_layers: int = field(
        default=-1,
        metadata={"help": "Put the RM's LoRA only on its top N decoder layers (-1: all layers). Fewer layers cut "
                  "the backward pass's CPU time."},
    )
    rm_center_rewards_coefficient: float | None = field(
        default=0.01,
        metadata={"help": "RewardConfig.center_rewards_coefficient: pulls the RM's scores towards mean 0 "
                  "(Eisenstein et al. 2023); None: off."},
    )
    rm_inputs: str = field(
        default="sampled_ids",
        metadata={"help": "'sampled_ids': the RM trains on the sampled token ids (what PPO's scorer reads); 'text': "
                  "RewardTrainer re-tokenizes prompt + completion and appends EOS to every completion."},
    )
    rm_pad_token: str = field(
        default="<|endoftext|>",
        metadata={"help": "Pad token of the RM (must differ from EOS, so the classifier pools at the final EOS)."},
    )
    # Stage 3: PPO
    lora_r: int = field(default=8, metadata={"help": "LoRA rank of the policy."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha of the policy (scale = alpha / r)."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names for LoRA (policy and RM), or 'all-linear'."},
    )
    value_trainable_layers: int = field(
        default=2,
        metadata={"help": "Train only the top N decoder layers (plus final norm and score head) of the critic; "
                  "-1 trains all of it (about twice the CPU time per step)."},
    )
    # Everything
    model_path: str | None = field(
        default=None, metadata={"help": "A local model folder; default: SmolLM2-135M-Instruct via smollm2_path()."})
    num_threads: int = field(
        default=0,
        metadata={"help": "torch.set_num_threads (0: torch's default). On a CPU shared with other jobs, 1 can be "
                  "several times faster than oversubscribed threads."},
    )
    write_report: bool = field(
        default=True, metadata={"help": "Also write the `trl-ext report` dashboard.png (needs matplotlib)."})


# Time and results: docs/results.md. Stage 1: 80 prompts x 4 samples of up to 32 tokens; stage 2:
# 1 epoch over the train pairs (up to 6 per prompt); stage 3: 20 PPO steps of 16 rollouts (5 passes over the 64
# train prompts) at learning_rate 1e-3 and kl_coef 0.05 (as ppo_smollm2_sentiment.py), held-out evaluation every 4
# steps.
RECIPE_DEFAULTS = dict(
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
    value_model_init="reward_model",  # the critic starts as a copy of the learned RM (InstructGPT)
    value_head_init="keep",  # ... head included: V(prefix) starts as the RM's score of the prefix
    eval_strategy="steps",
    eval_steps=4,
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
    s = script_args
    if s.samples_per_prompt < 2:
        raise ValueError(f"samples_per_prompt={s.samples_per_prompt}: a preference pair needs at least 2 completions "
                         "of a prompt; use 2 or more.")
    if s.pairing not in PAIRINGS:
        raise ValueError(f"pairing={s.pairing!r} is not one of {PAIRINGS}.")
    if s.rm_inputs not in RM_INPUTS:
        raise ValueError(f"rm_inputs={s.rm_inputs!r} is not one of {RM_INPUTS}.")
    for name in ("max_train_prompts", "max_test_prompts", "num_threads"):
        if getattr(s, name) < 0:
            meaning = "all" if "prompts" in name else "default"
            raise ValueError(f"{name}={getattr(s, name)} must be >= 0 (0: {meaning}).")
    for name in ("sample_batch_size", "rm_batch_size", "rm_lora_r"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name}={getattr(s, name)} must be >= 1.")
    if not s.rm_epochs > 0:
        raise ValueError(f"rm_epochs={s.rm_epochs} must be > 0.")
    if not s.preference_margin >= 0:
        raise ValueError(f"preference_margin={s.preference_margin} must be >= 0 (a gold-score difference).")
    if args.eval_strategy == "no":
        raise ValueError("eval_strategy='no': this recipe's output is the held-out proxy-vs-gold evaluation; use "
                         "--eval_strategy steps with --eval_steps N.")
    return script_args, args


# ------------------------------------------------------------------------------------------- stage 1: preference data


def build_preference_pairs(prompts: list[str], completions: list[list[str]], scores: list[list[float]],
                           margin: float = 0.0, pairing: str = "all", split: str = "train") -> list[dict]:
    """Preference pairs from gold-scored completions, in TRL's preference format (explicit prompt).

    prompts: P prompts; completions[p], scores[p]: the completions of prompt p and their gold scores (same length).
    For each prompt, two completions a, b (a before b) make a pair if |score_a - score_b| > margin; the higher-scored
    one is "chosen". Ties never make a pair (not even with margin=0). `pairing="best_worst"` keeps at most one pair
    per prompt: its best completion against its worst (the first of equal scores), if they differ by more than margin.

    Returns a list of dicts with "prompt", "chosen", "rejected", "gold_chosen", "gold_rejected", "prompt_index",
    "chosen_index", "rejected_index" (indices into `prompts` and `completions[p]`), in prompt order, then (a, b)
    order. Raises ValueError on mismatched lengths, a non-finite score, a negative margin, or when no pair passes
    the margin (the message says how to get pairs).
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not one of {PAIRINGS}.")
    if not margin >= 0:  # also rejects NaN
        raise ValueError(f"margin={margin} must be >= 0: it is a difference of gold scores.")
    if not (len(prompts) == len(completions) == len(scores)):
        raise ValueError(f"Got {len(prompts)} prompts, {len(completions)} completion lists and {len(scores)} score "
                         "lists; give one completion list and one score list per prompt.")
    pairs = []
    for p, (prompt, texts, values) in enumerate(zip(prompts, completions, scores)):
        if len(texts) != len(values):
            raise ValueError(f"Prompt {p} has {len(texts)} completions but {len(values)} scores; give one score per "
                             "completion.")
        values = [float(v) for v in values]
        bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"Prompt {p} has non-finite gold scores {bad} (index, value); the gold scorer must "
                             "return finite numbers.")
        if pairing == "best_worst":
            if len(values) < 2:
                continue
            best = max(range(len(values)), key=lambda i: (values[i], -i))
            worst = min(range(len(values)), key=lambda i: (values[i], i))
            candidates = [(min(best, worst), max(best, worst))]
        else:
            candidates = [(a, b) for a in range(len(values)) for b in range(a + 1, len(values))]
        for a, b in candidates:
            diff = values[a] - values[b]
            if diff == 0 or abs(diff) <= margin:
                continue
            hi, lo = (a, b) if diff > 0 else (b, a)
            pairs.append({"prompt": prompt, "chosen": texts[hi], "rejected": texts[lo], "gold_chosen": values[hi],
                          "gold_rejected": values[lo], "prompt_index": p, "chosen_index": hi, "rejected_index": lo})
    if not pairs:
        n = sum(len(texts) for texts in completions)
        raise ValueError(f"No preference pair in the {split!r} split: none of the {n} completions of {len(prompts)} "
                         f"prompts differ in gold score by more than margin={margin} (ties never pair). Lower "
                         "--preference_margin, sample more completions per prompt (--samples_per_prompt), use more "
                         "prompts, or sample longer or more varied completions (--response_length, --temperature).")
    return pairs


def sample_completions(policy, tokenizer, split: str, max_prompts: int, args: PPOConfig, script_args) -> dict:
    """Stage 1 sampling for one split: each prompt rendered as PPOTrainer renders it (trl_ext.prompts) and sampled
    `samples_per_prompt` times with trl_ext's PPO sampler; VADER scores the completions as PPO passes them to a reward
    function (decoded without special tokens, cut after the stop token).

    Returns prompts (P user messages), rows ((P*K) dicts: prompt_index, query_ids, response_ids, completion,
    completion_text (special tokens kept: "<|im_end|>" if it stopped), prompt_text, gold, stopped) and the padded
    tensors queries (P*K, Q), query_mask, responses (P*K, T), response_mask, for scoring with the RM later."""

    from trl_ext.core import response_mask_from_stop
    from trl_ext.models import Sampling, generate_responses
    from trl_ext.prompts import LeftPaddingCollator, prepare_prompts

    prompts = sentiment.load_prompts(split)
    if max_prompts:
        prompts = prompts[:max_prompts]
    dataset = sentiment.prompt_dataset(split).select(range(len(prompts)))
    prepared = prepare_prompts(dataset, tokenizer, args.max_prompt_length, args.prompt_truncation).dataset
    K = script_args.samples_per_prompt
    batch = LeftPaddingCollator(tokenizer)([prepared[p] for p in range(len(prompts)) for _ in range(K)])
    queries, query_mask = batch["input_ids"], batch["attention_mask"].bool()  # (P*K, Q), prompt p's rows together
    sampling = Sampling(args.response_length, args.temperature, tokenizer.eos_token_id)
    responses, _ = generate_responses(policy, queries, query_mask, sampling, script_args.sample_batch_size)  # (P*K, T)
    response_mask = response_mask_from_stop(responses, tokenizer.eos_token_id)
    completions = tokenizer.batch_decode([r[m] for r, m in zip(responses, response_mask)], skip_special_tokens=True)
    gold = sentiment.vader_reward([prompts[i // K] for i in range(len(completions))], completions)
    rows = []
    for i, (q, qm, r, rm) in enumerate(zip(queries, query_mask, responses, response_mask)):
        query_ids, response_ids = q[qm].tolist(), r[rm].tolist()
        rows.append({"prompt_index": i // K, "query_ids": query_ids, "response_ids": response_ids,
                     "prompt_text": tokenizer.decode(query_ids), "completion": completions[i],
                     "completion_text": tokenizer.decode(response_ids), "gold": gold[i],
                     "stopped": bool((r[rm] == tokenizer.eos_token_id).any())})
    return {"prompts": prompts, "rows": rows, "queries": queries, "query_mask": query_mask,
            "responses": responses, "response_mask": response_mask}


def preference_pairs(sampled: dict, K: int, margin: float, pairing: str, split: str) -> list[dict]:
    """`build_preference_pairs` over one split's samples, each pair with the prompt in text form (the rendered chat
    template), the completions' text (special tokens kept) and TRL's pre-tokenized columns chosen_ids/rejected_ids
    (prompt + completion ids exactly as sampled), and "row_chosen"/"row_rejected" (indices into sampled["rows"])."""
    rows = sampled["rows"]
    P = len(sampled["prompts"])
    pairs = build_preference_pairs(
        sampled["prompts"],
        [[rows[p * K + k]["completion"] for k in range(K)] for p in range(P)],
        [[rows[p * K + k]["gold"] for k in range(K)] for p in range(P)],
        margin=margin, pairing=pairing, split=split)
    out = []
    for pair in pairs:
        chosen = rows[pair["prompt_index"] * K + pair["chosen_index"]]
        rejected = rows[pair["prompt_index"] * K + pair["rejected_index"]]
        out.append({"prompt": chosen["prompt_text"], "chosen": chosen["completion_text"],
                    "rejected": rejected["completion_text"], "gold_chosen": pair["gold_chosen"],
                    "gold_rejected": pair["gold_rejected"],
                    "chosen_ids": chosen["query_ids"] + chosen["response_ids"],
                    "rejected_ids": rejected["query_ids"] + rejected["response_ids"],
                    "row_chosen": pair["prompt_index"] * K + pair["chosen_index"],
                    "row_rejected": pair["prompt_index"] * K + pair["rejected_index"]})
    return out


# ---------------------------------------------------------------------------------------------- stage 2: reward model


def train_reward_model(model_path: str, train_pairs: list[dict], test_pairs: list[dict], args: PPOConfig,
                       script_args, output_dir: Path):
    """RewardTrainer with LoRA (SEQ_CLS) on the train pairs; returns (merged RM, its tokenizer, TRL's held-out eval
    metrics, RewardTrainer's log lines)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    s = script_args
    rm_tokenizer = AutoTokenizer.from_pretrained(model_path)
    if s.rm_pad_token not in rm_tokenizer.get_vocab():
        raise ValueError(f"rm_pad_token={s.rm_pad_token!r} is not in the tokenizer's vocabulary; pass a token it has "
                         f"(not its EOS {rm_tokenizer.eos_token!r}).")
    if s.rm_pad_token == rm_tokenizer.eos_token:
        raise ValueError(f"rm_pad_token={s.rm_pad_token!r} is the EOS token: the classifier would pool at the token "
                         "before the final EOS, while PPO reads the EOS itself. Pass another token.")
    rm_tokenizer.pad_token = s.rm_pad_token
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    model.config.pad_token_id = rm_tokenizer.pad_token_id

    targets = s.lora_target_modules
    num_layers = model.config.num_hidden_layers
    peft_config = LoraConfig(
        task_type="SEQ_CLS",  # peft then trains the `score` head in full (modules_to_save)
        r=s.rm_lora_r,
        lora_alpha=s.rm_lora_alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        layers_to_transform=None if s.rm_lora_layers < 0 else list(range(num_layers - s.rm_lora_layers, num_layers)),
    )
    columns = ["prompt", "chosen", "rejected"] + (["chosen_ids", "rejected_ids"] if s.rm_inputs == "sampled_ids"
                                                  else [])

    def dataset(pairs):
        return Dataset.from_dict({c: [pair[c] for pair in pairs] for c in columns})

    config = RewardConfig(
        output_dir=str(output_dir / "reward_trainer"),
        num_train_epochs=s.rm_epochs,
        per_device_train_batch_size=s.rm_batch_size,
        per_device_eval_batch_size=max(1, len(test_pairs)),  # one batch: TRL's eval accuracy is then exact
        learning_rate=s.rm_learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        center_rewards_coefficient=s.rm_center_rewards_coefficient,
        max_length=None,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = RewardTrainer(model=model, args=config, train_dataset=dataset(train_pairs), processing_class=rm_tokenizer,
                            peft_config=peft_config)
    trainer.train()
    held_out = trainer.evaluate(dataset(test_pairs))
    log = [entry for entry in trainer.state.log_history if "loss" in entry]
    reward_model = trainer.model.merge_and_unload()
    reward_model.eval()
    return reward_model, rm_tokenizer, held_out, log


def pair_accuracy(scores: list[float], pairs: list[dict]) -> float:
    """Share of pairs whose chosen completion the RM scores higher than the rejected one (ties count half)."""
    wins = [1.0 if scores[p["row_chosen"]] > scores[p["row_rejected"]] else
            0.5 if scores[p["row_chosen"]] == scores[p["row_rejected"]] else 0.0 for p in pairs]
    return sum(wins) / len(wins) if wins else math.nan


def pearson(x: list[float], y: list[float]) -> float:
    n = len(x)
    if n < 2:
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


# -------------------------------------------------------------------------------------------------- stage 3 and output


def eval_table(log_history: list[dict], before: dict | None = None) -> list[dict]:
    """One row per held-out evaluation: step, kl, proxy/gold scores of policy and reference, their gains (policy minus
    reference, same prompts and random numbers) and win rates. `before`: an evaluation at step 0."""
    entries = ([{**before, "step": 0}] if before else []) + [e for e in log_history if "eval/gold_score" in e]
    table = []
    for e in entries:
        table.append({
            "step": int(e["step"]),
            "kl": float(e["eval/kl"]),
            "proxy": float(e["eval/score"]),
            "proxy_ref": float(e["eval/score_ref"]),
            "proxy_gain": float(e["eval/score"]) - float(e["eval/score_ref"]),
            "gold": float(e["eval/gold_score"]),
            "gold_ref": float(e["eval/gold_score_ref"]),
            "gold_gain": float(e["eval/gold_score"]) - float(e["eval/gold_score_ref"]),
            "proxy_win_rate": float(e["eval/win_rate_vs_ref"]),
            "gold_win_rate": float(e["eval/gold_win_rate_vs_ref"]),
        })
    return table


def format_table(table: list[dict]) -> str:
    lines = [f"{'step':>5} {'KL':>7} {'proxy':>8} {'Δproxy':>8} {'gold':>7} {'Δgold':>7} {'win(proxy)':>10} "
             f"{'win(gold)':>9}"]
    for r in table:
        lines.append(f"{r['step']:>5} {r['kl']:>7.2f} {r['proxy']:>+8.3f} {r['proxy_gain']:>+8.3f} {r['gold']:>+7.3f} "
                     f"{r['gold_gain']:>+7.3f} {r['proxy_win_rate']:>10.3f} {r['gold_win_rate']:>9.3f}")
    return "\n".join(lines)


def plot_proxy_vs_gold(table: list[dict], path, title: str = "") -> None:
    """Left: proxy (RM) and gold (VADER) gains over the reference against KL, on their own axes (the RM's scale is
    arbitrary). Right: the raw held-out scores of policy and reference over PPO steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_steps) = plt.subplots(1, 2, figsize=(12, 4.5))
    kl = [r["kl"] for r in table]
    ax.plot(kl, [r["proxy_gain"] for r in table], "o-", color="tab:blue", label="proxy (learned RM)")
    ax.set_xlabel("KL(policy ‖ reference), nats per completion (held out)")
    ax.set_ylabel("proxy reward gain over reference", color="tab:blue")
    ax.axhline(0.0, color="gray", lw=0.8)
    for r in table:
        ax.annotate(str(r["step"]), (r["kl"], r["proxy_gain"]), textcoords="offset points", xytext=(3, 3),
                    fontsize=7, color="tab:blue")
    gold_ax = ax.twinx()
    gold_ax.plot(kl, [r["gold_gain"] for r in table], "s--", color="tab:red", label="gold (VADER)")
    gold_ax.set_ylabel("gold reward gain over reference", color="tab:red")
    handles = ax.get_legend_handles_labels()[0] + gold_ax.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    ax.set_title("Proxy vs gold reward as KL grows (labels: PPO step)")
    ax.grid(True, alpha=0.3)

    steps = [r["step"] for r in table]
    ax_steps.plot(steps, [r["proxy"] for r in table], "o-", color="tab:blue", label="proxy, policy")
    ax_steps.plot(steps, [r["proxy_ref"] for r in table], "o:", color="tab:blue", alpha=0.5, label="proxy, reference")
    ax_steps.set_xlabel("PPO step")
    ax_steps.set_ylabel("proxy (RM) score", color="tab:blue")
    gold_steps = ax_steps.twinx()
    gold_steps.plot(steps, [r["gold"] for r in table], "s--", color="tab:red", label="gold, policy")
    gold_steps.plot(steps, [r["gold_ref"] for r in table], "s:", color="tab:red", alpha=0.5, label="gold, reference")
    gold_steps.set_ylabel("gold (VADER) score", color="tab:red")
    handles = ax_steps.get_legend_handles_labels()[0] + gold_steps.get_legend_handles_labels()[0]
    ax_steps.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    ax_steps.set_title("Held-out scores over steps")
    ax_steps.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clear_stale_run_files(output_dir: Path) -> list[str]:
    removed = []
    for name in _RUN_FILES:
        if (output_dir / name).is_file():
            (output_dir / name).unlink()
            removed.append(name)
    return removed


def _write_jsonl(path: Path, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def format_summary(s: dict) -> str:
    t = s["stage_s"]
    return "\n".join([
        f"[three-stage] done in {s['wall_s']:.0f} s: stage 1 {t['1_preferences']:.0f} s, stage 2 "
        f"{t['2_reward_model']:.0f} s, stage 3 {t['3_ppo']:.0f} s ({s['ppo_steps']} PPO steps)",
        f"  preference pairs: {s['train_pairs']} train / {s['test_pairs']} held out (gold margin "
        f"{s['preference_margin']}); completions that stopped before response_length: {s['stopped_rate']:.2f}",
        f"  reward model: held-out pair accuracy {s['rm_pair_accuracy']:.3f} (read as PPO reads it; TRL's eval "
        f"accuracy {s['rm_trl_eval_accuracy']:.3f}), train pair accuracy {s['rm_train_pair_accuracy']:.3f}, "
        f"Pearson r(RM, gold) on held-out samples {s['rm_gold_pearson']:.3f}; loss {s['rm_first_loss']:.3f} -> "
        f"{s['rm_last_loss']:.3f}",
        f"  held out, step {s['first_eval_step']} -> {s['last_eval_step']}: KL {s['kl_start']:.2f} -> "
        f"{s['kl_end']:.2f}; proxy {s['proxy_start']:+.3f} -> {s['proxy_end']:+.3f} (gain over reference "
        f"{s['proxy_gain_end']:+.3f}); gold {s['gold_start']:+.3f} -> {s['gold_end']:+.3f} (gain over reference "
        f"{s['gold_gain_end']:+.3f}, peak {s['gold_gain_peak']:+.3f} at step {s['gold_gain_peak_step']})",
        "  files: " + ", ".join(s["files"]),
    ])


def main(argv: list[str] | None = None) -> dict:
    wall_start = time.time()
    script_args, args = parse_args(argv)
    s = script_args

    import torch
    from peft import LoraConfig
    from ppo_smollm2_lora import freeze_value_backbone
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.rewards import score_responses

    if s.num_threads:
        torch.set_num_threads(s.num_threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    removed = _clear_stale_run_files(out)
    if removed:
        print(f"[three-stage] removed {', '.join(removed)} of an earlier run in {out}", flush=True)
    model_path = s.model_path or str(smollm2_path())  # the first call converts the GGUF file (~20 s)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # SmolLM2 already pads with its EOS token <|im_end|>
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    policy.eval()
    stage_s = {}

    # 1. preference data: the policy's own samples, ranked by the gold scorer
    t0 = time.time()
    K = s.samples_per_prompt
    set_seed(args.seed)
    sampled = {split: sample_completions(policy, tokenizer, split, limit, args, s)
               for split, limit in (("train", s.max_train_prompts), ("test", s.max_test_prompts))}
    pairs = {split: preference_pairs(sampled[split], K, s.preference_margin, s.pairing, split)
             for split in ("train", "test")}
    for split, split_pairs in pairs.items():
        _write_jsonl(out / PAIRS_FILE.format(split=split),
                     [{k: p[k] for k in ("prompt", "chosen", "rejected", "gold_chosen", "gold_rejected")}
                      for p in split_pairs])
    all_rows = sampled["train"]["rows"] + sampled["test"]["rows"]
    stopped_rate = sum(r["stopped"] for r in all_rows) / len(all_rows)
    stage_s["1_preferences"] = time.time() - t0
    print(f"[three-stage] stage 1 (preference data): {len(all_rows)} completions of up to {args.response_length} "
          f"tokens ({K} per prompt, {stopped_rate:.0%} stopped), gold mean "
          f"{sum(r['gold'] for r in all_rows) / len(all_rows):+.3f}; {len(pairs['train'])} train / "
          f"{len(pairs['test'])} held-out pairs in {stage_s['1_preferences']:.0f} s", flush=True)

    # 2. reward model: RewardTrainer + LoRA, merged
    t0 = time.time()
    reward_model, rm_tokenizer, trl_eval, rm_log = train_reward_model(model_path, pairs["train"], pairs["test"], args,
                                                                      s, out)
    reward_model.save_pretrained(out / RM_DIR)
    rm_tokenizer.save_pretrained(out / RM_DIR)
    _write_jsonl(out / RM_LOG_FILE, rm_log)
    device = next(reward_model.parameters()).device  # RewardTrainer may have moved it to an accelerator
    with torch.no_grad():  # the RM's score as PPO's scorer reads it: the policy's ids, the last real token
        rm_scores = {split: score_responses(reward_model, tokenizer, *(d[k].to(device) for k in (
            "queries", "query_mask", "responses", "response_mask"))).tolist() for split, d in sampled.items()}
    rm_pair_accuracy = pair_accuracy(rm_scores["test"], pairs["test"])
    rm_train_pair_accuracy = pair_accuracy(rm_scores["train"], pairs["train"])
    rm_gold_pearson = pearson(rm_scores["test"], [r["gold"] for r in sampled["test"]["rows"]])
    stage_s["2_reward_model"] = time.time() - t0
    print(f"[three-stage] stage 2 (reward model): {len(rm_log)} RewardTrainer steps, loss {rm_log[0]['loss']:.3f} -> "
          f"{rm_log[-1]['loss']:.3f}; held-out pair accuracy {rm_pair_accuracy:.3f} (TRL eval_accuracy "
          f"{trl_eval.get('eval_accuracy', math.nan):.3f}), train {rm_train_pair_accuracy:.3f}, Pearson r(RM, gold) "
          f"{rm_gold_pearson:.3f}; saved to {out / RM_DIR} in {stage_s['2_reward_model']:.0f} s", flush=True)

    # 3. PPO against the learned RM; the critic starts as a copy of it; VADER judges on held-out prompts
    t0 = time.time()
    # PPOTrainer deep-copies the RM into the critic (value_model_init="reward_model"), trainable flags included, so
    # the critic's trainable layers are chosen here, on the RM (merge_and_unload left the RM's backbone frozen).
    reward_model.requires_grad_(True)
    freeze_value_backbone(reward_model, s.value_trainable_layers)
    targets = s.lora_target_modules
    peft_config = LoraConfig(
        r=s.lora_r,
        lora_alpha=s.lora_alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    test_prompts = sampled["test"]["prompts"]
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # the policy with its adapter disabled is the reference
        reward_model=reward_model,  # shares the policy's tokenizer: read at the last real token of its ids
        train_dataset=sentiment.prompt_dataset("train").select(range(len(sampled["train"]["prompts"]))),
        value_model=None,  # built from the RM (args.value_model_init)
        eval_dataset=sentiment.prompt_dataset("test").select(range(len(test_prompts))),
        eval_reward=sentiment.vader_reward,  # gold: evaluation only
        peft_config=peft_config,
    )
    reward_model.requires_grad_(False)  # the RM itself only scores; the critic is its own copy
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
    table = eval_table(trainer.state.log_history, before)
    steps = [e for e in trainer.state.log_history if "objective/scores" in e]
    plot_proxy_vs_gold(table, out / PLOT_FILE, title=f"three-stage RLHF: {out.name}")
    if s.write_report:
        from trl_ext.report import report

        report(out)  # writes dashboard.png
    peak = max(table, key=lambda r: r["gold_gain"])
    files = [str(out / name) for name in (PAIRS_FILE.format(split="train"), PAIRS_FILE.format(split="test"),
                                          RM_LOG_FILE, RM_DIR, METRICS_FILE, PLOT_FILE, DASHBOARD_FILE,
                                          SUMMARY_FILE, "adapter_model.safetensors")
             if (out / name).exists() or name == SUMMARY_FILE]
    summary = {
        "wall_s": time.time() - wall_start,
        "stage_s": stage_s,
        "ppo_steps": len(steps),
        "s_per_ppo_step": stage_s["3_ppo"] / max(1, len(steps)),
        "samples_per_prompt": K,
        "preference_margin": s.preference_margin,
        "train_pairs": len(pairs["train"]),
        "test_pairs": len(pairs["test"]),
        "stopped_rate": stopped_rate,
        "gold_mean_samples": sum(r["gold"] for r in all_rows) / len(all_rows),
        "rm_steps": len(rm_log),
        "rm_first_loss": float(rm_log[0]["loss"]),
        "rm_last_loss": float(rm_log[-1]["loss"]),
        "rm_pair_accuracy": rm_pair_accuracy,
        "rm_train_pair_accuracy": rm_train_pair_accuracy,
        "rm_trl_eval_accuracy": float(trl_eval.get("eval_accuracy", math.nan)),
        "rm_trl_eval_loss": float(trl_eval.get("eval_loss", math.nan)),
        "rm_gold_pearson": rm_gold_pearson,
        "first_eval_step": table[0]["step"],
        "last_eval_step": table[-1]["step"],
        "kl_start": table[0]["kl"],
        "kl_end": table[-1]["kl"],
        "proxy_start": table[0]["proxy"],
        "proxy_end": table[-1]["proxy"],
        "proxy_gain_end": table[-1]["proxy_gain"],
        "gold_start": table[0]["gold"],
        "gold_end": table[-1]["gold"],
        "gold_gain_end": table[-1]["gold_gain"],
        "gold_gain_peak": peak["gold_gain"],
        "gold_gain_peak_step": peak["step"],
        "train_score_first": float(steps[0]["objective/scores"]) if steps else math.nan,
        "train_score_last": float(steps[-1]["objective/scores"]) if steps else math.nan,
        "train_kl_last": float(steps[-1]["objective/kl"]) if steps else math.nan,
        "eval_table": table,
        "output_dir": str(out),
        "files": files,
    }
    with open(out / SUMMARY_FILE, "w") as f:
        json.dump(summary, f, indent=2)
    print(format_table(table), flush=True)
    print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
