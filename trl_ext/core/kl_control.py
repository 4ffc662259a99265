"""Controllers for the KL-penalty coefficient β (the `kl_coef` of shape_rewards): fixed, or adapted to a target KL.

Imports only `typing` (not even torch): the trainer passes python numbers.

Shapes: scalars only. `kl` is one python number per rollout batch (a 0-d / one-element tensor is accepted too);
`n_steps` is the number of rollouts (sequences) in that batch.

Which KL is fed in: the trainer feeds the mean over the batch's rollouts of the PER-SEQUENCE SUM of the per-token
KL estimate (TRL's logged `objective/kl`, Ziegler et al.'s KL(π ‖ ρ) of a whole sample). So `target` is in nats
per sequence (TRL-legacy's default: target 6.0, horizon 10000). Systems that feed the per-token MEAN KL instead
(e.g. verl's `kl_ctrl.target_kl`) are on a different scale: their KL is smaller by a factor of the response length,
so a target copied between the two conventions is off by that factor.

Adaptive rule (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593, sec. 2.2), applied once per rollout batch:
    e = clip((kl − target) / target, −0.2, 0.2)
    β ← β · (1 + e · n_steps / horizon)
Each update multiplies β by a factor in [1 − 0.2·n/h, 1 + 0.2·n/h] ⊂ [0.8, 1.2] (n_steps <= horizon is enforced),
so β never goes negative and changes by at most 20%·n/h per batch.
"""
from typing import Any

KL_CONTROLLERS = ("fixed", "adaptive")

_MAX_PROPORTIONAL_ERROR = 0.2  # Ziegler et al. clip e to [−0.2, 0.2]

Number = Any  # a python int/float, or anything float() accepts (a numpy scalar, a one-element torch tensor)


def _is_finite(x: float) -> bool:
    # x − x is 0.0 for every finite float and NaN for NaN / ±inf (core may import only torch/typing: no `math`)
    return x - x == 0.0


def _as_float(name: str, x: Number) -> float:
    if isinstance(x, bool):
        raise ValueError(f"{name}={x!r} is a bool; pass a number")
    if isinstance(x, (str, bytes)):  # float("0.1") would parse it: a config typo should not pass silently
        raise ValueError(f"{name}={x!r} is not a scalar number (it is a string); pass a python float")
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name}={x!r} is not a scalar number; pass one python float (or a one-element tensor)") from e


def _check_kl_coef(name: str, value: Number) -> float:
    v = _as_float(name, value)
    if not _is_finite(v) or v < 0:
        raise ValueError(f"{name}={value} must be a finite number >= 0 (it is the weight β of the KL penalty); "
                         "typical values are 0.01-0.2")
    return v


def _check_target(target: Number) -> float:
    v = _as_float("target", target)
    if not _is_finite(v) or v <= 0:
        raise ValueError(f"target={target} must be a finite number > 0: the KL the adaptive controller steers to, "
                         "in nats per sequence (sum over the response's tokens), e.g. 6.0")
    return v


def _check_horizon(horizon: Number) -> float:
    v = _as_float("horizon", horizon)
    if not _is_finite(v) or v <= 0:
        raise ValueError(f"horizon={horizon} must be a finite number > 0: the number of rollouts over which β adapts, "
                         "e.g. 10000")
    return v


def _check_n_steps(n_steps: Any) -> int:
    index = getattr(type(n_steps), "__index__", None)  # what operator.index accepts: ints, numpy / torch int scalars
    if isinstance(n_steps, bool) or index is None:
        raise ValueError(f"n_steps={n_steps!r} must be an int: the number of rollouts in the batch")
    n = index(n_steps)
    if n < 1:
        raise ValueError(f"n_steps={n} must be >= 1: the number of rollouts in the batch the KL was measured on")
    return n


def _check_keys(cls_name: str, d: dict[str, Any], expected: tuple) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{cls_name}.load_state_dict expects a dict from state_dict(), got {type(d).__name__}")
    missing = sorted(set(expected) - set(d))
    unexpected = sorted(set(d) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{cls_name}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
                         f"expected exactly {sorted(expected)} (pass the dict its state_dict() returned)")


class FixedKLController:
    """β = kl_coef for the whole run; update() is a no-op (kept so the trainer can call it unconditionally)."""

    _KEYS = ("value",)

    def __init__(self, kl_coef: float):
        self._value = _check_kl_coef("kl_coef", kl_coef)

    @property
    def value(self) -> float:
        """The current KL coefficient β."""
        return self._value

    def update(self, kl: Number, n_steps: int) -> float:
        """Does nothing; returns β."""
        return self._value

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _check_keys(type(self).__name__, d, self._KEYS)
        self._value = _check_kl_coef("value", d["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self._value!r})"


class AdaptiveKLController:
    """Proportional controller that moves β so the measured KL tracks `target` (Ziegler et al. 2019, sec. 2.2).

    # Same rule as TRL-legacy's AdaptiveKLController (trl <= 0.11, trl/trainer/utils.py) and OpenRLHF's
    # (openrlhf/trainer/ppo_utils/kl_controller.py): e = clip(kl/target − 1, −0.2, 0.2); β *= 1 + e·n_steps/horizon.
    # Unlike those, bad input raises instead of silently corrupting β.

    Feed update() the KL of the batch just collected as the mean over its rollouts of the per-sequence SUM of the
    per-token KL (TRL's `objective/kl`), so `target` is in nats per sequence (e.g. 6.0). A per-token-mean KL is
    smaller by a factor of the response length; don't mix the two conventions.

    Args:
        init_kl_coef: β0 >= 0, finite. β is updated multiplicatively, so β0 = 0 stays 0 forever.
        target: finite > 0, the KL to steer to (nats per sequence).
        horizon: finite > 0, in rollouts; larger = slower adaptation. Must be >= the rollouts per batch (n_steps),
            which keeps every update's factor in [0.8, 1.2]. Typical: 10000.

    β rises when kl > target, falls when kl < target, is unchanged when kl == target; each update changes it by at
    most a factor 1 ± 0.2·n_steps/horizon. A finite negative kl (possible with the k1 estimator) is allowed and just
    lowers β at the clipped rate; NaN/inf kl raises and leaves β untouched.
    """

    _KEYS = ("value", "target", "horizon")

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self._value = _check_kl_coef("init_kl_coef", init_kl_coef)
        self._target = _check_target(target)
        self._horizon = _check_horizon(horizon)

    @property
    def value(self) -> float:
        """The current KL coefficient β."""
        return self._value

    @property
    def target(self) -> float:
        return self._target

    @property
    def horizon(self) -> float:
        return self._horizon

    def update(self, kl: Number, n_steps: int) -> float:
        """One controller step after a rollout batch; returns the new β.

        Args:
            kl: measured KL of the batch: mean over rollouts of the per-sequence sum of per-token KL (nats/sequence).
            n_steps: number of rollouts in the batch, 1 <= n_steps <= horizon.
        """
        kl_f = _as_float("kl", kl)
        if not _is_finite(kl_f):
            raise ValueError(f"kl={kl_f} is not finite; the policy/reference log-probs have overflowed or are NaN. "
                             "Fix the rollout (check logprobs, ref_logprobs and the response mask) instead of "
                             "updating β with it")
        n = _check_n_steps(n_steps)
        if n > self._horizon:
            raise ValueError(f"n_steps={n} exceeds horizon={self._horizon}: horizon must be at least the rollouts per "
                             f"batch (n) so each update's factor stays in [0.8, 1.2]; raise horizon (typical 10000)")
        e = (kl_f - self._target) / self._target
        e = min(max(e, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR)
        new_value = self._value * (1.0 + e * n / self._horizon)
        if not _is_finite(new_value):  # only reachable after ~3900 maximal increases from β ~ 1
            raise ValueError(f"KL coefficient overflowed: {self._value} · {1.0 + e * n / self._horizon} is not finite; "
                             "the KL has stayed far above target for thousands of updates — lower the learning rate "
                             "or raise target")
        self._value = new_value
        return new_value

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value, "target": self._target, "horizon": self._horizon}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore every field (β, target, horizon) from a state_dict(); validated before anything is changed."""
        _check_keys(type(self).__name__, d, self._KEYS)
        value = _check_kl_coef("value", d["value"])
        target = _check_target(d["target"])
        horizon = _check_horizon(d["horizon"])
        self._value, self._target, self._horizon = value, target, horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self._value!r}, target={self._target!r}, horizon={self._horizon!r})"


def make_kl_controller(
    kind: str,
    kl_coef: float,
    target: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build a controller from config values.

    Args:
        kind: one of KL_CONTROLLERS ("fixed", "adaptive").
        kl_coef: β for "fixed", β0 for "adaptive".
        target, horizon: required for "adaptive" (see AdaptiveKLController); ignored for "fixed".
    """
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller kind {kind!r}; use one of {KL_CONTROLLERS}")
    if kind == "fixed":
        return FixedKLController(kl_coef)
    missing = [name for name, v in (("target", target), ("horizon", horizon)) if v is None]
    if missing:
        raise ValueError(f"the adaptive KL controller needs {' and '.join(missing)}; pass e.g. target=6.0 "
                         "(nats per sequence) and horizon=10000 (rollouts)")
    return AdaptiveKLController(kl_coef, target, horizon)
