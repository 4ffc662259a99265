"""What every model gets before training: dropout off in every form, bitsandbytes' in-place CPU repacking off,
whether a model is quantized, (cast_lm_head_to_fp32) an fp32 LM head, and checkpointing switched by the names
transformers keeps."""

from __future__ import annotations

import torch
import torch.nn as nn

from .forward import _underlying

# gradient checkpointing's kwargs unless the config gives its own: non-reentrant, as peft's adapters need
CHECKPOINTING_KWARGS = {"use_reentrant": False}


def set_checkpointing(model: nn.Module, on: bool, kwargs: dict | None = None) -> None:
    """Gradient (activation) checkpointing on or off: transformers >= 5.25 calls it activation checkpointing and
    warns on the gradient_* names (removed in v6); older versions have only those."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model: nn.Module) -> bool:
    """Whether checkpointing is on, by the name this transformers keeps (see `set_checkpointing`)."""
    if hasattr(model, "activation_checkpointing_enable"):
        return bool(getattr(model, "is_activation_checkpointing", False))
    return bool(getattr(model, "is_gradient_checkpointing", False))


def disable_bnb_cpu_repack(*models) -> int:
    """Set `support_avx512bf16_for_cpu = False` on every bitsandbytes `Linear4bit` of the given models; returns how
    many layers were found.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place the first time it sees a no-grad
    forward in eval mode, and the repacked path (gemv_4bit) has no autograd: LoRA gradients through that layer come
    out silently wrong afterwards. With the flag off the weights are never repacked. A layer that was already
    repacked is an error (bitsandbytes' inverse conversion is lossy): call this right after loading the model.
    """
    count = 0
    for model in models:
        if not isinstance(model, nn.Module):
            continue
        for name, module in model.named_modules():
            if not hasattr(module, "support_avx512bf16_for_cpu"):
                continue
            module.support_avx512bf16_for_cpu = False
            count += 1
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            if getattr(state, "packing_format_for_cpu", False):
                raise ValueError(
                    f"The 4-bit layer {name!r} of {type(model).__name__} was already repacked for AVX512-BF16 CPU "
                    "inference (a no-grad forward in eval mode ran on it); LoRA gradients through it would be wrong. "
                    "Call trl_ext.models.disable_bnb_cpu_repack(model) right after loading, before any evaluation "
                    "forward, or reload the model.")
    return count


def _is_rate(name: str, value) -> bool:
    return "drop" in name.lower() and isinstance(value, float) and value > 0


def disable_dropout(model: nn.Module) -> None:
    """Turn off every dropout of `model`, whatever form it takes, so rollout and update forwards are deterministic:

    - `nn.Dropout` modules (p = 0; all TRL's `disable_dropout_in_model` does);
    - rates stored on modules and applied in forward in training mode (Llama's and Qwen's `attention_dropout`, OPT's
      `dropout`, Bloom's `hidden_dropout`: `dropout(x, p=self.dropout, training=self.training)`);
    - rates in the model's config read at forward time (`self.config.layerdrop`, ...).

    PPO needs this: with dropout on, the rollout's log-probs and the update's differ at lr 0 (ratio ≠ 1, KL ≠ 0
    against an identical reference). The config's rates stay 0 in a saved model's config.json."""
    from transformers import PretrainedConfig

    configs = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig) and all(config is not c for c in configs):
            configs.append(config)
    while configs:
        config = configs.pop()
        for name, value in list(vars(config).items()):
            if _is_rate(name, value):
                setattr(config, name, 0.0)
            elif isinstance(value, PretrainedConfig):  # text_config, vision_config, ...
                configs.append(value)


def is_quantized(model) -> bool:
    """Loaded in 4-bit or 8-bit by bitsandbytes (through a peft wrapper too)."""
    base = _underlying(model) if isinstance(model, nn.Module) else model
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


class FP32Head(nn.Linear):
    """An output layer computed in fp32 with autocast off: fp32 logits from fp32 hidden states and weights (a bf16
    or fp16 weight is widened per call, which is exact). `cast_lm_head_to_fp32` turns a model's `nn.Linear` head into
    one in place (its class), so its parameters, their names, tied embeddings and copies of the model are unchanged."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden_states.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """TRL's `cast_lm_head_to_fp32` for `model` (a causal LM, or a PeftModel around one): its output layer returns
    fp32 logits under any autocast (`FP32Head`). Raises for a head that is not a plain `nn.Linear` (a LoRA adapter
    or a quantized layer on it), as TRL does for an adapter."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, FP32Head):
        return
    if type(head) is not nn.Linear:
        raise ValueError(f"cast_lm_head_to_fp32=True needs the model's output layer to be a plain nn.Linear; "
                         f"{type(model).__name__}'s is {type(head).__name__}. Keep the LM head out of the adapter's "
                         "target_modules (and unquantized), or set cast_lm_head_to_fp32=False.")
    head.__class__ = FP32Head
