"""Checkpoint files of a PPO run, beyond what transformers' Trainer writes.

A checkpoint folder `checkpoint-N` holds: the policy (its adapter, with peft) as `save_pretrained` writes it,
`value_model/`, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `trainer_state.json` (global step, episode, log
history) and `trl_ext_state.json` (β controller state and the settings a resumed run must share). It is written into
`checkpoint-N.partial` and renamed when complete, so a run killed mid-save leaves the previous checkpoint intact
(`get_last_checkpoint` only sees complete `checkpoint-N` folders).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

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
