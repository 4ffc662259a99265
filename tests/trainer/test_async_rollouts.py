"""async_rollouts (trl_ext/trainer/async_rollouts.py, docs/training.md): the version schedule by hand and against its
bound, the off-policy sequence mask by hand and against a plain loop; in the trainer, max_staleness=0 equal to
synchronous PPO, max_staleness=1 one version old with the sampler's log-probs those of that version and the
correction weights the hand-computed ratios, resume and SIGTERM exact, a lowered max_staleness on resume dropping the
saved draws, and the settings it refuses."""

import copy
import os
import signal
import sys

import pytest
import torch

from trl_ext import PPOConfig
from trl_ext.core import off_policy_sequence_mask
from trl_ext.models import sequence_inputs
from trl_ext.models.forward import response_logprobs
from trl_ext.trainer.async_rollouts import DRAWN_FILE, AsyncRollouts, sampler_version

sys.path.insert(0, os.path.dirname(__file__))
from test_faults import signal_at_iteration_2  # noqa: E402
from test_training_state import StopAt, comparable, config, flat, make_trainer, step_logs  # noqa: E402

ASYNC_KEYS = ("rollout/staleness", "rollout/staleness_max", "rollout/dropped_share")


# --- the schedule ---------------------------------------------------------------------------------------------------
def test_the_version_schedule_by_hand():
    assert [sampler_version(j, 0, 1) for j in range(4)] == [0, 1, 2, 3]  # synchronous
    assert [sampler_version(j, 1, 1) for j in range(5)] == [0, 0, 1, 2, 3]  # one-step off-policy
    assert [sampler_version(j, 1, 2) for j in range(6)] == [0, 0, 2, 2, 4, 4]
    assert [sampler_version(j, 2, 2) for j in range(7)] == [0, 0, 0, 2, 2, 4, 4]


def test_the_schedule_keeps_its_bound_and_syncs_only_every_weight_sync_steps():
    for S in range(5):
        for W in range(1, S + 2):
            versions = [sampler_version(j, S, W) for j in range(40)]
            assert versions == sorted(versions)
            for j, v in enumerate(versions):
                oldest = max(j - S, 0)
                assert v % W == 0 and oldest <= v <= j and v - W < oldest, (S, W, j, v)


def test_config_refuses_a_schedule_that_cannot_run():
    with pytest.raises(ValueError, match=r"weight_sync_steps=3 must be an integer in \[1, max_staleness \+ 1 = 2\]"):
        PPOConfig(output_dir="/tmp/x", async_rollouts=True, max_staleness=1, weight_sync_steps=3)
    with pytest.raises(ValueError, match="max_staleness=-1 must be an integer >= 0"):
        PPOConfig(output_dir="/tmp/x", async_rollouts=True, max_staleness=-1)
    with pytest.raises(ValueError, match="off_policy_mask_threshold=-0.1 must be >= 0"):
        PPOConfig(output_dir="/tmp/x", off_policy_mask_threshold=-0.1)
    # the sampler correction is on by default only where the sampler is behind the policy
    assert PPOConfig(output_dir="/tmp/x", async_rollouts=True).vllm_importance_sampling_correction is True
    assert PPOConfig(output_dir="/tmp/x", async_rollouts=True,
                     max_staleness=0).vllm_importance_sampling_correction is False
    assert PPOConfig(output_dir="/tmp/x", async_rollouts=True,
                     rollout_logprobs="sampler").vllm_importance_sampling_correction is False


def test_a_stopped_sampler_never_hangs_a_checkpoint_and_the_draws_it_made_are_saved():
    """`AsyncRollouts` with an engine that draws one token per row: after close(), a checkpoint's wait for draws the
    sampler will not make ends at once with the ones it made."""
    class Engine:
        def weights(self, policy, version):
            return version

        def draw(self, weights, queries, query_mask, step):
            return queries[:, :1], torch.ones_like(queries[:, :1], dtype=torch.bool), torch.full((len(queries), 1),
                                                                                                   -float(weights))

        def release(self, weights):
            pass

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
    rollouts = AsyncRollouts(Engine(), iter([batch] * 10), torch.device("cpu"), 0, 10, max_staleness=2,
                             weight_sync_steps=1)
    rollouts.start(None)  # version 0 draws batches 0, 1 and 2; batch 3 needs version 1, never published
    drawn, _ = rollouts.take(2)
    assert (drawn.step, drawn.version) == (2, 0)
    rollouts.close()
    assert not rollouts.thread.is_alive()
    state = rollouts.state(1)  # batch 1 (version 0) was drawn and not trained yet: saved
    assert [(d["step"], d["version"]) for d in state["draws"]] == [(1, 0)]
    assert rollouts.state(3)["draws"] == []  # batches 3 and 4 (versions 1, 2) never will be


# --- the off-policy sequence mask -----------------------------------------------------------------------------------
def test_off_policy_sequence_mask_by_hand():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([[1.0, -1.0, -1.0], [-0.5, -0.5, 3.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 9.0]])  # padding holds garbage
    current = torch.tensor([[-2.0, -2.0, -1.5], [-2.2, -1.8, 0.0]])
    # mean drift log π_sampler − log π_θ: row 0 (1 + 1 + 0.5) / 3 = 0.833; row 1 (0.2 − 0.2) / 2 = 0
    keep = off_policy_sequence_mask(advantages, current, sampler, mask, 0.5)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    keep = off_policy_sequence_mask(advantages, current, sampler, mask, 0.9)  # row 0 under the threshold
    torch.testing.assert_close(keep, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))


def test_off_policy_sequence_mask_equals_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    B, T, lengths = 6, 5, [5, 1, 3, 0, 4, 2]
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    advantages, sampler, current = torch.randn(B, T, generator=g), -torch.rand(B, T, generator=g) * 2, \
        -torch.rand(B, T, generator=g) * 2
    keep = off_policy_sequence_mask(advantages, current, sampler, mask, 0.1)
    for b in range(B):
        drift = sum(sampler[b, t].item() - current[b, t].item() for t in range(lengths[b])) / max(lengths[b], 1)
        for t in range(T):
            want = float(t < lengths[b] and (advantages[b, t].item() >= 0 or drift <= 0.1))
            assert keep[b, t].item() == want, (b, t)


# --- in the trainer -------------------------------------------------------------------------------------------------
def run(out, **kw):
    t = make_trainer(config(out, **kw))
    t.train()
    return t


def without_async_keys(logs):
    return [{k: v for k, v in log.items() if k not in ASYNC_KEYS} for log in comparable(logs)]


def test_max_staleness_0_is_synchronous_ppo_exactly(tmp_path):
    sync = run(tmp_path / "sync")
    asynchronous = run(tmp_path / "async", async_rollouts=True, max_staleness=0)
    assert torch.equal(flat(asynchronous.unwrapped.policy), flat(sync.unwrapped.policy))
    assert torch.equal(flat(asynchronous.unwrapped.value_model), flat(sync.unwrapped.value_model))
    assert without_async_keys(step_logs(asynchronous)) == comparable(step_logs(sync))
    assert [log["rollout/staleness"] for log in step_logs(asynchronous)] == [0.0] * 4
    assert asynchronous.rollouts.publish_log == [0, 1, 2, 3]  # every batch waits for the update before it


def test_max_staleness_1_trains_one_version_old_with_the_hand_computed_correction(tmp_path):
    """Each batch j >= 1 is drawn by version j - 1: its sampler log-probs are version j - 1's, π_old is version j's,
    and the correction weights are exp(π_old − π_sampler) per token (token_truncate, a bound never reached)."""
    t = make_trainer(config(tmp_path, async_rollouts=True, max_staleness=1, total_episodes=20,
                            vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1e6))
    versions, rollouts = {}, []
    weights, phase = t.async_engine.weights, t.rollout_phase.run

    def keep_weights(policy, version):  # the trained tensors of every version the sampler gets
        got = weights(policy, version)
        versions[version] = {k: v.clone() for k, v in got[1].items()}
        return got

    def keep_rollout(*args, **kwargs):
        rollouts.append(phase(*args, **kwargs))
        return rollouts[-1]

    t.async_engine.weights, t.rollout_phase.run = keep_weights, keep_rollout
    t.train()

    log = t.rollouts.log
    assert [(e["step"], e["version"]) for e in log] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]
    assert t.rollouts.publish_log == [0, 1, 2, 3]  # version 4 draws nothing: never published
    assert [m["rollout/staleness"] for m in step_logs(t)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [m["rollout/staleness_max"] for m in step_logs(t)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(m["rollout/dropped_share"] == 0.0 for m in step_logs(t))

    policy = copy.deepcopy(t.unwrapped.policy)
    params = dict(policy.named_parameters())

    def logprobs_at(version, r):
        with torch.no_grad():
            for name, tensor in versions[version].items():
                params[name].copy_(tensor)
            inputs = sequence_inputs(r.queries, r.query_mask, r.responses, r.response_mask)
            return response_logprobs(policy, inputs, r.responses, t.args.temperature) * r.response_mask

    for j in (1, 2, 3):  # version j is known for j <= 3 (published for batch j + 1)
        r, mask = rollouts[j], rollouts[j].response_mask
        torch.testing.assert_close(r.sampler_logprobs, logprobs_at(j - 1, r), atol=2e-5, rtol=0)
        torch.testing.assert_close(r.logprobs, logprobs_at(j, r), atol=2e-5, rtol=0)
        assert (r.logprobs - r.sampler_logprobs)[mask].abs().max() > 1e-3  # the versions really differ
        by_hand = torch.where(mask, torch.exp(r.logprobs.double() - r.sampler_logprobs.double()), 0.0)
        torch.testing.assert_close(r.sampler_weights.double(), by_hand, rtol=1e-6, atol=0)

    sync = run(tmp_path / "sync", total_episodes=20)
    assert not torch.equal(flat(t.unwrapped.policy), flat(sync.unwrapped.policy))  # it trained off-policy


def test_the_off_policy_mask_removes_drifted_negative_tokens_from_the_loss(tmp_path):
    masked = run(tmp_path / "masked", async_rollouts=True, off_policy_mask_threshold=0.0)
    fractions = [m["policy/off_policy_masked_frac"] for m in step_logs(masked)]
    assert all(0.0 <= f < 1.0 for f in fractions) and max(fractions) > 0.05, fractions
    kept = run(tmp_path / "kept", async_rollouts=True, off_policy_mask_threshold=1e9)
    assert [m["policy/off_policy_masked_frac"] for m in step_logs(kept)] == [0.0] * 4
    off = run(tmp_path / "off", async_rollouts=True)
    assert "policy/off_policy_masked_frac" not in step_logs(off)[0]
    assert torch.equal(flat(kept.unwrapped.policy), flat(off.unwrapped.policy))  # a mask that keeps all: no change


@pytest.mark.parametrize("staleness", [1, 2])
def test_resume_gives_the_uninterrupted_async_run(tmp_path, staleness):
    kw = dict(async_rollouts=True, max_staleness=staleness, weight_sync_steps=staleness, total_episodes=24)
    straight = run(tmp_path / "a", **kw)
    first = make_trainer(config(tmp_path / "b", save_strategy="steps", save_steps=1, **kw), callbacks=[StopAt(3)])
    first.train()
    # the draws made with versions older than the checkpoint's are in it
    saved = torch.load(tmp_path / "b" / "checkpoint-3" / DRAWN_FILE.format(process=0), weights_only=True)
    older = [j for j in range(3, 6) if sampler_version(j, staleness, staleness) < 3]
    assert [d["step"] for d in saved["draws"]] == older and older
    resumed = make_trainer(config(tmp_path / "b", save_strategy="steps", save_steps=1, **kw))
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    assert torch.equal(flat(resumed.unwrapped.policy), flat(straight.unwrapped.policy))
    assert torch.equal(flat(resumed.unwrapped.value_model), flat(straight.unwrapped.value_model))
    assert comparable(step_logs(resumed)) == comparable(step_logs(straight))


def test_a_lower_max_staleness_on_resume_drops_the_saved_draws_that_are_too_old(tmp_path, capsys):
    kw = dict(async_rollouts=True, save_strategy="steps", save_steps=1, total_episodes=24)
    first = make_trainer(config(tmp_path, max_staleness=2, **kw), callbacks=[StopAt(3)])
    first.train()  # saved: batch 3 (drawn by version 1) and batch 4 (version 2), both 2 versions old
    resumed = make_trainer(config(tmp_path, max_staleness=1, **kw))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    log = resumed.rollouts.log  # both dropped and drawn again by the checkpoint's version 3
    assert [(e["step"], e["version"], e["dropped"]) for e in log] == [(3, 3, 1), (4, 3, 1), (5, 4, 0)]
    assert all(e["staleness"] <= 1 for e in log)
    logs = step_logs(resumed)  # dropped draws / (dropped + trained batches), over the run: 3 trained before
    assert [m["rollout/dropped_share"] for m in logs[3:]] == [1 / 5, 2 / 7, 2 / 8]
    assert "max_staleness: 2 -> 1" in capsys.readouterr().out


def test_the_sampler_thread_generates_in_the_losss_precision(tmp_path, monkeypatch):
    """Autocast is per thread: the sampler's thread enters the run's own (bf16 here), as the synchronous draw does."""
    import threading

    import trl_ext.trainer.generators as sampling

    seen, generate = [], sampling.generate_responses

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.is_autocast_enabled("cpu"),
                     torch.get_autocast_dtype("cpu")))
        return generate(*args, **kwargs)

    monkeypatch.setattr(sampling, "generate_responses", spy)
    run(tmp_path, async_rollouts=True, bf16=True, use_cpu=True, total_episodes=8)
    assert seen == [("trl_ext-async-rollouts", True, torch.bfloat16)] * 2


def test_a_nan_in_the_sampler_thread_stops_the_run_with_the_trainers_message_and_the_thread(tmp_path):
    t = make_trainer(config(tmp_path, async_rollouts=True))
    with torch.no_grad():
        for p in t.unwrapped.policy.parameters():
            p.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"Iteration 1: the policy's next-token probabilities hold NaN/inf.*"
                                                 r"learning_rate=0.001 too high"):
        t.train()
    assert not t.rollouts.thread.is_alive()


def test_settings_async_rollouts_cannot_run_with_are_refused_at_construction(tmp_path):
    from peft import LoraConfig

    from trl_ext import PPOTrainer
    from trl_ext.models import build_shared_base
    from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

    tok = tiny_tokenizer()
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    shared = build_shared_base(tiny_causal_lm(tok), policy_lora=LoraConfig(**lora), critic_lora=LoraConfig(**lora))
    with pytest.raises(ValueError, match="async_rollouts=True with HF generate samples with a copy of the policy"):
        PPOTrainer(args=config(tmp_path, async_rollouts=True), processing_class=tok, model=shared, ref_model=None,
                   reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 8),
                   value_model=None)


@pytest.mark.slow
def test_sigterm_saves_the_in_flight_draw_exits_0_and_the_resume_is_exact(tmp_path):
    out, _ = signal_at_iteration_2(tmp_path, signal.SIGTERM, extra=", async_rollouts=True")
    saved = torch.load(out / "checkpoint-2" / DRAWN_FILE.format(process=0), weights_only=True)
    assert [(d["step"], d["version"]) for d in saved["draws"]] == [(2, 1)]  # drawn during update 1, kept

    resumed = make_trainer(config(out, save_strategy="steps", save_steps=3, async_rollouts=True))
    resumed.train(resume_from_checkpoint=True)
    straight = run(tmp_path / "straight", async_rollouts=True)
    assert torch.equal(flat(resumed.unwrapped.policy), flat(straight.unwrapped.policy))
    assert comparable(step_logs(resumed)) == comparable(step_logs(straight))
