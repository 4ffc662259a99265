"""Run a PPO trainer for one iteration and capture what it computed, the same way for trl_ext's trainer and for
TRL 1.12's, so each regression test asserts one behaviour against either.

TRL_EXT_TEST_UPSTREAM=1 makes `PPOConfig`/`PPOTrainer` here TRL's own (`trl.experimental.ppo`): the regression tests
then run against TRL's trainer, and each of them fails (tests/trl/test_upstream_fails.py checks that they all do).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

UPSTREAM = os.environ.get("TRL_EXT_TEST_UPSTREAM") == "1"

if UPSTREAM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.ppo import PPOConfig, PPOTrainer
else:
    from trl_ext import PPOConfig, PPOTrainer

from transformers import TrainerCallback  # noqa: E402


def config(output_dir, **overrides) -> PPOConfig:
    """One PPO iteration over 4 prompts, 1 epoch, 1 minibatch, fp32 on CPU, quiet. Uses TRL's fields only."""
    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=1, total_episodes=4,
        response_length=8, num_ppo_epochs=1, num_mini_batches=1, report_to=[], save_strategy="no",
        num_sample_generations=0, bf16=False, logging_steps=1, disable_tqdm=True, seed=0, learning_rate=1e-3,
    )
    kwargs.update(overrides)
    return PPOConfig(**kwargs)


class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def run(trainer) -> dict:
    """Train, and return the first iteration's tensors and each step's logged metrics:
    {"responses", "response_mask", "scores", "rewards", "logprobs", "ref_logprobs", "queries", "query_mask",
     "logs": [dict, ...]}."""
    logs = _Logs()
    trainer.add_callback(logs)
    captured = {}
    if UPSTREAM:
        original_log = trainer.log

        def log_and_capture(metrics, *args, **kwargs):
            if not captured:  # TRL's train() keeps these as locals of the loop; read them at its first log call
                f = sys._getframe(1).f_locals
                mask = ~f["padding_mask"]
                captured.update(
                    responses=f["postprocessed_responses"], response_mask=mask, scores=f["scores"],
                    rewards=f["rewards"], logprobs=f["logprobs"], ref_logprobs=f["ref_logprobs"],
                    queries=f["query_responses"][:, : f["context_length"]],
                    query_mask=f["query_responses"][:, : f["context_length"]] != trainer.processing_class.pad_token_id,
                )
            return original_log(metrics, *args, **kwargs)

        trainer.log = log_and_capture
    else:
        original_rollout = trainer.rollout_phase.run

        def rollout_and_capture(*args, **kwargs):
            r = original_rollout(*args, **kwargs)
            if not captured:
                captured.update({k: getattr(r, k) for k in (
                    "responses", "response_mask", "scores", "rewards", "logprobs", "ref_logprobs", "queries",
                    "query_mask")})
            return r

        trainer.rollout_phase.run = rollout_and_capture
    trainer.train()
    captured["logs"] = [entry for entry in logs.logs if "objective/scores" in entry]
    return captured


def trainer(args, tokenizer, policy, reward_model, value_model, **kwargs):
    return PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=kwargs.pop("ref_model", None),
                      reward_model=reward_model, train_dataset=kwargs.pop("train_dataset"), value_model=value_model,
                      **kwargs)


def first_index(row: torch.Tensor, token_id: int) -> int | None:
    hits = (row == token_id).nonzero()
    return int(hits[0]) if len(hits) else None
