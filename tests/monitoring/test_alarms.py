"""Tests for trl_ext.monitoring.alarms: each alarm fires once at a known step on a synthetic metrics stream, a long
healthy noisy stream raises nothing, once-per-episode and re-arming, missing keys, threshold overrides and validation,
the callback (warning + alarm/<name> in the logs dict a later MetricsFileCallback writes), and state round trips.

trl_ext.monitoring.alarms loads without trl; its one heavy import is transformers.trainer_callback (for
TrainerCallback), which this file needs anyway.
"""
import json
import math
import random
import warnings

import pytest
from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

from trl_ext.monitoring import alarms, callbacks

Alarm, AlarmCallback, AlarmMonitor = alarms.Alarm, alarms.AlarmCallback, alarms.AlarmMonitor
AlarmThresholds, PPOAlarmWarning, ALARM_NAMES = alarms.AlarmThresholds, alarms.PPOAlarmWarning, alarms.ALARM_NAMES


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Overrides conftest's fixture of the same name: nothing here builds an Accelerator."""
    yield


# ---------------------------------------------------------------------------------------------------- streams
def calm(**overrides) -> dict:
    """One step of a healthy run, every key the alarms read; `overrides` replace values (None drops the key)."""
    m = {
        "objective/scores": 0.5, "objective/scores_std": 0.3, "objective/kl": 1.0, "objective/kl_coef": 0.05,
        "policy/clipfrac_avg": 0.1, "policy/approxkl_avg": 0.01, "policy/ratio_first_minibatch": 1.0,
        "policy/entropy_avg": 2.0, "val/explained_variance": 0.5, "val/warmup": 0.0,
        "rollout/response_length_mean": 40.0, "rollout/truncation_rate": 0.1,
        "rollout/sampler_logprob_diff_mean": 1e-6, "update/skipped_steps": 0.0, "loss/policy_avg": -0.01,
        "loss/value_avg": 0.2,
    }
    for key, value in overrides.items():
        key = key.replace("__", "/")
        if value is None:
            m.pop(key)
        else:
            m[key] = value
    return m


def run(stream, thresholds=None, start=1):
    """Feed `stream` (step `start`, start+1, ...) to a fresh monitor; return [(name, step), ...] of all raised."""
    monitor = AlarmMonitor(thresholds)
    for step, metrics in enumerate(stream, start):
        monitor.update(step, metrics)
    return [(a.name, a.step) for a in monitor.raised]


def healthy_stream(n=300, seed=0):
    """A realistic healthy run: KL 0 -> 3 nats with noise, score rising with it, clipfrac 0.05-0.15, approx-KL
    0.005-0.02, ratio 1 up to float noise, EV 0.2-0.8 (negative during a 5-step critic warmup), entropy flat-ish
    with noise and a slight drift, truncation 0.1 ± 0.05, length 40 ± 3."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        kl = max(0.0, 3.0 * t / n + rng.gauss(0, 0.08))
        warm = t < 5
        out.append({
            "objective/kl": kl,
            "objective/scores": -0.5 + 0.4 * kl + rng.gauss(0, 0.05),
            "objective/scores_std": 0.5 + rng.gauss(0, 0.05),
            "objective/kl_coef": 0.05,
            "policy/clipfrac_avg": rng.uniform(0.05, 0.15),
            "policy/approxkl_avg": rng.uniform(0.005, 0.02),
            "policy/ratio_first_minibatch": 1.0 + rng.uniform(-1e-5, 1e-5),
            "policy/entropy_avg": 2.0 - 0.2 * t / n + rng.gauss(0, 0.04),
            "val/explained_variance": rng.uniform(-0.9, -0.1) if warm else rng.uniform(0.2, 0.8),
            "val/warmup": 1.0 if warm else 0.0,
            "rollout/response_length_mean": 40.0 + rng.gauss(0, 3),
            "rollout/truncation_rate": min(1.0, max(0.0, 0.1 + rng.uniform(-0.05, 0.05))),
        })
    return out


# ---------------------------------------------------------------------------------------------------- each alarm
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_long_healthy_noisy_run_raises_nothing(seed):
    stream = healthy_stream(seed=seed)
    assert run(stream) == []
    # the stream is not trivially quiet: a stricter clipfrac limit inside its range does fire
    assert run(stream, AlarmThresholds(clipfrac_max=0.06))[0][0] == "kl_blowup"


def test_kl_jump_fires_kl_blowup_at_the_jump():
    stream = [calm() for _ in range(9)] + [calm(objective__kl=6.5)] + [calm(objective__kl=6.6) for _ in range(5)]
    assert run(stream) == [("kl_blowup", 10)]
    # a 4.9-nat jump is under kl_jump
    assert run([calm() for _ in range(9)] + [calm(objective__kl=5.9)]) == []
    # a KL that falls sharply is not a blow-up
    assert run([calm(objective__kl=8.0) for _ in range(5)] + [calm(objective__kl=1.0)]) == []


@pytest.mark.parametrize("key, value", [("policy__clipfrac_avg", 0.35), ("policy__approxkl_avg", 0.08),
                                        ("objective__kl", math.nan), ("policy__approxkl_avg", math.inf)])
def test_clipfrac_approxkl_or_nonfinite_kl_fire_kl_blowup(key, value):
    stream = [calm() for _ in range(6)] + [calm(**{key: value}) for _ in range(4)] + [calm() for _ in range(2)]
    assert run(stream) == [("kl_blowup", 7)]


def test_kl_blowup_message_names_cause_and_remedy():
    monitor = AlarmMonitor()
    (alarm,) = monitor.update(3, calm(policy__clipfrac_avg=0.42))
    assert isinstance(alarm, Alarm) and alarm == monitor.raised[0] and (alarm.name, alarm.step) == ("kl_blowup", 3)
    for fragment in ("policy/clipfrac_avg=0.42", "> 0.3", "lower learning_rate", "raise kl_coef", "β is 0.05",
                     'kl_controller="adaptive"', "cliprange", "num_ppo_epochs"):
        assert fragment in alarm.message


def test_generator_mismatch_fires_when_the_first_ratio_leaves_one():
    stream = [calm(policy__ratio_first_minibatch=1.0 + 2e-4) for _ in range(6)] \
        + [calm(policy__ratio_first_minibatch=0.97) for _ in range(5)]
    assert run(stream) == [("generator_mismatch", 7)]
    message = AlarmMonitor().update(1, calm(policy__ratio_first_minibatch=1.01))[0].message
    for fragment in ("policy/ratio_first_minibatch=1.01", "generation", "precision", "dropout"):
        assert fragment in message


def test_generator_mismatch_fires_when_the_sampler_disagrees_with_the_trainer():
    """The sampler's log-probs against the trainer's: bf16-level noise (0.03) is quiet, 0.5 nats fires, even while
    the first ratio reads exactly 1 (it compares the trainer with itself); either input alone is enough."""
    stream = [calm(rollout__sampler_logprob_diff_mean=0.03) for _ in range(4)] \
        + [calm(rollout__sampler_logprob_diff_mean=0.5) for _ in range(3)]
    assert run(stream) == [("generator_mismatch", 5)]
    message = AlarmMonitor().update(1, calm(rollout__sampler_logprob_diff_mean=0.5))[0].message
    assert "rollout/sampler_logprob_diff_mean=0.5 > 0.1" in message
    only_sampler = [calm(policy__ratio_first_minibatch=None, rollout__sampler_logprob_diff_mean=x) for x in (0, 0.2)]
    assert run(only_sampler) == [("generator_mismatch", 2)]
    assert run(stream, AlarmThresholds(sampler_logprob_tol=math.inf)) == []
    with pytest.raises(ValueError, match="sampler_logprob_tol=0 must be > 0 nats"):
        AlarmThresholds(sampler_logprob_tol=0)


def test_generator_mismatch_is_quiet_on_a_rollout_an_older_version_drew():
    """async_rollouts: a sampler one version behind differs from the trainer by the update since; at staleness 0 the
    same numbers still fire."""
    stale = [calm(policy__ratio_first_minibatch=0.97, rollout__sampler_logprob_diff_mean=0.5,
                  rollout__staleness=1.0) for _ in range(4)]
    assert run(stale) == []
    fresh = [calm(policy__ratio_first_minibatch=0.97, rollout__staleness=0.0) for _ in range(2)]
    assert run(fresh) == [("generator_mismatch", 1)]


def test_value_lag_fires_after_value_lag_steps_post_warmup():
    # warmup steps 1-5 with a useless critic: ignored; then good until step 10; EV <= 0 from step 11
    stream = [calm(val__warmup=1.0, val__explained_variance=-0.8) for _ in range(5)] \
        + [calm(val__explained_variance=0.4) for _ in range(5)] \
        + [calm(val__explained_variance=ev) for ev in (0.0, -0.2, -0.1, -0.3, -0.2)]
    assert run(stream) == [("value_lag", 13)]
    # two lagging steps then a good one resets the count
    stream = [calm(val__explained_variance=ev) for ev in (-0.1, -0.1, 0.3, -0.1, -0.1, 0.3)]
    assert run(stream) == []
    # without val/warmup the steps count as post-warmup
    assert run([calm(val__warmup=None, val__explained_variance=-0.5) for _ in range(4)]) == [("value_lag", 3)]
    # a warmup step restarts the count
    stream = [calm(val__warmup=None, val__explained_variance=-0.1)] * 2 \
        + [calm(val__warmup=1.0, val__explained_variance=-0.5)] + [calm(val__explained_variance=-0.1)] * 3
    assert run(stream) == [("value_lag", 6)]
    message = AlarmMonitor(AlarmThresholds(value_lag_steps=1)).update(1, calm(val__explained_variance=-1.0))[0].message
    for fragment in ("critic_warmup_steps", "critic_learning_rate", "vf_coef", "value_model_init"):
        assert fragment in message


def test_entropy_collapse_needs_a_steady_fall_below_half_the_first_value():
    # flat at 2.0 for steps 1-10, then -0.12 per step: 5 falls in a row by step 15 (1.4), below 1.0 at step 19 (0.92)
    stream = [calm() for _ in range(10)] + [calm(policy__entropy_avg=2.0 - 0.12 * k) for k in range(1, 12)]
    assert run(stream) == [("entropy_collapse", 19)]
    # a sudden drop to a low but flat entropy is not a steady fall
    assert run([calm() for _ in range(10)] + [calm(policy__entropy_avg=0.4) for _ in range(10)]) == []
    # a steady fall that stays above half the first value is not a collapse
    assert run([calm(policy__entropy_avg=2.0 - 0.05 * k) for k in range(15)]) == []
    m = AlarmMonitor(AlarmThresholds(entropy_window=1))
    m.update(1, calm(policy__entropy_avg=2.0))
    (alarm,) = m.update(2, calm(policy__entropy_avg=0.5))
    for fragment in ("raise kl_coef", "lower learning_rate", "raise temperature"):
        assert fragment in alarm.message


def test_entropy_falling_as_the_score_climbs_is_convergence_with_a_score_rise_threshold():
    """The same fall of entropy (5 falls by step 15, below half at 19): with entropy_score_rise 0.05, a score climbing
    0.2 -> 0.9 alongside keeps the alarm quiet (converging on the answers); a flat score fires it at 19."""
    falling = [calm(policy__entropy_avg=2.0, objective__scores=0.2) for _ in range(10)]
    climbing = falling + [calm(policy__entropy_avg=2.0 - 0.12 * k, objective__scores=0.2 + 0.06 * k)
                          for k in range(1, 12)]
    flat = falling + [calm(policy__entropy_avg=2.0 - 0.12 * k, objective__scores=0.2) for k in range(1, 12)]
    thresholds = AlarmThresholds(entropy_score_rise=0.05)
    assert run(climbing, thresholds) == [] and run(climbing) == [("entropy_collapse", 19)]
    assert run(flat, thresholds) == [("entropy_collapse", 19)]
    monitor = AlarmMonitor(thresholds)
    for step, metrics in enumerate(flat, 1):
        monitor.update(step, metrics)
    assert "objective/scores rose by only 0 (< 0.05)" in monitor.raised[0].message
    # the later half's mean minus the earlier half's, over the 6 steps of the window: 3 steps each
    window = [calm(policy__entropy_avg=e, objective__scores=s) for e, s in
              zip([2.0, 2.0, 1.0, 0.9, 0.8, 0.7, 0.6], [0.5, 0.5, 0.5, 0.5, 0.5625, 0.5625, 0.5625])]
    assert run(window, AlarmThresholds(entropy_score_rise=0.0625)) == []  # (0.5625·3 − 0.5·3) / 3: not below
    assert run(window, AlarmThresholds(entropy_score_rise=0.0626)) == [("entropy_collapse", 7)]


def test_the_verifiable_profile_and_its_overrides():
    from trl_ext import PPOConfig
    from trl_ext.monitoring.alarms import ALARM_PROFILES, profile_thresholds

    assert profile_thresholds("rlhf") == AlarmThresholds()
    verifiable = profile_thresholds("verifiable")
    assert verifiable.to_dict() == {**AlarmThresholds().to_dict(), **ALARM_PROFILES["verifiable"]}
    assert math.isfinite(verifiable.entropy_score_rise)
    assert profile_thresholds("verifiable", {"clipfrac_max": 0.9}).clipfrac_max == 0.9
    with pytest.raises(ValueError, match="alarm_profile='chat'"):
        PPOConfig(output_dir="/tmp/x", bf16=False, alarm_profile="chat")


def test_length_exploitation_on_a_truncation_rise():
    truncation = [0.1] * 10 + [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8]
    stream = [calm(rollout__truncation_rate=r) for r in truncation]
    # step 14: 0.5 is not > 0.5; step 15: 0.6 > 0.5 and 0.6 - 0.1 (step 10) > 0.2
    assert run(stream) == [("length_exploitation", 15)]
    m = AlarmMonitor()
    alarms_ = [a for step, x in enumerate(stream, 1) for a in m.update(step, x)]
    for fragment in ("rollout/truncation_rate", "missing_eos_penalty", "length term", "response_length"):
        assert fragment in alarms_[0].message


def test_reward_hacking_is_not_fired_by_one_lucky_batch():
    """A healthy run measured on 16-rollout batches (the quickstart's seed-42 scores, rounded): the first batch scores
    high by chance, then score and KL rise together (score +0.35, KL +1.7 nats over the run). Single-step differences
    read step 1 -> step 11 as 'score +0.11 for 1.75 nats' and fire; 3-step means do not."""
    scores = [0.19, -0.25, -0.22, 0.20, 0.16, 0.21, 0.04, -0.02, -0.04, 0.35, 0.30, 0.16, 0.43, 0.38, 0.41, 0.37]
    kls = [0.0, 0.0, 0.18, 0.16, 0.52, 0.24, 0.06, 1.54, 0.99, 1.41, 1.75, 1.74, 2.86, 2.15, 1.76, 2.0]
    stream = [calm(objective__scores=s, objective__kl=k) for s, k in zip(scores, kls)]
    assert run(stream, {"hacking_smooth": 1}) == [("reward_hacking", 11)]
    assert run(stream) == []
    # ... while the same run with the score flat after step 6 is still caught
    flat = [calm(objective__scores=s if i < 6 else 0.2, objective__kl=k) for i, (s, k) in enumerate(zip(scores, kls))]
    assert [name for name, _ in run(flat)] == ["reward_hacking"]


def test_length_exploitation_on_a_steady_length_rise_with_high_truncation():
    lengths = [40.0] * 10 + [45.0, 50.0, 55.0, 60.0, 65.0, 70.0]
    stream = [calm(rollout__truncation_rate=0.6, rollout__response_length_mean=n) for n in lengths]
    assert run(stream) == [("length_exploitation", 15)]
    # the same length rise with truncation under truncation_max is fine
    assert run([calm(rollout__response_length_mean=n) for n in lengths]) == []
    # a high but steady truncation rate with a steady length is not flagged
    assert run([calm(rollout__truncation_rate=0.6) for _ in range(20)]) == []


def test_reward_hacking_when_kl_outgrows_the_score():
    # flat to step 10, then KL +0.25 nat/step and score +0.01/step: ΔKL/Δscore = 25; ΔKL over 10 steps > 1 at step 15
    stream = [calm() for _ in range(10)] + [calm(objective__kl=1.0 + 0.25 * k, objective__scores=0.5 + 0.01 * k)
                                            for k in range(1, 10)]
    # (Δ of 3-step means: ΔKL first exceeds 1 nat at step 16)
    assert run(stream) == [("reward_hacking", 16)]
    assert run(stream, {"hacking_smooth": 1}) == [("reward_hacking", 15)]  # single steps: one step earlier
    # the same KL growth with the score keeping pace (ratio 2.5) is learning, not hacking
    assert run([calm() for _ in range(10)] + [calm(objective__kl=1.0 + 0.25 * k, objective__scores=0.5 + 0.1 * k)
                                              for k in range(1, 10)]) == []
    # KL growth while the score falls is not reward hacking either
    assert run([calm() for _ in range(10)] + [calm(objective__kl=1.0 + 0.25 * k, objective__scores=0.5 - 0.01 * k)
                                              for k in range(1, 10)]) == []
    m = AlarmMonitor()
    new = [a for step, x in enumerate(stream, 1) for a in m.update(step, x)]
    assert "means over 3 steps" in new[0].message
    for fragment in ("samples.jsonl", "kl_target", "reward model", "raise kl_coef"):
        assert fragment in new[0].message


# ---------------------------------------------------------------------------------------------------- episodes
def test_a_condition_holding_ten_steps_fires_once_then_rearms_after_rearm_steps_clear():
    bad, good = calm(policy__ratio_first_minibatch=1.1), calm()
    stream = [good] * 4 + [bad] * 10 + [good] * 3 + [bad] * 4
    assert run(stream) == [("generator_mismatch", 5), ("generator_mismatch", 18)]
    # only two clear steps between: one episode
    stream = [good] * 4 + [bad] * 10 + [good] * 2 + [bad] * 4
    assert run(stream) == [("generator_mismatch", 5)]
    # rearm_steps=1: a single clear step re-arms
    stream = [good, bad, good, bad, bad, good, bad]
    assert run(stream, AlarmThresholds(rearm_steps=1)) == [("generator_mismatch", 2), ("generator_mismatch", 4),
                                                           ("generator_mismatch", 7)]
    monitor = AlarmMonitor()
    monitor.update(1, bad)
    assert monitor.active() == ["generator_mismatch"]


def test_missing_keys_do_not_crash_and_do_not_count_as_clear():
    rng = random.Random(0)
    keys = list(calm())
    stream = [{k: v for k, v in x.items() if rng.random() < 0.5} for x in healthy_stream(100)[5:]]  # past warmup
    stream += [{}, {"objective/scores": 1.0}, {"unrelated": "text", "policy/entropy_avg": None}]
    stream += [{k: "n/a" for k in keys}]
    assert run(stream) == []
    # holds at 2, three steps without the key (not evaluated), holds again at 6: still one episode
    bad = calm(policy__ratio_first_minibatch=0.9)
    missing = calm(policy__ratio_first_minibatch=None, rollout__sampler_logprob_diff_mean=None)
    assert run([calm(), bad, missing, missing, missing, bad]) == [("generator_mismatch", 2)]
    # every alarm evaluated on a stream with only its own keys still fires
    only = [{"policy/ratio_first_minibatch": 1.0}] * 3 + [{"policy/ratio_first_minibatch": 1.5}]
    assert run(only) == [("generator_mismatch", 4)]


def test_metric_values_may_be_numpy_or_torch_scalars():
    import numpy as np
    import torch

    assert run([calm(policy__clipfrac_avg=np.float32(0.1)), calm(policy__clipfrac_avg=np.float64(0.4))]) \
        == [("kl_blowup", 2)]
    assert run([calm(policy__clipfrac_avg=torch.tensor(0.1)), calm(policy__clipfrac_avg=torch.tensor(0.4))]) \
        == [("kl_blowup", 2)]


# ---------------------------------------------------------------------------------------------------- thresholds
def test_threshold_overrides_change_behaviour():
    stream = [calm(), calm(policy__clipfrac_avg=0.4)]
    assert run(stream) == [("kl_blowup", 2)]
    assert run(stream, AlarmThresholds(clipfrac_max=0.5)) == []
    assert run(stream, {"clipfrac_max": 0.5}) == []
    assert run(stream, AlarmThresholds.from_dict({"clipfrac_max": 0.5})) == []
    jump = [calm(), calm(objective__kl=4.0)]
    assert run(jump) == [] and run(jump, AlarmThresholds(kl_jump=2.0)) == [("kl_blowup", 2)]
    lag = [calm(val__explained_variance=-0.1)] * 5
    assert run(lag, AlarmThresholds(value_lag_steps=5)) == [("value_lag", 5)]
    assert run(lag, AlarmThresholds(explained_variance_min=-0.5)) == []


def test_thresholds_round_trip_and_defaults():
    t = AlarmThresholds()
    assert (t.rearm_steps, t.kl_jump, t.clipfrac_max, t.approxkl_max, t.ratio_tol) == (3, 5.0, 0.3, 0.05, 1e-3)
    assert (t.explained_variance_min, t.value_lag_steps, t.entropy_window, t.entropy_drop) == (0.0, 3, 5, 0.5)
    assert (t.length_window, t.truncation_rise, t.truncation_max) == (5, 0.2, 0.5)
    assert (t.hacking_window, t.hacking_smooth, t.hacking_ratio, t.hacking_kl_min) == (10, 3, 10.0, 1.0)
    assert AlarmThresholds.from_dict(t.to_dict()) == t
    assert AlarmThresholds.from_dict({}) == t


@pytest.mark.parametrize("field, value", [
    ("rearm_steps", 0), ("rearm_steps", 2.5), ("rearm_steps", True), ("kl_jump", 0.0), ("kl_jump", math.nan),
    ("clipfrac_max", 1.5), ("clipfrac_max", 0.0), ("approxkl_max", -0.01), ("ratio_tol", 0.0),
    ("explained_variance_min", 1.0), ("value_lag_steps", 0), ("entropy_window", -1), ("entropy_drop", 0.0),
    ("entropy_drop", 1.5), ("length_window", 0), ("truncation_rise", 1.0), ("truncation_max", -0.1),
    ("hacking_window", 0), ("hacking_ratio", 0.0), ("hacking_kl_min", -1.0), ("kl_jump", "5"),
])
def test_bad_thresholds_raise_naming_the_value(field, value):
    with pytest.raises(ValueError, match=rf"AlarmThresholds\.{field}=") as excinfo:
        AlarmThresholds(**{field: value})
    assert repr(value) in str(excinfo.value) and "use e.g." in str(excinfo.value)


def test_from_dict_rejects_unknown_keys_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown alarm threshold.*'clip_frac_max'") as excinfo:
        AlarmThresholds.from_dict({"clip_frac_max": 0.5})
    for name in ("clipfrac_max", "rearm_steps", "hacking_kl_min"):
        assert name in str(excinfo.value)
    with pytest.raises(ValueError, match="mapping"):
        AlarmThresholds.from_dict([("clipfrac_max", 0.5)])
    with pytest.raises(ValueError, match="unknown alarm threshold"):
        AlarmMonitor({"nope": 1})
    with pytest.raises(ValueError, match="thresholds must be"):
        AlarmMonitor(0.3)


# ---------------------------------------------------------------------------------------------------- callback
def _state(step):
    state = TrainerState()
    state.global_step = step
    return state


def test_callback_warns_and_writes_the_alarm_into_the_logs_dict():
    cb = AlarmCallback()
    logs = calm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy step warns nothing
        cb.on_log(None, _state(1), TrainerControl(), logs=logs)
    assert not any(k.startswith("alarm/") for k in logs)
    logs = calm(policy__ratio_first_minibatch=1.2, policy__clipfrac_avg=0.5)
    with pytest.warns(PPOAlarmWarning) as record:
        cb.on_log(None, _state(2), TrainerControl(), logs=logs)
    assert sorted(str(w.message).split("]")[0] for w in record) == ["[trl_ext alarm generator_mismatch",
                                                                     "[trl_ext alarm kl_blowup"]
    assert logs["alarm/kl_blowup"] == 1.0 and logs["alarm/generator_mismatch"] == 1.0
    assert [(a.name, a.step) for a in cb.monitor.raised] == [("kl_blowup", 2), ("generator_mismatch", 2)]
    # still holding: no new warning, no alarm keys
    logs = calm(policy__ratio_first_minibatch=1.2, policy__clipfrac_avg=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_log(None, _state(3), TrainerControl(), logs=logs)
    assert not any(k.startswith("alarm/") for k in logs)
    assert issubclass(PPOAlarmWarning, UserWarning)


def test_callback_ignores_logs_without_the_ppo_metrics():
    cb = AlarmCallback({"clipfrac_max": 0.2})
    logs = {"policy/clipfrac_avg": 0.9, "train_runtime": 12.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_log(None, _state(5), TrainerControl(), logs=logs)
        cb.on_log(None, _state(5), TrainerControl(), logs=None)
    assert cb.monitor.raised == [] and "alarm/kl_blowup" not in logs


def test_a_later_metrics_file_callback_writes_the_alarm_key(tmp_path):
    handler = CallbackHandler([AlarmCallback(), callbacks.MetricsFileCallback(output_dir=tmp_path)], None, None, None,
                              None)
    control = TrainerControl()
    with pytest.warns(PPOAlarmWarning, match="kl_blowup"):
        for step, metrics in enumerate([calm(), calm(policy__approxkl_avg=0.2), calm()], 1):
            handler.on_log(None, _state(step), control, dict(metrics))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row.get("alarm/kl_blowup") for row in rows] == [None, 1.0, None]


def test_callback_warns_only_on_the_world_process_zero():
    cb = AlarmCallback()
    state = _state(1)
    state.is_world_process_zero = False
    logs = calm(policy__clipfrac_avg=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_log(None, state, TrainerControl(), logs=logs)
    assert logs["alarm/kl_blowup"] == 1.0 and len(cb.monitor.raised) == 1


# ---------------------------------------------------------------------------------------------------- state
def _busy_stream():
    """Every alarm fires somewhere, some twice, with open episodes and part-filled windows at most split points."""
    s = [calm() for _ in range(10)]
    s += [calm(objective__kl=1.0 + 0.25 * k, objective__scores=0.5 + 0.01 * k) for k in range(1, 10)]  # hacking
    s += [calm(objective__kl=3.25, objective__scores=0.6, policy__entropy_avg=2.0 - 0.12 * k,
               rollout__truncation_rate=min(0.9, 0.1 * k), policy__ratio_first_minibatch=1.1 if k % 6 < 2 else 1.0,
               val__explained_variance=-0.1 if k < 6 else 0.3) for k in range(1, 14)]
    s += [calm(objective__kl=12.0, objective__scores=0.6, policy__entropy_avg=0.3, rollout__truncation_rate=0.9,
               update__skipped_steps=2.0)]
    return s


def test_state_dict_round_trip_continues_exactly_where_it_stopped():
    stream = _busy_stream()
    full = AlarmMonitor()
    for step, m in enumerate(stream, 1):
        full.update(step, m)
    fired = {a.name for a in full.raised}
    assert fired == set(ALARM_NAMES), fired  # the stream exercises every alarm
    assert len(full.raised) > len(ALARM_NAMES)  # ...and a re-armed one
    for split in range(len(stream) + 1):
        first = AlarmMonitor()
        for step, m in enumerate(stream[:split], 1):
            first.update(step, m)
        resumed = AlarmMonitor()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict(), allow_nan=False)))
        for step, m in enumerate(stream[split:], split + 1):
            resumed.update(step, m)
        assert resumed.raised == full.raised, split
    # a fresh monitor that did not load the state re-raises an episode that was open at the split
    fresh = AlarmMonitor()
    fresh.update(1, calm(policy__ratio_first_minibatch=1.1))
    half = AlarmMonitor()
    half.load_state_dict(fresh.state_dict())
    assert half.update(2, calm(policy__ratio_first_minibatch=1.1)) == []
    assert AlarmMonitor().update(2, calm(policy__ratio_first_minibatch=1.1)) != []


def test_load_state_dict_rejects_other_dicts():
    with pytest.raises(ValueError, match="state_dict"):
        AlarmMonitor().load_state_dict({"armed": {}})
    state = AlarmMonitor().state_dict()
    state["format"] = 99
    with pytest.raises(ValueError, match="state_dict"):
        AlarmMonitor().load_state_dict(state)


def test_callback_state_is_json_and_restores_the_monitor():
    cb = AlarmCallback({"rearm_steps": 2})
    with pytest.warns(PPOAlarmWarning):
        cb.on_log(None, _state(1), TrainerControl(), logs=calm(policy__clipfrac_avg=0.9))
    saved = json.loads(json.dumps(cb.state()))
    restored = AlarmCallback.from_state(saved)
    assert restored.monitor.thresholds.rearm_steps == 2
    assert restored.monitor.raised == cb.monitor.raised
    logs = calm(policy__clipfrac_avg=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the episode is still open after the restore: no second warning
        restored.on_log(None, _state(2), TrainerControl(), logs=logs)
    other = AlarmCallback()
    other.load_state(saved)
    assert other.monitor.active() == ["kl_blowup"] and other.monitor.thresholds.rearm_steps == 3
    assert isinstance(cb, alarms.ExportableState)


def test_nonfinite_update_fires_on_skipped_steps_or_a_nonfinite_loss_once_per_episode():
    monitor = AlarmMonitor()
    assert monitor.update(1, calm()) == []
    first = monitor.update(2, calm(update__skipped_steps=3.0))
    assert [a.name for a in first] == ["nonfinite_update"] and "update/skipped_steps=3" in first[0].message
    assert monitor.update(3, calm(loss__value_avg=float("inf"))) == []  # the same episode
    for step in range(4, 7):
        assert monitor.update(step, calm()) == []  # clear 3 times: re-armed
    again = monitor.update(7, calm(loss__value_avg=float("inf")))
    assert [a.name for a in again] == ["nonfinite_update"] and "loss/value_avg=inf" in again[0].message
