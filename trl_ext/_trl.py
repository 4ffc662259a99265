"""The one place trl_ext imports TRL's experimental PPO, without printing TRL's experimental warning at the user.

`trl.experimental` warns on import unless `TRL_EXPERIMENTAL_SILENCE` is set. trl_ext is a supported layer over it, so
the warning would be noise; we silence that one warning category for this import only and leave the user's
environment and warning filters untouched.
"""

import warnings

from trl.import_utils import TRLExperimentalWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    from trl.experimental.ppo import PPOConfig as TRLPPOConfig
    from trl.experimental.ppo import PPOTrainer as TRLPPOTrainer
    from trl.experimental.ppo.ppo_trainer import OnlineTrainerState
    from trl.experimental.utils import create_reference_model

__all__ = ["TRLPPOConfig", "TRLPPOTrainer", "OnlineTrainerState", "create_reference_model"]
