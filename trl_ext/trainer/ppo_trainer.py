"""`trl_ext.PPOTrainer`: TRL 1.12's PPOTrainer with a correct, decomposed training step.

One PPO iteration (`train()`), in TRL's numbered steps, each phase in its own file of this package:

    rollout = self.rollouts.next(step, β)         # 1-7: generate, mask, log-probs, values, scores, rewards, GAE
    stats = self.ppo_update(rollout)              # 8: PPO epochs over minibatches (clipped losses, grad clipping)
    self.log(self.metrics(rollout, stats))        # 9: log over real tokens only

The constructor calls the set-up builders (builders.py) in order, each returning one collaborator (among them the
rollout source: `SyncRollouts`, or `AsyncRollouts`' sampler thread); the phases it builds (`rollout_phase`:
rollout.py, `update_phase`: update.py, `evaluator`: evaluation.py) each receive only what they use, and every
question about the engine or the model layout goes to `backend` (backend.py). Saving and resuming: `checkpoints`
(checkpoint.py).

Shapes: B = rollouts, Q = query length (left-padded), T = response length.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerControl
from transformers.trainer_callback import CallbackHandler, ExportableState, PrinterCallback
from transformers.trainer_utils import TrainOutput, enable_full_determinism, set_seed
from transformers.utils import is_peft_available

from .._trl import OnlineTrainerState, PPOTrainerBase
from ..config import PPOConfig
from ..core.types import Rollout, UpdateStats
from ..models import (
    CHECKPOINTING_KWARGS,
    PolicyAndValueWrapper,
    Sampling,
    disable_bnb_cpu_repack,
    disable_dropout,
    sampling_config,
)
from ..monitoring.alarms import AlarmCallback
from ..monitoring.callbacks import SAMPLES_FILE, append_jsonl, sample_records
from ..monitoring.diagnostics import (
    grpo_metrics,
    mean_sequence_kl,
    rollout_metrics,
    source_metrics,
    update_metrics,
    value_fit,
)
from ..monitoring.phases import Phases
from ..monitoring.progress import PPOProgress
from . import builders as build
from .allocator import reuse_freed_memory
from .async_rollouts import AsyncRollouts
from .backend import Backend, Reference
from .checkpoint import Checkpoints, WeightGrowth, recovery_advice
from .evaluation import Evaluator
from .multi_turn import MultiTurn, RolloutFunction
from .preemption import Preemption
from .rollout import MorePrompts, RolloutPhase, SyncRollouts
from .sampling import ResponseSampler
from .seeds import process_seed
from .update import PPOUpdate, vf_coef_at

if is_peft_available():
    from peft import PeftConfig


class PPOTrainer(PPOTrainerBase):
    """Drop-in replacement for `trl.experimental.ppo.PPOTrainer` (same arguments), with its reported defects fixed.

    `reward_model` may also be a plain function `(prompts: list[str], completions: list[str]) -> list[float]`.

    Multi-turn rollouts (trl_ext/trainer/multi_turn.py, docs/multi-turn.md), with TRL GRPOTrainer's arguments:
    `tools` (functions the model may call), `environment_factory` (a callable, or {name: callable}, building
    environments with `reset` whose public methods are tools, and optionally `get_reward` and trl_ext's `step`) and
    `rollout_func(prompts, trainer) -> dict` (the user's own conversations). `reward_model` may then be None when an
    environment's `get_reward` scores the episodes.
    """

    _tag_names = ["trl", "ppo", "trl_ext"]

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class=None,
        model=None,
        ref_model=None,
        reward_model=None,
        train_dataset=None,
        value_model=None,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config: PeftConfig | None = None,
        eval_reward=None,
        reward_processing_classes=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        reward_funcs=None,
        quantization_config=None,
    ) -> None:
        """TRL 1.12's arguments. Set up in steps, each a builder (trl_ext/trainer/builders.py) or a method below, in
        this order (the order random numbers are drawn in: seeding, the critic's new head, the LoRA matrices, the
        reference copy)."""
        call = build.grpo_call(args, processing_class, model, reward_model, reward_funcs, quantization_config)
        args, processing_class, model, reward_model = call.args, call.processing_class, call.model, call.reward_model
        build.check_arguments(args, processing_class, model, ref_model, train_dataset)
        self.args, self.processing_class = args, processing_class
        # python, numpy and torch seeded: on CPU two runs with the same seed give the same weights; on CUDA also with
        # full_determinism=True (deterministic kernels, cuBLAS workspace: TrainingArguments' switch), else close only
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        self.shared = build.shared_base(args, model, ref_model, value_model, peft_config)
        if self.shared is not None:  # (one made for a quantized policy took peft_config as its adapters)
            model, peft_config = self.shared.policy, None
        self.stop_token_id = build.stop_token_id(args, processing_class)
        self.multi_turn = build.multi_turn(args, processing_class, self.stop_token_id, tools, environment_factory,
                                           rollout_func, eval_dataset, self)
        data = build.prompts(args, processing_class, self.multi_turn, train_dataset, eval_dataset, data_collator)
        self.column_names, self.prompt_counts = data.columns, data.counts
        rewards = build.rewards(args, processing_class, self.multi_turn, reward_model, reward_processing_classes,
                                eval_reward, data.eval_dataset)
        self.reward_model = reward_model
        self.reward_scorer, self.reward_normalizer, self.eval_scorer = rewards.scorer, rewards.normalizer, \
            rewards.eval_scorer
        if data.own_collator and not isinstance(self.multi_turn, RolloutFunction):  # (its fields are columns too)
            # multi-turn: reward functions also get the episodes' environments (TRL's)
            environments = ("environments",) if getattr(self.multi_turn, "factories", None) else ()
            self.reward_scorer.check_columns(self.column_names + environments)
        # the critic before PEFT touches the policy (value_model_init="policy" copies the plain backbone)
        self.value_model = build.critic(args, self.shared, value_model, model, peft_config, self.reward_scorer,
                                        processing_class)
        self.policy_model, self.ref_model, self.is_peft_model = build.policy_and_reference(args, model, ref_model,
                                                                                           peft_config)
        self.model_adapter_name, self.ref_adapter_name = args.model_adapter_name, args.ref_adapter_name
        longest_prompt = build.check_positions(args, {"policy": self.policy_model, "value_model": self.value_model,
                                                      "ref_model": self.ref_model}, data)
        self.train_dataset, self.eval_dataset, self.data_collator = data.train_dataset, data.eval_dataset, \
            data.collator
        self.train_dataset_len = len(self.train_dataset)
        self.episodes_per_epoch = self.train_dataset_len * args.num_generations  # an episode is one completion
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None
        build.batch_sizes(args, self.optimizer, self.episodes_per_epoch)
        self.accelerator = build.accelerator(args)
        self.kl_ctl = build.kl_controller(args)
        self.local_seed = process_seed(args.seed, self.accelerator.process_index)
        if args.num_sample_generations > 0:
            self.sample_generations_freq = max(1, args.num_total_batches // args.num_sample_generations)
        self.backend = Backend(self.accelerator, self.shared, args.max_grad_norm)  # the engine and layout, read once
        self.checkpoints = Checkpoints(args, self.backend)  # saving and resuming (checkpoint.py)
        self._setup_models()
        build.check_packing(args, longest_prompt, self.policy_model, self.ref_model, self.value_model,
                            self.reward_scorer)
        self.reuses_freed_memory = reuse_freed_memory(args.cpu_reuse_freed_memory, self.accelerator.device.type,
                                                      self.model)
        self._setup_callbacks_and_state(build.callbacks(args, callbacks))
        self._setup_trainer_internals()
        self.prompt_batches, self.dataloader, self.eval_dataloader = build.dataloaders(
            args, self.accelerator, self.backend.params_sharded, data)
        self._prepare_models()
        self._place_frozen_models()
        self.trunk_from_reference = build.trunk_from_reference(
            args, self.backend, self.shared, self.unwrapped, self.ref_model, self.reference,
            self.policy_model.config.vocab_size, self.accelerator.device)
        # what PPO samples: softmax(logits / temperature) of the policy, stopping at the stop token (if any)
        self.sampling = Sampling(args.response_length, args.temperature, self.stop_token_id)
        self.generation_config = sampling_config(self.sampling)  # the complete config generate() runs with
        # what draws: HF generate, and the rollouts' generator (HF generate itself, or vLLM: self.vllm its engine)
        hf, generator, self.vllm = build.generators(args, self.backend, self.shared, self.reference,
                                                    self.unwrapped.policy, processing_class, self.sampling,
                                                    self.local_seed)
        # each process's global RNG (the minibatch order; the rollouts draw from generators seeded per iteration),
        # seeded last, as DeepSpeed's engine set-up may draw random numbers
        torch.manual_seed(self.local_seed)
        self._setup_phases(hf, generator)
        self.async_engine = build.async_sampler(args, self.vllm, self.shared, self.backend.params_sharded,
                                                self.sampler, self.unwrapped.policy) if args.async_rollouts else None
        # each train() opens the rollout source on its prompt batches: synchronous, or async_rollouts' sampler thread
        self.open_rollouts = build.rollout_source(args, self.rollout_phase, self.async_engine, self.accelerator.device)
        self.rollouts: SyncRollouts | AsyncRollouts | None = None  # the last train()'s source (async: its logs)
        self._resumed_draws: dict = {}  # what a checkpoint saved of async_rollouts' draws

    # ------------------------------------------------------------------------------------------------ setup steps
    def _setup_models(self) -> None:
        """Dropout off in every model, gradient checkpointing as configured, policy+value as one trained module, the
        optimizer and scheduler."""
        args = self.args
        scorers = [m for scorer in filter(None, (self.reward_scorer, self.eval_scorer)) for m in scorer.models.values()]
        for module in [self.policy_model, self.ref_model, self.value_model] + scorers:
            if isinstance(module, torch.nn.Module):
                disable_dropout(module)  # nn.Dropout modules and dropout rates held as numbers
                # bitsandbytes on AVX512-BF16 CPUs: no in-place repacking of 4-bit weights (it breaks LoRA gradients)
                disable_bnb_cpu_repack(module)
        if self.shared is not None:
            self.model = self.shared
        else:
            self.model = PolicyAndValueWrapper(self.policy_model, self.value_model)
        if args.gradient_checkpointing:
            # on the policy and the critic (one base for both when shared)
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or CHECKPOINTING_KWARGS)
            if self.is_peft_model:
                self.policy_model.enable_input_require_grads()
        self.model.config = self.policy_model.config
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)

    def _setup_callbacks_and_state(self, callbacks: list) -> None:
        """The callbacks (`builders.callbacks`) behind transformers' handler; the progress bar is PPOProgress (or
        printed logs with disable_tqdm); the trainer state and control."""
        args = self.args
        self.callbacks = callbacks
        self.callback_handler = CallbackHandler(self.callbacks, self.model, self.processing_class, self.optimizer,
                                                self.lr_scheduler)
        if args.disable_tqdm:
            self.add_callback(PrinterCallback)
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                if isinstance(cb, ExportableState)],
        )

    def _setup_trainer_internals(self) -> None:
        """The attributes `transformers.Trainer`'s methods that trl_ext calls read (save_model, the optimizer/RNG
        checkpoint helpers, create_model_card, init_hf_repo), as of transformers 5.18-5.24: `Trainer.__init__` is
        never run, so they are set here, in one place."""
        args = self.args
        self.current_flos = 0
        self.hp_search_backend = None
        self.is_deepspeed_enabled, self.is_fsdp_enabled = self.backend.deepspeed, self.backend.fsdp
        self.is_distributed_loading_by_transformers = False  # read by Trainer._save on non-zero ranks
        self.is_fsdp_xla_v1_enabled = False  # read by Trainer._load_optimizer_and_scheduler
        self.hub_model_id = None
        if args.push_to_hub:
            self.init_hf_repo()
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)

    def _prepare_models(self) -> None:
        """`accelerate.prepare` of the trained module and its optimizer, through the backend."""
        self.backend.prepare(self.unwrapped, self.optimizer, self.args)
        self.model, self.optimizer = self.backend.model, self.backend.optimizer
        self.group_roles = self.backend.group_roles

    def _place_frozen_models(self) -> None:
        """The reference and the reward models on the training device (DeepSpeed: wrapped for inference); then
        which model acts as the reference (`Reference`)."""
        for scorer in filter(None, (self.reward_scorer, self.eval_scorer)):
            for name, module in scorer.models.items():
                placed = self.backend.place_frozen(module)
                if placed is not module:
                    scorer.replace_model(name, placed)
        if self.ref_model is not None:
            self.ref_model = self.backend.place_frozen(self.ref_model)
        self.reference = Reference(self.ref_model, self.shared, self.is_peft_model, self.ref_adapter_name,
                                   self.model_adapter_name, self.args.temperature)

    def _setup_phases(self, hf, generator) -> None:
        """The phases of an iteration, each given only what it uses: the sampler (every draw of responses), the
        rollout (steps 1-7), the update (step 8) and the evaluator; `phases` announces them (progress, benchmarks)."""
        args = self.args
        self.phases = Phases()
        self.sampler = ResponseSampler(self.backend, self.reference, self.sampling, self.processing_class.pad_token_id,
                                       hf, generator, self.local_seed)
        more_prompts = MorePrompts(self.prompt_batches, self.train_dataset, self.data_collator, args.seed,
                                   self.accelerator.device)
        self.rollout_phase = RolloutPhase(args, self.backend, self.sampler, self.reference, self.reward_scorer,
                                          self.reward_normalizer, self.stop_token_id, self.phases,
                                          self.trunk_from_reference, more_prompts=more_prompts,
                                          multi_turn=self.multi_turn)
        self.update_phase = PPOUpdate(args, self.backend)
        self.evaluator = Evaluator(args, self.backend, self.sampler, self.reference, self.reward_scorer,
                                   self.eval_scorer, self.processing_class, self.eval_dataloader)

    # ------------------------------------------------------------------------------------------------ multi-turn
    def generate_turns(self, contexts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Inside rollout_func: one model turn for each context (token ids), at most max_new_tokens each, sampled
        as the trainer samples (HF generate or vLLM, seeded by process and step): [(ids up to and including the stop
        token, the sampler's log-probs)]."""
        generate = getattr(self.multi_turn, "generate", None)
        if generate is None:
            raise RuntimeError("generate_turns samples inside rollout_func, while the trainer makes a rollout.")
        return generate(contexts, max_new_tokens)

    @torch.no_grad()
    def run_episodes(self, dataset, seed: int = 0, batch_size: int = 32) -> list[dict]:
        """Play one episode per row of `dataset` (prompts in any form the trainer takes, with the columns the
        environments' reset reads) with the current policy, sampled as in training but from an RNG stream of its own
        (`seed`): the evaluation of tools and environments. Returns one dict per row: `messages` (TRL's
        conversational completion), `turns`, `tool_calls`, `tool_failures`, `truncated` and `reward` (the
        environment's get_reward, None without one)."""
        if not isinstance(self.multi_turn, MultiTurn):
            raise ValueError("run_episodes plays episodes with tools or environment_factory; this trainer has none.")
        generate = self.sampler.turn_generator(self.state.global_step, seed=seed)
        return self.multi_turn.episodes(dataset, generate, self.backend, batch_size)

    # ------------------------------------------------------------------------------------------------ helpers
    def create_optimizer(self, model=None):
        """Trainer's optimizer, each of its parameter groups split into the policy's and the value model's (tagged
        "role"; the value groups at `critic_learning_rate` if set): critic warmup under DeepSpeed freezes the policy's
        groups (trl_ext/trainer/backend.py)."""
        optimizer = super().create_optimizer(model)
        critic_lr = self.args.critic_learning_rate
        value_ids = {id(p) for p in self.unwrapped.value_parameters()}
        groups = []
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for role in ("policy", "value"):
                params = [p for p in group["params"] if (id(p) in value_ids) == (role == "value")]
                if params:
                    lr = critic_lr if role == "value" and critic_lr is not None else settings["lr"]
                    groups.append({**settings, "params": params, "lr": lr, "role": role})
        optimizer.param_groups[:] = groups
        return optimizer

    @property
    def unwrapped(self) -> PolicyAndValueWrapper:
        """The policy+value wrapper without its DDP/DeepSpeed shell."""
        return self.accelerator.unwrap_model(self.model)

    def null_ref_context(self):
        """The policy acts as the reference: its adapter disabled (peft), or the reference adapter selected."""
        return self.reference.context(self.unwrapped.policy)

    def write_samples(self, rollout: Rollout, max_rows: int = 4) -> None:
        """Append a few of this rollout's prompts, completions and scores to output_dir/samples.jsonl."""
        if not self.is_world_process_zero():
            return
        records = sample_records(rollout, self.processing_class, self.state.global_step, max_rows)
        append_jsonl(os.path.join(self.args.output_dir, SAMPLES_FILE), records)

    # ------------------------------------------------------------------------------------------------ the phases
    def rollout(self, queries: torch.Tensor, query_mask: torch.Tensor, extra_columns: dict | None = None,
                drawn: tuple | None = None) -> Rollout:
        """Steps 1-7 of a PPO iteration on a batch of left-padded prompts: (B, Q) ids and (B, Q) bool mask, rewards
        shaped with the current β (trl_ext/trainer/rollout.py). extra_columns: other dataset columns of these
        prompts (lists), passed to reward functions. drawn: the responses, their mask and the sampler's log-probs
        drawn already (async_rollouts)."""
        return self.rollout_phase.run(queries, query_mask, extra_columns, kl_coef=self.kl_ctl.value,
                                      step=self.state.global_step, trainer_state=self.state, drawn=drawn)

    def ppo_update(self, rollout: Rollout, critic_only: bool = False) -> UpdateStats:
        """Step 8: `num_ppo_epochs` passes over the rollout in shuffled minibatches, clipped policy and value losses,
        each role's gradients clipped to `max_grad_norm` (trl_ext/trainer/update.py). critic_only (critic warmup):
        only the value model learns."""
        with self.phases("critic_warmup" if critic_only else "update"):
            return self.update_phase.run(rollout, critic_only, self.vf_coef, self.state.global_step)

    @property
    def vf_coef(self) -> float:
        """The value loss's weight at this iteration: vf_coef, or linear from vf_coef to vf_coef_end over the run."""
        return vf_coef_at(self.args, self.state.global_step)

    # ------------------------------------------------------------------------------------------------ logging
    def metrics(self, rollout: Rollout, stats: UpdateStats, kl_coef: float, warmup: bool,
                run: tuple[int, float], iteration_seconds: float) -> dict:
        """Step 9: TRL's metric keys and trl_ext's (trl_ext/monitoring/diagnostics.py), over real tokens and all
        processes (an evaluation's are added where one runs).
        kl_coef: the β this rollout's rewards were shaped with; run: (episodes, seconds) since train() started (TRL's
        `eps`, episodes per second); iteration_seconds: this iteration's rollout and update."""
        gather = self.backend.gather
        m = rollout_metrics(rollout, kl_coef, self.stop_token_id, gather)
        if rollout.source_scores is not None:
            m.update(source_metrics(rollout.source_scores, self.reward_scorer.names, gather))
        m.update(update_metrics(stats, self.backend.sum_over_processes, gather))
        m.update(rollout.draw_metrics)  # num_generations, dynamic_sampling, multi-turn
        m["val/warmup"] = float(warmup)
        m.update(self.prompt_counts)
        m["lr"] = self.lr_scheduler.get_last_lr()[0]
        if self.args.vf_coef_end is not None:
            m["val/vf_coef"] = self.vf_coef  # the weight this update's value loss had
        m["episode"] = self.state.episode
        m["eps"] = run[0] / max(run[1], 1e-9)
        m["perf/tokens_per_second"] = m["rollout/tokens"] / iteration_seconds  # real tokens of all processes
        m.update(grpo_metrics(m, self.reward_scorer.names))  # GRPOTrainer's names of the same numbers
        return m

    # ------------------------------------------------------------------------------------------------ train
    def _init_state(self):
        args = self.args
        self.critic_warmup_ended = False  # critic_warmup_explained_variance reached (`_in_critic_warmup`)
        self.weight_growth = WeightGrowth()  # where a blow-up of the policy's weights began (the advice after one)
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.episodes_per_epoch
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value) if value < 1 else value)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Run PPO. `resume_from_checkpoint`: a checkpoint folder, or True for the latest in `output_dir`."""
        args = self.args
        self.model.train()
        self._init_state()
        if resume_from_checkpoint:
            self.checkpoints.resume(self, resume_from_checkpoint)
        else:
            self.checkpoints.start_timeline()
        self.weight_growth.observe(self.state.global_step, self.backend.policy_weights_norm())
        self.prompt_batches.start_batch = self.state.global_step  # iteration k uses global batch k
        batches = iter(self.dataloader)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model
            self.model_wrapped = self.model
        start_time, start_episode, start_step = time.time(), self.state.episode, self.state.global_step
        progress = PPOProgress(args.num_total_batches, initial=self.state.global_step,
                               disable=args.disable_tqdm or not self.is_world_process_zero())
        self.phases.add(progress)

        self.rollouts = self.open_rollouts(batches, first_step=self.state.global_step, saved=self._resumed_draws)
        self.rollouts.start(self.unwrapped.policy)
        try:
            with Preemption() as preemption:
                self._train_loop(progress, start_time, start_episode, preemption)
            progress.close()
            self.phases.listeners.remove(progress)
            output = self._train_output(start_step, time.time() - start_time)
            self.log(dict(output.metrics))  # the last log_history entry, as transformers' Trainer (GRPO) logs it
            self.control = self.callback_handler.on_train_end(args, self.state, self.control)
            if self.control.should_save:  # (a run stopped early: the sampler's older draws still go in)
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        finally:
            self.rollouts.close()  # (async: the sampler stops after its current draw)
        return output

    def _train_output(self, start_step: int, seconds: float) -> TrainOutput:
        """What transformers' Trainer.train returns and logs last (GRPO scripts read and save its metrics):
        `train_loss` is the mean over this call's iterations of the loss PPO minimised, loss/policy_avg + vf_coef x
        loss/value_avg."""
        steps = [h for h in self.state.log_history if "loss/policy_avg" in h and h.get("step", 0) > start_step]
        losses = [h["loss/policy_avg"] + h.get("val/vf_coef", self.args.vf_coef) * h["loss/value_avg"] for h in steps]
        loss = sum(losses) / len(losses) if losses else float("nan")
        done = self.state.global_step - start_step
        metrics = {"train_runtime": seconds, "train_samples_per_second": done * self.args.batch_size / seconds,
                   "train_steps_per_second": done / seconds, "train_loss": loss, "epoch": self.state.epoch}
        return TrainOutput(self.state.global_step, loss, metrics)

    def _in_critic_warmup(self, rollout: Rollout) -> bool:
        """Whether this iteration trains the critic alone: the first critic_warmup_steps iterations, or with
        critic_warmup_explained_variance until the first rollout whose explained variance reaches it (then never
        again: `critic_warmup_ended`, kept in checkpoints)."""
        args = self.args
        if self.critic_warmup_ended or self.state.global_step >= args.critic_warmup_steps:
            return False
        if args.critic_warmup_explained_variance is not None:
            explained, _ = value_fit(rollout, self.backend.gather)
            self.critic_warmup_ended = explained >= args.critic_warmup_explained_variance
        return not self.critic_warmup_ended

    def _train_loop(self, progress, start_time: float, start_episode: int, preemption: Preemption) -> None:
        """The iterations from the current global step on; each ends at a safe boundary where a signal received
        (`preemption`) saves a checkpoint and exits the process with status 0."""
        args = self.args
        for update in range(self.state.global_step + 1, args.num_total_batches + 1):
            iteration_start = time.perf_counter()
            self.state.episode += args.batch_size
            kl_coef = self.kl_ctl.value
            # 1-7. rollout: generate (async_rollouts: the sampler thread's draw), score, shape rewards with the
            # current β, advantages
            try:
                rollout = self.rollouts.next(self.state.global_step, kl_coef, self.state)
            except FloatingPointError as e:  # the sampler met NaN/inf probabilities
                raise FloatingPointError(f"Iteration {update}: {e} Likely cause: learning_rate={args.learning_rate:g} "
                                         f"too high. {recovery_advice(args.output_dir, self.weight_growth)}") from e
            # 8. PPO epochs (value model only during critic warmup)
            warmup = self._in_critic_warmup(rollout)
            try:
                stats = self.ppo_update(rollout, critic_only=warmup)
            except FloatingPointError as e:  # on_nonfinite: no finite step to take
                raise FloatingPointError(f"{e} {recovery_advice(args.output_dir, self.weight_growth)}") from e
            self.rollouts.publish(self.unwrapped.policy, self.state.global_step + 1)  # (async: if a batch needs it)
            # 9. metrics; then adapt β for the *next* rollout from this batch's per-sequence KL
            run = (self.state.episode - start_episode, time.time() - start_time)
            metrics = self.metrics(rollout, stats, kl_coef, warmup, run, time.perf_counter() - iteration_start)
            self.kl_ctl.update(mean_sequence_kl(rollout, self.backend.gather), args.batch_size)
            self.state.epoch = self.state.episode / self.episodes_per_epoch
            self.state.global_step += 1
            self.weight_growth.observe(self.state.global_step, self.backend.policy_weights_norm())
            if self._should_evaluate():
                metrics.update(self.evaluate_policy())
            self.log(metrics)
            progress.step(metrics)

            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.write_samples(rollout)
                self.generate_completions(sampling=True)
            elif args.log_completions:  # GRPO's: a few rows of every iteration's rollout (each iteration logs)
                self.write_samples(rollout)
            saved = self.control.should_save
            if saved:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if preemption.requested(self.backend):
                if not saved:
                    self._save_checkpoint(self.model, trial=None)
                folder = os.path.join(args.output_dir, f"checkpoint-{self.state.global_step}")
                if self.accelerator.is_main_process:
                    print(f"[trl_ext] {preemption.received or 'a signal to another process'}: saved {folder} at "
                          f"iteration {self.state.global_step} of {args.num_total_batches}; exiting with status 0. "
                          "Resume with train(resume_from_checkpoint=True).", flush=True)
                raise SystemExit(0)
            if self.control.should_training_stop:
                break

    # ------------------------------------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy (its adapter, with peft) for inference, under DDP, DeepSpeed or FSDP2 (every process
        calls this). A shared base saves `policy/` and `critic/` (peft adapters) and `value_head.safetensors`."""
        output_dir = output_dir or self.args.output_dir
        self.backend.save_roles(output_dir, self.processing_class, self._save_policy, with_value_model=False)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_policy(self, folder: str, state_dict: dict | None) -> None:
        """`Trainer._save` of the policy: its weights (`state_dict`, or its own), config, tokenizer, training args."""
        wrapped, self.model = self.model, self.unwrapped.policy
        try:
            Trainer._save(self, folder, state_dict=state_dict)
        finally:
            self.model = wrapped

    def _should_evaluate(self) -> bool:
        steps = self.state.eval_steps or self.args.logging_steps
        return (self.eval_dataloader is not None and self.args.eval_strategy != "no"
                and (self.state.global_step % max(int(steps), 1) == 0
                     or self.state.global_step == self.args.num_total_batches))

    def _write_model_card(self) -> None:
        """`output_dir/README.md`, the model card TRL's trainers write with every checkpoint (TRL's
        `create_model_card`: base model, tags, how to cite PPO), named after the output folder or `hub_model_id`."""
        args = self.args
        model_name = Path(args.output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]
        wrapped, self.model = self.model, self.unwrapped  # TRL reads self.model.config, which DDP's shell hides
        try:
            self.create_model_card(model_name=model_name)
        finally:
            self.model = wrapped

    def _save_checkpoint(self, model, trial):
        """transformers' hook: `checkpoint-N`, written by the run's room (`checkpoints.save`, checkpoint.py)."""
        self.checkpoints.save(self)

    # ------------------------------------------------------------------------------------------------ evaluation
    @property
    def alarms_raised(self) -> list:
        """Every `trl_ext.monitoring.alarms.Alarm` the run has raised so far (empty with `alarms=False`)."""
        return [a for cb in self.callback_handler.callbacks if isinstance(cb, AlarmCallback) for a in cb.monitor.raised]

    def evaluate_policy(self) -> dict[str, float]:
        """Held-out evaluation on `eval_dataset` (trl_ext/trainer/evaluation.py): completions of the policy and of
        the reference for each prompt, scored by the training reward and, if given, by `eval_reward` (a gold scorer
        the policy never trains on).

        eval/score, eval/score_ref: mean scores; eval/win_rate_vs_ref: share of prompts where the policy's completion
        scores higher than the reference's (ties count half); eval/kl: mean per-sequence KL(π‖π_ref) (k1) of the
        policy's completions; eval/gold_* the same with `eval_reward`."""
        with self.phases("evaluation"):
            return self.evaluator.evaluate(self.state.global_step, self.state)

    def paired_completions(self, dataset, seed: int, batch_size: int | None = None) -> list[dict]:
        """For each prompt of `dataset` (any prompt dataset the trainer takes: a `prompt` column of text or chat
        messages, or `input_ids`), one completion of the reference ("before" training) and one of the policy, drawn
        with the same random numbers from an RNG stream of their own (`seed`; the training RNG is untouched):
        identical models give identical completions. Runs on this process, in dataset order.

        Returns one dict per prompt: "query" (the rendered prompt, special tokens left out), "reference" and "policy"
        (the completions as the reward functions get them)."""
        return self.evaluator.paired_completions(dataset, seed, batch_size or self.args.per_device_eval_batch_size,
                                                 self.state.global_step)

    def generate_completions(self, sampling: bool = False):
        """Print a few completions of `eval_dataset` prompts with their scores (the first batch only if `sampling`).
        Drawn from an RNG stream of their own, so calling this never changes the training run."""
        if self.eval_dataloader is not None:
            self.evaluator.print_completions(self.state.global_step, self.state, first_batch_only=sampling)
