"""Which TRL trl_ext builds on, and why: the one place trl_ext imports TRL's PPO.

- trl 1.12 ships PPOTrainer (`trl.experimental.ppo`): trl_ext's `PPOConfig` and `PPOTrainer` subclass TRL's, so
  `isinstance(trainer, trl.experimental.ppo.PPOTrainer)` holds, as code written for TRL may check.
- trl 1.13 and later removed it (PR #7020): trl_ext builds on its own bases (`trl_ext/ppo_base.py`): a config with
  exactly TRL 1.12's PPOConfig fields and defaults on `transformers.TrainingArguments`, and `transformers.Trainer`.
  trl_ext never calls TRL's `PPOTrainer.__init__` or `train()`, so the trainer is the same on either base.

`PPO_BASE` names the base in use. `trl.experimental` warns on import unless `TRL_EXPERIMENTAL_SILENCE` is set;
trl_ext is a supported layer over it, so that one warning category is silenced for these imports only.
"""

import warnings

from trl.import_utils import TRLExperimentalWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    try:
        from trl.experimental.ppo import PPOConfig as PPOConfigBase
        from trl.experimental.ppo import PPOTrainer as PPOTrainerBase
        from trl.experimental.ppo.ppo_trainer import OnlineTrainerState
    except ImportError:  # trl >= 1.13
        from .ppo_base import OnlineTrainerState, PPOConfigBase, PPOTrainerBase
    from trl.experimental.utils import create_reference_model

TRL_HAS_PPO = PPOTrainerBase.__module__.startswith("trl.")
PPO_BASE = ("TRL's own PPOTrainer (trl.experimental.ppo)" if TRL_HAS_PPO
            else "trl_ext's own base (trl_ext/ppo_base.py): this TRL has no PPOTrainer")

__all__ = ["OnlineTrainerState", "PPOConfigBase", "PPOTrainerBase", "PPO_BASE", "TRL_HAS_PPO",
           "create_reference_model"]
