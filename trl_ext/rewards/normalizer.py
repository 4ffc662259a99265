"""`RewardNormalizer`: score conditioning before the stop penalty ("none", "fixed" or "running" mean/std, an
optional clip), its running statistics carried through checkpoints."""

from __future__ import annotations

import math
import numbers

import torch

_STD_FLOOR = 1e-8  # divide by max(std, this), so a batch of identical scores gives 0, not NaN
NORMALIZER_MODES = ("none", "running", "fixed")


class RewardNormalizer:
    """Normalise (B,) scores: "none" (identity), "fixed" ((s − mean) / std with the given mean/std) or "running"
    ((s − μ) / σ with the mean μ and SAMPLE standard deviation σ (n − 1 in the denominator, as `torch.std`) of every
    score seen so far, this batch included; σ = 1 while fewer than 2 scores have been seen). Then, in every mode,
    `clip` (if not None) clamps the result to [−clip, clip]. σ is floored at 1e-8.

    The running statistics are updated with Chan et al.'s parallel (Welford) merge in float64. Under several
    processes, call `update()` with the gathered scores and `normalize()` on the local ones, so every rank uses the
    same statistics; `__call__` is `update` then `normalize` on the same scores.

    The trainer normalises the score before it subtracts `missing_eos_penalty`: the penalty is applied afterwards,
    in normalised units, never scaled by σ or clipped.

    `state_dict()` / `load_state_dict()` carry the running statistics (JSON-able), so a resumed run continues them;
    the settings (mode, mean, std, clip) come from the constructor.
    """

    def __init__(self, mode: str = "none", mean: float = 0.0, std: float = 1.0, clip: float | None = None):
        if mode not in NORMALIZER_MODES:
            raise ValueError(f"RewardNormalizer mode must be one of {NORMALIZER_MODES}, got {mode!r}.")
        for label, v in (("mean", mean), ("std", std)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise ValueError(f"RewardNormalizer {label} must be a finite number, got {v!r}.")
        if std <= 0:
            raise ValueError(f"RewardNormalizer std must be > 0, got {std!r}.")
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not float(clip) > 0 \
                    or math.isnan(float(clip)):
                raise ValueError(f"RewardNormalizer clip must be None or a number > 0, got {clip!r}.")
        self.mode, self.mean, self.std = mode, float(mean), float(std)
        self.clip = None if clip is None else float(clip)
        self.count = 0
        self.running_mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the running mean

    @property
    def running_std(self) -> float:
        """Sample std of every score seen so far (1.0 with fewer than 2)."""
        if self.count < 2:
            return 1.0
        return math.sqrt(self.m2 / (self.count - 1))

    def update(self, scores: torch.Tensor) -> None:
        """Merge a batch into the running statistics (only in "running" mode)."""
        if self.mode != "running":
            return
        x = self._check(scores).detach().double().reshape(-1).cpu()
        n = x.numel()
        if n == 0:
            return
        b_mean = float(x.mean())
        b_m2 = float(((x - b_mean) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.running_mean
        self.running_mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """Normalise with the current statistics, without updating them."""
        scores = self._check(scores)
        if self.mode == "fixed":
            out = (scores - self.mean) / self.std
        elif self.mode == "running":
            out = (scores - self.running_mean) / max(self.running_std, _STD_FLOOR)
        else:
            out = scores
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """(B,) -> (B,): update the running statistics with these scores (mode "running"), then normalise them."""
        self.update(scores)
        return self.normalize(scores)

    @staticmethod
    def _check(scores: torch.Tensor) -> torch.Tensor:
        if not isinstance(scores, torch.Tensor):
            scores = torch.as_tensor(scores, dtype=torch.float32)
        if scores.dim() != 1:
            raise ValueError(f"RewardNormalizer takes (B,) scores, got shape {tuple(scores.shape)}.")
        if not torch.isfinite(scores).all():
            raise ValueError(f"RewardNormalizer got non-finite scores {scores.tolist()[:5]}...; they would poison "
                             "the running statistics.")
        return scores

    def state_dict(self) -> dict:
        return {"mode": self.mode, "mean": self.mean, "std": self.std, "clip": self.clip,
                "count": int(self.count), "running_mean": float(self.running_mean), "m2": float(self.m2)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running statistics (count, running_mean, m2); settings stay as constructed."""
        try:
            count, mean, m2 = int(state["count"]), float(state["running_mean"]), float(state["m2"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a RewardNormalizer state: {state!r}") from e
        if count < 0 or m2 < 0 or not math.isfinite(mean) or not math.isfinite(m2):
            raise ValueError(f"corrupt RewardNormalizer state: {state!r}")
        self.count, self.running_mean, self.m2 = count, mean, m2
