"""One PPO update (`PPOTrainer.ppo_update`) on a fixed rollout, for tests/core/test_token_mean.py.

    python tests/scripts/token_mean_runs.py --rollout R.pt --out DIR --ga 1            # one process, every row
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 tests/scripts/token_mean_runs.py \
        --rollout R.pt --out DIR --ga 2                                                 # each process its rows

`--config '{"loss_agg_mode": "token-sum"}'`: PPOConfig fields on top (tests/trainer/test_ppo_variants.py).

`R.pt` holds a `Rollout` (as a dict of tensors) of B rows and the row split: process p updates on the rows
`split[p]`. Every process builds the same models (same seeds); the main process writes `DIR/weights.pt`: the
policy's and the value model's weights after the update, flattened.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from trl_ext import PPOConfig, PPOTrainer, Rollout
from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

EOS_BIAS = {1: 2.0}  # EOS likely: ragged responses
LR = 0.05
VF_COEF = 0.7
TEMPERATURE = 0.7


def models(tok):
    return tiny_causal_lm(tok, seed=0, token_bias=EOS_BIAS), tiny_scalar_model(tok, seed=1)


def trainer(out: str, tok, policy, value, rows: int, ga: int, minibatches: int = 1, dataset=None,
            **overrides) -> PPOTrainer:
    """A trainer whose per-process batch is `rows` rollouts in `ga` micro-batches (per_device = rows / ga), SGD,
    no gradient clipping (so the update is lr x the gradient); `overrides`: more PPOConfig fields."""
    from trl_ext.testing import tiny_prompt_dataset

    sgd = torch.optim.SGD(list(policy.parameters()) + list(value.parameters()), lr=LR)
    args = PPOConfig(output_dir=out, per_device_train_batch_size=rows // ga, gradient_accumulation_steps=ga,
                     num_mini_batches=minibatches, num_ppo_epochs=1, total_episodes=rows, response_length=6,
                     vf_coef=VF_COEF, temperature=TEMPERATURE, max_grad_norm=None, report_to=[], save_strategy="no",
                     num_sample_generations=0,
                     bf16=False, disable_tqdm=True, seed=0, gradient_checkpointing=False, **overrides)
    return PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None,
                      reward_model=lambda prompts, completions: [float(len(c)) for c in completions],
                      train_dataset=dataset if dataset is not None else tiny_prompt_dataset(tok, n=8),
                      value_model=value, optimizers=(sgd, None))


def ragged_rollout(out: str, rows: int = 8) -> Rollout:
    """A fixed rollout of `rows` prompts with ragged responses, from the trainer's own rollout."""
    from trl_ext.testing import tiny_prompt_dataset

    tok = tiny_tokenizer()
    policy, value = models(tok)
    t = trainer(out, tok, policy, value, rows=rows, ga=1, dataset=tiny_prompt_dataset(tok, n=rows, seed=4))
    batch = next(iter(t.dataloader))
    torch.manual_seed(3)
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    lengths = r.response_mask.sum(1)
    assert len(set(lengths.tolist())) >= 3, f"responses not ragged enough: {lengths.tolist()}"
    return r


def minibatch_order(seed: int, rows: int, minibatches: int) -> list[list[int]]:
    """The rows of each minibatch in the order `ppo_update` draws them after torch.manual_seed(seed) (one epoch)."""
    torch.manual_seed(seed)
    order = torch.randperm(rows).tolist()
    size = rows // minibatches
    return [order[i : i + size] for i in range(0, rows, size)]


def flat(*modules) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for m in modules for p in m.parameters()])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollout", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--config", default="{}", help="PPOConfig overrides, JSON")
    cli = parser.parse_args()
    saved = torch.load(cli.rollout)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    rows = saved["split"][rank] if world > 1 else list(range(len(saved["rollout"]["queries"])))
    rollout = Rollout(**saved["rollout"])[torch.tensor(rows)]
    tok = tiny_tokenizer()
    policy, value = models(tok)
    t = trainer(os.path.join(cli.out, "run"), tok, policy, value, rows=len(rows), ga=cli.ga,
                **json.loads(cli.config))
    assert t.accelerator.num_processes == world
    t.ppo_update(rollout.to(t.accelerator.device))
    if t.accelerator.is_main_process:
        torch.save({"weights": flat(t.unwrapped.policy, t.unwrapped.value_model),
                    "local_tokens": int(rollout.response_mask.sum())}, os.path.join(cli.out, "weights.pt"))
    t.accelerator.wait_for_everyone()
    if rank == 0:
        print("UPDATE DONE")
