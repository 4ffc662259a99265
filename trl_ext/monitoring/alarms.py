"""Failure-mode alarms for PPO runs.

`AlarmMonitor` watches the per-step metrics dict the trainer logs and raises an `Alarm` when one of seven known PPO
failure modes starts; `AlarmCallback` runs it inside the trainer and turns each alarm into a `PPOAlarmWarning` plus an
``alarm/<name>: 1.0`` entry in the logged metrics::

    from trl_ext.monitoring.alarms import AlarmCallback
    from trl_ext.monitoring.callbacks import MetricsFileCallback

    trainer = PPOTrainer(..., callbacks=[AlarmCallback(), MetricsFileCallback()])   # AlarmCallback first

Alarms (the name is `Alarm.name` and the ``alarm/<name>`` log key):

============================  ==========================================================================================
``kl_blowup``                 the PPO update is too large: ``objective/kl`` jumped by more than ``kl_jump`` nats since
                              the previous logged step, or ``policy/clipfrac_avg > clipfrac_max``, or
                              ``policy/approxkl_avg > approxkl_max`` (or KL / approx-KL is NaN/inf).
``generator_mismatch``        ``rollout/sampler_logprob_diff_mean > sampler_logprob_tol`` (the sampler drew the tokens
                              from another distribution than the policy the loss trains: other logits processors,
                              dropout, another precision or engine), or ``|policy/ratio_first_minibatch - 1| >
                              ratio_tol`` (before any update the trainer's own ratio must be 1). Not on a rollout
                              an older policy version drew (``rollout/staleness > 0``: async_rollouts), whose gap is
                              the updates since.
``value_lag``                 ``val/explained_variance <= explained_variance_min`` on ``value_lag_steps`` consecutive
                              logged steps after critic warmup (``val/warmup`` is 0 or missing).
``entropy_collapse``          ``policy/entropy_avg`` fell on each of the last ``entropy_window`` logged steps and is
                              below ``entropy_drop`` × its first logged value, while ``objective/scores`` rose by less
                              than ``entropy_score_rise`` over those steps (inf by default: the score not consulted).
``length_exploitation``       ``rollout/truncation_rate > truncation_max`` and either it rose by more than
                              ``truncation_rise`` over the last ``length_window`` logged steps, or
                              ``rollout/response_length_mean`` rose on each of those steps.
``reward_hacking``            the score rose while KL rose much faster: with ``Δx`` = the mean of x over the last
                              ``hacking_smooth`` logged steps − its mean over the ``hacking_smooth`` steps
                              ``hacking_window`` steps earlier (x = ``objective/scores`` or ``objective/kl``, steps
                              where both are logged), ``Δscore > 0`` and ``ΔKL > hacking_kl_min`` and
                              ``ΔKL / max(Δscore, 1e-8) > hacking_ratio`` (nats of KL bought per unit of score).
``nonfinite_update``          the update met NaN/inf: ``update/skipped_steps > 0`` (optimizer steps skipped for a
                              non-finite loss or gradient norm, ``on_nonfinite="skip"``), or ``loss/policy_avg`` or
                              ``loss/value_avg`` is NaN/inf.
============================  ==========================================================================================

**Once per episode of trouble.** An alarm fires at the step its condition starts holding, stays quiet while the
condition keeps holding, and re-arms only after the condition has been evaluated clear on ``rearm_steps`` consecutive
logged steps (default 3). A flickering condition (holds, clears for one step, holds) is one episode.

**Missing inputs.** Any key may be absent from a step, or NaN/inf. An alarm whose inputs are missing does not evaluate
that step: it neither fires nor counts the step as clear. Windows ("over the last N steps", "on N consecutive steps")
count the steps at which the inputs were logged. The one exception to "non-finite = missing" is ``kl_blowup``: a NaN or
infinite ``objective/kl`` or ``policy/approxkl_avg`` holds its condition.

**Where the keys come from.** ``objective/*``, ``policy/clipfrac_avg``, ``policy/approxkl_avg``,
``policy/entropy_avg``, ``val/warmup`` and ``rollout/sampler_logprob_diff_mean`` are logged by `PPOTrainer.metrics`.
``policy/ratio_first_minibatch``,
``val/explained_variance``, ``rollout/response_length_mean`` and ``rollout/truncation_rate`` are evaluated only when
something logs them; until then the alarms that need them stay silent.

**Callback order.** `AlarmCallback.on_log` writes ``alarm/<name>`` into the *same* logs dict the other callbacks
receive, so only callbacks that run *after* it see the key: register it before `MetricsFileCallback` and any
report/plot callback (``callbacks=[AlarmCallback(), MetricsFileCallback(), ...]``). The trainer runs its default and
``report_to`` integration callbacks (TensorBoard, W&B, ...) before user callbacks, so those do not see the alarm keys;
the trainer's ``state.log_history`` is copied before ``on_log`` and does not hold them either.
``AlarmCallback.monitor.raised`` holds every alarm of the run.

**Resuming.** `AlarmMonitor.state_dict()` is plain JSON. `AlarmCallback` is an `ExportableState`, so the trainer's
checkpoint writes its state to ``trainer_state.json`` under ``stateful_callbacks["AlarmCallback"]``; restore it with
``callback.load_state(saved_state)`` (or ``AlarmCallback.from_state(saved_state)``) so a resumed run keeps its open
episodes and windows instead of re-raising them.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

__all__ = ["ALARM_NAMES", "ALARM_PROFILES", "Alarm", "AlarmCallback", "AlarmMonitor", "AlarmThresholds",
           "PPOAlarmWarning", "profile_thresholds"]

ALARM_NAMES = ("kl_blowup", "generator_mismatch", "value_lag", "entropy_collapse", "length_exploitation",
               "reward_hacking", "nonfinite_update")
"""Every alarm, in the order they are evaluated (and returned) within a step."""

_EPS = 1e-8
"""Floor of Δscore in the reward-hacking ratio ΔKL / max(Δscore, _EPS)."""

_STATE_FORMAT = 1

# metric keys
SCORES, KL, KL_COEF = "objective/scores", "objective/kl", "objective/kl_coef"
CLIPFRAC, APPROXKL, RATIO1, ENTROPY = ("policy/clipfrac_avg", "policy/approxkl_avg", "policy/ratio_first_minibatch",
                                       "policy/entropy_avg")
SAMPLER_DIFF = "rollout/sampler_logprob_diff_mean"
STALENESS = "rollout/staleness"  # async_rollouts: versions the sampler was behind
EXPLAINED_VARIANCE, WARMUP = "val/explained_variance", "val/warmup"
LENGTH, TRUNCATION = "rollout/response_length_mean", "rollout/truncation_rate"
SKIPPED, LOSSES = "update/skipped_steps", ("loss/policy_avg", "loss/value_avg")


class PPOAlarmWarning(UserWarning):
    """Warning category of `AlarmCallback`: ``warnings.simplefilter("error", PPOAlarmWarning)`` stops a run at the
    first alarm; ``"ignore"`` silences them (the ``alarm/<name>`` log keys are still written)."""


@dataclass
class AlarmThresholds:
    """Thresholds of the PPO failure-mode alarms (see the module docstring for each alarm's exact condition).

    Every field has a working default; override a few with ``AlarmThresholds(clipfrac_max=0.5)`` or, from a config
    file, ``AlarmThresholds.from_dict({"clipfrac_max": 0.5})``. Bad values raise a `ValueError` naming the field, the
    value and the fix.
    """

    rearm_steps: int = 3
    """An alarm that fired re-arms after its condition was clear on this many consecutive logged steps (>= 1)."""

    kl_jump: float = 5.0
    """kl_blowup: a rise of ``objective/kl`` by more than this many nats from one logged step to the next (> 0;
    ``math.inf`` disables this part)."""

    clipfrac_max: float = 0.3
    """kl_blowup: ``policy/clipfrac_avg`` above this fraction of clipped tokens (in (0, 1]; 1.0 disables this part)."""

    approxkl_max: float = 0.05
    """kl_blowup: ``policy/approxkl_avg`` (per-token KL between the rollout and updated policy) above this (> 0;
    ``math.inf`` disables this part)."""

    ratio_tol: float = 1e-3
    """generator_mismatch: ``|policy/ratio_first_minibatch - 1|`` above this (> 0; ``math.inf`` disables this part)."""

    sampler_logprob_tol: float = 0.1
    """generator_mismatch: ``rollout/sampler_logprob_diff_mean`` (mean |log π_sampler − log π_trainer| of the sampled
    tokens, nats) above this (> 0; ``math.inf`` disables this part). Measured on SmolLM2-135M: ~4e-6 in fp32, 0.03 in
    bf16 (KV-cached generation against the full forward); a sampler that ignores the policy's distribution is off by
    nats."""

    explained_variance_min: float = 0.0
    """value_lag: ``val/explained_variance`` at or below this counts as a lagging critic (< 1)."""

    value_lag_steps: int = 3
    """value_lag: this many consecutive logged post-warmup steps with a lagging critic raise the alarm (>= 1)."""

    entropy_window: int = 5
    """entropy_collapse: ``policy/entropy_avg`` must have fallen on each of this many last logged steps (>= 1)."""

    entropy_drop: float = 0.5
    """entropy_collapse: ...and be below this fraction of its first logged value (in (0, 1])."""
    entropy_score_rise: float = math.inf
    """entropy_collapse: ...while ``objective/scores`` rose by less than this over the same steps (the mean of the
    window's later half minus its earlier half): entropy falling as the score climbs is a policy converging on the
    answers, not collapsing (verifiable rewards). ``math.inf``: the score is not consulted."""

    length_window: int = 5
    """length_exploitation: number of logged steps the truncation rise / length rise is measured over (>= 1)."""

    truncation_rise: float = 0.2
    """length_exploitation: rise of ``rollout/truncation_rate`` over ``length_window`` steps above this (in [0, 1))."""

    truncation_max: float = 0.5
    """length_exploitation: ``rollout/truncation_rate`` must also be above this (in [0, 1))."""

    hacking_window: int = 10
    """reward_hacking: number of logged steps Δscore and ΔKL are measured over (>= 1)."""

    hacking_smooth: int = 3
    """reward_hacking: Δscore and ΔKL compare means over this many logged steps (>= 1), so that one noisy step (a
    batch of 16 rollouts has a mean score uncertain by ~0.1) neither fires nor hides the alarm; 1 compares single
    steps."""

    hacking_ratio: float = 10.0
    """reward_hacking: ΔKL / Δscore above this (KL in nats per unit of score; > 0)."""

    hacking_kl_min: float = 1.0
    """reward_hacking: ΔKL must also exceed this many nats, so small KL drifts never fire (>= 0)."""

    def __post_init__(self):
        def check(ok: bool, name: str, rule: str, fix: str):
            if not ok:
                raise ValueError(f"AlarmThresholds.{name}={getattr(self, name)!r} {rule}; {fix}")

        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                check(isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1, f.name,
                      "must be an integer >= 1 (a number of logged steps)", f"use e.g. the default {f.default}.")
            else:
                check(isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value),
                      f.name, "must be a number", f"use e.g. the default {f.default}.")
        check(self.kl_jump > 0, "kl_jump", "must be > 0 nats",
              "use e.g. 5.0, or math.inf to ignore KL jumps.")
        check(0 < self.clipfrac_max <= 1, "clipfrac_max", "must be in (0, 1] (policy/clipfrac_avg is a fraction)",
              "use e.g. 0.3, or 1.0 to ignore the clip fraction.")
        check(self.approxkl_max > 0, "approxkl_max", "must be > 0",
              "use e.g. 0.05, or math.inf to ignore approx-KL.")
        check(self.sampler_logprob_tol > 0, "sampler_logprob_tol", "must be > 0 nats",
              "use e.g. 0.1, or math.inf to ignore the sampler's log-probs.")
        check(self.ratio_tol > 0, "ratio_tol", "must be > 0 (the first-minibatch ratio is never exactly 1 in floats)",
              "use e.g. 1e-3, or math.inf to disable generator_mismatch.")
        check(self.explained_variance_min < 1, "explained_variance_min",
              "must be < 1 (explained variance is at most 1, so every step would count as lagging)",
              "use e.g. 0.0 (the critic predicts no better than the mean return).")
        check(0 < self.entropy_drop <= 1, "entropy_drop", "must be in (0, 1] (a fraction of the first entropy)",
              "use e.g. 0.5.")
        check(0 <= self.truncation_rise < 1, "truncation_rise",
              "must be in [0, 1) (rollout/truncation_rate is a fraction)", "use e.g. 0.2.")
        check(0 <= self.truncation_max < 1, "truncation_max",
              "must be in [0, 1) (rollout/truncation_rate is a fraction)", "use e.g. 0.5.")
        check(self.hacking_ratio > 0, "hacking_ratio", "must be > 0 (nats of KL per unit of score)",
              "use e.g. 10.0, or math.inf to disable reward_hacking.")
        check(self.hacking_kl_min >= 0, "hacking_kl_min", "must be >= 0 nats", "use e.g. 1.0.")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AlarmThresholds:
        """Thresholds from a (possibly partial) mapping; missing fields keep their defaults, unknown keys raise."""
        if not isinstance(d, Mapping):
            raise ValueError(f"AlarmThresholds.from_dict expects a mapping of threshold names to values, got "
                             f"{type(d).__name__}.")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid), key=str)
        if unknown:
            raise ValueError(f"unknown alarm threshold(s) {', '.join(map(repr, unknown))}; valid thresholds: "
                             f"{', '.join(valid)}.")
        return cls(**d)

    def to_dict(self) -> dict:
        """All thresholds as a plain dict (``from_dict(t.to_dict()) == t``)."""
        return asdict(self)


# Threshold presets per kind of run (PPOConfig.alarm_profile); alarm_thresholds override single values. The runs
# behind each number: tests/data/verifiable_metric_streams.json, docs/results.md ("Verifiable rewards").
ALARM_PROFILES: dict[str, dict[str, float]] = {
    "rlhf": {},  # a learned reward model: the defaults
    # a right-or-wrong score: the entropy falls as the policy converges on the answers (judged against the score),
    # objective/kl of a small batch jumps by up to ~9 nats on one unlikely completion, the KL grows a few nats while
    # a noisy 0/1 score creeps up (a verifier cannot be bought with drift), and a verifier does not pay for length
    # (a cut answer scores 0) while the truncation rate of 8 rollouts swung 0.125 -> 0.875 in runs that learned;
    # the update-size limits stay
    "verifiable": {"entropy_score_rise": 0.05, "kl_jump": 10.0, "hacking_kl_min": 5.0, "hacking_ratio": 50.0,
                   "truncation_max": 0.9},
}


def profile_thresholds(profile: str, overrides: Mapping[str, Any] | None = None) -> AlarmThresholds:
    """The thresholds of `profile` (one of ALARM_PROFILES) with `overrides` on top."""
    if profile not in ALARM_PROFILES:
        raise ValueError(f"alarm profile {profile!r} is not one of {tuple(ALARM_PROFILES)}.")
    return AlarmThresholds.from_dict({**ALARM_PROFILES[profile], **(overrides or {})})


@dataclass
class Alarm:
    """One raised alarm: which (`name`, one of `ALARM_NAMES`), when (the trainer's global step) and why/what to do."""

    name: str
    step: int
    message: str


def _value(metrics: Mapping, key: str, allow_nonfinite: bool = False) -> float | None:
    """metrics[key] as a float; None when missing, not a number, or (unless allowed) NaN/inf."""
    value = metrics.get(key)
    if value is None or isinstance(value, (bool, str)):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # 0-d torch tensor / NumPy scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if allow_nonfinite or math.isfinite(value) else None


def _push(history: list, value, maxlen: int) -> None:
    history.append(value)
    del history[:-maxlen]


def _strictly_falling(values: list[float]) -> bool:
    return all(b < a for a, b in zip(values, values[1:]))


def _strictly_rising(values: list[float]) -> bool:
    return all(b > a for a, b in zip(values, values[1:]))


def _g(x: float) -> str:
    return f"{x:.4g}"


class AlarmMonitor:
    """Watch a PPO run's per-step metrics and raise each failure-mode alarm once per episode of trouble.

    Pure logic: `update` returns the alarms newly raised at a step and prints nothing. Feed it every logged step in
    order::

        monitor = AlarmMonitor(AlarmThresholds(clipfrac_max=0.4))
        for step, metrics in enumerate(stream, 1):
            for alarm in monitor.update(step, metrics):
                print(alarm.message)

    Attributes:
        thresholds: the `AlarmThresholds` in use.
        raised: every `Alarm` raised so far, in order.
    """

    def __init__(self, thresholds: AlarmThresholds | Mapping[str, Any] | None = None):
        if thresholds is None:
            thresholds = AlarmThresholds()
        elif isinstance(thresholds, Mapping):
            thresholds = AlarmThresholds.from_dict(thresholds)
        elif not isinstance(thresholds, AlarmThresholds):
            raise ValueError(f"thresholds must be an AlarmThresholds, a dict of threshold overrides or None, got "
                             f"{type(thresholds).__name__}.")
        self.thresholds = thresholds
        self.raised: list[Alarm] = []
        self._armed = {name: True for name in ALARM_NAMES}  # False while an episode is open
        self._clear_streak = {name: 0 for name in ALARM_NAMES}  # consecutive evaluated-clear steps
        self._prev_kl: float | None = None
        self._first_entropy: float | None = None
        self._value_lag_streak = 0
        self._history: dict[str, list] = {"entropy": [], "entropy_score": [], "truncation": [], "length": [],
                                          "score_kl": []}

    # ------------------------------------------------------------------------------------------------ checks
    # Each returns None (inputs missing: not evaluated), "" (evaluated, clear) or the cause (condition holds).
    def _kl_blowup(self, m: Mapping) -> str | None:
        t = self.thresholds
        kl, clipfrac = _value(m, KL, allow_nonfinite=True), _value(m, CLIPFRAC)
        approxkl = _value(m, APPROXKL, allow_nonfinite=True)
        causes, evaluated = [], False
        if kl is not None and not math.isfinite(kl):
            evaluated = True
            causes.append(f"{KL} is {kl}")
        elif kl is not None and self._prev_kl is not None:
            evaluated = True
            if kl - self._prev_kl > t.kl_jump:
                causes.append(f"{KL} jumped {_g(self._prev_kl)} -> {_g(kl)} nats (> {_g(t.kl_jump)} in one step)")
        if clipfrac is not None:
            evaluated = True
            if clipfrac > t.clipfrac_max:
                causes.append(f"{CLIPFRAC}={_g(clipfrac)} > {_g(t.clipfrac_max)}")
        if approxkl is not None:
            evaluated = True
            if not math.isfinite(approxkl) or approxkl > t.approxkl_max:
                causes.append(f"{APPROXKL}={_g(approxkl)} > {_g(t.approxkl_max)}")
        if kl is not None and math.isfinite(kl):
            self._prev_kl = kl
        return "; ".join(causes) if evaluated else None

    def _generator_mismatch(self, m: Mapping) -> str | None:
        t = self.thresholds
        ratio, diff = _value(m, RATIO1), _value(m, SAMPLER_DIFF)
        if ratio is None and diff is None or _value(m, STALENESS):  # drawn by an older version: the policy's drift
            return None
        causes = []
        if diff is not None and diff > t.sampler_logprob_tol:
            causes.append(f"{SAMPLER_DIFF}={diff:.6g} > {_g(t.sampler_logprob_tol)}")
        if ratio is not None and abs(ratio - 1.0) > t.ratio_tol:
            causes.append(f"{RATIO1}={ratio:.6g}, |ratio - 1| > {_g(t.ratio_tol)}")
        return "; ".join(causes)

    def _value_lag(self, m: Mapping) -> str | None:
        t = self.thresholds
        ev, warmup = _value(m, EXPLAINED_VARIANCE), _value(m, WARMUP)
        if warmup is not None and warmup >= 0.5:  # critic warmup: the policy is not trained yet
            self._value_lag_streak = 0
            return None
        if ev is None:
            return None
        self._value_lag_streak = self._value_lag_streak + 1 if ev <= t.explained_variance_min else 0
        if self._value_lag_streak >= t.value_lag_steps:
            return (f"{EXPLAINED_VARIANCE}={_g(ev)} <= {_g(t.explained_variance_min)} on "
                    f"{self._value_lag_streak} consecutive steps after warmup")
        return ""

    def _entropy_collapse(self, m: Mapping) -> str | None:
        t = self.thresholds
        entropy = _value(m, ENTROPY)
        if entropy is None:
            return None
        if self._first_entropy is None:
            self._first_entropy = entropy
        history, scores = self._history["entropy"], self._history["entropy_score"]
        _push(history, entropy, t.entropy_window + 1)
        _push(scores, _value(m, SCORES), t.entropy_window + 1)
        if len(history) < t.entropy_window + 1:
            return None
        if not (_strictly_falling(history) and entropy < t.entropy_drop * self._first_entropy):
            return ""
        cause = (f"{ENTROPY} fell on each of the last {t.entropy_window} steps to {_g(entropy)}, below "
                 f"{_g(t.entropy_drop)} x its first value {_g(self._first_entropy)}")
        if math.isinf(t.entropy_score_rise):
            return cause
        if any(score is None for score in scores):
            return None
        half = len(scores) // 2
        rise = sum(scores[-half:]) / half - sum(scores[:half]) / half
        if rise >= t.entropy_score_rise:  # converging: the score climbs as the entropy falls
            return ""
        return cause + f", while {SCORES} rose by only {_g(rise)} (< {_g(t.entropy_score_rise)})"

    def _length_exploitation(self, m: Mapping) -> str | None:
        t = self.thresholds
        truncation, length = _value(m, TRUNCATION), _value(m, LENGTH)
        if length is not None:
            _push(self._history["length"], length, t.length_window + 1)
        if truncation is None:
            return None
        trunc_hist = self._history["truncation"]
        _push(trunc_hist, truncation, t.length_window + 1)
        if truncation <= t.truncation_max:
            return ""
        causes = []
        if len(trunc_hist) == t.length_window + 1 and truncation - trunc_hist[0] > t.truncation_rise:
            causes.append(f"{TRUNCATION} rose {_g(trunc_hist[0])} -> {_g(truncation)} over {t.length_window} steps")
        len_hist = self._history["length"]
        if length is not None and len(len_hist) == t.length_window + 1 and _strictly_rising(len_hist):
            causes.append(f"{LENGTH} rose on each of the last {t.length_window} steps "
                          f"({_g(len_hist[0])} -> {_g(length)})")
        if causes:
            return "; ".join(causes) + f", with {TRUNCATION}={_g(truncation)} > {_g(t.truncation_max)}"
        return ""

    def _reward_hacking(self, m: Mapping) -> str | None:
        t = self.thresholds
        score, kl = _value(m, SCORES), _value(m, KL)
        if score is None or kl is None:
            return None
        history = self._history["score_kl"]
        n = t.hacking_smooth
        _push(history, [score, kl], t.hacking_window + n)
        if len(history) < t.hacking_window + n:
            return None

        def mean(rows, i):
            return sum(row[i] for row in rows) / len(rows)

        then, now = history[:n], history[-n:]
        d_score, d_kl = mean(now, 0) - mean(then, 0), mean(now, 1) - mean(then, 1)
        if d_score > 0 and d_kl > t.hacking_kl_min and d_kl / max(d_score, _EPS) > t.hacking_ratio:
            return (f"over the last {t.hacking_window} steps the score rose by only {_g(d_score)} while "
                    f"{KL} rose by {_g(d_kl)} nats (means over {n} steps) ({_g(d_kl / max(d_score, _EPS))} nats "
                    f"per unit of score > "
                    f"{_g(t.hacking_ratio)})")
        return ""

    def _nonfinite_update(self, m: Mapping) -> str | None:
        skipped = _value(m, SKIPPED)
        losses = {key: _value(m, key, allow_nonfinite=True) for key in LOSSES}
        if skipped is None and all(v is None for v in losses.values()):
            return None
        causes = [f"{SKIPPED}={skipped:g}"] if skipped else []
        causes += [f"{key}={v}" for key, v in losses.items() if v is not None and not math.isfinite(v)]
        return "; ".join(causes)

    # ------------------------------------------------------------------------------------------------ messages
    @staticmethod
    def _remedy(name: str, m: Mapping) -> str:
        beta = _value(m, KL_COEF)
        beta = f" (β is {_g(beta)})" if beta is not None else ""
        return {
            "kl_blowup": "the policy moves too far per update. Remedy: lower learning_rate; raise kl_coef"
                         f"{beta} or use kl_controller=\"adaptive\"; lower cliprange or num_ppo_epochs.",
            "generator_mismatch": "the sampled tokens' log-probs differ between the sampler and the trainer before any "
                                  "update (they must agree, and the first ratio must be 1). Remedy: check the "
                                  "generation settings (no top_k / "
                                  "top_p / repetition_penalty altering the sampling distribution, the same "
                                  "temperature), the precision (bf16/fp16/quantization: generate and train in the "
                                  "same dtype) and dropout (set the model config's *dropout fields to 0); for a "
                                  "mismatch that remains (bf16): with rollout_logprobs=\"sampler\" it is in the "
                                  "ratio itself, rollout_logprobs=\"trainer\" recomputes π_old in the loss's "
                                  "precision; there vllm_importance_sampling_correction=True weights the policy "
                                  "loss by π_old / π_sampler.",
            "value_lag": "the critic predicts the returns no better than their mean, so the advantages are noise. "
                         "Remedy: raise critic_warmup_steps, raise critic_learning_rate, raise vf_coef, or start the "
                         "critic from a better value_model_init (\"reward_model\" or \"policy\").",
            "entropy_collapse": "the policy is becoming deterministic (mode collapse). Remedy: raise kl_coef"
                                f"{beta}, lower learning_rate, raise temperature.",
            "length_exploitation": "responses are growing into the length cap without a stop token (the reward "
                                   "likely favours length). Remedy: set missing_eos_penalty (or raise it), add a "
                                   "length term to the reward, or raise response_length if the long answers are "
                                   "legitimate.",
            "nonfinite_update": "optimizer steps met a NaN/inf loss or gradient and were skipped (the weights are "
                                "untouched; max_skipped_steps in a row stop the run). Remedy: lower learning_rate; "
                                "bound the rewards (reward_clip, reward_norm=\"running\"); under fp16 use bf16.",
            "reward_hacking": "the policy is buying score with large moves away from the reference (likely "
                              "exploiting the reward). Remedy: inspect the completions in samples.jsonl; raise "
                              f"kl_coef{beta} or use kl_controller=\"adaptive\" with a lower kl_target; improve the "
                              "reward model.",
        }[name]

    # ------------------------------------------------------------------------------------------------ update
    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        """Evaluate every alarm on the metrics logged at `step`; return the alarms newly raised (also appended to
        `raised`), in `ALARM_NAMES` order. Call once per logged step, in step order."""
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics must be a dict of metric name -> value, got {type(metrics).__name__}.")
        new = []
        for name in ALARM_NAMES:
            cause = getattr(self, f"_{name}")(metrics)
            if cause is None:  # inputs missing: not evaluated, the episode state does not move
                continue
            if cause:
                self._clear_streak[name] = 0
                if self._armed[name]:
                    self._armed[name] = False
                    alarm = Alarm(name, int(step), f"[trl_ext alarm {name}] step {int(step)}: {cause}: "
                                                   f"{self._remedy(name, metrics)}")
                    new.append(alarm)
            else:
                self._clear_streak[name] += 1
                if self._clear_streak[name] >= self.thresholds.rearm_steps:
                    self._armed[name] = True
        self.raised.extend(new)
        return new

    def active(self) -> list[str]:
        """Names of the alarms whose episode is open (fired and not yet re-armed)."""
        return [name for name in ALARM_NAMES if not self._armed[name]]

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to continue the episodes and windows after a resume, as plain JSON-able data (the
        thresholds are not included: they come from the resumed run's constructor)."""
        return copy.deepcopy({
            "format": _STATE_FORMAT,
            "raised": [asdict(a) for a in self.raised],
            "armed": self._armed,
            "clear_streak": self._clear_streak,
            "prev_kl": self._prev_kl,
            "first_entropy": self._first_entropy,
            "value_lag_streak": self._value_lag_streak,
            "history": self._history,
        })

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (e.g. after ``json.loads``). Windows longer than the current
        thresholds' windows are cut to their most recent values."""
        expected = {"format", "raised", "armed", "clear_streak", "prev_kl", "first_entropy", "value_lag_streak",
                    "history"}
        if not isinstance(state, Mapping) or set(state) != expected or state["format"] != _STATE_FORMAT:
            raise ValueError("not an AlarmMonitor.state_dict() of this version (expected keys "
                             f"{sorted(expected)}, format {_STATE_FORMAT}); pass the dict AlarmMonitor.state_dict() "
                             "returned.")
        state = copy.deepcopy(dict(state))
        raised = [Alarm(str(a["name"]), int(a["step"]), str(a["message"])) for a in state["raised"]]
        armed = {name: bool(state["armed"].get(name, True)) for name in ALARM_NAMES}
        clear = {name: int(state["clear_streak"].get(name, 0)) for name in ALARM_NAMES}
        t, history = self.thresholds, state["history"]
        maxlen = {"entropy": t.entropy_window + 1, "entropy_score": t.entropy_window + 1,
                  "truncation": t.length_window + 1, "length": t.length_window + 1,
                  "score_kl": t.hacking_window + t.hacking_smooth}
        history = {"entropy_score": [], **history}  # (a state saved before the score was kept)
        if set(history) != set(maxlen):
            raise ValueError(f"state_dict history has keys {sorted(history)}, expected {sorted(maxlen)}.")
        self.raised = raised
        self._armed, self._clear_streak = armed, clear
        self._prev_kl = None if state["prev_kl"] is None else float(state["prev_kl"])
        self._first_entropy = None if state["first_entropy"] is None else float(state["first_entropy"])
        self._value_lag_streak = int(state["value_lag_streak"])
        self._history = {key: list(history[key])[-n:] for key, n in maxlen.items()}


class AlarmCallback(TrainerCallback, ExportableState):
    """Run an `AlarmMonitor` on every PPO metrics log; warn and log each new alarm.

    On each ``on_log`` whose logs hold ``objective/scores`` (the PPO per-step metrics), the monitor is updated with
    ``state.global_step``. For each newly raised alarm the callback

    - issues ``warnings.warn(alarm.message, PPOAlarmWarning)`` (on the world process zero only; every process runs
      the monitor, on the same all-process means, so their states agree), and
    - sets ``logs["alarm/<name>"] = 1.0`` in the same logs dict, so callbacks registered *after* this one (e.g.
      `MetricsFileCallback`, which writes ``metrics.jsonl``) record it. Register it first:
      ``callbacks=[AlarmCallback(), MetricsFileCallback()]``.

    Every alarm of the run is in ``callback.monitor.raised``.

    Args:
        thresholds: an `AlarmThresholds`, a dict of overrides (`AlarmThresholds.from_dict`), or None for defaults.
    """

    def __init__(self, thresholds: AlarmThresholds | Mapping[str, Any] | None = None):
        self.monitor = AlarmMonitor(thresholds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or SCORES not in logs:
            return
        for alarm in self.monitor.update(state.global_step, logs):
            logs[f"alarm/{alarm.name}"] = 1.0
            if state.is_world_process_zero:
                warnings.warn(alarm.message, PPOAlarmWarning, stacklevel=2)

    # ExportableState: the trainer's checkpoints save this in trainer_state.json["stateful_callbacks"]["AlarmCallback"]
    def state(self) -> dict:
        return {"args": {"thresholds": self.monitor.thresholds.to_dict()},
                "attributes": {"monitor": self.monitor.state_dict()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from what `state()` returned (keeps this callback's own thresholds)."""
        self.monitor.load_state_dict(state["attributes"]["monitor"])

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> AlarmCallback:
        """A callback with the saved thresholds and monitor state."""
        callback = cls(thresholds=state["args"]["thresholds"])
        callback.load_state(state)
        return callback
