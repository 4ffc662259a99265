"""Multi-turn PPO on CPU: SmolLM2-135M-Instruct + LoRA plays an addition game with feedback, three tries per question.

What it does:
  - task: "What is 17 + 8? Reply with the number only." for a, b in 1..25 (the arithmetic recipe's split: 256 held
    out, 369 trained on). An episode is a conversation: after a wrong answer the environment replies "No, 26 is too
    high. Try again." (or too low, or "Reply with a number."), up to 3 model turns (`max_tool_calling_iterations=2`
    rounds of feedback); the episode succeeds when a turn's last number is the sum;
  - environment (`AdditionGame`, TRL's environment_factory contract plus trl_ext's `step`): `reset(answer)` starts an
    episode, `step(completion)` gives the feedback or ends it, `get_reward()` scores it: 1.0 solved, else 0.0 — the
    score on the conversation's last model token; the feedback tokens are context only (no loss, no KL);
  - policy: SmolLM2-135M-Instruct with a LoRA adapter (r=8), its reference the same model with the adapter off;
    value model: SmolLM2-135M with a fresh 1-output head, its top 2 decoder layers trained; it values every model token
    of the conversation, and GAE runs over the model's tokens only;
  - held-out success (`trainer.run_episodes`): 128 held-out episodes, sampled at the training temperature from a
    fixed seed, before and after training.

Run it (figures measured: docs/results.md, "Multi-turn"; the first run also converts the model once, ~20 s):

    python recipes/ppo_smollm2_multiturn.py --output_dir runs/multiturn
    python recipes/ppo_smollm2_multiturn.py --max_train_seconds 300 --seed 1      # another seed, 5 minutes

Every `trl_ext.PPOConfig`, `trl.ModelConfig` and `ScriptArguments` field is a flag (`--max_turn_length`,
`--max_tool_calling_iterations`, `--response_length` for the whole conversation, ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ppo_smollm2_arithmetic as arithmetic
from ppo_smollm2_arithmetic import last_number
from trl import ModelConfig

from trl_ext import PPOConfig
from trl_ext.scripts import CPU_DEFAULTS, LORA_DEFAULTS, parse_args

HELD_OUT = 128  # held-out episodes for the success rate


class AdditionGame:
    """One question; feedback after a wrong answer. TRL's environment contract (`reset`, `get_reward`) and trl_ext's
    `step(completion) -> feedback | None`."""

    def __init__(self):
        self.answer, self.solved, self.tries = None, False, 0

    def reset(self, answer, **row):
        self.answer, self.solved, self.tries = int(answer), False, 0

    def step(self, completion: str):
        self.tries += 1
        guess = last_number(completion)
        if guess == self.answer:
            self.solved = True
            return None  # the episode ends
        if guess is None:
            return "Reply with a number."
        return f"No, {guess} is too {'high' if guess > self.answer else 'low'}. Try again."

    def get_reward(self) -> float:
        return float(self.solved)


@dataclass
class ScriptArguments(arithmetic.ScriptArguments):
    """The arithmetic recipe's options (the critic's trained layers, a time budget, the evaluation before); the
    held-out set counts episodes here."""

    held_out_size: int = field(default=HELD_OUT, metadata={"help": "Held-out episodes played (at most 256)."})


# 32 PPO steps of 8 episodes: up to 3 turns of at most 16 tokens, 96 tokens of conversation after the prompt;
# the arithmetic recipe's learning rate, temperature and β; padding-free passes.
RECIPE_DEFAULTS = dict(
    **CPU_DEFAULTS,
    value_trainable_layers=2,  # arithmetic.build_trainer's critic: its top 2 decoder layers, final norm and head
    output_dir="runs/multiturn",
    total_episodes=256,
    per_device_train_batch_size=8,
    num_mini_batches=1,
    num_ppo_epochs=2,
    response_length=96,
    max_turn_length=16,
    max_tool_calling_iterations=2,
    padding_free=True,  # logits only where they predict the model's tokens: not the feedback's, not padding
    temperature=0.7,
    learning_rate=3e-4,
    kl_coef=0.05,
    alarm_profile="verifiable",
    **LORA_DEFAULTS,
)


def build_trainer(script_args, args, model_args, callbacks=()):
    """The arithmetic recipe's PPOTrainer (policy, reference, critic, prompts) with the game as its environment and
    score, and the held-out prompts."""
    return arithmetic.build_trainer(script_args, args, model_args, reward=None, callbacks=callbacks,
                                    environment_factory=AdditionGame)


def held_out_success(trainer, held_out) -> dict:
    """The share of held-out episodes solved, and the mean model turns per episode (one fixed sampling seed)."""
    episodes = trainer.run_episodes(held_out, seed=0)
    return {"success": sum(e["reward"] for e in episodes) / len(episodes),
            "turns": sum(e["turns"] for e in episodes) / len(episodes),
            "first_try": sum(e["reward"] == 1.0 and e["turns"] == 1 for e in episodes) / len(episodes)}


def main(argv: list[str] | None = None) -> dict:
    script_args, args, model_args = parse_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)
    trainer, held_out = build_trainer(script_args, args, model_args)
    held_out = held_out.select(range(min(script_args.held_out_size, len(held_out))))
    before = held_out_success(trainer, held_out) if script_args.eval_before else None
    start = time.time()
    trainer.train()
    wall = time.time() - start
    after = held_out_success(trainer, held_out)
    trainer.save_model(args.output_dir)
    summary = {"success_before": before and before["success"], "success_after": after["success"],
               "turns_before": before and before["turns"], "turns_after": after["turns"],
               "first_try_before": before and before["first_try"], "first_try_after": after["first_try"],
               "wall_s": wall, "steps": trainer.state.global_step, "episodes": trainer.state.episode}
    if trainer.is_world_process_zero():
        was = f"{before['success']:.3f} -> " if before else ""
        print(f"[recipe] held-out success ({len(held_out)} episodes, up to {args.max_tool_calling_iterations + 1} "
              f"turns, temperature {args.temperature}): {was}{after['success']:.3f} after "
              f"{trainer.state.global_step} steps ({trainer.state.episode} episodes) in {wall:.0f} s; adapter in "
              f"{args.output_dir}", flush=True)
    return summary


if __name__ == "__main__":
    main()
