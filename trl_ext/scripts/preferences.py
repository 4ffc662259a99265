"""Preference data from a gold scorer, for training a reward model (the first two stages of RLHF), and how well a
reward model reads it. recipes/ppo_three_stage.py runs the pipeline.

- `sample_completions`: K completions per prompt from a policy, rendered and sampled exactly as PPOTrainer does (its
  prompt preparation and sampler), scored by a gold reward function.
- `build_preference_pairs` / `preference_pairs`: pairs of completions of the same prompt whose gold scores differ by
  more than a margin, as TRL preference rows ("prompt"/"chosen"/"rejected", and the sampled token ids
  "chosen_ids"/"rejected_ids").
- `train_reward_model`: TRL's RewardTrainer with LoRA on those pairs, padded so the RM reads as PPO's scorer.
- `pair_accuracy`, `pearson`: the reward model against the pairs and the gold scores.
"""

from __future__ import annotations

import math
import os
import statistics

PAIRINGS = ("all", "best_worst")


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



def sample_completions(policy, tokenizer, prompts: list[str], K: int, args, gold, batch_size: int = 64) -> dict:
    """`K` completions of each of `prompts` (user messages, rendered with the chat template as PPOTrainer renders a
    conversational prompt: trl_ext.data.prompts), sampled with trl_ext's PPO sampler at `args.response_length` and
    `args.temperature`; `gold(prompts, completions)` scores them as PPO passes them to a reward function (decoded
    without special tokens, cut after the stop token).

    Returns prompts (P user messages), rows ((P*K) dicts: prompt_index, query_ids, response_ids, completion,
    completion_text (special tokens kept: "<|im_end|>" if it stopped), prompt_text, gold, stopped) and the padded
    tensors queries (P*K, Q), query_mask, responses (P*K, T), response_mask, for scoring with the RM later."""
    from datasets import Dataset

    from ..core import response_mask_from_stop
    from ..data.prompts import LeftPaddingCollator, prepare_prompts
    from ..models import Sampling, generate_responses

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    prepared = prepare_prompts(dataset, tokenizer, args.max_prompt_length, args.prompt_truncation).dataset
    batch = LeftPaddingCollator(tokenizer)([prepared[p] for p in range(len(prompts)) for _ in range(K)])
    queries, query_mask = batch["input_ids"], batch["attention_mask"].bool()  # (P*K, Q), prompt p's rows together
    sampling = Sampling(args.response_length, args.temperature, tokenizer.eos_token_id)
    responses, _ = generate_responses(policy, queries, query_mask, sampling, batch_size)  # (P*K, T)
    response_mask = response_mask_from_stop(responses, tokenizer.eos_token_id)
    completions = tokenizer.batch_decode([r[m] for r, m in zip(responses, response_mask)], skip_special_tokens=True)
    gold = [float(g) for g in gold([prompts[i // K] for i in range(len(completions))], completions)]
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


def pair_accuracy(scores: list[float], pairs: list[dict]) -> float:
    """Share of pairs whose chosen completion the RM scores higher than the rejected one (ties count half)."""
    wins = [1.0 if scores[p["row_chosen"]] > scores[p["row_rejected"]] else
            0.5 if scores[p["row_chosen"]] == scores[p["row_rejected"]] else 0.0 for p in pairs]
    return sum(wins) / len(wins) if wins else math.nan


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson's r (`statistics.correlation`), NaN when it is undefined (fewer than 2 points, or no spread)."""
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return math.nan


def train_reward_model(model_path: str, train_pairs: list[dict], test_pairs: list[dict], script_args, seed: int,
                       output_dir, target_modules: str | list[str] = "all-linear"):
    """TRL's RewardTrainer with LoRA (SEQ_CLS; the `score` head trained in full) on the train pairs of
    `preference_pairs`; returns (the merged RM, its tokenizer, TRL's held-out eval metrics, RewardTrainer's log lines).

    `script_args` gives rm_pad_token (must differ from EOS, so the classifier pools at the final EOS, where PPO's
    scorer reads), rm_lora_r, rm_lora_alpha, rm_lora_layers (top N layers; -1 all), rm_inputs
    ("sampled_ids": TRL's pre-tokenized chosen_ids/rejected_ids, the ids as sampled; "text": re-tokenized),
    rm_epochs, rm_batch_size, rm_learning_rate, rm_center_rewards_coefficient."""
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

    targets = target_modules  # LoRA on these modules ('all-linear', a list, or comma-separated names)
    num_layers = model.config.num_hidden_layers
    peft_config = LoraConfig(
        task_type="SEQ_CLS",  # peft then trains the `score` head in full (modules_to_save)
        r=s.rm_lora_r,
        lora_alpha=s.rm_lora_alpha,
        lora_dropout=0.0,
        target_modules=[t.strip() for t in targets.split(",")] if isinstance(targets, str) and targets != "all-linear"
        else targets,
        layers_to_transform=None if s.rm_lora_layers < 0 else list(range(num_layers - s.rm_lora_layers, num_layers)),
    )
    columns = ["prompt", "chosen", "rejected"] + (["chosen_ids", "rejected_ids"] if s.rm_inputs == "sampled_ids"
                                                  else [])

    def dataset(pairs):
        return Dataset.from_dict({c: [pair[c] for pair in pairs] for c in columns})

    config = RewardConfig(
        output_dir=os.path.join(str(output_dir), "reward_trainer"),
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
        seed=seed,
    )
    trainer = RewardTrainer(model=model, args=config, train_dataset=dataset(train_pairs), processing_class=rm_tokenizer,
                            peft_config=peft_config)
    trainer.train()
    held_out = trainer.evaluate(dataset(test_pairs))
    log = [entry for entry in trainer.state.log_history if "loss" in entry]
    reward_model = trainer.model.merge_and_unload()
    reward_model.eval()
    return reward_model, rm_tokenizer, held_out, log


def preference_data(policy, tokenizer, prompts: dict[str, list[str]], K: int, args, gold, margin: float,
                    pairing: str = "all", batch_size: int = 64) -> tuple[dict, dict]:
    """Stage 1 for each split of `prompts` ({"train": [...], "test": [...]}): `sample_completions` and
    `preference_pairs`. Returns ({split: samples}, {split: pairs})."""
    sampled = {split: sample_completions(policy, tokenizer, texts, K, args, gold, batch_size)
               for split, texts in prompts.items()}
    return sampled, {split: preference_pairs(sampled[split], K, margin, pairing, split) for split in sampled}


def evaluate_reward_model(reward_model, tokenizer, sampled: dict, pairs: dict, trl_eval: dict | None = None,
                          rm_log: list[dict] | None = None) -> dict:
    """The reward model on the samples as PPO's scorer reads them (the policy's token ids, the score at the last real
    token): pair accuracy on the "test" and "train" pairs, and Pearson's r of RM and gold scores on the "test"
    samples; with `train_reward_model`'s eval metrics and log, also TRL's eval accuracy and loss and the first and last
    training loss."""
    import torch

    from ..rewards import score_responses

    device = next(reward_model.parameters()).device  # RewardTrainer may have moved it to an accelerator
    with torch.no_grad():
        scores = {split: score_responses(reward_model, tokenizer, *(d[k].to(device) for k in (
            "queries", "query_mask", "responses", "response_mask"))).tolist() for split, d in sampled.items()}
    out = {"rm_pair_accuracy": pair_accuracy(scores["test"], pairs["test"]),
           "rm_train_pair_accuracy": pair_accuracy(scores["train"], pairs["train"]),
           "rm_gold_pearson": pearson(scores["test"], [r["gold"] for r in sampled["test"]["rows"]])}
    if trl_eval is not None:
        out.update(rm_trl_eval_accuracy=float(trl_eval.get("eval_accuracy", math.nan)),
                   rm_trl_eval_loss=float(trl_eval.get("eval_loss", math.nan)))
    if rm_log:
        out.update(rm_steps=len(rm_log), rm_first_loss=float(rm_log[0]["loss"]),
                   rm_last_loss=float(rm_log[-1]["loss"]))
    return out
