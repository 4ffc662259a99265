"""Per-step metrics of a PPO iteration: batch tensors in, a dict of floats out; where the metrics are reduced across
processes.

Every token statistic is over real response tokens only (`response_mask`), every sequence statistic over all rollouts
of all processes: row tensors are gathered whole (each process holds the same number of rows), token statistics are
combined from per-process sums, so the numbers equal those of a single process holding the whole batch.

Shapes: B = rollouts on this process, T = response length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..core import estimate_kl, last_true_index
from ..core.types import Rollout, UpdateStats

Gather = Callable[[torch.Tensor], torch.Tensor]  # (B, k) on each process -> (B·processes, k)
WALL_CLOCK_KEYS = ("eps", "perf/tokens_per_second", "perf/rollout_wait_s",  # metrics of time: a repeated run
                   "perf/sampler_weight_wait_s",  # logs other values
                   "train_runtime", "train_samples_per_second", "train_steps_per_second")  # train()'s last entry


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def mean_sequence_kl(r: Rollout, gather: Gather = _identity) -> float:
    """The mean over all rollouts of all processes of the per-sequence KL that shaped the rewards (Σ over real tokens
    of the configured estimator): `objective/kl`, and what the adaptive β controller is fed."""
    return gather(r.kl.sum(1).float()).mean().item()


def source_metrics(source_scores: torch.Tensor, names: list[str], gather: Gather = _identity) -> dict:
    """Each reward's raw (unweighted) mean score over the rows it scored, `objective/scores/<name>`, and, where a
    function returned None (TRL's "not applicable", NaN in `source_scores`), that share as
    `objective/scores_none/<name>`. source_scores: (B, S)."""
    scores = gather(source_scores.float())
    out = {}
    for name, mean, none in zip(names, torch.nanmean(scores, 0), torch.isnan(scores).float().mean(0)):
        out[f"objective/scores/{name}"] = mean.item()
        if none > 0:
            out[f"objective/scores_none/{name}"] = none.item()
    return out


# GRPOTrainer's logged key -> the PPO metric of the same meaning (logged under both names; GRPO's `kl` is a per-token
# mean of another estimator than objective/kl's per-sequence sum, so it has none)
GRPO_KEYS = {"reward": "objective/scores", "reward_std": "objective/scores_std",
             "completions/mean_length": "rollout/response_length_mean",
             "completions/clipped_ratio": "rollout/truncation_rate", "entropy": "policy/entropy_avg",
             "frac_reward_zero_std": "rollout/frac_reward_zero_std"}


def grpo_metrics(metrics: dict, names: list[str]) -> dict:
    """GRPOTrainer's names of this iteration's metrics (`GRPO_KEYS`), and `rewards/<name>/mean` for each reward's
    raw mean score (`objective/scores/<name>`), so a GRPO user's dashboards and scripts read a PPO run."""
    out = {grpo: metrics[ppo] for grpo, ppo in GRPO_KEYS.items() if ppo in metrics}
    for name in names:
        if f"objective/scores/{name}" in metrics:
            out[f"rewards/{name}/mean"] = metrics[f"objective/scores/{name}"]
    return out


def evaluation_metrics(table: torch.Tensor) -> dict:
    """Held-out evaluation (`PPOTrainer.evaluate_policy`): `table` (prompts, 3 or 5) holds per prompt the policy's
    KL, the policy's and the reference's training-reward score, and (5 columns) their gold scores. Win rate: the
    share of prompts where the policy's completion scores higher than the reference's, ties counting half."""

    def win_rate(policy, reference):
        return ((policy > reference).float() + 0.5 * (policy == reference).float()).mean().item()

    out = {"eval/kl": table[:, 0].mean().item(), "eval/score": table[:, 1].mean().item(),
           "eval/score_ref": table[:, 2].mean().item(), "eval/win_rate_vs_ref": win_rate(table[:, 1], table[:, 2])}
    if table.shape[1] == 5:
        out.update({"eval/gold_score": table[:, 3].mean().item(), "eval/gold_score_ref": table[:, 4].mean().item(),
                    "eval/gold_win_rate_vs_ref": win_rate(table[:, 3], table[:, 4])})
    return out


def value_fit(r: Rollout, gather: Gather = _identity) -> tuple[float, float]:
    """The critic against the rollout's returns over the real tokens of every process: (explained variance, mean
    squared error)."""
    mask = r.response_mask
    # per-process sums over real tokens: n, Σ returns, Σ returns², Σ d, Σ d², d = returns − V
    ret, d = r.returns[mask].double(), (r.returns - r.values)[mask].double()
    sums = gather(torch.stack([torch.tensor(float(ret.numel()), dtype=torch.float64, device=ret.device),
                               ret.sum(), (ret**2).sum(), d.sum(), (d**2).sum()])[None]).sum(0)
    n, s_ret, s_ret2, s_d, s_d2 = sums.tolist()
    var_ret = s_ret2 / n - (s_ret / n) ** 2
    var_d = s_d2 / n - (s_d / n) ** 2
    # 1 − Var(returns − V) / Var(returns); 0.0 when the returns do not vary (as core.explained_variance)
    return (1.0 - var_d / var_ret if var_ret > 1e-12 else 0.0), s_d2 / n


def rollout_metrics(r: Rollout, kl_coef: float, stop_token_id: int | None, gather: Gather = _identity) -> dict:
    """Metrics of one rollout batch (see the README's metric table for meaning and healthy ranges)."""
    mask = r.response_mask
    T = mask.shape[1]
    lengths = mask.sum(1)  # (B,) real response tokens, the stop token included
    if stop_token_id is None:
        stopped = torch.zeros_like(lengths, dtype=torch.bool)
    else:  # the last real token (of a conversation: the model's last turn) is the stop token
        stopped = r.responses.gather(1, last_true_index(mask)[:, None])[:, 0] == stop_token_id
    truncated = (lengths == T) & ~stopped  # hit the length cap without a stop token
    if r.context_mask is not None:  # a conversation: its last model turn was cut by a length cap
        truncated = ~stopped if stop_token_id is not None else torch.zeros_like(stopped)
    kl_seq = r.kl.sum(1)  # (B,) per-sequence KL of the estimator that shapes the reward
    kl_k1 = (estimate_kl(r.logprobs, r.ref_logprobs, "k1") * mask).sum(1)
    kl_k3 = (estimate_kl(r.logprobs, r.ref_logprobs, "k3") * mask).sum(1)
    entropy_seq = (-r.logprobs * mask).sum(1)  # sampled-token estimate of the sequence entropy (TRL's)
    # each row's real tokens (prompt + response) and its width in the padded (B, Q + T) layout
    real = (r.query_mask.sum(1) + r.input_mask.sum(1)).float()
    width = torch.full_like(real, r.query_mask.shape[1] + T)
    rows = gather(torch.stack([r.scores.float(), kl_seq, kl_k1, kl_k3, entropy_seq, lengths.float(),
                               truncated.float(), stopped.float(), real, width], 1).float())
    scores, kl_seq, kl_k1, kl_k3, entropy_seq, lengths, truncated, stopped, real, width = rows.unbind(1)

    explained_variance, value_error = value_fit(r, gather)

    non_score = -kl_coef * kl_seq
    out = {
        "objective/kl": kl_seq.mean().item(),
        "objective/kl_k1": kl_k1.mean().item(),
        "objective/kl_k3": kl_k3.mean().item(),
        "objective/kl_coef": float(kl_coef),
        "objective/entropy": entropy_seq.mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (non_score + scores).mean().item(),
        "objective/scores": scores.mean().item(),
        "objective/scores_std": scores.std(unbiased=False).item(),
        "objective/scores_min": scores.min().item(),
        "objective/scores_max": scores.max().item(),
        "val/explained_variance": explained_variance,
        "val/value_error": value_error,  # mean squared error of V against the returns
        "val/num_eos_tokens": stopped.sum().item(),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/truncation_rate": truncated.mean().item(),
        "rollout/tokens": real.sum().item(),  # real tokens (prompt + response) of the batch, all processes
        "perf/padding_fraction": 1.0 - (real.sum() / width.sum()).item(),
    }
    if r.sampler_logprobs is not None:
        out.update(sampler_metrics(r.sampler_logprobs, r.logprobs, mask, gather))
    if r.sampler_weights is not None:
        out.update(sampler_weight_metrics(r.sampler_weights, mask, gather))
    if r.advantage_lam is not None:  # length-adaptive λ of the policy's advantages, one per rollout
        lam = gather(r.advantage_lam.float())
        out.update({"policy/lam_mean": lam.mean().item(), "policy/lam_min": lam.min().item(),
                    "policy/lam_max": lam.max().item()})
    return out


def sampler_weight_metrics(weights: torch.Tensor, mask: torch.Tensor, gather: Gather = _identity) -> dict:
    """TRL's `sampling/importance_sampling_ratio/{min,mean,max}` of the sampler correction's weights
    (`core.sampler_correction_weights`) over the real tokens of all processes (a sequence mode's one weight per row
    counts once per token), and `sampling/importance_sampling_masked`: the share of real tokens whose weight is 0."""
    w = weights.double()[mask]
    empty = w.numel() == 0
    stats = torch.stack([torch.tensor(float(w.numel()), dtype=torch.float64, device=weights.device),
                         w.sum(), (w == 0).sum().double(),
                         w.min() if not empty else torch.tensor(math.inf, dtype=torch.float64, device=weights.device),
                         w.max() if not empty else torch.tensor(-math.inf, dtype=torch.float64,
                                                                device=weights.device)])
    rows = gather(stats[None])  # (processes, 5)
    n = rows[:, 0].sum().clamp(min=1)
    return {"sampling/importance_sampling_ratio/min": rows[:, 3].min().item(),
            "sampling/importance_sampling_ratio/mean": (rows[:, 1].sum() / n).item(),
            "sampling/importance_sampling_ratio/max": rows[:, 4].max().item(),
            "sampling/importance_sampling_masked": (rows[:, 2].sum() / n).item()}


def sampler_metrics(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor,
                    gather: Gather = _identity) -> dict:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's recomputation of them, over real
    tokens of all processes: `rollout/sampler_logprob_diff_max` and `_mean` of |log π_sampler − log π_trainer|.
    ~1e-6 when both are the same fp32 computation; larger when the sampler's distribution is not the policy the loss
    trains (other logits processors, dropout, another precision or engine) — what the generator_mismatch alarm reads."""
    diff = (sampler_logprobs.double() - logprobs.double()).abs()[mask]
    n = torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device)
    top = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=diff.device)
    rows = gather(torch.stack([n, diff.sum(), top])[None])  # (processes, 3)
    return {"rollout/sampler_logprob_diff_max": rows[:, 2].max().item(),
            "rollout/sampler_logprob_diff_mean": (rows[:, 1].sum() / rows[:, 0].sum().clamp(min=1)).item()}


def update_metrics(u: UpdateStats, sum_over_processes: Gather = _identity, gather: Gather = _identity) -> dict:
    """The update's metrics: token means of the token statistics over all micro-batches and processes,
    `policy/ratio_first_minibatch` (the token-mean ratio of the first minibatch, before any optimizer step: must be
    1), `val/ratio_var` (variance of the per-micro-batch mean ratios; 0 with a single micro-batch, TRL 1.12: NaN),
    the mean of each per-step value (grad norms), `update/skipped_steps` (optimizer steps skipped for a non-finite
    loss or gradient norm), and, where π_old was the sampler's, `rollout/sampler_logprob_diff_*`
    over the first minibatch's tokens."""
    sums = torch.stack(u.token_sums).sum(0)
    n = torch.stack(u.num_tokens).sum()
    first = torch.stack(u.first_minibatch).sum(0)
    totals = sum_over_processes(torch.cat([sums, n[None], first]).double())
    k = len(u.keys)
    out = {key: (totals[i] / totals[k]).item() for i, key in enumerate(u.keys)}
    out["policy/ratio_first_minibatch"] = (totals[k + 1] / totals[k + 2]).item()
    ratios = torch.stack(u.micro_batch_ratios).double()
    local_var = ratios.var() if len(ratios) > 1 else torch.zeros((), dtype=torch.float64, device=ratios.device)
    out["val/ratio_var"] = gather(local_var[None]).mean().item()
    for key, values in u.steps.items():
        out[key] = gather(torch.tensor([sum(values) / len(values)], dtype=torch.float64,
                                       device=ratios.device)).mean().item()
    out["update/skipped_steps"] = float(u.skipped_steps)
    tokens = gather(torch.stack(u.step_tokens).double()[None]) if u.step_tokens else []  # (processes, steps)
    if len(tokens) > 1:  # the busiest process's tokens over the mean, per step (the others wait for it there)
        out["perf/update_token_imbalance"] = (tokens.max(0).values / tokens.mean(0).clamp(min=1)).mean().item()
    if u.sampler_rows:
        out.update(sampler_metrics(*(torch.cat(column) for column in zip(*u.sampler_rows)), gather=gather))
    return out
