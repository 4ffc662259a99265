"""The sampler-vs-trainer correction (TRL's `vllm_importance_sampling_*`): `core.sampler_correction_weights` on
hand-computed numbers and against a plain loop, the weighted policy loss, and the trainer's use of it: weights from
the recorded sampler log-probs, the policy loss and its gradient scaled by them, TRL's metric keys."""

import math

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.core import SAMPLER_CORRECTION_MODES, clipped_policy_loss, sampler_correction_weights
from trl_ext.models import sequence_inputs
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer
from trl_ext.trainer.update import policy_terms

MASK = torch.tensor([[True, True, True], [True, False, False]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 7.0, 7.0]])  # padding holds garbage
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -9.0, 3.0]])


def test_weights_by_hand():
    # log w per token: row 0: 0.5, -1.0, 0.0 (sum -0.5); row 1: -0.5 (sum -0.5)
    e = math.exp
    expected = {
        "token_truncate": [[min(e(0.5), 1.5), e(-1.0), 1.0], [e(-0.5), 0, 0]],
        "token_mask": [[0.0, e(-1.0), 1.0], [e(-0.5), 0, 0]],  # e^0.5 = 1.65 > 1.5: masked
        "sequence_truncate": [[e(-0.5)] * 3, [e(-0.5), 0, 0]],
        "sequence_mask": [[e(-0.5)] * 3, [e(-0.5), 0, 0]],
    }
    for mode, want in expected.items():
        w = sampler_correction_weights(OLD, SAMPLER, MASK, mode, clip_max=1.5)
        torch.testing.assert_close(w, torch.tensor(want), rtol=1e-6, atol=0, msg=mode)
    # a lower bound: row 1's sequence weight e^-0.5 = 0.61 < 0.7
    torch.testing.assert_close(sampler_correction_weights(OLD, SAMPLER, MASK, "sequence_mask", 0.7, None),
                               torch.tensor([[0.0] * 3, [0.0] * 3]))
    torch.testing.assert_close(sampler_correction_weights(OLD, SAMPLER, MASK, "sequence_truncate", 0.7, None),
                               torch.tensor([[0.7] * 3, [0.7, 0, 0]]))


@pytest.mark.parametrize("mode", SAMPLER_CORRECTION_MODES)
def test_weights_equal_a_plain_loop(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old, sampler = -torch.rand(B, T, generator=g) * 3, -torch.rand(B, T, generator=g) * 3
    lengths = [7, 1, 4, 0, 3]
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    low, high = 0.5, 2.0
    w = sampler_correction_weights(old, sampler, mask, mode, low, high)
    for b in range(B):
        seq = math.exp(sum(old[b, t].item() - sampler[b, t].item() for t in range(lengths[b])))
        for t in range(T):
            if t >= lengths[b]:
                want = 0.0
            else:
                raw = seq if mode.startswith("sequence") else math.exp(old[b, t].item() - sampler[b, t].item())
                if mode.endswith("truncate"):
                    want = min(max(raw, low), high)
                else:
                    want = raw if low <= raw <= high else 0.0
            assert w[b, t].item() == pytest.approx(want, rel=1e-6), (mode, b, t)


def test_weights_bad_input():
    with pytest.raises(ValueError, match="mode='tokens' is not one of"):
        sampler_correction_weights(OLD, SAMPLER, MASK, "tokens")
    with pytest.raises(ValueError, match="both None"):
        sampler_correction_weights(OLD, SAMPLER, MASK, "token_mask", None, None)
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        sampler_correction_weights(OLD, SAMPLER[:, :2], MASK)


def test_weighted_policy_loss_is_the_weighted_token_mean():
    g = torch.Generator().manual_seed(1)
    new = (-torch.rand(2, 3, generator=g)).requires_grad_()
    adv = torch.randn(2, 3, generator=g)
    w = torch.tensor([[2.0, 0.5, 0.0], [1.5, 9.0, 9.0]])  # padding weights are ignored
    loss, _ = clipped_policy_loss(new, OLD.clamp(max=0), adv, MASK, 0.2, weights=w)
    unweighted, _ = clipped_policy_loss(new, OLD.clamp(max=0), adv, MASK, 0.2)
    ratio = torch.exp(new - OLD.clamp(max=0))
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    want = (per_token * w)[MASK].sum() / MASK.sum()
    torch.testing.assert_close(loss, want)
    ones, _ = clipped_policy_loss(new, OLD.clamp(max=0), adv, MASK, 0.2, weights=torch.ones(2, 3))
    assert torch.equal(ones, unweighted)
    loss.backward()
    assert new.grad[0, 2] == 0  # a weight of 0 removes the token from the gradient


def _trainer(tmp_path, **kw):
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                     total_episodes=4, response_length=5, stop_token="none", report_to=[], save_strategy="no",
                     num_sample_generations=0, bf16=False, disable_tqdm=True, seed=0, **kw)
    return PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                      reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, n=4),
                      value_model=tiny_scalar_model(tok, seed=1))


def _rollout(trainer, sampler_shift: float):
    """A rollout whose sampler reports log-probs `sampler_shift` below the true ones (a sampler that disagrees)."""
    def shifted(*args, **kwargs):
        responses, logprobs = draw(*args, **kwargs)
        return responses, logprobs - sampler_shift

    draw = trainer.sampler.hf.draw  # the one call of HF generate
    batch = next(iter(trainer.dataloader))
    trainer.sampler.hf.draw = shifted
    try:
        return trainer.rollout(batch["input_ids"], batch["attention_mask"])
    finally:
        del trainer.sampler.hf.draw


def test_trainer_weights_the_policy_loss_by_the_samplers_mismatch(tmp_path):
    off = _trainer(tmp_path / "off")
    assert off.args.vllm_importance_sampling_correction is False and _rollout(off, 0.5).sampler_weights is None

    on = _trainer(tmp_path / "on", vllm_importance_sampling_correction=True,
                  vllm_importance_sampling_mode="token_truncate")
    rollout = _rollout(on, 0.5)
    mask = rollout.response_mask
    torch.testing.assert_close(rollout.sampler_weights[mask], torch.full((int(mask.sum()),), math.exp(0.5)),
                               rtol=1e-5, atol=0)
    metrics = on.metrics(rollout, on.ppo_update(rollout), on.kl_ctl.value, False, (0, 1.0), 1.0)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert metrics["sampling/importance_sampling_masked"] == 0.0
    assert metrics["rollout/sampler_logprob_diff_mean"] == pytest.approx(0.5, rel=1e-4)

    # the policy loss is scaled by the weights
    micro = rollout
    inputs = sequence_inputs(micro.queries, micro.query_mask, micro.responses, micro.response_mask)
    logits, _ = on.model(**inputs, logits_to_keep=micro.responses.shape[1] + 1)
    uniform = torch.where(mask, math.exp(0.5), 0.0)  # the weights above, without their ~1e-6 sampler noise
    weighted, _, _ = policy_terms(logits, type(micro)(**{**vars(micro), "sampler_weights": uniform}), on.args, None)
    plain, _, _ = policy_terms(logits, type(micro)(**{**vars(micro), "sampler_weights": None}), on.args, None)
    # (rel 1e-4: the per-token losses nearly cancel in the fp32 sum, so its rounding shows at 2e-5)
    assert weighted.item() == pytest.approx(math.exp(0.5) * plain.item(), rel=1e-4) and plain.item() != 0

    # sequence_mask (TRL's default) with clip_max 3: a 5-token sequence at e^0.5 per token weighs e^2.5 > 3, masked
    masked = _trainer(tmp_path / "mask", vllm_importance_sampling_correction=True)
    weights = _rollout(masked, 0.5).sampler_weights
    assert torch.count_nonzero(weights) == 0
    assert masked.metrics(_rollout(masked, 0.0), masked.ppo_update(_rollout(masked, 0.0)), 0.1, False, (0, 1.0), 1.0)[
        "sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)  # the sampler is the policy


@pytest.mark.parametrize("field, value, match", [
    ("vllm_importance_sampling_mode", "sequence", "is not one of"),
    ("vllm_importance_sampling_clip_max", 0.0, "must be > 0"),
    ("vllm_importance_sampling_clip_min", -1.0, "must be >= 0"),
    ("vllm_importance_sampling_clip_min", 5.0, "must be below vllm_importance_sampling_clip_max=3.0"),
])
def test_config_errors(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match="both None"):
        PPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_max=None)
