"""PPO runs on tiny models for tests/trainer/test_scale_out.py, under `accelerate launch` (2 CPU processes; DDP,
DeepSpeed ZeRO-2/3 or FSDP2) or as one process.

    python tests/scripts/ddp_runs.py --out DIR --runs matched             # one process
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 tests/scripts/ddp_runs.py --out DIR \
        --runs matched,straight,interrupted,resumed
    DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero3.yaml \
        --num_processes 2 --mixed_precision no tests/scripts/ddp_runs.py --out DIR --runs matched

Launched, the script first imports `engine_shim` (accelerate 1.15 runs DeepSpeed and FSDP on CPU only with it).
Each run trains its own trainer in `DIR/<run>` and the main process writes `DIR/<run>.pt`: the policy's and the value
model's whole weights (flattened; gathered from ZeRO-3 / FSDP2 shards), the logged metrics of each step, the engine
and how it held the parameters.

- `matched` / `matched_lora`: a global batch of `GLOBAL_BATCH` prompts whatever the number of processes (per-device
  batch = GLOBAL_BATCH / processes), a critic-warmup iteration then PPO, with the one thing that legitimately differs
  between N processes and one made equal (`matched_sampling`): responses are sampled from an RNG stream seeded by the
  prompt and the iteration (each process otherwise samples with its own stream). Advantages need no patch: the
  trainer whitens them with statistics over all processes (TRL whitens each process's share on its own). Responses
  stop at a likely EOS, so the processes hold different numbers of response tokens: the losses are token means over
  all of them, as in one process. `matched_lora` trains a LoRA policy.
- `unpacked` / `packed` / `packed_own_rows` / `packed_budget`: `matched` with SGD (lr 0.1: the weights differ by lr x
  the gradients' difference; Adam's first steps would magnify float noise in gradients near its ε), padded /
  padding_free=True (each minibatch's rows dealt out again by tokens: balance_batch) / padding-free with each process
  on its own rows (balance_batch=False) / micro-batches of at most `PACKED_BUDGET` tokens (as many on each process);
  `micro_tokens`: each micro-batch's real tokens on the main process.
- `warmup`: one critic-warmup iteration with weight decay (the policy must not move); `loaded`: the config first,
  then the models from disk (partitioned as they load under ZeRO-3), no gathering for generation, an evaluation,
  padding-free (the models' probe runs on partitioned weights).
- `straight`: 4 iterations, default sampling; `interrupted`: the same settings, a checkpoint every iteration, stopped
  after 2; `resumed`: a fresh trainer resumed from `interrupted`'s checkpoint-2.
- Another number of processes (the same global batch): `one_straight` / `one_interrupted` (one process, run by the
  test itself) as `straight` / `interrupted`; `grown`: `one_interrupted`'s checkpoint-2 resumed on 2 processes;
  `shrunk`: `interrupted`'s checkpoint-2 (2 processes) resumed on one (refused where the state is split per process:
  its error, and whether the weights stayed as built). Each records its weights when training begins (after the
  load: `WeightsAtStart`) and every iteration's prompts over all processes (`record_prompts`).
- Faults (each must end as `straight` does): `preempted`: SIGTERM to process 1 alone at iteration 2, no
  save_strategy (the run saves and exits 0 on every process; SystemExit is caught here); `preempted_resumed`:
  `resume_from_checkpoint=True` in its folder. `damaged`: a copy of `interrupted`'s checkpoint-1 and -2 with 64
  bytes of process 1's engine file in checkpoint-2 flipped (`engine_file`), then deleted: both refused naming the file
  when given by path, then `resume_from_checkpoint=True` falls back to checkpoint-1. `killed_in_save`: hangs inside
  the save of checkpoint-2 (`hang_in_save`: after every process wrote its files) until the test SIGKILLs the launch;
  `killed_resumed` (the next launch): `resume_from_checkpoint=True` in its folder.
- `dynamic`: groups of 2 completions, dynamic sampling with at most 3 draws, a reward constant on half the prompts:
  the processes need different numbers of draws and must make as many (their forwards meet under ZeRO-3).
- `multi_turn`: an environment that answers "yes" after a model turn and ends the episode after the second, turns of at
  most 3 tokens (most cut there: those conversations end): the processes talk for different numbers of turns and must
  generate as many.
- `async_synchronous`: `straight` with async_rollouts at max_staleness=0 (must be `straight`); `async_stale`: at
  max_staleness=1; `async_interrupted` / `async_resumed`: `async_stale` stopped after 2 iterations with a checkpoint
  each, and resumed from checkpoint-2 (must be `async_stale`); `async_refused`: the error under ZeRO-3 / FSDP2.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import shutil
import signal
import time
import zlib
from contextlib import contextmanager

import torch
from accelerate import PartialState
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models import Packing, build_shared_base, freeze_backbone
from trl_ext.models import generate_responses as _generate
from trl_ext.testing import (
    loss_input_dtypes,
    quantized_4bit,
    tiny_causal_lm,
    tiny_prompt_dataset,
    tiny_scalar_model,
    tiny_tokenizer,
)
from trl_ext.trainer.generators import HFGenerate

GLOBAL_BATCH = 8
PACKED_BUDGET = 14  # `packed_budget`'s tokens per micro-batch: the longest row (prompt + response_length) is 12
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
    def draw(self, policy, queries, query_mask, sampling, generator=None):  # HFGenerate.draw: the one HF generate
        # call (the rows seeded by prompt and rollout instead of the iteration's generator)
        with self.backend.accelerator.autocast():
            return seeded_generate(policy, queries, query_mask, sampling, self.forward_batch_size)

    saved, HFGenerate.draw = HFGenerate.draw, draw
    _ROLLOUTS[0] = 0
    try:
        yield
    finally:
        HFGenerate.draw = saved


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class SignalAt(TrainerCallback):
    """SIGTERM to this process at the end of iteration `step`, on process `rank` only (a scheduler's signal reaching
    one process first)."""

    def __init__(self, step, rank):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


class WeightsAtStart(TrainerCallback):
    """The whole weights when training begins, after a resume has loaded them (`flat_roles`; every process)."""

    def __init__(self):
        self.trainer, self.roles = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.roles = flat_roles(self.trainer)


def record_prompts(trainer: PPOTrainer) -> list:
    """Filled as the trainer runs: each iteration's prompts (their real token ids) over all processes, process 0's
    rows first (a collective per iteration)."""
    from accelerate.utils import gather_object

    seen, run = [], trainer.rollout_phase.run

    def recorded(queries, query_mask, *args, **kwargs):
        seen.append(gather_object([ids[mask.bool()].tolist() for ids, mask in zip(queries, query_mask)]))
        return run(queries, query_mask, *args, **kwargs)

    trainer.rollout_phase.run = recorded
    return seen


def hang_in_save(step: int, marker_dir: str) -> None:
    """From now on, the save of checkpoint `step` stops for good once every process has written its files into
    `checkpoint-N.partial` (before the seal and the rename), each process writing its pid into `SAVING.rank<i>` in
    marker_dir."""
    save_rng_state = PPOTrainer._save_rng_state

    def hanging(self, output_dir):
        save_rng_state(self, output_dir)
        if self.state.global_step == step:
            marker = os.path.join(marker_dir, f"SAVING.rank{self.args.process_index}")
            with open(marker + ".tmp", "w") as f:  # the test kills it by pid: it runs in a session of its own
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)  # the marker appears with its pid in it
            time.sleep(3600)

    PPOTrainer._save_rng_state = hanging


def engine_file(checkpoint: str) -> str:
    """The path, relative to `checkpoint`, of a file process 1 wrote: its DeepSpeed optimizer partition
    (`global_stepK/zero_pp_rank_1_*optim_states.pt`), its FSDP2 shard (`*/__1_0.distcp`, with SHARDED_STATE_DICT),
    or its RNG state (DDP; FSDP2 with FULL_STATE_DICT, as the shipped fsdp.yaml, where process 0 writes the rest)."""
    names = sorted(os.path.relpath(os.path.join(d, f), checkpoint) for d, _, files in os.walk(checkpoint)
                   for f in files)
    for pattern in ("rank_1_mp_rank_00_optim", "__1_0.distcp", "rng_state_1.pth"):
        found = [n for n in names if pattern in os.path.basename(n)]
        if found:
            return found[0]
    raise FileNotFoundError(f"no file of process 1 in {checkpoint}: {names}")


def flip_bytes(path: str, count: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(count)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


def listing(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)


def damaged_run(run_dir: str, interrupted: str, per_device: int) -> tuple[PPOTrainer, dict]:
    """`damaged`: see the module docstring; returns the trainer resumed with True and what each step saw."""
    main = int(os.environ.get("RANK", "0")) == 0
    target = os.path.join(run_dir, "checkpoint-2")
    t = build(run_dir, per_device, RESUME_STEPS, critic_warmup_steps=1, save_strategy="steps", save_steps=1)
    if main:
        for step in ("checkpoint-1", "checkpoint-2"):
            shutil.copytree(os.path.join(interrupted, step), os.path.join(run_dir, step))
    t.accelerator.wait_for_everyone()
    name = engine_file(target)
    errors = []
    for damage in (flip_bytes, os.remove):
        if main:
            damage(os.path.join(target, name))
        t.accelerator.wait_for_everyone()
        try:
            t.train(resume_from_checkpoint=target)
        except ValueError as error:  # CheckpointError
            errors.append(f"{type(error).__name__}: {error}")
        else:
            errors.append(None)
    t.train(resume_from_checkpoint=True)
    abandoned = os.path.join(run_dir, "abandoned")
    return t, {"file": name, "errors": errors,
               "abandoned": sorted(os.listdir(abandoned)) if os.path.isdir(abandoned) else []}


_WHOLE_MODELS: dict = {}


def whole_models(tok, eos_bias: float, frozen_critic: bool = False) -> tuple:
    """Copies of the policy (EOS logit bias 0 or 2), reward and value models, all built at the first call, before any
    PPOConfig exists: once one does under a ZeRO-3 launch, transformers builds every model partitioned (zero.Init),
    with other random weights. frozen_critic: the value model is the policy's backbone with a new head and its lower
    layer frozen (the quickstart's layout: the reference pass gives the critic's trunk, `models.FrozenTrunk`)."""
    if not _WHOLE_MODELS:
        for bias in (0.0, 2.0):
            policy = tiny_causal_lm(tok, seed=0, token_bias={tok.eos_token_id: bias} if bias else None)
            config = copy.deepcopy(policy.config)
            config.num_labels = 1
            frozen = AutoModelForSequenceClassification.from_config(config)
            frozen.model.load_state_dict(policy.model.state_dict())
            freeze_backbone(frozen, 1)
            _WHOLE_MODELS[bias] = (policy, tiny_scalar_model(tok, seed=2), tiny_scalar_model(tok, seed=1), frozen)
    policy, reward, value, frozen = _WHOLE_MODELS[eos_bias]
    return tuple(copy.deepcopy(m) for m in (policy, reward, frozen if frozen_critic else value))


def build(out_dir: str, per_device: int, steps: int, callbacks=(), eos_bias: float = 0.0, lora: bool = False,
          from_disk: bool = False, frozen_critic: bool = False, **overrides) -> PPOTrainer:
    """The models are whole (under ZeRO-3 the engine partitions them when the trainer prepares them)."""
    tok = tiny_tokenizer()
    kwargs = dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                  num_mini_batches=1, num_ppo_epochs=2, total_episodes=steps * GLOBAL_BATCH, response_length=6,
                  learning_rate=3e-3, kl_coef=0.1, kl_controller="adaptive", kl_target=0.05, kl_horizon=16,
                  report_to=[], save_strategy="no", num_sample_generations=0, bf16=False, disable_tqdm=True,
                  logging_steps=1, seed=5, gradient_checkpointing=False)
    eval_dataset = overrides.pop("eval_dataset", None)
    reward = overrides.pop("reward", None)
    environment_factory = overrides.pop("environment_factory", None)
    if environment_factory is not None:  # the feedback rendered as its words and EOS after the turn's
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}"
    kwargs.update(overrides)
    policy, reward_model, value_model = whole_models(tok, eos_bias, frozen_critic)
    reward_model = reward or reward_model
    args = PPOConfig(**kwargs)
    if from_disk:  # saved by the main process after the config (and a ZeRO-3 launch) exists, loaded by each
        folder = os.path.join(out_dir, "models")
        if args.process_index == 0:
            for model, sub in zip((policy, reward_model, value_model), ("policy", "reward", "value")):
                model.save_pretrained(os.path.join(folder, sub))
        PartialState().wait_for_everyone()
        policy = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "policy"))
        reward_model, value_model = (AutoModelForSequenceClassification.from_pretrained(os.path.join(folder, sub))
                                     for sub in ("reward", "value"))
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) if lora else None
    return PPOTrainer(args=args, processing_class=tok, eval_dataset=eval_dataset, model=policy, ref_model=None,
                      reward_model=reward_model, train_dataset=tiny_prompt_dataset(tok, n=3 * GLOBAL_BATCH, seed=1),
                      value_model=value_model, callbacks=list(callbacks), peft_config=peft_config,
                      environment_factory=environment_factory)


class YesThenStop:
    """`multi_turn`'s environment: "yes" after the first turn, the end after the second."""

    def reset(self, **row):
        self.turns = 0

    def step(self, completion: str):
        self.turns += 1
        return "yes" if self.turns == 1 else None


def build_shared(out_dir: str, per_device: int, steps: int, callbacks=(), **overrides) -> PPOTrainer:
    """A shared 4-bit base (nf4 on CPU): policy and critic LoRA adapters of one base, the reference its adapters off.
    The fp32 base is saved by the main process after the config exists and loaded in 4-bit by every process."""
    tok = tiny_tokenizer()
    kwargs = dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                  num_mini_batches=1, num_ppo_epochs=2, total_episodes=steps * GLOBAL_BATCH, response_length=6,
                  learning_rate=1e-3, kl_coef=0.1, report_to=[], save_strategy="no", num_sample_generations=0,
                  bf16=False, disable_tqdm=True, logging_steps=1, seed=5, gradient_checkpointing=True,
                  critic_warmup_steps=1)
    kwargs.update(overrides)
    reward_model = whole_models(tok, 0.0)[1]
    args = PPOConfig(**kwargs)
    folder = os.path.join(out_dir, "base")
    if args.process_index == 0:
        tiny_causal_lm(tok, seed=0, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    PartialState().wait_for_everyone()
    torch.manual_seed(0)  # the LoRA matrices' initialisation
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    shared = build_shared_base(quantized_4bit(AutoModelForCausalLM, folder), policy_lora=LoraConfig(**lora),
                               critic_lora=LoraConfig(**{**lora, "r": 2}))
    return PPOTrainer(args=args, processing_class=tok, model=shared, ref_model=None, reward_model=reward_model,
                      train_dataset=tiny_prompt_dataset(tok, n=3 * GLOBAL_BATCH, seed=1), value_model=None,
                      callbacks=list(callbacks))


def build_quantized(out_dir: str, per_device: int) -> PPOTrainer:
    """The separate layout with a 4-bit policy (LoRA on nf4) beside whole reward and value models
    (`recipes/ppo_tldr.py --use_peft --load_in_4bit`)."""
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=out_dir, per_device_train_batch_size=per_device, total_episodes=GLOBAL_BATCH,
                     response_length=6, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True)
    folder = os.path.join(out_dir, "base")
    if args.process_index == 0:
        tiny_causal_lm(tok, seed=0, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    PartialState().wait_for_everyone()
    _, reward_model, value_model = whole_models(tok, 0.0)
    return PPOTrainer(args=args, processing_class=tok, model=quantized_4bit(AutoModelForCausalLM, folder),
                      ref_model=None, reward_model=reward_model, value_model=value_model,
                      train_dataset=tiny_prompt_dataset(tok, n=3 * GLOBAL_BATCH, seed=1),
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def micro_batch_tokens(trainer: PPOTrainer) -> list[int]:
    """Filled as the trainer runs: the real tokens of each micro-batch this process trains on."""
    tokens, original = [], trainer.update_phase.micro_batch_losses

    def losses(rows, micro, *args):
        tokens.append(rows.num_tokens if isinstance(rows, Packing) else int(rows.inputs["attention_mask"].sum()))
        return original(rows, micro, *args)

    trainer.update_phase.micro_batch_losses = losses
    return tokens


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


def flat_roles(trainer: PPOTrainer) -> dict | None:
    """{"policy", "value"}: each role's whole weights flattened (gathered from ZeRO-3 / FSDP2 shards: every process
    calls this; None on the others)."""
    full = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.accelerator.is_main_process:
        return None
    if trainer.shared is not None:  # its trained parts: the adapters and the value head
        return {role: torch.cat([p.detach().float().flatten().clone() for p in params]) for role, params in
                (("policy", trainer.shared.policy_parameters()), ("value", trainer.shared.value_parameters()))}
    names = [n for n, _ in trainer.unwrapped.named_parameters()]
    return {role: torch.cat([full[n].detach().float().flatten().clone() for n in names if n.startswith(prefix)])
            for role, prefix in (("policy", "policy."), ("value", "value_model."))}


def summary(trainer: PPOTrainer) -> dict:
    roles = flat_roles(trainer) or {}
    return {"policy": roles.get("policy"), "value": roles.get("value"),
            "logs": [h for h in trainer.state.log_history if "objective/scores" in h],
            "global_step": trainer.state.global_step, "world_size": trainer.accelerator.num_processes,
            "engine": trainer.accelerator.distributed_type.value, "sharded": sharded(trainer),
            "trunk_from_reference": getattr(trainer, "trunk_from_reference", None) is not None}


def sharded(trainer: PPOTrainer) -> str:
    """How the trained parameters are held: "dtensor" (FSDP2), "zero3" (partitioned), or "whole"."""
    params = list(trainer.unwrapped.parameters())
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params):
        return "dtensor"
    return "zero3" if any(hasattr(p, "ds_id") for p in params) else "whole"


def refused(name: str, out: str, make) -> dict:
    """`make()` must raise a ValueError: its message (None if it built a trainer) in `out/<name>.pt`."""
    try:
        make()
    except ValueError as error:
        result = {"error": str(error)}
    else:
        result = {"error": None}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(result, os.path.join(out, f"{name}.pt"))
    return result


def half_constant_reward(prompts, completions):
    """0 for every completion of a prompt with an even checksum (a constant group), else the completion's length."""
    return [0.0 if zlib.crc32(p.encode()) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


def run(name: str, out: str) -> dict:
    per_device = GLOBAL_BATCH // _world_size_hint()
    run_dir = os.path.join(out, name)
    initial, extra = None, {}
    if name in ("matched", "matched_lora", "matched_trunk"):
        with matched_sampling():  # ragged responses: stop at a likely EOS; critic warmup, then 2 PPO steps
            t = build(run_dir, per_device, MATCHED_STEPS, eos_bias=2.0, lora=name != "matched",
                      frozen_critic=name == "matched_trunk", critic_warmup_steps=1)
            t.train()
    elif name in ("unpacked", "packed", "packed_own_rows", "packed_budget"):  # padded / padding-free; SGD
        packing = {"unpacked": {}, "packed": {"padding_free": True},
                   "packed_own_rows": {"padding_free": True, "balance_batch": False},
                   "packed_budget": {"padding_free": True, "max_tokens_per_micro_batch": PACKED_BUDGET}}[name]
        with matched_sampling():
            t = build(run_dir, per_device, MATCHED_STEPS, eos_bias=2.0, critic_warmup_steps=1, optim="sgd",
                      learning_rate=0.1, **packing)
            extra["micro_tokens"] = micro_batch_tokens(t)
            initial = flat_roles(t)
            t.train()
    elif name == "warmup":  # one critic-warmup step with weight decay: the policy must not move at all
        t = build(run_dir, per_device, 1, critic_warmup_steps=1, weight_decay=0.1)
        initial = flat_roles(t)
        t.train()
    elif name == "loaded":  # as a script runs: the config first, then the models from disk (ZeRO-3: partitioned
        # as they load, so the reference is built partitioned too), generation without gathering, an evaluation
        t = build(run_dir, per_device, 2, from_disk=True, ds3_gather_for_generation=False, padding_free=True,
                  eval_dataset=tiny_prompt_dataset(tiny_tokenizer(), n=4, seed=3), eval_strategy="steps", eval_steps=1)
        t.train()
    elif name == "shared_matched":
        with matched_sampling():
            t = build_shared(run_dir, per_device, MATCHED_STEPS)
            t.train()
    elif name == "shared_autocast":  # bf16: the policy's logits and the critic's values in the compute dtype
        with loss_input_dtypes() as seen:
            t = build_shared(run_dir, per_device, 2, bf16=True, use_cpu=True)
            t.train()
        result = {"dtypes": sorted(seen)}
        torch.save(result, os.path.join(out, f"{name}.rank{t.accelerator.process_index}.pt"))
        if t.accelerator.is_main_process:
            torch.save(result, os.path.join(out, f"{name}.pt"))
        t.accelerator.wait_for_everyone()
        return result
    elif name in ("shared_refused", "quantized_refused", "async_refused"):  # a clear error, no run
        return refused(name, out, {
            "shared_refused": lambda: build_shared(run_dir, per_device, 1),  # under DeepSpeed / FSDP
            "quantized_refused": lambda: build_quantized(run_dir, per_device),
            "async_refused": lambda: build(run_dir, per_device, 1, async_rollouts=True),  # under ZeRO-3 / FSDP2
        }[name])
    elif name.removeprefix("shared_").removeprefix("one_") in ("straight", "interrupted", "resumed"):
        make = build_shared if name.startswith("shared_") else functools.partial(build, critic_warmup_steps=1)
        interrupted = os.path.join(out, name.replace("resumed", "interrupted"))
        if name.endswith("straight"):
            t = make(run_dir, per_device, RESUME_STEPS)
            extra["prompts"] = record_prompts(t)
            t.train()
        elif name.endswith("interrupted"):
            t = make(run_dir, per_device, RESUME_STEPS, callbacks=[StopAt(2)], save_strategy="steps", save_steps=1)
            extra["prompts"] = record_prompts(t)
            t.train()
        else:
            t = make(interrupted, per_device, RESUME_STEPS, save_strategy="steps", save_steps=1)
            t.train(resume_from_checkpoint=os.path.join(interrupted, "checkpoint-2"))
    elif name in ("grown", "shrunk"):  # the same global batch on another number of processes
        start = WeightsAtStart()
        t = build(run_dir, per_device, RESUME_STEPS, callbacks=[start], save_strategy="steps", save_steps=1)
        start.trainer, initial = t, flat_roles(t)
        extra["prompts"] = record_prompts(t)
        try:
            t.train(resume_from_checkpoint=os.path.join(out, "one_interrupted" if name == "grown" else "interrupted",
                                                        "checkpoint-2"))
        except ValueError as error:  # CheckpointError: refused
            extra["error"] = str(error)
        extra["at_start"] = start.roles
    elif name == "preempted":
        t = build(run_dir, per_device, RESUME_STEPS, critic_warmup_steps=1, callbacks=[SignalAt(2, rank=1)])
        try:
            t.train()
        except SystemExit as exit_:
            extra["exit_code"] = exit_.code
    elif name in ("preempted_resumed", "killed_resumed"):
        folder = os.path.join(out, name.replace("_resumed", "_in_save" if name.startswith("killed") else ""))
        extra["before"] = listing(folder)
        saving = dict(save_strategy="steps", save_steps=1) if name == "killed_resumed" else {}
        t = build(folder, per_device, RESUME_STEPS, critic_warmup_steps=1, **saving)
        t.train(resume_from_checkpoint=True)
    elif name == "damaged":
        t, extra = damaged_run(run_dir, os.path.join(out, "interrupted"), per_device)
    elif name in ("async_synchronous", "async_stale", "async_interrupted", "async_resumed"):
        staleness = 0 if name == "async_synchronous" else 1
        make = functools.partial(build, per_device=per_device, steps=RESUME_STEPS, critic_warmup_steps=1,
                                 async_rollouts=True, max_staleness=staleness)
        interrupted = os.path.join(out, "async_interrupted")
        if name == "async_interrupted":
            t = make(run_dir, callbacks=[StopAt(2)], save_strategy="steps", save_steps=1)
            t.train()
        elif name == "async_resumed":
            t = make(interrupted, save_strategy="steps", save_steps=1)
            t.train(resume_from_checkpoint=os.path.join(interrupted, "checkpoint-2"))
        else:
            t = make(run_dir)
            t.train()
        extra["async_log"] = t.rollouts.log
    elif name == "dynamic":  # groups of 2; half the prompts score every completion 0: constant groups, redrawn
        t = build(run_dir, per_device, 3, num_generations=2, dynamic_sampling=True, max_num_gen_batches=3,
                  reward=half_constant_reward)
        t.train()
    elif name == "multi_turn":
        t = build(run_dir, per_device, 3, eos_bias=2.0, environment_factory=YesThenStop, response_length=10,
                  max_turn_length=3)
        t.train()
    elif name == "killed_in_save":
        hang_in_save(2, out)
        t = build(run_dir, per_device, RESUME_STEPS, critic_warmup_steps=1, save_strategy="steps", save_steps=1)
        t.train()
        raise AssertionError("killed_in_save must hang in the save of checkpoint-2 until it is killed")
    else:
        raise ValueError(f"unknown run {name!r}: choose from matched, matched_lora, matched_trunk, unpacked, "
                         "packed, packed_own_rows, packed_budget, warmup, loaded, "
                         "[shared_|one_]straight, [shared_|one_]interrupted, [shared_]resumed, grown, shrunk, "
                         "shared_matched, shared_autocast, "
                         "preempted, preempted_resumed, damaged, killed_in_save, killed_resumed, async_synchronous, "
                         "async_stale, async_interrupted, async_resumed, async_refused, dynamic, multi_turn")
    result = summary(t) | {"initial": initial} | extra
    if t.accelerator.is_main_process:
        torch.save(result, os.path.join(out, f"{name}.pt"))
    t.accelerator.wait_for_everyone()
    return result


def _world_size_hint() -> int:
    """The number of processes before any trainer exists (accelerate launch sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    import engine_shim  # noqa: F401  (test-only: DeepSpeed and FSDP2 on CPU under accelerate 1.15; see its docstring)

    whole_models(tiny_tokenizer(), 0.0)  # before any PPOConfig (see whole_models)

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default="matched")
    cli = parser.parse_args()
    main_process = int(os.environ.get("RANK", "0")) == 0
    for name in cli.runs.split(","):
        started = time.perf_counter()
        run(name, cli.out)
        if main_process:
            print(f"run {name}: {time.perf_counter() - started:.1f} s", flush=True)
    if main_process:
        print("RUNS DONE")
