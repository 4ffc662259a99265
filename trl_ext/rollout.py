"""`Rollout`: everything one PPO iteration collects, as named tensors (torch only).

Shapes: B = rollouts in the batch, Q = query length (left-padded), T = response length (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Rollout:
    queries: torch.Tensor  # (B, Q) prompt ids, left-padded
    query_mask: torch.Tensor  # (B, Q) bool, True = real prompt token (the collator's attention mask)
    responses: torch.Tensor  # (B, T) sampled ids; positions after the stop token hold padding
    response_mask: torch.Tensor  # (B, T) bool, True = real response token (up to and including the stop token)
    logprobs: torch.Tensor  # (B, T) log π_θ_old(token), from the same forward pass the loss uses
    ref_logprobs: torch.Tensor  # (B, T) log π_ref(token)
    values: torch.Tensor  # (B, T) V(state before each token); 0 outside the mask
    scores: torch.Tensor  # (B,) reward-model / reward-function score (after missing_eos_penalty)
    kl: torch.Tensor  # (B, T) per-token KL estimate used in the penalty; 0 outside the mask
    rewards: torch.Tensor  # (B, T) −β·kl on every real token + score on the last real token
    advantages: torch.Tensor  # (B, T) GAE advantages, whitened over real tokens (what the loss uses)
    returns: torch.Tensor  # (B, T) raw GAE advantages + values (the value target)
    source_scores: torch.Tensor | None = None  # (B, S) raw score of each reward source (PPOTrainer.reward_scorer.names)
    sampler_logprobs: torch.Tensor | None = None  # (B, T) the sampler's own log-probs of the tokens; 0 outside the mask
    sampler_weights: torch.Tensor | None = None  # (B, T) π_old / π_sampler, truncated or masked (the policy loss's
    # per-token weights when vllm_importance_sampling_correction is on; core.sampler_correction_weights); 0 outside
    advantage_lam: torch.Tensor | None = None  # (B,) the policy's GAE λ of each rollout, with length_adaptive_alpha
    value_trunk_hidden: torch.Tensor | None = None  # (B, Q+T, H) the output of the critic's frozen lower layers
    # (models.FrozenTrunk): the update runs only the layers above it

    def __len__(self) -> int:
        return self.queries.shape[0]

    def __getitem__(self, idx) -> Rollout:
        """Select rollouts (rows) by index tensor or slice: a minibatch."""
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                          for f in fields(self)})

    def to(self, device) -> Rollout:
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                          for f in fields(self)})
