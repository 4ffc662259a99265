"""Every regression test in test_regressions.py fails against TRL 1.12's own PPOTrainer.

This runs that file with TRL_EXT_TEST_UPSTREAM=1 (tests/trl/harness.py then hands the tests TRL's PPOConfig and
PPOTrainer) and checks that no test passes there, and that it runs as many tests as here.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.trl_ppo
def test_every_regression_test_fails_on_trl(tmp_path):
    report = tmp_path / "upstream.xml"
    env = {**os.environ, "TRL_EXT_TEST_UPSTREAM": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "trl" / "test_regressions.py"), "-q",
                    "-p", "no:cacheprovider", f"--junitxml={report}"], env=env, cwd=ROOT, capture_output=True,
                   text=True, timeout=900)
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {c.get("name"): ("failed" if c.find("failure") is not None or c.find("error") is not None
                                else "skipped" if c.find("skipped") is not None else "passed") for c in cases}
    import test_regressions

    ours = {name for name in dir(test_regressions) if name.startswith("test_")}
    assert set(outcomes) == ours
    assert {name for name, outcome in outcomes.items() if outcome != "failed"} == set()
