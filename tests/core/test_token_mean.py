"""The PPO losses are token means over the whole minibatch (issue 12, item 4): Σ over its real tokens / their
number, whatever the gradient accumulation and the process count.

The reference is a plain loop over the minibatch at once: clipped policy loss and ½ clipped value loss summed over
its real tokens and divided by their number, one SGD step. With ragged responses, the trainer's update for
gradient_accumulation_steps 1, 2, 4 and for 2 DDP processes holding unequal token counts equals the reference to
1e-5; the mean of per-micro-batch means (what trl_ext did before, and TRL 1.12 does) differs from it by more than
1e-3 on the same rollout, so these tests would catch it.
"""

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import token_mean_runs as runs  # noqa: E402

from trl_ext.testing import tiny_tokenizer  # noqa: E402

B = 8


def reference_update(rollout, minibatches, cliprange=0.2, cliprange_value=0.2, per_micro_batch=None):
    """Plain-PyTorch PPO update of fresh models on `rollout`: for each minibatch (rows in `minibatches`), one SGD
    step on the token mean over the minibatch (log-probs at the sampling temperature). per_micro_batch=k: the mean of
    per-micro-batch token means over
    micro-batches of k rows instead (the defect). Returns the flattened weights."""
    tok = tiny_tokenizer()
    policy, value = runs.models(tok)
    sgd = torch.optim.SGD(list(policy.parameters()) + list(value.parameters()), lr=runs.LR)
    T = rollout.responses.shape[1]
    for rows in minibatches:
        pieces = [rows] if per_micro_batch is None else [rows[i : i + per_micro_batch]
                                                         for i in range(0, len(rows), per_micro_batch)]
        sgd.zero_grad()
        for piece in pieces:
            r = rollout[torch.tensor(piece)]
            mask = r.response_mask
            attention = torch.cat([r.query_mask, mask], 1).long()
            ids = torch.cat([r.queries, r.responses], 1).masked_fill(attention == 0, 0)
            position = (attention.cumsum(1) - 1).clamp(min=0)
            logits = policy(input_ids=ids, attention_mask=attention, position_ids=position).logits[:, -T - 1 : -1]
            tokens = r.responses.masked_fill(~mask, 0)[..., None]
            logp = torch.log_softmax(logits.float() / runs.TEMPERATURE, -1).gather(-1, tokens)[..., 0]
            ratio = torch.exp(logp - r.logprobs)
            pg = torch.max(-r.advantages * ratio, -r.advantages * ratio.clamp(1 - cliprange, 1 + cliprange))
            hidden = value.model(input_ids=ids, attention_mask=attention, position_ids=position).last_hidden_state
            v = value.score(hidden).squeeze(-1)[:, -T - 1 : -1]
            v_clip = torch.max(torch.min(v, r.values + cliprange_value), r.values - cliprange_value)
            vf = 0.5 * torch.max((v - r.returns) ** 2, (v_clip - r.returns) ** 2)
            n = mask.sum()
            loss = (pg[mask].sum() + runs.VF_COEF * vf[mask].sum()) / n
            (loss / len(pieces)).backward()
        sgd.step()
    return runs.flat(policy, value)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A fixed rollout of 8 prompts with ragged responses (from the trainer's own rollout)."""
    return runs.ragged_rollout(str(tmp_path_factory.mktemp("rollout")), B)


def trainer_update(tmp_path, rollout, ga, minibatches=1, seed=0):
    tok = tiny_tokenizer()
    policy, value = runs.models(tok)
    t = runs.trainer(str(tmp_path), tok, policy, value, rows=B, ga=ga, minibatches=minibatches)
    torch.manual_seed(seed)
    t.ppo_update(rollout)
    return runs.flat(policy, value)


def minibatch_order(seed, minibatches):
    return runs.minibatch_order(seed, B, minibatches)


def test_the_per_micro_batch_mean_differs_from_the_token_mean(rollout):
    """The check has teeth: on this rollout the defect moves the update by far more than the tolerance."""
    start = runs.flat(*runs.models(tiny_tokenizer()))
    token_mean = reference_update(rollout, [list(range(B))])
    for k in (4, 2):
        per_micro = reference_update(rollout, [list(range(B))], per_micro_batch=k)
        assert (per_micro - token_mean).abs().max() > 1e-3
    assert (token_mean - start).abs().max() > 1e-2  # the update is not empty


@pytest.mark.parametrize("ga", [1, 2, 4])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_gradient_accumulation_never_changes_the_update(tmp_path, rollout, ga, minibatches):
    expected = reference_update(rollout, minibatch_order(seed=7, minibatches=minibatches))
    got = trainer_update(tmp_path, rollout, ga=ga, minibatches=minibatches, seed=7)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
def test_two_processes_with_unequal_token_counts_update_like_one(tmp_path, rollout, ga):
    """Process 0 holds the 4 rows with the most response tokens, process 1 the 4 with the fewest; each takes
    `ga` micro-batches. The update equals the one-process reference on all 8 rows."""
    lengths = rollout.response_mask.sum(1)
    by_length = torch.argsort(lengths, descending=True, stable=True).tolist()
    split = [sorted(by_length[:4]), sorted(by_length[4:])]
    counts = [int(lengths[s].sum()) for s in split]
    assert counts[0] > counts[1]
    path = tmp_path / "rollout.pt"
    torch.save({"rollout": {k: v for k, v in asdict(rollout).items()}, "split": split}, path)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29531",
           str(ROOT / "tests" / "scripts" / "token_mean_runs.py"), "--rollout", str(path), "--out", str(tmp_path),
           "--ga", str(ga)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "UPDATE DONE" in proc.stdout
    result = torch.load(tmp_path / "weights.pt")
    assert result["local_tokens"] == counts[0]
    expected = reference_update(rollout, [list(range(B))])
    torch.testing.assert_close(result["weights"], expected, rtol=0, atol=1e-5)
