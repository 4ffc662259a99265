"""What PPO scripts written for trl 0.12-0.2x imported from TRL and TRL has since removed, under the same names
(docs/versions.md: the porting guide). PPOTrainer takes models the script loaded, so these still matter to it."""

import torch

__all__ = ["SIMPLE_CHAT_TEMPLATE", "get_kbit_device_map"]

# TRL's chat template for tokenizers that have none (trl.trainer.utils until trl 0.26, trl.experimental.utils until
# 1.0; removed in 1.1): "User: ...\n\nAssistant:"; TRL's PPO examples set it with `if tokenizer.chat_template is None`.
SIMPLE_CHAT_TEMPLATE = ("{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + "
                        "'\n\n'}}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def get_kbit_device_map() -> dict[str, int] | None:
    """`{"": local process index}` where there is a GPU (CUDA or XPU), else None: the `device_map` that puts a
    4-bit/8-bit model on this process's own GPU when it is loaded (bitsandbytes weights cannot be moved afterwards).
    TRL's helper (removed in trl 1.8, trl#6158, as its trainers now load such models themselves); PPOTrainer takes
    the models a script loads, so a PPO script under DDP still needs it."""
    from accelerate import PartialState

    if torch.cuda.is_available() or torch.xpu.is_available():
        return {"": PartialState().local_process_index}
    return None
