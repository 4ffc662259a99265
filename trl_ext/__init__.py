"""trl_ext: a correct, drop-in PPOTrainer for Hugging Face TRL.

    from trl_ext import PPOConfig, PPOTrainer   # instead of: from trl.experimental.ppo import PPOConfig, PPOTrainer

The trainer classes are imported on first use, so `trl_ext.core`, `trl_ext.monitoring.report` and the `trl-ext` command
start without loading trl.
"""

__version__ = "0.1.0"
__all__ = ["PPOConfig", "PPOTrainer", "Rollout", "SIMPLE_CHAT_TEMPLATE", "__version__", "get_kbit_device_map"]

_LAZY = {"PPOConfig": ".config", "PPOTrainer": ".trainer.ppo_trainer", "Rollout": ".core.types",
         # helpers TRL removed that PPO scripts import (docs/versions.md, the porting guide)
         "SIMPLE_CHAT_TEMPLATE": ".compat", "get_kbit_device_map": ".compat"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
