"""Per-token estimators of KL(π_θ ‖ π_ref) from log-probs of tokens sampled from π_θ.

Shapes: B = batch, T = response length.

With log ρ = log π_ref(x) − log π_θ(x) and x ~ π_θ (http://joschu.net/blog/kl-approx.html):
    k1 = −log ρ                unbiased, high variance, can be negative per token
    k2 = ½ (log ρ)²            biased, low variance, never negative
    k3 = (ρ − 1) − log ρ       unbiased, low variance, never negative
"""
import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def estimate_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Elementwise estimate of KL(π_θ ‖ π_ref) for each sampled token.

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens (the policy that sampled them).
        ref_logprobs: (B, T) log π_ref of the same tokens.
        estimator: one of KL_ESTIMATORS ("k1", "k2", "k3").

    Returns:
        (B, T) per-token estimates. Padding is NOT masked here; callers zero it with their response_mask.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs has shape {tuple(logprobs.shape)} but ref_logprobs has shape {tuple(ref_logprobs.shape)}; "
            "they must match (one log-prob per sampled token)"
        )
    log_ratio = ref_logprobs - logprobs  # log ρ
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3: expm1 keeps (ρ − 1) accurate when ρ ≈ 1, so the result stays >= 0 in floating point
    return torch.expm1(log_ratio) - log_ratio
