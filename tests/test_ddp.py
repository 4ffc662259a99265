"""Issue 8: trl_ext under DDP (2 CPU processes over gloo) against one process, and save/resume under DDP.

One `accelerate launch` of tests/scripts/ddp_runs.py runs four trainers in the same two processes:

- `matched`: global batch 8 (4 per process), 3 PPO iterations. The same run in one process (batch 8) must reach the
  same weights and log the same metrics, to float tolerance. One thing differs between N processes and one by
  design, and the script makes it equal in both runs (`ddp_runs.matched_sampling`): each process samples with its
  own RNG stream (here each prompt's response comes from a stream seeded by the prompt and the iteration). The
  advantages are the trainer's own: trl_ext whitens them over all processes (TRL whitens each process's share on
  its own, which this test would catch). Responses stop at a likely EOS, so the processes hold different numbers of
  response tokens; the losses are token means over the tokens of all processes. Everything else — which prompts each
  process gets, gradient averaging, optimizer
  steps, the learning-rate schedule, adaptive β from the gathered KL, metrics reduced over processes — is the
  trainer's own, so a bug in any of them moves the weights by far more than the tolerance (1e-5; measured 3e-7).
- `straight` / `interrupted` + `resumed`: default sampling (each process its own RNG stream), 4 iterations
  straight, or 2 with a checkpoint per iteration and then resumed from checkpoint-2 by a fresh trainer: the weights
  and every logged metric must be bit-identical (each process's RNG state is saved and restored).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import ddp_runs  # noqa: E402

# Differ between 2 processes and 1 by construction, not by a fault:
# - val/ratio_var: the variance of the per-micro-batch mean ratios, over 2 x (micro-batches) values with 2
#   processes and over half as many with one;
# - val/clipfrac_avg: trl_ext/core/losses.py builds V_clip = V_old + clamp(V − V_old, ±c), which differs from V by a
#   rounding error inside the range, and counts V_clip's error > V's as clipped: float noise decides some tokens;
# - eps: throughput.
NOT_COMPARED = {"val/ratio_var", "val/clipfrac_avg", "eps"}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29523",
           str(ROOT / "tests" / "scripts" / "ddp_runs.py"), "--out", str(out),
           "--runs", "matched,straight,interrupted,resumed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RUNS DONE" in proc.stdout
    return {name: torch.load(out / f"{name}.pt") for name in ("matched", "straight", "interrupted", "resumed")}, out


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_global_batch(ddp_results, tmp_path):
    results, _ = ddp_results
    ddp = results["matched"]
    one = ddp_runs.run("matched", str(tmp_path))  # this process: world size 1, per-device batch 8
    assert ddp["world_size"] == 2 and one["world_size"] == 1
    assert ddp["global_step"] == one["global_step"] == ddp_runs.MATCHED_STEPS

    initial = ddp_runs.build(str(tmp_path / "init"), 8, 1, eos_bias=2.0)
    for part, module in (("policy", initial.unwrapped.policy), ("value", initial.unwrapped.value_model)):
        moved = (one[part] - ddp_runs.flat(module)).abs().max().item()
        assert moved > 1e-3, f"the {part} barely trained ({moved:.2e}); the comparison would be empty"
        torch.testing.assert_close(ddp[part], one[part], rtol=0, atol=1e-5, msg=f"{part} weights differ")

    assert len(ddp["logs"]) == len(one["logs"]) == ddp_runs.MATCHED_STEPS
    assert all(log["rollout/response_length_mean"] < 5 for log in one["logs"])  # ragged: most responses stop
    for step, (a, b) in enumerate(zip(ddp["logs"], one["logs"]), 1):
        keys = set(a) - NOT_COMPARED
        assert keys == set(b) - NOT_COMPARED
        for key in sorted(keys):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), f"step {step}: {key}"


@pytest.mark.slow
def test_save_and_resume_under_ddp_gives_the_uninterrupted_run(ddp_results):
    results, out = ddp_results
    straight, interrupted, resumed = results["straight"], results["interrupted"], results["resumed"]
    assert interrupted["global_step"] == 2 and (out / "interrupted" / "checkpoint-2").is_dir()
    assert (out / "interrupted" / "checkpoint-2" / "rng_state_1.pth").exists()  # each process's RNG state
    assert straight["world_size"] == resumed["world_size"] == 2
    assert resumed["global_step"] == straight["global_step"] == ddp_runs.RESUME_STEPS
    assert not torch.equal(interrupted["policy"], straight["policy"])
    assert torch.equal(resumed["policy"], straight["policy"])
    assert torch.equal(resumed["value"], straight["value"])

    def comparable(logs):
        return [{k: v for k, v in log.items() if k != "eps"} for log in logs]

    assert comparable(resumed["logs"]) == comparable(straight["logs"])
