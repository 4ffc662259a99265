"""Checkpoint files of a PPO run, beyond what transformers' Trainer writes.

A checkpoint folder `checkpoint-N` holds: the policy (its adapter, with peft) as `save_pretrained` writes it,
`value_model/`, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `trainer_state.json` (global step, episode, log
history) and `trl_ext_state.json` (β controller state and the settings a resumed run must share). It is written into
`checkpoint-N.partial` and renamed when complete, so a run killed mid-save leaves the previous checkpoint intact
(`get_last_checkpoint` only sees complete `checkpoint-N` folders).

The trainer writes the files (`PPOTrainer._save_checkpoint`, with transformers' own optimizer/RNG writers) inside
`staged`, and resumes with `find_checkpoint`, `read_state`, `check_compatible` and `load_trained_weights`.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager

import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints
from transformers.utils import is_peft_available

TRL_EXT_STATE = "trl_ext_state.json"
VALUE_MODEL_DIR = "value_model"


def load_weights(module: torch.nn.Module, folder: str) -> None:
    """Load a `save_pretrained` folder's weights into an existing module. Keys missing from the file must be tied
    to a key that is present (e.g. tied embeddings); anything else is an error."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete or not a trl_ext checkpoint.")
        state.update(load_file(path))
    result = module.load_state_dict(state, strict=False)
    params = dict(module.named_parameters(remove_duplicate=False))
    present = {params[k].data_ptr() for k in state if k in params}
    untied_missing = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in present]
    if untied_missing or result.unexpected_keys:
        raise ValueError(f"Checkpoint {folder} does not match the model: missing {untied_missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}. Resume with the same model (and peft config) it was "
                         "saved from.")


def load_adapter(peft_model, folder: str) -> None:
    """Load a saved LoRA/peft adapter into the trainer's peft policy (adapter name 'default')."""
    from peft import set_peft_model_state_dict

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint holds no adapter, but the policy is a peft "
                                "model. Resume with the setup the checkpoint was saved from.")
    result = set_peft_model_state_dict(peft_model, load_file(path))
    if result.unexpected_keys:
        raise ValueError(f"Adapter in {folder} does not match the policy's peft config: unexpected "
                         f"{result.unexpected_keys[:5]}.")


def check_compatible(saved: dict, current: dict, checkpoint: str) -> None:
    """Refuse a checkpoint whose run settings differ from this run's (batch geometry, KL control, model shape)."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"Cannot resume from {checkpoint}: it was saved with different settings ("
                         + "; ".join(diffs) + "). Resume with the settings it was saved with, or start a new run "
                         "in another output_dir.")


def _numel(param: torch.Tensor) -> int:
    """A parameter's whole size, also when ZeRO-3 has partitioned it (FSDP2's DTensors report theirs)."""
    return getattr(param, "ds_numel", param.numel())


def run_settings(args, wrapper, num_prompts: int, is_peft: bool, shared: bool) -> dict:
    """What a resumed run must share with the run that saved the checkpoint."""
    return {
        "world_size": args.world_size, "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps, "num_mini_batches": args.num_mini_batches,
        "num_ppo_epochs": args.num_ppo_epochs, "response_length": args.response_length, "seed": args.seed,
        "num_prompts": num_prompts, "kl_controller": args.kl_controller, "peft": is_peft,
        "policy_trainable_parameters": sum(_numel(p) for p in wrapper.policy_parameters() if p.requires_grad),
        "value_parameters": sum(_numel(p) for p in wrapper.value_parameters()),
    } | ({"shared_base": True} if shared else {})


@contextmanager
def staged(run_dir: str, step: int, backend, save_total_limit: int | None):
    """Inside: write checkpoint `step` into the folder yielded (`checkpoint-N.partial`, every process); after: one
    rename makes it `checkpoint-N`, and older checkpoints beyond `save_total_limit` go."""
    final = os.path.join(run_dir, f"checkpoint-{step}")
    staging = final + ".partial"
    main = backend.accelerator.is_main_process
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    backend.barrier()
    yield staging
    backend.barrier()
    if main:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staging, final)
        rotate_checkpoints(run_dir, save_total_limit=save_total_limit)
    backend.barrier()


def write_state(folder: str, kl_controller, reward_normalizer, settings: dict, grad_scaler=None) -> None:
    """trl_ext's own state: β's controller, the reward normalizer's statistics, the run's settings and, under fp16,
    the GradScaler's loss scale and growth tracker (a resumed run scales as the straight one would)."""
    state = {"kl_controller": kl_controller.state_dict(), "reward_normalizer": reward_normalizer.state_dict(),
             "settings": settings}
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler.state_dict()
    with open(os.path.join(folder, TRL_EXT_STATE), "w") as f:
        json.dump(state, f, indent=2)


def find_checkpoint(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """The checkpoint folder to resume from: the one given, or with True the latest in `output_dir`."""
    checkpoint = resume_from_checkpoint
    if checkpoint is True:
        checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if checkpoint is None:
            raise ValueError(f"resume_from_checkpoint=True but there is no checkpoint-N folder in {output_dir!r}; "
                             "pass a checkpoint path or train without resuming.")
    return str(checkpoint)


def read_state(checkpoint: str) -> dict:
    state_file = os.path.join(checkpoint, TRL_EXT_STATE)
    if not os.path.isfile(state_file):
        raise ValueError(f"{checkpoint!r} is not a complete trl_ext checkpoint (no {TRL_EXT_STATE}); pass a "
                         "checkpoint-N folder written by trl_ext.")
    with open(state_file) as f:
        return json.load(f)


def load_trained_weights(wrapper, checkpoint: str, is_peft: bool, shared) -> None:
    """The trained weights of a checkpoint that the engine did not restore itself: a shared base's adapters and
    heads, or the policy (its adapter, with peft) and the value model (a quantized critic's LoRA)."""
    if shared is not None:
        shared.load_trained(checkpoint)
        return
    if is_peft:
        load_adapter(wrapper.policy, checkpoint)
    else:
        load_weights(wrapper.policy, checkpoint)
    value_dir = os.path.join(checkpoint, VALUE_MODEL_DIR)
    if is_peft_available() and _is_peft_model(wrapper.value_model):
        load_adapter(wrapper.value_model, value_dir)
    else:
        load_weights(wrapper.value_model, value_dir)


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)
