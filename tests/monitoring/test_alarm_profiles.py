"""alarm_profile="verifiable" against recorded runs of recipes/ppo_smollm2_arithmetic.py (tests/data/
verifiable_metric_streams.json: each logged step's alarm inputs, which run, how it ended): quiet on the runs that
learned (held-out accuracy up), firing on the runs that broke (score to 0, KL 9-28 nats); the "rlhf" defaults fire on
runs that learned, which is why the profile exists. The runs and the thresholds: docs/results.md, "Verifiable
rewards"."""

import json
from pathlib import Path

import pytest

from trl_ext.monitoring.alarms import AlarmMonitor, profile_thresholds

STREAMS = json.loads((Path(__file__).resolve().parents[1] / "data" / "verifiable_metric_streams.json").read_text())
HEALTHY = [name for name, s in STREAMS.items() if s["healthy"]]
SICK = [name for name, s in STREAMS.items() if not s["healthy"]]
# value_lag is the critic's own alarm: a critic that cannot yet predict a right-or-wrong score (explained variance
# <= 0) is what it reports, on runs that learn anyway (the policy follows the score's noise less efficiently)
CRITIC = {"value_lag"}


def raised(name: str, profile: str) -> set[str]:
    monitor = AlarmMonitor(profile_thresholds(profile))
    for step, metrics in enumerate(STREAMS[name]["steps"], 1):
        monitor.update(step, metrics)
    return {alarm.name for alarm in monitor.raised}


def test_the_recordings_hold_both_kinds():
    assert len(HEALTHY) >= 3 and len(SICK) >= 2


@pytest.mark.parametrize("name", HEALTHY)
def test_the_verifiable_profile_is_quiet_on_runs_that_learned(name):
    assert raised(name, "verifiable") <= CRITIC, STREAMS[name]["note"]


@pytest.mark.parametrize("name", SICK)
def test_the_verifiable_profile_fires_on_runs_that_broke(name):
    assert raised(name, "verifiable") - CRITIC, STREAMS[name]["note"]


def test_the_rlhf_defaults_fire_on_runs_that_learned():
    assert any(raised(name, "rlhf") - CRITIC for name in HEALTHY)
