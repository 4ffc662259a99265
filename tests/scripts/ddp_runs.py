"""PPO runs on tiny models for tests/test_ddp.py, under `accelerate launch` (2 CPU processes) or as one process.

    python tests/scripts/ddp_runs.py --out DIR --runs matched             # one process
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 tests/scripts/ddp_runs.py --out DIR \
        --runs matched,straight,interrupted,resumed

Each run trains its own trainer in `DIR/<run>` and the main process writes `DIR/<run>.pt`: the policy's and the value
model's weights (flattened) and the logged metrics of each step.

- `matched`: a global batch of `GLOBAL_BATCH` prompts whatever the number of processes (per-device batch =
  GLOBAL_BATCH / processes), with the two things that legitimately differ between N processes and one made equal
  (`matched_sampling`): responses are sampled from an RNG stream seeded by the prompt and the iteration (each process
  otherwise samples with its own stream). Advantages need no patch: the trainer whitens them with statistics over all
  processes (TRL whitens each process's share on its own). Responses stop at a likely EOS, so the processes hold
  different numbers of response tokens: the losses are token means over all of them, as in one process.
- `straight`: 4 iterations, default sampling; `interrupted`: the same settings, a checkpoint every iteration, stopped
  after 2; `resumed`: a fresh trainer resumed from `interrupted`'s checkpoint-2.
"""

from __future__ import annotations

import argparse
import copy
import os
import zlib
from contextlib import contextmanager

import torch
from peft import LoraConfig
from transformers import TrainerCallback

import trl_ext.trainer as trainer_module
from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models import generate_responses as _generate
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

GLOBAL_BATCH = 8
MATCHED_STEPS = 3
RESUME_STEPS = 4


_ROLLOUTS = [0]  # rollouts sampled so far by `seeded_generate` in this process


def seeded_generate(policy, queries, query_mask, sampling, chunk_size):
    """Drop-in for `generate_responses`: each row sampled on its own, unpadded, from an RNG stream seeded by its
    prompt ids and the rollout number, so a prompt gets the same response whichever process and batch it is in."""
    rollout_number = _ROLLOUTS[0]
    _ROLLOUTS[0] += 1
    out, logprobs = [], []
    for q, m in zip(queries, query_mask.bool()):
        ids = q[m][None]  # (1, real prompt length)
        seed = zlib.crc32(f"{ids.tolist()}|{rollout_number}".encode())
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            response, logprob = _generate(policy, ids, torch.ones_like(ids, dtype=torch.bool), sampling, 1)
        out.append(response)
        logprobs.append(logprob)
    return torch.cat(out), torch.cat(logprobs)


@contextmanager
def matched_sampling():
    if not hasattr(trainer_module, "generate_responses"):  # the name trl_ext.trainer's rollout calls
        raise RuntimeError("trl_ext.trainer no longer uses generate_responses; update ddp_runs.matched_sampling")
    saved = trainer_module.generate_responses
    trainer_module.generate_responses = seeded_generate
    _ROLLOUTS[0] = 0
    try:
        yield
    finally:
        trainer_module.generate_responses = saved


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


_WHOLE_MODELS: dict = {}


def whole_models(tok, eos_bias: float) -> tuple:
    """Copies of the policy (EOS logit bias 0 or 2), reward and value models, all built at the first call, before any
    PPOConfig exists: once one does under a ZeRO-3 launch, transformers builds every model partitioned (zero.Init),
    with other random weights."""
    if not _WHOLE_MODELS:
        for bias in (0.0, 2.0):
            _WHOLE_MODELS[bias] = (tiny_causal_lm(tok, seed=0, token_bias={tok.eos_token_id: bias} if bias else None),
                                   tiny_scalar_model(tok, seed=2), tiny_scalar_model(tok, seed=1))
    return tuple(copy.deepcopy(m) for m in _WHOLE_MODELS[eos_bias])


def build(out_dir: str, per_device: int, steps: int, callbacks=(), eos_bias: float = 0.0, lora: bool = False,
          **overrides) -> PPOTrainer:
    """The models are whole (under ZeRO-3 the engine partitions them when the trainer prepares them)."""
    tok = tiny_tokenizer()
    kwargs = dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                  num_mini_batches=1, num_ppo_epochs=2, total_episodes=steps * GLOBAL_BATCH, response_length=6,
                  learning_rate=3e-3, kl_coef=0.1, kl_controller="adaptive", kl_target=0.05, kl_horizon=16,
                  report_to=[], save_strategy="no", num_sample_generations=0, bf16=False, disable_tqdm=True,
                  logging_steps=1, seed=5, gradient_checkpointing=False)
    kwargs.update(overrides)
    policy, reward_model, value_model = whole_models(tok, eos_bias)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) if lora else None
    return PPOTrainer(args=PPOConfig(**kwargs), processing_class=tok, model=policy, ref_model=None,
                      reward_model=reward_model, train_dataset=tiny_prompt_dataset(tok, n=3 * GLOBAL_BATCH, seed=1),
                      value_model=value_model, callbacks=list(callbacks), peft_config=peft_config)


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


def flat_roles(trainer: PPOTrainer) -> dict | None:
    """{"policy", "value"}: each role's whole weights flattened (gathered from ZeRO-3 / FSDP2 shards: every process
    calls this; None on the others)."""
    full = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.accelerator.is_main_process:
        return None
    names = [n for n, _ in trainer.unwrapped.named_parameters()]
    return {role: torch.cat([full[n].detach().float().flatten().clone() for n in names if n.startswith(prefix)])
            for role, prefix in (("policy", "policy."), ("value", "value_model."))}


def summary(trainer: PPOTrainer) -> dict:
    roles = flat_roles(trainer) or {}
    return {"policy": roles.get("policy"), "value": roles.get("value"),
            "logs": [h for h in trainer.state.log_history if "objective/scores" in h],
            "global_step": trainer.state.global_step, "world_size": trainer.accelerator.num_processes}


def run(name: str, out: str) -> dict:
    per_device = GLOBAL_BATCH // _world_size_hint()
    run_dir = os.path.join(out, name)
    initial = None
    if name in ("matched", "matched_lora"):
        with matched_sampling():  # ragged responses: stop at a likely EOS; critic warmup, then 2 PPO steps
            t = build(run_dir, per_device, MATCHED_STEPS, eos_bias=2.0, lora=name == "matched_lora",
                      critic_warmup_steps=1)
            t.train()
    elif name == "warmup":  # one critic-warmup step with weight decay: the policy must not move at all
        t = build(run_dir, per_device, 1, critic_warmup_steps=1, weight_decay=0.1)
        initial = flat_roles(t)
        t.train()
    elif name == "straight":
        t = build(run_dir, per_device, RESUME_STEPS, critic_warmup_steps=1)
        t.train()
    elif name == "interrupted":
        t = build(run_dir, per_device, RESUME_STEPS, callbacks=[StopAt(2)], critic_warmup_steps=1,
                  save_strategy="steps", save_steps=1)
        t.train()
    elif name == "resumed":
        t = build(os.path.join(out, "interrupted"), per_device, RESUME_STEPS, critic_warmup_steps=1,
                  save_strategy="steps", save_steps=1)
        t.train(resume_from_checkpoint=os.path.join(out, "interrupted", "checkpoint-2"))
    else:
        raise ValueError(f"unknown run {name!r}: choose from matched, matched_lora, warmup, straight, interrupted, "
                         "resumed")
    result = summary(t) | {"initial": initial}
    if t.accelerator.is_main_process:
        torch.save(result, os.path.join(out, f"{name}.pt"))
    t.accelerator.wait_for_everyone()
    return result


def _world_size_hint() -> int:
    """The number of processes before any trainer exists (accelerate launch sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    import engine_shim  # noqa: F401  (test-only: DeepSpeed and FSDP2 on CPU under accelerate 1.15; see its docstring)

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default="matched")
    cli = parser.parse_args()
    for name in cli.runs.split(","):
        run(name, cli.out)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RUNS DONE")
