"""trl_ext: a correct, drop-in PPOTrainer for Hugging Face TRL.

    from trl_ext import PPOConfig, PPOTrainer   # instead of: from trl.experimental.ppo import PPOConfig, PPOTrainer
"""

from .config import PPOConfig
from .rollout import Rollout
from .trainer import PPOTrainer

__version__ = "0.1.0"
__all__ = ["PPOConfig", "PPOTrainer", "Rollout", "__version__"]
