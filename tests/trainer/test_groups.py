"""Group sampling (num_generations), the group advantage mixed into GAE's (group_advantage_weight, scale_rewards,
multi_objective_aggregation) and DAPO's dynamic sampling: against hand-computed numbers, TRL 1.16's GRPO formula
written out as a plain loop, the trainer's rollouts, and short runs that train."""

import math
import sys
from pathlib import Path

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.core import compute_gae, constant_groups, group_advantages, masked_whiten
from trl_ext.data.batches import PromptBatches
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ppo_variants import _learned, train  # noqa: E402


# ------------------------------------------------------------------------------------------ hand-computed numbers
def test_group_advantage_by_hand():
    """Two groups of 3: scores (1, 0, 0) and (2, 2, 5). Group means 1/3 and 3; unbiased stds √(1/3) and √3."""
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, -1.0, 2.0])
    torch.testing.assert_close(group_advantages(scores, 3, "none"), centred)
    group_std = torch.tensor([math.sqrt(1 / 3)] * 3 + [math.sqrt(3)] * 3)
    torch.testing.assert_close(group_advantages(scores, 3, "group"), centred / (group_std + 1e-4))
    batch_std = scores.std()  # mean 5/3; Σ(r − mean)² = 17.33; / 5 = 3.467; √ = 1.862
    assert batch_std.item() == pytest.approx(1.8619, abs=1e-4)
    torch.testing.assert_close(group_advantages(scores, 3, "batch"), centred / (batch_std + 1e-4))
    # "batch" over every process: the gathered rows' std
    other = torch.tensor([0.0, 10.0, 0.0, 10.0, 0.0, 10.0])
    both = torch.cat([scores, other])
    torch.testing.assert_close(group_advantages(scores, 3, "batch", gather=lambda x: torch.cat([x, other])),
                               centred / (both.std() + 1e-4))
    assert constant_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0, 3.0]), 2).tolist() == [True, False, True]


def test_normalize_then_sum_by_hand():
    """Two sources, weights (1, 2), one group of 2: source 1 (1, 0) → (±1/√2 over std √0.5); source 2 (3, 3)
    → 0 (std 0). Summed: (0.7070, −0.7070); over the batch: ±0.7070 / (1.0 + 1e-4)."""
    source = torch.tensor([[1.0, 3.0], [0.0, 3.0]])
    out = group_advantages(torch.zeros(2), 2, aggregation="normalize_then_sum", source_scores=source,
                           weights=torch.tensor([1.0, 2.0]))
    s1 = 0.5 / (math.sqrt(0.5) + 1e-4)
    summed = torch.tensor([s1, -s1])
    torch.testing.assert_close(out, summed / (summed.std() + 1e-4))


def trl_grpo_advantages(rewards_per_func, weights, G, scale_rewards, aggregation):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, the advantage lines, row by row in plain Python."""
    rows = len(rewards_per_func)

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # TRL's nanstd: Bessel-corrected
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    if aggregation == "sum_then_normalize":
        r = [sum(w * x for w, x in zip(weights, row)) for row in rewards_per_func]
        out = []
        for i in range(rows):
            group = r[(i // G) * G : (i // G + 1) * G]
            a = r[i] - mean(group)
            if scale_rewards == "group":
                a /= std(group) + 1e-4
            elif scale_rewards == "batch":
                a /= std(r) + 1e-4
            out.append(a)
        return out
    summed = []
    for i in range(rows):
        group = rewards_per_func[(i // G) * G : (i // G + 1) * G]
        total = 0.0
        for k, w in enumerate(weights):
            column = [row[k] for row in group]
            total += w * (rewards_per_func[i][k] - mean(column)) / (std(column) + 1e-4)
        summed.append(total)
    return [(s - mean(summed)) / (std(summed) + 1e-4) for s in summed]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_group_advantage_is_trls_grpo_formula(scale, aggregation):
    g = torch.Generator().manual_seed(0)
    source = torch.randint(0, 3, (12, 2), generator=g).double()
    weights = [1.0, 0.5]
    combined = (source * torch.tensor(weights, dtype=torch.float64)).sum(1)
    out = group_advantages(combined, 4, scale, aggregation, source, torch.tensor(weights))
    expected = torch.tensor(trl_grpo_advantages(source.tolist(), weights, 4, scale, aggregation))
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ the batches
def test_prompt_batches_hold_groups_of_one_prompt():
    batches = iter(PromptBatches(12, 6, world_size=2, rank=1, seed=3, num_generations=3))
    first = next(batches)
    assert first[:3] == [first[0]] * 3 and first[3:] == [first[3]] * 3 and first[0] != first[3]
    rank0 = next(iter(PromptBatches(12, 6, world_size=2, rank=0, seed=3, num_generations=3)))
    assert not set(rank0) & set(first)  # 4 distinct prompts per global batch
    # the refills: their own permutation, the same for a resumed run, never the main order's
    sampler = PromptBatches(12, 6, world_size=2, rank=1, seed=3, num_generations=3)
    assert sampler.extra(7) == PromptBatches(12, 6, world_size=2, rank=1, seed=3, num_generations=3).extra(7)
    assert sampler.extra(7) != sampler.extra(8)
    assert list(zip(range(3), iter(sampler)))[1][1] == next(iter(PromptBatches(12, 6, 2, 1, 3, start_batch=1,
                                                                                num_generations=3)))
    with pytest.raises(ValueError, match="num_generations=4"):
        PromptBatches(12, 6, num_generations=4)


def _trainer(tmp_path, reward=None, rows=8, **overrides):
    tok = tiny_tokenizer()
    args = PPOConfig(**{**dict(output_dir=str(tmp_path), per_device_train_batch_size=rows, num_ppo_epochs=1,
                               response_length=4, report_to=[], save_strategy="no", num_sample_generations=0,
                               bf16=False, disable_tqdm=True, seed=0), **overrides})
    return PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                      reward_model=reward or (lambda prompts, completions: [float(len(c)) for c in completions]),
                      train_dataset=tiny_prompt_dataset(tok, 16), value_model=tiny_scalar_model(tok))


def test_the_batch_counts_completions(tmp_path):
    """8 completions per batch in groups of 4: 2 prompts per iteration; an epoch of 16 prompts is 64 completions."""
    t = _trainer(tmp_path, num_generations=4, num_train_epochs=1)
    assert t.args.total_episodes == 64 and t.args.num_total_batches == 8
    batch = next(iter(t.dataloader))
    ids = batch["input_ids"]
    assert all(torch.equal(ids[i], ids[i // 4 * 4]) for i in range(8)) and not torch.equal(ids[0], ids[4])
    r = t.rollout(ids, batch["attention_mask"])
    assert len({tuple(x.tolist()) for x in r.responses[:4]}) > 1  # one prompt, different completions


def test_the_group_advantage_is_mixed_into_gaes(tmp_path):
    for w in (0.25, 1.0):
        t = _trainer(tmp_path, num_generations=4, group_advantage_weight=w, scale_rewards="batch")
        batch = next(iter(t.dataloader))
        r = t.rollout(batch["input_ids"], batch["attention_mask"])
        mask = r.response_mask
        gae = masked_whiten(compute_gae(r.rewards, r.values, mask, 1.0, 0.95)[0], mask) * mask
        centred = r.scores - r.scores.view(2, 4).mean(1).repeat_interleave(4)
        group = centred / (r.scores.std() + 1e-4)
        torch.testing.assert_close(r.advantages, ((1 - w) * gae + w * group[:, None]) * mask)
        assert r.scores.std() > 0


def _first_word_reward(prompts, completions):
    """0 for every completion of a prompt whose first word is 'w0'..'w3' (a constant group), else the length."""
    return [0.0 if p.split()[0] in ("w0", "w1", "w2", "w3") else float(len(c)) for p, c in zip(prompts, completions)]


def test_dynamic_sampling_replaces_constant_groups(tmp_path):
    plain = _trainer(tmp_path, reward=_first_word_reward, num_generations=2)
    batches = iter(plain.dataloader)
    batch = next(b for b in batches if any(plain.processing_class.decode(q, skip_special_tokens=True).split()[0]
                                           in ("w0", "w1", "w2", "w3") for q in b["input_ids"]))
    r = plain.rollout(batch["input_ids"], batch["attention_mask"])
    plain_metrics = r.draw_metrics
    assert constant_groups(r.scores, 2).any() and plain_metrics["rollout/frac_reward_zero_std"] > 0
    t = _trainer(tmp_path, reward=_first_word_reward, num_generations=2, dynamic_sampling=True,
                 max_num_gen_batches=8)
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    m = r.draw_metrics
    assert not constant_groups(r.scores, 2).any() and m["rollout/frac_reward_zero_std"] == 0
    assert m["rollout/dynamic_draws"] >= 2 and 0 < m["rollout/dynamic_dropped_frac"] < 1
    assert m["rollout/completions_drawn"] == 8 * m["rollout/dynamic_draws"]
    assert len(r) == 8 and all(torch.equal(r.queries[i], r.queries[i // 2 * 2]) for i in range(8))
    again = t.rollout(batch["input_ids"], batch["attention_mask"])  # the same draws: seeded by (step, draw)
    assert torch.equal(again.responses, r.responses)
    # at the bound, constant groups of the first draw fill the batch
    one = _trainer(tmp_path, reward=_first_word_reward, num_generations=2, dynamic_sampling=True,
                   max_num_gen_batches=1)
    r = one.rollout(batch["input_ids"], batch["attention_mask"])
    assert len(r) == 8 and r.draw_metrics["rollout/frac_reward_zero_std"] > 0


def test_bad_group_settings_name_the_value_and_the_fix(tmp_path):
    base = dict(output_dir=str(tmp_path), bf16=False)
    for overrides, match in [
        (dict(num_generations=0), "num_generations=0"),
        (dict(group_advantage_weight=0.5), "num_generations >= 2"),
        (dict(num_generations=2, group_advantage_weight=1.5), r"group_advantage_weight=1.5 must be in \[0, 1\]"),
        (dict(scale_rewards="batch"), "group_advantage_weight > 0"),
        (dict(num_generations=2, group_advantage_weight=1, scale_rewards="std"), "scale_rewards='std'"),
        (dict(num_generations=2, group_advantage_weight=1, multi_objective_aggregation="normalize_then_sum",
              missing_eos_penalty=1.0), "missing_eos_penalty=1.0"),
        (dict(dynamic_sampling=True), "num_generations >= 2"),
        (dict(num_generations=2, dynamic_sampling=True, max_num_gen_batches=0), "max_num_gen_batches=0"),
        (dict(num_generations=2, dynamic_sampling=True, async_rollouts=True), "async_rollouts=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            PPOConfig(**base, **overrides)
    assert PPOConfig(**base, num_generations=2, group_advantage_weight=1, scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match="num_generations=3"):
        _trainer(tmp_path, num_generations=3)


def test_the_group_fields_are_command_line_flags(tmp_path):
    from trl import TrlParser

    (args,) = TrlParser((PPOConfig,)).parse_args_and_config([
        "--output_dir", str(tmp_path), "--bf16", "False", "--num_generations", "4", "--group_advantage_weight", "0.5",
        "--scale_rewards", "true", "--multi_objective_aggregation", "normalize_then_sum", "--dynamic_sampling",
        "true", "--max_num_gen_batches", "3", "--overlong_buffer_len", "4", "--overlong_penalty_factor", "0.5",
        "--critic_warmup_steps", "5", "--critic_warmup_explained_variance", "0.3", "--alarm_profile", "verifiable"])
    assert (args.num_generations, args.group_advantage_weight, args.scale_rewards, args.multi_objective_aggregation,
            args.dynamic_sampling, args.max_num_gen_batches) == (4, 0.5, "group", "normalize_then_sum", True, 3)
    assert (args.overlong_buffer_len, args.overlong_penalty_factor, args.critic_warmup_explained_variance,
            args.alarm_profile) == (4, 0.5, 0.3, "verifiable")


# --------------------------------------------------------------------------------------------- short PPO runs
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(num_generations=4),
    dict(num_generations=4, group_advantage_weight=1.0),
    dict(num_generations=4, group_advantage_weight=0.5, dynamic_sampling=True, scale_rewards="batch"),
])
def test_group_sampling_trains(tmp_path, overrides):
    logs = train(tmp_path, **overrides)
    first, last = _learned(logs)
    assert first < 0.3 and last > 0.5, (overrides, first, last)
    assert all(0 <= log["rollout/frac_reward_zero_std"] <= 1 for log in logs)


# --------------------------------------------------------------------------------- DAPO's soft overlong punishment
def test_the_overlong_punishment_is_a_weighted_source(tmp_path):
    """response_length 6, buffer 2: 0 up to 4 tokens, −0.5 at 5, −1 at 6 (DAPO eq. 13), times the factor 0.4."""
    t = _trainer(tmp_path, response_length=6, overlong_buffer_len=2, overlong_penalty_factor=0.4)
    assert t.reward_scorer.weights == [1.0, 0.4] and len(t.reward_scorer.names) == 2
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    lengths = r.response_mask.sum(1).float()
    expected = torch.where(lengths <= 4, 0.0, (4 - lengths) / 2)
    torch.testing.assert_close(r.source_scores[:, 1], expected)
    torch.testing.assert_close(r.scores, r.source_scores[:, 0] + 0.4 * expected)
    assert (lengths == 6).any()  # the tiny policy runs to the cap on some rows: the penalty is exercised
    with pytest.raises(ValueError, match="overlong_buffer_len=7"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, response_length=6, overlong_buffer_len=7)
    with pytest.raises(ValueError, match="overlong_penalty_factor=0.5"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, overlong_penalty_factor=0.5)


# ------------------------------------------------------------------------------ VAPO's value pretraining criterion
@pytest.mark.parametrize("threshold", [-1e9, 0.2, 1.0])
def test_the_critic_warmup_runs_until_the_explained_variance_criterion(tmp_path, threshold):
    """Warmup (critic alone) while the iteration is below the cap and no rollout so far reached the criterion; the
    rollout that reaches it already trains the policy. -1e9: never warms up; 1.0: the cap (5 iterations)."""
    logs = train(tmp_path, steps=8, critic_warmup_steps=5, critic_warmup_explained_variance=threshold,
                 value_head_init="zero")
    reached, expected = False, []
    for i, log in enumerate(logs):
        reached = reached or log["val/explained_variance"] >= threshold
        expected.append(float(i < 5 and not reached))
    assert [log["val/warmup"] for log in logs] == expected
    assert expected[-1] == 0 and (threshold != 1.0 or sum(expected) == 5) and (threshold != -1e9 or sum(expected) == 0)
    with pytest.raises(ValueError, match="critic_warmup_steps > 0"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, critic_warmup_explained_variance=0.5)


def test_the_ended_warmup_survives_a_resume(tmp_path):
    """The criterion met at iteration 1; a run resumed from iteration 3 does not warm up again."""
    common = dict(critic_warmup_steps=6, critic_warmup_explained_variance=-1e9, save_strategy="steps", save_steps=3)
    first = train(tmp_path, steps=3, **common)
    assert [log["val/warmup"] for log in first] == [0.0] * 3
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=48, learning_rate=1e-2,
                     num_ppo_epochs=2, kl_coef=0.01, response_length=4, logging_steps=1, report_to=[],
                     num_sample_generations=0, bf16=False, disable_tqdm=True, seed=0,
                     **{**common, "critic_warmup_explained_variance": 1.0})
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=lambda prompts, completions: [1.0] * len(completions),
                   train_dataset=tiny_prompt_dataset(tok, 16), value_model=tiny_scalar_model(tok))
    t.train(resume_from_checkpoint=True)
    resumed = [log for log in t.state.log_history if "val/warmup" in log][3:]
    assert len(resumed) == 3 and [log["val/warmup"] for log in resumed] == [0.0] * 3


# ------------------------------------------------------------------------------------- mask_truncated_completions
def test_truncated_completions_leave_the_policy_mask(tmp_path):
    t = _trainer(tmp_path, response_length=4, mask_truncated_completions=True)
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    stopped = ((r.responses == t.stop_token_id) & r.response_mask).any(1)
    assert stopped.any() and not stopped.all()  # both kinds in this batch
    assert torch.equal(r.policy_mask, r.response_mask & stopped[:, None])
    assert _trainer(tmp_path, response_length=4).rollout(batch["input_ids"], batch["attention_mask"]).policy_mask \
        is None
    with pytest.raises(ValueError, match="mask_truncated_completions=True .* no stop token"):
        _trainer(tmp_path, stop_token="none", mask_truncated_completions=True)


# ------------------------------------------------------------------------------------------ top_entropy_quantile
def test_the_rollout_keeps_the_top_entropy_tokens_of_pi_old(tmp_path):
    """The mask holds the real tokens whose entropy under the rollout's policy (recomputed here from a plain forward)
    is in the top half of the batch's real tokens."""
    from trl_ext.core import entropy_from_logits
    from trl_ext.models import sequence_inputs

    t = _trainer(tmp_path, response_length=6, top_entropy_quantile=0.5, temperature=0.7)
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    inputs = sequence_inputs(r.queries, r.query_mask, r.responses, r.response_mask)
    with torch.no_grad():
        logits = t.unwrapped.policy(**inputs).logits[:, -7:-1]
    entropy = entropy_from_logits(logits, 0.7)
    real = entropy[r.response_mask]
    threshold = torch.quantile(real, 0.5)
    torch.testing.assert_close(r.entropy_mask, (entropy >= threshold) & r.response_mask, rtol=0, atol=0)
    assert 0.4 < r.entropy_mask.sum() / r.response_mask.sum() <= 0.6
    assert _trainer(tmp_path).rollout(batch["input_ids"], batch["attention_mask"]).entropy_mask is None


def test_the_top_entropy_mask_is_the_same_padding_free(tmp_path):
    masks = []
    for padding_free in (False, True):
        t = _trainer(tmp_path / str(padding_free), response_length=6, top_entropy_quantile=0.3,
                     padding_free=padding_free)
        batch = next(iter(t.dataloader))
        masks.append(t.rollout(batch["input_ids"], batch["attention_mask"]).entropy_mask)
    assert torch.equal(masks[0], masks[1]) and masks[0].any()
