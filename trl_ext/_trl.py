"""Which TRL trl_ext builds on, and why: the one place trl_ext chooses its base from TRL's version.

- trl 1.12 ships PPOTrainer (`trl.experimental.ppo`): trl_ext's `PPOConfig` and `PPOTrainer` subclass TRL's, so
  `isinstance(trainer, trl.experimental.ppo.PPOTrainer)` holds, as code written for TRL may check.
- trl 1.13 and later removed it (PR #7020): trl_ext builds on its own bases (`trl_ext/ppo_base.py`): a config with
  exactly TRL 1.12's PPOConfig fields and defaults on `transformers.TrainingArguments`, and `transformers.Trainer`.
  trl_ext never calls TRL's `PPOTrainer.__init__` or `train()`, so the trainer is the same on either base.

Beyond that base trl_ext uses TRL's public names only (`trl.models`' DeepSpeed helpers, `ModelConfig`, `TrlParser`,
`get_peft_config`, `get_quantization_config` in the recipes), so a TRL newer
than the newest tested (`NEWEST_TESTED_TRL`) is used as it is, with a warning naming that version; pyproject.toml puts
no upper bound on trl, so installing trl_ext never downgrades it.

`PPO_BASE` names the base in use. `trl.experimental` warns on import unless `TRL_EXPERIMENTAL_SILENCE` is set;
trl_ext is a supported layer over it, so that one warning category is silenced for these imports only.
"""

import warnings
from importlib.metadata import version

from packaging.version import Version

NEWEST_TESTED_TRL = "1.16"  # CI's newest environment (.ci/run); trl 1.17 and 1.18 are not on this project's index
TRL_VERSION = Version(version("trl"))
TRL_HAS_PPO = TRL_VERSION < Version("1.13")


def warn_if_untested(installed: Version = TRL_VERSION) -> bool:
    """Warn when trl's release series is newer than the newest one trl_ext is tested with; True if it warned."""
    tested = Version(NEWEST_TESTED_TRL)
    if (installed.major, installed.minor) <= (tested.major, tested.minor):
        return False
    warnings.warn(f"trl {installed} is newer than {NEWEST_TESTED_TRL}, the newest trl that trl_ext is tested with. "
                  "trl_ext uses only TRL's public API and its own PPO base from trl 1.13 on, so it should work; if "
                  f"something breaks, `pip install 'trl<{tested.major}.{tested.minor + 1}'` and report it.",
                  stacklevel=3)
    return True


warn_if_untested()

if TRL_HAS_PPO:
    from trl.import_utils import TRLExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        from trl.experimental.ppo import PPOConfig as PPOConfigBase
        from trl.experimental.ppo import PPOTrainer as PPOTrainerBase
        from trl.experimental.ppo.ppo_trainer import OnlineTrainerState
else:  # trl >= 1.13
    from .ppo_base import OnlineTrainerState, PPOConfigBase, PPOTrainerBase

PPO_BASE = ("TRL's own PPOTrainer (trl.experimental.ppo)" if TRL_HAS_PPO
            else "trl_ext's own base (trl_ext/ppo_base.py): this TRL has no PPOTrainer")

__all__ = ["NEWEST_TESTED_TRL", "OnlineTrainerState", "PPOConfigBase", "PPOTrainerBase", "PPO_BASE", "TRL_HAS_PPO",
           "warn_if_untested"]
