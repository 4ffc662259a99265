"""Issue 5 through the trainer: prompt datasets in TRL's three forms give identical rollouts; reward functions see
dataset columns; weighted reward lists log each source; score normalisation and clipping; long prompts."""

import torch
from datasets import Dataset

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "hello world"]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def tokenizer():
    tok = tiny_tokenizer(padding_side="right")  # the trainer pads prompts on the left whatever this says
    tok.chat_template = TEMPLATE
    return tok


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=5,
                num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, seed=11)
    base.update(kw)
    return PPOConfig(**base)


def first_rollout(tmp_path, dataset, reward, tok=None, **kw):
    tok = tok or tokenizer()
    t = PPOTrainer(args=config(tmp_path, **kw), processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=reward, train_dataset=dataset, value_model=tiny_scalar_model(tok))
    batch = next(iter(t.dataloader))
    extra = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    return t, t.rollout(batch["input_ids"], batch["attention_mask"], extra)


def length_reward(prompts, completions):
    return [float(len(c.split())) for c in completions]


def test_text_conversational_and_tokenized_prompts_give_identical_rollouts(tmp_path):
    tok = tokenizer()
    forms = {
        "text": Dataset.from_dict({"prompt": PROMPTS}),
        # the template renders "<content> " and the word-level tokenizer splits on whitespace: the same tokens
        "conversational": Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]}),
        "tokenized": Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in PROMPTS]}),
    }
    rollouts = {name: first_rollout(tmp_path / name, ds, length_reward)[1] for name, ds in forms.items()}
    ref = rollouts["tokenized"]
    assert not ref.query_mask[:, 0].all(), "prompts of different lengths: some left padding expected"
    for name, r in rollouts.items():
        for field in ("queries", "query_mask", "responses", "response_mask", "scores", "logprobs"):
            assert torch.equal(getattr(r, field), getattr(ref, field)), (name, field)


def test_reward_functions_get_dataset_columns_and_weighted_sources_are_logged(tmp_path):
    seen = {}

    def exact_answer(prompts, completions, answer):
        seen["answer"] = list(answer)
        return [1.0 if a in c.split() else 0.0 for c, a in zip(completions, answer)]

    ds = Dataset.from_dict({"prompt": PROMPTS, "answer": ["w1", "w2", "w3", "w4"]})
    tok = tokenizer()
    t = PPOTrainer(args=config(tmp_path, reward_weights=[2.0, -0.5], logging_steps=1), processing_class=tok,
                   model=tiny_causal_lm(tok), ref_model=None, reward_model=[exact_answer, length_reward],
                   train_dataset=ds, value_model=tiny_scalar_model(tok))
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"],
                  {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")})
    assert sorted(seen["answer"]) == ["w1", "w2", "w3", "w4"]
    exact, length = r.source_scores.unbind(1)
    assert torch.allclose(r.scores, 2.0 * exact - 0.5 * length)
    t.train()
    log = [h for h in t.state.log_history if "objective/scores" in h][0]
    assert {"objective/scores/exact_answer", "objective/scores/length_reward"} <= set(log)


def test_fixed_normalisation_and_clipping_of_scores(tmp_path):
    _, raw = first_rollout(tmp_path / "raw", Dataset.from_dict({"prompt": PROMPTS}), length_reward)
    _, r = first_rollout(tmp_path / "norm", Dataset.from_dict({"prompt": PROMPTS}), length_reward,
                         reward_norm="fixed", reward_norm_mean=3.0, reward_norm_std=2.0, reward_clip=0.75)
    assert torch.equal(r.responses, raw.responses)
    assert torch.allclose(r.scores, ((raw.scores - 3.0) / 2.0).clamp(-0.75, 0.75))


def characters(prompts, completions):
    return [float(len(c.replace(" ", ""))) for c in completions]


def test_running_normalisation_uses_every_score_so_far(tmp_path):
    """After the first batch the running statistics are this batch's: (raw − mean) / sample std."""
    t, r1 = first_rollout(tmp_path, Dataset.from_dict({"prompt": PROMPTS}), characters, reward_norm="running")
    raw1 = r1.source_scores[:, 0]
    assert raw1.std() > 0
    assert torch.allclose(r1.scores, (raw1 - raw1.mean()) / raw1.std(), atol=1e-5)


def test_long_prompts_are_cut_from_the_left_or_dropped_and_counted(tmp_path):
    ds = Dataset.from_dict({"prompt": PROMPTS + ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"] * 4})
    t, r = first_rollout(tmp_path / "left", ds, length_reward, max_prompt_length=3, per_device_train_batch_size=8,
                         total_episodes=8)
    assert r.queries.shape[1] == 3
    assert t.prompt_counts == {"data/prompts_truncated": 5, "data/prompts_dropped": 0}  # "w6 w7 w8 w9" and 4 long
    t, _ = first_rollout(tmp_path / "drop", ds, length_reward, max_prompt_length=3, prompt_truncation="drop",
                         per_device_train_batch_size=3, total_episodes=3)
    assert t.prompt_counts == {"data/prompts_truncated": 0, "data/prompts_dropped": 5}
    assert t.train_dataset_len == 3
    t.train()
    log = [h for h in t.state.log_history if "objective/scores" in h][0]
    assert log["data/prompts_dropped"] == 5


def test_a_reward_model_with_its_own_tokenizer(tmp_path):
    """(model, tokenizer): the text is re-tokenized for the reward model (another vocabulary, right padding)."""
    from trl_ext.rewards import RewardScorer

    policy_tok = tokenizer()
    rm_tok = tiny_tokenizer(padding_side="right")
    rm_tok.add_tokens(["extra1", "extra2"])  # a different vocabulary size
    rm = tiny_scalar_model(rm_tok, seed=4)
    t, r = first_rollout(tmp_path, Dataset.from_dict({"prompt": PROMPTS}), (rm, rm_tok), tok=policy_tok)
    assert r.scores.abs().sum() > 0
    direct, _ = RewardScorer((rm, rm_tok), policy_tok)(r.queries, r.query_mask, r.responses, r.response_mask)
    assert torch.allclose(r.scores, direct)
    # and each row equals the reward model run alone on that row's text, unpadded
    for b in range(len(PROMPTS)):
        text = policy_tok.decode(torch.cat([r.queries[b][r.query_mask[b]], r.responses[b][r.response_mask[b]]]),
                                 skip_special_tokens=True)
        ids = rm_tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            alone = rm(input_ids=ids).logits[0, 0]
        assert torch.allclose(r.scores[b], alone, atol=1e-5), b
