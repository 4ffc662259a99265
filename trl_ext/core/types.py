"""The types the phases pass each other, below them all: a `Rollout` (what steps 1-7 of an iteration collect, read by
the update, the diagnostics and the alarms) and `UpdateStats` (what the update records, reduced by
`monitoring.update_metrics`).

The mask vocabulary, one name per meaning, each (B, T) bool over the response positions:
    response_mask  the tokens the model sampled and is trained on: up to and including the stop token (in a
                   multi-turn rollout the model's turns only)
    context_mask   multi-turn only: every real token of the conversation, the model's and the environment's (what
                   the models read); `Rollout.input_mask` is it, or the response mask where there is none
    policy_mask    the tokens of the policy loss where they are not the response mask's (mask_truncated_completions)
    entropy_mask   top_entropy_quantile: the tokens the policy loss weighs (its denominator unchanged)
The prompt's is `query_mask`, (B, Q): the collator's attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    trunk_hidden: torch.Tensor | None = None  # (B, Q+T, H) the output of the critic's frozen trunk, its lower
    # layers (models.FrozenTrunk): the update runs only the layers above it
    policy_mask: torch.Tensor | None = None  # (B, T) bool, the tokens of the policy loss when they are not the
    # response mask's: mask_truncated_completions leaves the completions cut at response_length out
    entropy_mask: torch.Tensor | None = None  # (B, T) bool, top_entropy_quantile: the tokens whose entropy under
    # π_old is in the rollout's top quantile; the policy loss weighs the others 0 (its denominator unchanged)
    context_mask: torch.Tensor | None = None  # (B, T) bool, multi-turn rollouts: every real token of the
    # conversation, the model's and the tools' and environment's (what the models read); response_mask is then the
    # model's tokens only, all that is trained on (trl_ext/trainer/multi_turn.py)
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: the environment's per-turn rewards, each on the last
    # token of its turn (already in `rewards`)
    draw_metrics: dict = field(default_factory=dict)  # the draw's own metrics, logged with the iteration's (group
    # statistics, dynamic sampling, multi-turn turns and tools): the batch's, not a row's

    @property
    def input_mask(self) -> torch.Tensor:
        """(B, T) bool: the response positions the models read (the conversation's, or the response mask)."""
        return self.response_mask if self.context_mask is None else self.context_mask

    def __len__(self) -> int:
        return self.queries.shape[0]

    def __getitem__(self, idx) -> Rollout:
        """Select rollouts (rows) by index tensor or slice: a minibatch."""
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                          for f in row_fields(self)})

    def to(self, device) -> Rollout:
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                          for f in row_fields(self)})


def row_fields(rollout: Rollout) -> list:
    """The fields of a `Rollout` that hold one entry per row (all but `draw_metrics`)."""
    return [f for f in fields(rollout) if f.name != "draw_metrics"]



# the token statistics of the update: logged key -> the stat's name in `UpdateStats.add`
TOKEN_STATS = ("policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
               "policy/entropy_avg", "val/ratio", "policy/clipfrac_low_avg", "policy/clipfrac_high_avg")
DUAL_CLIP_STATS = ("policy/clipfrac_dual_avg",)  # with clip_ratio_c
OFF_POLICY_MASK_STATS = ("policy/off_policy_masked_frac",)  # with off_policy_mask_threshold: tokens masked
KL_LOSS_STATS = ("policy/kl_loss_avg",)  # with beta: the KL loss term's per-token estimate


class UpdateStats:
    """What one `PPOTrainer.ppo_update` records on this process; `update_metrics` reduces it over processes.

    Token statistics (losses, clip fractions, approx-KL, entropy, ratio) are kept as sums over real tokens, so
    their logged value is a token mean over every micro-batch of the update on every process (the same for any
    gradient accumulation and process count, like the loss itself). Per optimizer step: the grad norms."""

    def __init__(self, keys: tuple[str, ...] = TOKEN_STATS):
        self.keys = keys  # the token statistics recorded: TOKEN_STATS, maybe + DUAL_CLIP_STATS
        self.token_sums: list[torch.Tensor] = []  # per micro-batch: (len(TOKEN_STATS),) Σ over its real tokens
        self.num_tokens: list[torch.Tensor] = []  # per micro-batch: its real tokens
        self.first_minibatch: list[torch.Tensor] = []  # per micro-batch of the first minibatch: (Σ ratio, tokens)
        self.micro_batch_ratios: list[torch.Tensor] = []  # per micro-batch: its mean ratio (for val/ratio_var)
        self.steps: dict[str, list[float]] = {}  # per optimizer step, e.g. "policy/grad_norm"
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient norm (the same everywhere)
        self.step_tokens: list[torch.Tensor] = []  # per optimizer step: the real tokens this process ran for it
        # rollout_logprobs="sampler": per micro-batch of the first minibatch, (sampler, trainer) log-probs and mask
        self.sampler_rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, num_tokens: torch.Tensor, first_minibatch: bool, **means: torch.Tensor) -> None:
        """One micro-batch: its real-token count and its token means, by the names in `keys`."""
        row = torch.stack([means[key].detach().float() for key in self.keys]) * num_tokens
        self.token_sums.append(row)
        self.num_tokens.append(num_tokens.float())
        self.micro_batch_ratios.append(means["val/ratio"].detach().float())
        if first_minibatch:
            self.first_minibatch.append(torch.stack([row[self.keys.index("val/ratio")], num_tokens.float()]))

    def add_sampler_rows(self, sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """A first-minibatch micro-batch whose π_old is the sampler's: the trainer's log-probs of it before any
        optimizer step, for `rollout/sampler_logprob_diff_*` (`sampler_metrics`)."""
        self.sampler_rows.append((sampler_logprobs.detach(), logprobs.detach(), mask))

    def add_step(self, key: str, value: float) -> None:
        self.steps.setdefault(key, []).append(float(value))
