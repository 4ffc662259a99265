"""One base model for every PPO role: the policy, the critic and optionally the reward model are LoRA adapters of
one (4-bit) base, and the reference is the base with every adapter disabled (`build_shared_base`)."""

from __future__ import annotations

import copy
import dataclasses
import os
from contextlib import contextmanager

import torch
import torch.nn as nn

from .forward import lm_logits, output_device
from .preparation import CHECKPOINTING_KWARGS, disable_bnb_cpu_repack, is_checkpointing, set_checkpointing
from .value import scalar_head_outputs

POLICY, CRITIC, REWARD = "policy", "critic", "reward"  # adapter names of a shared base


class _AdapterBackbone:
    """Callable in TRL's backbone slot (`model.<base_model_prefix>(**inputs).last_hidden_state`): the shared base's
    decoder run with one adapter active. Not an nn.Module, so the views below own no base weights."""

    def __init__(self, shared: SharedBaseModels, adapter: str):
        self.shared, self.adapter = shared, adapter

    def __call__(self, **inputs):
        with self.shared.adapter(self.adapter):
            return self.shared.decoder(**inputs)


class SharedRoleModel(nn.Module):
    """A value or reward model that is one adapter of a shared base plus its own scalar head (`score`), in TRL's
    layout (`base_model_prefix`, backbone, `score`), so `scalar_head_outputs` and `RewardScorer` read it like any
    sequence-classification model. It owns only its head; the base lives in the `SharedBaseModels`."""

    base_model_prefix = "backbone"

    def __init__(self, shared: SharedBaseModels, adapter: str, head: nn.Linear):
        super().__init__()
        self.score = head
        self.adapter_name = adapter
        self.__dict__["backbone"] = _AdapterBackbone(shared, adapter)  # a plain attribute, not a submodule
        self.__dict__["shared"] = shared
        self.config = copy.copy(shared.policy.config)
        self.config._name_or_path = f"{adapter}_adapter"

    def adapter_parameters(self) -> list[nn.Parameter]:
        return self.shared.adapter_parameters(self.adapter_name)


class SharedBaseModels(nn.Module):
    """One base model (4-bit, 8-bit or bf16) serving every PPO role; build it with `build_shared_base`.

    - policy: the base with LoRA adapter "policy" (trained);
    - reference: the base with adapters disabled;
    - critic (`value_model`): the base with LoRA adapter "critic" (trained) and a scalar `value_head` (trained);
    - reward (`reward_model`, optional): the base with a frozen adapter "reward" and its frozen score head.

    Pass it as `PPOTrainer(model=shared, ref_model=None, value_model=None, reward_model=shared.reward_model or any
    other reward)`. Only the policy and critic adapters and the value head are trainable; the trainer's optimizer
    holds exactly those. The active adapter at rest is "policy" (generation and the policy forward use it); every
    other role switches with `adapter(name)` / `reference()` and switches back on exit.

    Gradient checkpointing recomputes a layer's forward during backward with whatever adapter is active *then*, so
    a role's backward must run inside its own `adapter(...)` context (`PPOTrainer.ppo_update` does: one backward per
    role).
    """

    def __init__(self, policy, value_head: nn.Linear, reward_head: nn.Linear | None = None):
        super().__init__()
        self.policy = policy  # the PeftModel: adapters "policy", "critic" (and "reward")
        self.value_model = SharedRoleModel(self, CRITIC, value_head)
        self._reward_model = SharedRoleModel(self, REWARD, reward_head) if reward_head is not None else None
        if self._reward_model is not None:
            self._reward_model.requires_grad_(False)
        self.gradient_checkpointing_kwargs: dict | None = None
        self._restore_trainable()

    # -- roles
    @property
    def decoder(self) -> nn.Module:
        """The base's transformer body (hidden states), with the LoRA layers inside it."""
        base = self.policy.get_base_model()
        return getattr(base, base.base_model_prefix)

    @property
    def reward_model(self) -> SharedRoleModel:
        if self._reward_model is None:
            raise ValueError("This shared base has no reward adapter: pass reward_adapter=... to build_shared_base, "
                             "or give the trainer another reward_model (a model or a function).")
        return self._reward_model

    @property
    def has_reward(self) -> bool:
        return self._reward_model is not None

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """The LoRA parameters of adapter `name` (in module order)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if name not in self.policy.peft_config:
            raise ValueError(f"no adapter {name!r}; the adapters are {list(self.policy.peft_config)}.")
        params = []
        for module in self.policy.modules():
            if isinstance(module, BaseTunerLayer):
                for layer_name in module.adapter_layer_names:
                    layers = getattr(module, layer_name)
                    if name in layers:
                        item = layers[name]
                        params += [item] if isinstance(item, nn.Parameter) else list(item.parameters())
        return params

    def policy_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters(POLICY)

    def value_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters(CRITIC) + list(self.value_model.score.parameters())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.policy_parameters() + self.value_parameters()

    def _restore_trainable(self) -> None:
        """peft's set_adapter / disable_adapter mark only the active adapter trainable; PPO trains two adapters."""
        for p in self.trainable_parameters():
            p.requires_grad_(True)
        if self.has_reward:
            for p in self.adapter_parameters(REWARD):
                p.requires_grad_(False)

    @contextmanager
    def adapter(self, name: str):
        """Run with adapter `name` active (its backward too, under gradient checkpointing); restores the previous."""
        previous = self.policy.active_adapter
        if previous != name:
            self.policy.set_adapter(name)
            self._restore_trainable()
        try:
            yield
        finally:
            if previous != name:
                self.policy.set_adapter(previous)
                self._restore_trainable()

    @contextmanager
    def reference(self):
        """Run as the reference: the base with every adapter disabled."""
        with self.adapter(POLICY), self.policy.disable_adapter():
            yield
        self._restore_trainable()

    # -- checkpointing (TRL's unwrap_model_for_generation turns it off to generate and back on without arguments)
    @property
    def is_gradient_checkpointing(self) -> bool:
        return is_checkpointing(self.policy)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        if gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        set_checkpointing(self.policy, True, self.gradient_checkpointing_kwargs or CHECKPOINTING_KWARGS)

    def gradient_checkpointing_disable(self):
        set_checkpointing(self.policy, False)

    # -- forward
    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int = 0, role: str = "both"):
        """role "both" -> (policy logits (B, L', V), values (B, L)); "policy" -> logits; "value" -> values.
        For a backward, call "policy" and "value" separately, each inside its adapter context."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if role not in ("both", "policy", "value"):
            raise ValueError(f"role={role!r} is not one of 'both', 'policy', 'value'.")
        logits = values = None
        if role in ("both", "policy"):
            with self.adapter(POLICY):
                logits = lm_logits(self.policy, inputs, logits_to_keep)
        if role in ("both", "value"):
            values = scalar_head_outputs(self.value_model, inputs)
        return (logits, values) if role == "both" else logits if role == "policy" else values

    # -- saving
    def save_pretrained(self, folder: str) -> None:
        """`folder/policy/` and `folder/critic/` (peft adapters, loadable with PeftModel.from_pretrained(base,
        folder/policy)) and `folder/value_head.safetensors`. The reward adapter is the user's input: not saved."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        self.policy.save_pretrained(folder, selected_adapters=[POLICY, CRITIC])
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_model.score.state_dict().items()},
                  os.path.join(folder, "value_head.safetensors"))

    def load_trained(self, folder: str) -> None:
        """Restore the policy and critic adapters and the value head written by `save_pretrained`."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        for name in (POLICY, CRITIC):
            path = os.path.join(folder, name, "adapter_model.safetensors")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is missing: not a checkpoint of a shared-base run.")
            result = set_peft_model_state_dict(self.policy, load_file(path), adapter_name=name)
            if result.unexpected_keys:
                raise ValueError(f"adapter {name!r} in {folder} does not match this shared base: unexpected "
                                 f"{result.unexpected_keys[:5]}.")
        self.value_model.score.load_state_dict(load_file(os.path.join(folder, "value_head.safetensors")))


def _lora_copy(config, what: str):
    """A causal-LM copy of a LoraConfig for one adapter of the shared base; LoRA matrices only."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise TypeError(f"{what} must be a peft.LoraConfig, got {type(config).__name__}.")
    extra = [f for f in ("modules_to_save", "trainable_token_indices") if getattr(config, f, None)]
    if extra:
        raise ValueError(f"{what} sets {extra}: a shared base trains LoRA matrices and the heads only (no full "
                         "copies of embeddings or heads). Remove those settings.")
    return dataclasses.replace(copy.deepcopy(config), task_type="CAUSAL_LM", inference_mode=False)


def _load_reward_adapter(reward_adapter):
    """-> (LoraConfig, LoRA state dict, score-head state dict) from a peft folder or (config, state_dict)."""
    if isinstance(reward_adapter, (str, os.PathLike)):
        from peft import PeftConfig
        from safetensors.torch import load_file

        folder = str(reward_adapter)
        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reward_adapter={folder!r} has no adapter_model.safetensors: pass the folder "
                                    "peft's save_pretrained wrote (e.g. RewardTrainer's output with a peft_config).")
        config, state = PeftConfig.from_pretrained(folder), load_file(path)
    elif isinstance(reward_adapter, tuple) and len(reward_adapter) == 2:
        config, state = reward_adapter
    else:
        raise TypeError("reward_adapter must be a folder written by peft's save_pretrained, or a (LoraConfig, "
                        f"state_dict) pair; got {type(reward_adapter).__name__}.")
    head = {}
    lora = {}
    for key, value in state.items():
        short = key.split("base_model.model.", 1)[-1]
        if short.startswith(("score.", "classifier.")):  # the sequence-classification head (modules_to_save)
            head[short.split(".", 1)[1].replace("modules_to_save.default.", "")] = value
        else:
            lora[key] = value
    if "weight" not in head:
        raise ValueError("the reward adapter has no score head (`score.weight`): train it as a sequence-classification "
                         "model (task_type='SEQ_CLS', as RewardTrainer does) so its head is saved with it.")
    if head["weight"].shape[0] != 1:
        raise ValueError(f"the reward adapter's score head has {head['weight'].shape[0]} outputs; a reward model "
                         "has 1.")
    config = dataclasses.replace(copy.deepcopy(config), modules_to_save=None, task_type="CAUSAL_LM",
                                 inference_mode=True)
    return config, lora, head


def build_shared_base(base_model: nn.Module, policy_lora, critic_lora=None, reward_adapter=None,
                      value_head_init: str = "zero") -> SharedBaseModels:
    """One base model for every PPO role (see `SharedBaseModels`).

    Args:
        base_model: a causal LM (`AutoModelForCausalLM`), loaded in 4-bit (nf4), 8-bit or bf16. Its own weights
            are frozen and keep their dtype (unlike peft's prepare_model_for_kbit_training, nothing is upcast to
            fp32: the embeddings and norms are not trained). Gradient checkpointing is turned on by the trainer
            (`PPOConfig.gradient_checkpointing`).
        policy_lora: `peft.LoraConfig` of the policy adapter.
        critic_lora: `LoraConfig` of the critic adapter (default: the policy's).
        reward_adapter: optional frozen reward adapter with its score head, trained on the same base as a
            sequence-classification model (e.g. TRL's RewardTrainer with a peft_config): the folder its
            `save_pretrained` wrote, or a `(LoraConfig, state_dict)` pair in that format.
        value_head_init: "zero" (V = 0 at step 0) or "normal" (std 1/sqrt(H + 1)).

    Returns:
        A `SharedBaseModels`; `.reward_model` is the reward role when `reward_adapter` is given.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(base_model, PeftModel):
        raise ValueError("build_shared_base takes the plain base model, not a PeftModel: merge_and_unload() it or "
                         "pass the model it wraps.")
    if value_head_init not in ("zero", "normal"):
        raise ValueError(f"value_head_init={value_head_init!r} is not one of ('zero', 'normal').")
    disable_bnb_cpu_repack(base_model)
    base_model.requires_grad_(False)
    peft_model = get_peft_model(base_model, _lora_copy(policy_lora, "policy_lora"), adapter_name=POLICY)
    peft_model.add_adapter(CRITIC, _lora_copy(critic_lora if critic_lora is not None else policy_lora, "critic_lora"))

    config = base_model.config.get_text_config() if hasattr(base_model.config, "get_text_config") \
        else base_model.config
    hidden = config.hidden_size
    device = output_device(base_model)  # the heads read the final hidden states (device_map="auto": the last GPU)
    value_head = nn.Linear(hidden, 1, bias=False, device=device, dtype=torch.float32)
    with torch.no_grad():
        if value_head_init == "zero":
            value_head.weight.zero_()
        else:
            value_head.weight.normal_(0.0, 1.0 / (hidden + 1) ** 0.5)

    reward_head = None
    if reward_adapter is not None:
        from peft import set_peft_model_state_dict

        reward_config, lora_state, head_state = _load_reward_adapter(reward_adapter)
        peft_model.add_adapter(REWARD, reward_config)
        result = set_peft_model_state_dict(peft_model, lora_state, adapter_name=REWARD)
        if result.unexpected_keys:
            raise ValueError(f"the reward adapter does not fit this base model: unexpected keys "
                             f"{result.unexpected_keys[:5]}. Train it on the same base architecture.")
        reward_head = nn.Linear(hidden, 1, bias="bias" in head_state, device=device, dtype=torch.float32)
        reward_head.load_state_dict({k: v.float() for k, v in head_state.items()})
    peft_model.set_adapter(POLICY)
    return SharedBaseModels(peft_model, value_head, reward_head)
