"""The set-up of a `PPOTrainer` as builders: each reads the config and what the user passed and returns one
collaborator (the stop token, the multi-turn engine, the prompts, the rewards, the policy and reference, the critic,
the accelerator, the callbacks, the dataloaders, the critic's trunk source, the vLLM sampler, the async sampler, the
rollout source), or raises the error that names the setting and its fix. `PPOTrainer.__init__` calls them in order,
the order random numbers are drawn in; what needs transformers' Trainer itself (the optimizer, the callback handler,
the state) stays there. The checks of two settings that need only the config are `PPOConfig`'s; those here need the
models or data.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch.utils.data import DataLoader
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS
from transformers.utils import is_peft_available

from ..config import PPOConfig
from ..core import make_kl_controller
from ..data.batches import PromptBatches
from ..data.prompts import LeftPaddingCollator, left_padding_tokenizer, prepare_prompts
from ..models import (
    POLICY,
    FrozenTrunk,
    Padded,
    SharedBaseModels,
    build_shared_base,
    build_value_model,
    cast_lm_head_to_fp32,
    check_padding_free,
    freeze_backbone,
    is_quantized,
    lm_logits,
    lora_for_quantized_value_model,
    probe_batch,
    scalar_head_outputs,
)
from ..monitoring.alarms import AlarmCallback, profile_thresholds
from ..monitoring.callbacks import MetricsFileCallback
from ..rewards import RewardNormalizer, RewardScorer, has_score_head, is_reward_function
from ..rewards.functions import GRPORewardFunction
from .async_rollouts import AsyncRollouts, ServerSampler, ThreadSampler
from .backend import reference_copy
from .generators import HFGenerate, VLLMGenerate, colocated_vllm, server_vllm
from .multi_turn import MultiTurn, RolloutFunction
from .rollout import SyncRollouts

if is_peft_available():
    from peft import PeftModel, get_peft_model


def _exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}; choose sizes so that it is.")
    return a // b


# ------------------------------------------------------------------------------------------------ the arguments
@dataclass
class Call:
    """The trainer's arguments after GRPOTrainer's call is read as TRL 1.12 PPO's (`grpo_call`)."""
    args: PPOConfig
    processing_class: Any
    model: Any
    reward_model: Any


def grpo_call(args, processing_class, model, reward_model, reward_funcs, quantization_config) -> Call:
    """GRPOTrainer's call (TRL 1.16) as PPO's: `model` a name or path loaded as TRL loads it (`create_model_from_path`
    with `model_init_kwargs` and `quantization_config`), `reward_funcs` the rewards, `args=None` a default config
    named after the model, `processing_class=None` the model's tokenizer, left-padded, EOS as pad if it has none.
    `PPOTrainer(model, reward_funcs, args, ...)` positionally: GRPO's first three arguments."""
    if isinstance(args, (str, os.PathLike, torch.nn.Module)):  # GRPO's positional order: model, reward_funcs, args
        if model is not None and not isinstance(model, PPOConfig):
            raise TypeError(f"PPOTrainer({name_of(args) if isinstance(args, torch.nn.Module) else args!r}, ...) reads "
                            "GRPOTrainer's positional order (model, reward_funcs, args); its third argument must be "
                            f"a PPOConfig, got {type(model).__name__}: pass the others by name.")
        if reward_funcs is None:  # the second positional argument sits where PPO has processing_class
            reward_funcs, processing_class = processing_class, None
        args, model = model, args
    if reward_funcs is not None:
        if reward_model is not None:
            raise ValueError("reward_funcs (GRPO's name) and reward_model (PPO's) are both given: pass the rewards "
                             "once (either name takes functions, models, paths or a list).")
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]  # called as GRPOTrainer calls them
        reward_model = [GRPORewardFunction(f) if is_reward_function(f) else f for f in funcs]
    if model is None:
        raise ValueError("`model` is required: a model, a PeftModel, or a name or path (loaded as GRPOTrainer loads "
                         "it).")
    if args is None:
        name = (model if isinstance(model, (str, os.PathLike)) else name_of(model)).rstrip("/").split("/")[-1]
        args = PPOConfig(output_dir=f"{name}-PPO")
    if not isinstance(args, PPOConfig):  # (check_arguments names it)
        return Call(args, processing_class, model, reward_model)
    if isinstance(model, (str, os.PathLike)):
        kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in kwargs:
                raise ValueError("quantization_config is given both as an argument and in args.model_init_kwargs: "
                                 "give it once (as the argument).")
            kwargs["quantization_config"] = quantization_config
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model = load_causal_lm(str(model), kwargs)
    elif args.model_init_kwargs or quantization_config is not None:
        raise ValueError("model_init_kwargs / quantization_config load a model given by name or path; `model` is "
                         "a model object already: load it with them yourself, or pass its name.")
    if processing_class is None:
        processing_class = left_padding_tokenizer(name_of(model), args.trust_remote_code)
    return Call(args, processing_class, model, reward_model)


def load_causal_lm(path: str, kwargs: dict):
    """A policy given by name or path, loaded as GRPOTrainer loads one (TRL's create_model_from_path, which is not
    public API across TRL 1.12-1.16): `dtype` a torch dtype, 'auto' or its name, float32 unless given."""
    from transformers import AutoModelForCausalLM

    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"model_init_kwargs dtype={dtype!r} is not 'auto', 'bfloat16', 'float16' or 'float32'.")
        kwargs["dtype"] = getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def check_arguments(args, tokenizer, model, ref_model, train_dataset) -> None:
    if not isinstance(args, PPOConfig):
        raise TypeError(f"`args` must be a trl_ext.PPOConfig, got {type(args).__name__}: import PPOConfig from "
                        "trl_ext alongside PPOTrainer.")
    if train_dataset is None:
        raise ValueError("`train_dataset` is required.")
    if ref_model is model:
        raise ValueError("`model` and `ref_model` cannot be the same object: pass a copy, or `None` (a frozen "
                         "copy is made, or with peft the adapter is disabled).")
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token: set `tokenizer.pad_token` (e.g. to its EOS token).")


def shared_base(args, model, ref_model, value_model, peft_config) -> SharedBaseModels | None:
    """The shared base (trl_ext.models.build_shared_base: one base model, every role an adapter of it): `model` if
    it is one, checked against the other arguments; one made for a 4-bit/8-bit policy given with a peft_config and
    no critic or reference (the QLoRA recipes' layout: a second quantized copy for the critic would double the base's
    memory, and its embeddings could not be trained); else None."""
    if not isinstance(model, SharedBaseModels):
        if not (is_quantized(model) and peft_config is not None and value_model is None and ref_model is None
                and args.value_model_init in (None, "policy") and not args.ref_adapter_name
                and not (is_peft_available() and isinstance(model, PeftModel))):
            return None
        shared = build_shared_base(model, peft_config, value_head_init=args.value_head_init or "zero")
        trainable = sum(p.numel() for p in shared.value_parameters())
        made_for_you(f"critic: a 'critic' LoRA adapter (the peft_config's) and a new zero-initialised value head on "
                     f"the policy {name_of(model)}'s quantized base, shared with the policy's adapter "
                     f"(trl_ext.models.build_shared_base), {trainable:,} trainable parameters (pass a shared base "
                     "or value_model=... to use your own)")
        made_for_you("reference: the shared base with its adapters disabled (no copy)")
        return shared
    if peft_config is not None:
        raise ValueError("A shared-base model already carries its adapters: pass peft_config=None (give the "
                         "LoraConfigs to build_shared_base).")
    if ref_model is not None:
        raise ValueError("With a shared-base model the reference is the base with its adapters disabled: pass "
                         "ref_model=None.")
    if value_model is not None or args.value_model_init not in (None, "given"):
        raise ValueError("With a shared-base model the critic is its 'critic' adapter and value head: pass "
                         "value_model=None and leave value_model_init at 'given'.")
    if args.ref_adapter_name:
        raise ValueError(f"ref_adapter_name={args.ref_adapter_name!r} is not used with a shared-base model (the "
                         "reference is the base with adapters disabled): unset it.")
    return model


def stop_token_id(args, tokenizer) -> int | None:
    """By default generation stops at EOS, and the stop token is a real response token."""
    if args.stop_token_id is not None:
        stop = args.stop_token_id
    elif args.stop_token == "none":
        stop = None
    else:
        stop = tokenizer.eos_token_id
    if args.missing_eos_penalty and stop is None:  # 0: no penalty, as in TRL
        raise ValueError(f"missing_eos_penalty={args.missing_eos_penalty} is set but there is no stop token "
                         "(stop_token='none'): set a stop token or drop the penalty.")
    if args.mask_truncated_completions and stop is None:
        raise ValueError("mask_truncated_completions=True leaves completions without a stop token out of the "
                         "policy loss, but there is no stop token (stop_token='none'): every completion would be "
                         "left out. Set a stop token or drop the setting.")
    return stop


def multi_turn(args, tokenizer, stop, tools, environment_factory, rollout_func, eval_dataset, trainer):
    """Conversations with tools and environments (`MultiTurn`), the user's rollout_func (`RolloutFunction`, which
    hands `trainer` to it, as TRL's GRPOTrainer does), or None (trl_ext/trainer/multi_turn.py)."""
    engine = None
    if rollout_func is not None:
        if tools or environment_factory is not None:
            raise ValueError("rollout_func makes the conversations itself: pass it alone, without tools or "
                             "environment_factory (call them from inside rollout_func).")
        engine = RolloutFunction(rollout_func, trainer, args, tokenizer.pad_token_id)
    elif tools or environment_factory is not None:
        engine = MultiTurn(tokenizer, args, tools, environment_factory, tokenizer.pad_token_id, stop)
    if engine is None:
        return None
    if stop is None and isinstance(engine, MultiTurn):
        raise ValueError("multi-turn rollouts end each model turn at the stop token, but there is none "
                         "(stop_token='none'): set a stop token (the chat template's end of turn).")
    if args.async_rollouts:
        raise ValueError("async_rollouts=True draws single-turn responses in its own thread; multi-turn "
                         "rollouts (tools, environment_factory, rollout_func) are drawn in step: set "
                         "async_rollouts=False.")
    if eval_dataset is not None:
        raise ValueError("evaluation (eval_dataset) samples single-turn answers, which would not be the episodes "
                         "trained on: drop eval_dataset with tools, environment_factory or rollout_func, and "
                         "evaluate episodes yourself with trainer.run_episodes (docs/multi-turn.md).")
    return engine


# ------------------------------------------------------------------------------------------------ data, rewards
@dataclass
class Prompts:
    """The prompt datasets as the trainer uses them, their collator, the columns that travel with each prompt to
    the rewards, and how many prompts were cut or dropped."""

    train_dataset: object
    eval_dataset: object
    collator: object
    own_collator: bool  # trl_ext's collator: the prompts' lengths and columns are known
    columns: tuple[str, ...] = ()
    counts: dict = field(default_factory=lambda: {"data/prompts_truncated": 0, "data/prompts_dropped": 0})


def prompts(args, tokenizer, engine, train_dataset, eval_dataset, data_collator) -> Prompts:
    """A `prompt` column of text or of chat messages, or TRL's `input_ids`; left-padded here, whatever the
    tokenizer's padding side. A custom data_collator gets the dataset as given (and must left-pad)."""
    if data_collator is not None:
        return Prompts(train_dataset, eval_dataset, data_collator, own_collator=False)
    tools = engine.prompt_tools if isinstance(engine, MultiTurn) else None
    prepared = prepare_prompts(train_dataset, tokenizer, args.max_prompt_length, args.prompt_truncation, tools=tools,
                               chat_template_kwargs=args.chat_template_kwargs)
    counts = {"data/prompts_truncated": prepared.num_truncated, "data/prompts_dropped": prepared.num_dropped}
    if prepared.num_truncated or prepared.num_dropped:
        print(f"[trl_ext] prompts longer than max_prompt_length={args.max_prompt_length}: "
              f"{prepared.num_truncated} cut from the left after their head, {prepared.num_dropped} dropped")
    if eval_dataset is not None:
        eval_dataset = prepare_prompts(eval_dataset, tokenizer, args.max_prompt_length, args.prompt_truncation,
                                       chat_template_kwargs=args.chat_template_kwargs).dataset
    columns = tuple(prepared.extra_columns)
    return Prompts(prepared.dataset, eval_dataset, LeftPaddingCollator(tokenizer, columns), True, columns, counts)


@dataclass
class Rewards:
    scorer: RewardScorer  # the training reward: every source, weighted
    normalizer: RewardNormalizer
    eval_scorer: RewardScorer | None  # the gold scorer of evaluation (`eval_reward`), never trained on


def rewards(args, tokenizer, engine, reward_model, reward_processing_classes, eval_reward, eval_dataset) -> Rewards:
    """Models (the policy's tokenizer or their own), functions, or a weighted list (trl_ext/rewards/); an
    environment's get_reward and DAPO's overlong punishment as further sources; the score conditioning; an optional
    gold scorer for evaluation only."""
    weights = args.reward_weights
    environment_rewards = engine.reward_functions() if engine is not None else []
    if reward_model is None and not environment_rewards:
        raise ValueError("`reward_model` is required: a sequence-classification model, a function "
                         "(prompts: list[str], completions: list[str], **columns) -> list[float], or a list "
                         "(or None with an environment_factory whose environments define get_reward).")
    if environment_rewards:  # TRL's: each environment class with get_reward is one more source, weight 1
        sources = [] if reward_model is None else RewardScorer._as_list(reward_model)
        if isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [*reward_processing_classes, *[None] * len(environment_rewards)]
        weights = None if weights is None else [*weights, *[1.0] * len(environment_rewards)]
        reward_model = [*sources, *environment_rewards]
    if args.overlong_buffer_len is not None:  # DAPO's soft overlong punishment: one more source, TRL's function
        from trl.rewards import get_soft_overlong_punishment

        sources = RewardScorer._as_list(reward_model)
        if isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [*reward_processing_classes, None]
        punishment = get_soft_overlong_punishment(args.response_length, args.overlong_buffer_len)
        reward_model = [*sources, punishment]
        weights = [*(weights or [1.0] * len(sources)), args.overlong_penalty_factor]
    scorer = RewardScorer(reward_model, tokenizer, weights, reward_processing_classes, padding_free=args.padding_free)
    normalizer = RewardNormalizer(args.reward_norm, args.reward_norm_mean, args.reward_norm_std, args.reward_clip)
    if eval_reward is not None and eval_dataset is None:
        raise ValueError("eval_reward is set but there is no eval_dataset to evaluate on: pass eval_dataset.")
    return Rewards(scorer, normalizer, RewardScorer(eval_reward, tokenizer) if eval_reward is not None else None)


# ------------------------------------------------------------------------------------------------ the models
# The top decoder layers a critic made for you trains (value_trainable_layers unset), measured on the quickstart
# (docs/results.md, "The critic made for you"); its lower layers are the reference's (FrozenTrunk).
MADE_CRITIC_LAYERS = 6


def critic(args, shared, value_model, policy, peft_config, scorer: RewardScorer, tokenizer):
    """The critic, built before PEFT touches the policy (value_model_init="policy" copies the plain backbone), with
    only its top `value_trainable_layers` trained (unset: MADE_CRITIC_LAYERS for a made one, all of a given one)."""
    if shared is not None:
        if args.value_trainable_layers is not None:
            raise ValueError(f"value_trainable_layers={args.value_trainable_layers} trains a critic's top layers; "
                             "a shared base's critic is a LoRA adapter on every layer: unset it.")
        return shared.value_model  # the critic adapter + value head
    init = args.value_model_init or ("given" if value_model is not None else "policy")
    source = _reward_model_for_critic(scorer, tokenizer) if init == "reward_model" else None
    built = build_value_model(init, args.value_head_init, value_model, policy, source)
    layers = args.value_trainable_layers
    if layers is None and value_model is None and has_decoder_layers(built) and not is_quantized(built):
        layers = min(MADE_CRITIC_LAYERS, len(_decoder_layers(built)))
    if layers is not None and layers >= 0:
        if is_quantized(built):
            raise ValueError(f"value_trainable_layers={layers}: the critic is quantized, so it trains a LoRA "
                             "adapter, not its top layers: unset value_trainable_layers.")
        freeze_backbone(built, layers)  # (names the fix for a critic without Llama-style layers)
    if value_model is None:
        source_name = f"policy {name_of(policy)}" if init == "policy" else f"reward model {name_of(source)}"
        trained = (f"its top {layers} of {len(_decoder_layers(built))} decoder layers, final norm and head trained"
                   if layers is not None and layers >= 0 else "all of it trained")
        trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
        made_for_you(f"critic: {type(built).__name__}, the {source_name}'s backbone with a new 1-output head "
                     f"({args.value_head_init or 'zero'}-initialised), {trained}: {trainable:,} trainable parameters "
                     "(value_trainable_layers=N to change; pass value_model=... to use your own)")
    # a 4-bit/8-bit critic trains LoRA + its head, never its embeddings and norms in full
    return lora_for_quantized_value_model(built, peft_config)


def _decoder_layers(model) -> list:
    return list(getattr(getattr(model, model.base_model_prefix, None), "layers", None) or [])


def has_decoder_layers(model) -> bool:
    """A Llama-style sequence classifier (`<prefix>.layers`, `.norm`, `score`): what freeze_backbone can split."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return bool(_decoder_layers(model)) and hasattr(backbone, "norm") and hasattr(model, "score")


def name_of(model) -> str:
    """A model's name or path, as from_pretrained was given it (TRL's get_config_model_id), or its class."""
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def made_for_you(line: str) -> None:
    """What set-up built because the call did not pass it, printed once (main process)."""
    if int(os.environ.get("RANK", "0")) == 0:  # (before the Accelerator exists; launchers set RANK)
        print(f"trl_ext: {line}.")


def _reward_model_for_critic(scorer: RewardScorer, tokenizer):
    """The reward model value_model_init="reward_model" copies: the one reward model, which must read the
    policy's token ids (the critic reads them through its embedding table)."""
    models = scorer.models
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
    own = scorer.tokenizer_of(name)
    if own is not None and own.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"value_model_init='reward_model' copies {name!r}, which has its own tokenizer with "
                         "another vocabulary: the critic reads the policy's token ids, which mean other tokens in "
                         "its embedding table. Use value_model_init='policy', or pass a value_model that shares "
                         "the policy's tokenizer.")
    return reward_model


def policy_and_reference(args, model, ref_model, peft_config):
    """-> (policy, reference, is_peft): the policy with its PEFT adapter, and the reference: the given model, None
    (the policy with its adapter disabled, peft) or a frozen copy."""
    policy = model
    if args.cast_lm_head_to_fp32:  # before the adapter: a plain nn.Linear head
        cast_lm_head_to_fp32(model)
        if ref_model is not None:
            cast_lm_head_to_fp32(ref_model)
    if peft_config is not None:
        if not is_peft_available():
            raise ImportError("You passed `peft_config` but `peft` is not installed: `pip install peft`.")
        if isinstance(model, PeftModel):
            raise ValueError("You passed a PeftModel together with a `peft_config`: merge and unload the existing "
                             "adapter first, or pass the PeftModel without `peft_config`.")
        policy = get_peft_model(model, peft_config)
    is_peft = is_peft_available() and isinstance(policy, PeftModel)
    if is_quantized(policy) and not is_peft:
        raise ValueError("The policy is loaded in 4-bit/8-bit and has no adapter, so PPO could train only its "
                         "unquantized embeddings and norms: pass a peft_config (e.g. LoraConfig(r=16, "
                         "target_modules='all-linear')), or use trl_ext.models.build_shared_base.")
    if ref_model is None and not is_peft:
        ref_model = reference_copy(policy)  # a frozen deep copy (ZeRO-3 aware)
        made_for_you(f"reference: a frozen copy of the policy {name_of(policy)} (pass ref_model=... to use your own)")
    elif ref_model is None and not args.ref_adapter_name:
        made_for_you(f"reference: the policy {name_of(policy)} with its adapter disabled (no copy)")
    return policy, ref_model, is_peft


def check_positions(args, roles: dict, data: Prompts) -> int | None:
    """The longest prompt + response_length must fit each model's position limit (`max_position_embeddings` or
    `n_positions`): past it GPT-2's position table raises an IndexError mid-run, and a rotary model trains on
    positions it never learned. Returns the longest prompt's length (None: not known here)."""
    if data.own_collator:
        longest = max((len(ids) for d in (data.train_dataset, data.eval_dataset) if d is not None
                       for ids in d["input_ids"]), default=0)
    elif args.max_prompt_length is not None:
        longest = args.max_prompt_length
    else:
        return None  # a custom collator without max_prompt_length: the prompts' lengths are not known here
    need = longest + args.response_length
    for role, module in roles.items():
        config = getattr(module, "config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(limit, int) and need > limit:
            raise ValueError(f"The longest prompt has {longest} tokens and response_length={args.response_length}: "
                             f"{need} positions, beyond the {role}'s position limit ({type(module).__name__}: "
                             f"{limit}). Set max_prompt_length <= {limit - args.response_length} (longer prompts are "
                             "cut from the left), or lower response_length.")
    return longest


def check_packing(args, longest_prompt: int | None, policy, ref_model, value_model, scorer: RewardScorer) -> None:
    """padding_free: every model that runs packed gives its padded outputs on a probe (`check_padding_free`);
    a token budget holds the longest row (prompt + response_length)."""
    if not args.padding_free:
        return
    budget = args.max_tokens_per_micro_batch
    if budget is not None and longest_prompt is not None and longest_prompt + args.response_length > budget:
        raise ValueError(f"max_tokens_per_micro_batch={budget} cannot hold the longest row: a prompt of "
                         f"{longest_prompt} tokens + response_length={args.response_length}. Raise it to at least "
                         f"{longest_prompt + args.response_length}, or set max_prompt_length.")
    check_padding_free(policy, "policy", lm_logits)
    if isinstance(ref_model, torch.nn.Module):
        check_padding_free(ref_model, "ref_model", lm_logits)
    for name, module in {"value_model": value_model, **scorer.models}.items():
        if has_score_head(module):
            check_padding_free(module, name, scalar_head_outputs)


# ------------------------------------------------------------------------------------------------ the engine
def batch_sizes(args, optimizer, episodes_per_epoch: int) -> None:
    """TRL's batch definitions per process, written into `args` as TRL's trainer did."""
    if optimizer is not None and args.critic_learning_rate is not None:
        raise ValueError("critic_learning_rate is set but you passed your own optimizer: give the value model's "
                         "parameters their learning rate in your optimizer's param groups, or drop the setting.")
    if args.generation_batch_size is not None and args.steps_per_generation is None:  # GRPO's name of the batch
        per_step = args.per_device_train_batch_size * int(os.environ.get("WORLD_SIZE", "1"))  # (launchers set it)
        if args.generation_batch_size % per_step:
            raise ValueError(f"generation_batch_size={args.generation_batch_size} must be a multiple of "
                             f"per_device_train_batch_size x processes = {per_step} (GRPO's rule).")
        args.use_steps_per_generation(args.generation_batch_size // per_step)
    if args.total_episodes is not None and args.max_steps > 0:
        raise ValueError(f"total_episodes={args.total_episodes} and max_steps={args.max_steps} both set the run's "
                         "length: set one (max_steps counts PPO iterations, one rollout batch each).")
    if args.total_episodes is None and args.max_steps <= 0:
        args.total_episodes = int(args.num_train_epochs * episodes_per_epoch)
    # One rollout batch per process = per_device_train_batch_size x gradient_accumulation_steps prompts; it splits
    # into num_mini_batches minibatches of micro-batches.
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.local_mini_batch_size = _exact_div(args.local_batch_size, args.num_mini_batches,
                                            "per-process batch (per_device_train_batch_size x "
                                            "gradient_accumulation_steps) must split into num_mini_batches")


def accelerator(args) -> Accelerator:
    """The Accelerator (one optimizer step per minibatch, the mixed precision); the sizes over all processes written
    into `args`."""
    # TRL's micro-batch rule: per_device_train_batch_size rows at a time, the last micro-batch of a minibatch
    # possibly smaller (a minibatch smaller than per_device_train_batch_size is one micro-batch)
    micro_batches_per_minibatch = math.ceil(args.local_mini_batch_size / args.per_device_train_batch_size)
    # One optimizer step per minibatch: accumulate over its micro-batches, never sync at the dataloader's end
    # (TRL accumulated over gradient_accumulation_steps micro-batches, straddling minibatches).
    built = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=micro_batches_per_minibatch,
                                                                sync_with_dataloader=False),
        mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
        cpu=args.use_cpu,
    )
    args.world_size = built.num_processes
    args.micro_batch_size = args.per_device_train_batch_size * args.world_size
    args.batch_size = args.local_batch_size * args.world_size
    args.mini_batch_size = args.local_mini_batch_size * args.world_size
    if args.total_episodes is None:  # max_steps iterations (GRPO's length: one optimizer step per generation)
        args.total_episodes = args.max_steps * args.batch_size
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    # GRPO's names of the rollout batch, read back as GRPO scripts read them
    args.steps_per_generation, args.generation_batch_size = args.gradient_accumulation_steps, args.batch_size
    return built


def kl_controller(args):
    """β: fixed, or adapted after each rollout batch (trl_ext/core/kl_control.py)."""
    controller = make_kl_controller(args.kl_controller, args.kl_coef, args.kl_target, args.kl_horizon)
    if args.kl_controller == "adaptive" and args.kl_horizon < args.batch_size:
        raise ValueError(f"kl_horizon={args.kl_horizon} is smaller than one rollout batch ({args.batch_size}); "
                         "the controller would move β by more than 20% per batch. Use a horizon of at least "
                         "the batch size (typical: 10000).")
    return controller


def callbacks(args, given) -> list:
    """Alarms first (they add alarm/<name> keys to the logs the others see); report_to adds TensorBoard/trackio/
    wandb; every run writes output_dir/metrics.jsonl."""
    given = list(given or [])
    alarms = [cb for cb in given if isinstance(cb, AlarmCallback)]
    if not alarms and args.alarms:
        alarms = [AlarmCallback(profile_thresholds(args.alarm_profile, args.alarm_thresholds))]
    given = [cb for cb in given if not isinstance(cb, AlarmCallback)]
    run_folder = [] if any(isinstance(cb, MetricsFileCallback) for cb in given) else [MetricsFileCallback()]
    return DEFAULT_CALLBACKS + alarms + get_reporting_integration_callbacks(args.report_to) + given + run_folder


def dataloaders(args, accelerator: Accelerator, params_sharded: bool, data: Prompts):
    """-> (prompt_batches, dataloader, eval_dataloader): the rollout dataloader (one seeded permutation per data
    epoch, shared by all processes, each taking its slice) and each process's share of eval_dataset (or None)."""
    prompt_batches = PromptBatches(len(data.train_dataset), args.local_batch_size, accelerator.num_processes,
                                   accelerator.process_index, args.seed, num_generations=args.num_generations)
    # (its own generator: creating the iterator must not draw from the global RNG that sampling uses)
    dataloader = DataLoader(data.train_dataset, batch_sampler=prompt_batches, collate_fn=data.collator,
                            generator=torch.Generator().manual_seed(args.seed))
    eval_dataset = data.eval_dataset
    if eval_dataset is None:
        return prompt_batches, dataloader, None
    # each process evaluates its own share of the prompts, in order; its own generator so that iterating it never
    # draws from the training RNG
    shard = torch.utils.data.Subset(eval_dataset, range(accelerator.process_index, len(eval_dataset),
                                                        accelerator.num_processes))
    if len(shard) == 0:
        raise ValueError(f"eval_dataset has {len(eval_dataset)} prompts, fewer than the "
                         f"{accelerator.num_processes} processes; add prompts.")
    if params_sharded and len(eval_dataset) % accelerator.num_processes:
        raise ValueError(f"eval_dataset has {len(eval_dataset)} prompts for {accelerator.num_processes} "
                         "processes: with sharded parameters (ZeRO-3, FSDP) every process must run the same "
                         "forward passes, so use a multiple of the process count (drop or add prompts).")
    eval_dataloader = DataLoader(shard, batch_size=args.per_device_eval_batch_size, collate_fn=data.collator,
                                 generator=torch.Generator().manual_seed(0))
    return prompt_batches, dataloader, eval_dataloader


# ------------------------------------------------------------------------------------------------ rollouts
def trunk_from_reference(args, backend, shared, unwrapped, ref_model, reference, vocab_size: int, device):
    """The critic's frozen lower layers run once per rollout, not again in each minibatch (`FrozenTrunk`, set on
    `unwrapped`); not with a shared base (one backbone for both roles) or under DeepSpeed/FSDP (their engines own
    the layers). Where the reference holds those same weights (a critic built from the policy's checkpoint, the
    reference the policy with its adapter off or a copy), the reference pass computes their output and they never
    run: returns that layer of the reference (else None)."""
    if shared is not None or backend.deepspeed or backend.fsdp:
        return None
    unwrapped.trunk = trunk = FrozenTrunk.of(unwrapped.value_model)
    source = ref_model if ref_model is not None else unwrapped.policy
    if trunk is None or args.ref_adapter_name or not trunk.same_weights_as(source):
        return None
    layer = trunk.reference_layer(source)
    # the same numbers on the reference's real path (its adapter disabled, its precision) or not at all
    inputs, responses = probe_batch(vocab_size, device)
    with torch.no_grad(), backend.accelerator.autocast():
        with trunk.capture(layer) as captured:
            reference.logprobs(unwrapped.policy, Padded.of(inputs, responses))
        own = trunk.hidden_states(inputs)
    if len(captured) == 1 and torch.allclose(captured[0].float(), own.float(), atol=1e-5, rtol=1e-4):
        return layer
    return None


def generators(args, backend, shared, reference, policy, tokenizer, sampling, local_seed: int):
    """What draws the responses (trl_ext/trainer/generators.py), chosen once: (HF generate, the rollouts' generator,
    the vLLM engine or None). The rollouts' generator is HF generate itself, or with use_vllm the colocated vLLM
    engine or the vLLM servers of vllm_mode='server'; HF generate draws evaluation's completions either way."""
    hf = HFGenerate(backend, args.local_rollout_forward_batch_size, args.ds3_gather_for_generation)
    if not args.use_vllm:
        return hf, hf, None
    accelerator = backend.accelerator
    if args.vllm_mode == "server":
        adapter = POLICY if shared is not None else args.model_adapter_name
        engine = server_vllm(args, policy, tokenizer, sampling, accelerator.device, backend.params_sharded,
                             accelerator, adapter)
    else:
        whole_policy = shared is None and not backend.params_sharded
        engine = colocated_vllm(args, policy, tokenizer, sampling, accelerator.device, whole_policy, local_seed,
                                accelerator.num_processes)
    return hf, VLLMGenerate(engine, backend, reference), engine


def rollout_source(args, phase, async_engine, device: torch.device):
    """How each iteration gets its Rollout, chosen once: `open(batches, first_step, saved)` -> a `SyncRollouts` (the
    trainer's thread draws each batch when it needs it) or, with async_rollouts, an `AsyncRollouts` (a sampler
    thread draws ahead with older policy versions; `saved`: its draws from a checkpoint)."""
    if async_engine is None:  # (nothing drawn ahead: where a run starts and what a checkpoint saved do not matter)
        return lambda batches, first_step, saved: SyncRollouts(phase, batches, device)
    return functools.partial(AsyncRollouts, async_engine, device=device, total_steps=args.num_total_batches,
                             max_staleness=args.max_staleness, weight_sync_steps=args.weight_sync_steps, phase=phase)


def async_sampler(args, vllm, shared, params_sharded: bool, sampler, policy):
    """The sampler of async_rollouts (trl_ext/trainer/async_rollouts.py): HF generate on a copy of the policy in
    a thread of its own, or the vLLM servers of vllm_mode='server'."""
    if vllm is None:
        if shared is not None or params_sharded:
            raise ValueError("async_rollouts=True with HF generate samples with a copy of the policy that "
                             "each process holds whole: not a shared 4-bit base, ZeRO-3 or FSDP (their "
                             "weights are shared or sharded). Use vllm_mode='server', a separate policy with "
                             "DDP or ZeRO-2, or async_rollouts=False.")
        return ThreadSampler(sampler, policy)
    if args.vllm_mode != "server":
        raise ValueError("async_rollouts=True with vllm_mode='colocate': the colocated engine shares the "
                         "trainer's device and process; use vllm_mode='server' (the sampler on GPUs or cores "
                         "of its own), or use_vllm=False (HF generate in a thread of its own).")
    if not vllm.is_peft:
        raise ValueError("async_rollouts=True with vllm_mode='server' keeps the policy versions still drawn "
                         "with side by side on the server, as LoRA adapters: train a LoRA policy (peft_config), "
                         "or use_vllm=False.")
    return ServerSampler(sampler)
