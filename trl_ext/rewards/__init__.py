"""Rewards behind one interface.

`RewardScorer` scores query+response batches with any mix of

(a) a sequence-classification reward model that shares the policy's tokenizer: it reads the policy's token ids
    directly and its score is read at the last real token (found from the attention mask, positionally), so with
    pad == EOS it still reads the EOS token, never the token before it; a module without a `score` head (a
    rule-based `PreTrainedModel`, any `nn.Module`) is called on the policy's ids and returns one score per row
    (`module_scores`);
(b) a sequence-classification reward model with its OWN tokenizer (`reward_tokenizers`, or a `(model, tokenizer)`
    tuple): the text is decoded from the policy's tokens, re-rendered and re-tokenized for it (see `RewardScorer`);
(c) a Python function `(prompts: list[str], completions: list[str], **columns) -> list[float]`;
(d) a list of these, combined as Σ w_i·s_i with `reward_weights`.

`RewardNormalizer` normalises the combined score ("none", "fixed" or "running" mean/std, optional clip). The trainer
normalises the score BEFORE it applies `missing_eos_penalty`, so the penalty keeps its configured size in normalised
units and is never scaled or clipped away.

`score_responses` scores with one reward on the policy's tokenizer (kind (a) or (c)); the trainer uses `RewardScorer`.

    scorer.py      RewardScorer: the rewards' names, tokenizers and weights, the combined score
    functions.py   FunctionReward: how a function is called (TRL's convention or trl_ext's), what it must return
    modules.py     ModelReward, ModuleReward, TextModelReward: the reward models, one class per kind
    batch.py       RewardBatch: the batch every kind reads, its decodings made once
    normalizer.py  RewardNormalizer
"""

from .batch import RewardBatch
from .functions import RewardFunction, check_reward_function_output, is_reward_function
from .modules import has_score_head, load_reward_model, module_scores, score_responses
from .normalizer import NORMALIZER_MODES, RewardNormalizer
from .scorer import RewardScorer

__all__ = [
    "NORMALIZER_MODES",
    "RewardBatch",
    "RewardFunction",
    "RewardNormalizer",
    "RewardScorer",
    "check_reward_function_output",
    "has_score_head",
    "is_reward_function",
    "load_reward_model",
    "module_scores",
    "score_responses",
]
