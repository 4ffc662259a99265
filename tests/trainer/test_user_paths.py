"""The learning signal on the paths TRL users take (issue 12): the sampler is the policy whatever the model's
generation_config says, `stop_token="none"` samples to the length cap, no dropout in any form, generation in the
loss's precision, a sampler/trainer log-prob metric that can move, policy and critic clipped apart, the crashes of
`value_model_init` and `generate_completions`, and every batch setup TRL accepts.

Each test here failed on trl_ext before issue 12 (see the README's "what is fixed" table for which fail on TRL 1.12
too)."""

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import OPTConfig, OPTForCausalLM, TrainerCallback

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models import Sampling, generate_responses, sequence_inputs
from trl_ext.models.preparation import is_checkpointing
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

EOS = 1  # tiny_tokenizer: <pad> 0, <eos> 1, <unk> 2


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=8, response_length=8,
                num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, learning_rate=1e-3, logging_steps=1, seed=0)
    base.update(kw)
    return PPOConfig(**base)


class Capture(TrainerCallback):
    """The logged metrics of each step, and the rollouts (the rollout phase's run wrapped)."""

    def __init__(self, trainer):
        self.logs, self.rollouts = [], []
        trainer.add_callback(self)
        original = trainer.rollout_phase.run

        def rollout(*args, **kwargs):
            r = original(*args, **kwargs)
            self.rollouts.append(r)
            return r

        trainer.rollout_phase.run = rollout

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "objective/kl" in logs:
            self.logs.append(dict(logs))


def ppo(tmp_path, tok, policy, dataset=None, reward=None, value=None, **kw):
    init = {k: kw.pop(k) for k in ("ref_model", "peft_config", "eval_dataset", "optimizers", "callbacks") if k in kw}
    t = PPOTrainer(args=config(tmp_path, **kw), processing_class=tok, model=policy,
                   ref_model=init.pop("ref_model", None),
                   reward_model=reward or (lambda prompts, completions: [float(len(c)) for c in completions]),
                   train_dataset=dataset if dataset is not None else tiny_prompt_dataset(tok, n=8),
                   value_model=value if value is not None else tiny_scalar_model(tok), **init)
    return t, Capture(t)


def one_prompt(tok, n=64, text="w1 w2 w3"):
    return Dataset.from_dict({"input_ids": [tok(text)["input_ids"]] * n})


def poison(generation_config, tok):
    """Every sampling-related field a model's generation_config can carry, set to something that changes sampling."""
    for name, value in dict(do_sample=False, temperature=0.05, top_k=1, top_p=0.01, min_p=0.999, typical_p=0.01,
                            repetition_penalty=5.0, no_repeat_ngram_size=1, num_beams=4,
                            suppress_tokens=[tok.convert_tokens_to_ids(w) for w in ("w10", "w11", "w12")],
                            bad_words_ids=[[tok.convert_tokens_to_ids("w13")]],
                            sequence_bias={(tok.convert_tokens_to_ids("w14"),): 10.0},
                            min_new_tokens=3, forced_eos_token_id=EOS, epsilon_cutoff=0.5).items():
        setattr(generation_config, name, value)


# ------------------------------------------------------------------------------------------------ 1. the sampler
def test_sampled_tokens_follow_the_policys_distribution_whatever_its_generation_config_says():
    """20000 first tokens of one prompt, sampled with a model whose generation_config would make sampling greedy
    (min_p, top_k, temperature, ...): their frequencies are softmax(logits / 0.7), within sampling noise (total
    variation < 0.06; greedy would be ~0.9), and the sampler's log-probs are those of the policy."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=3)
    poison(policy.generation_config, tok)
    queries = torch.tensor([tok("w1 w2 w3")["input_ids"]] * 20000)
    mask = torch.ones_like(queries, dtype=torch.bool)
    torch.manual_seed(0)
    responses, sampler_logprobs = generate_responses(policy, queries, mask, Sampling(1, 0.7, EOS), chunk_size=20000)
    with torch.no_grad():
        probs = torch.softmax(policy(queries[:1]).logits[0, -1] / 0.7, dim=-1)
    freq = torch.bincount(responses[:, 0], minlength=probs.numel()).float() / len(responses)
    assert 0.5 * (freq - probs).abs().sum().item() < 0.06
    torch.testing.assert_close(sampler_logprobs[:, 0], probs.log()[responses[:, 0]], rtol=0, atol=1e-5)
    assert policy.generation_config.min_p == 0.999  # the model's own config is left as it was


def test_a_poisoned_generation_config_changes_nothing_in_training(tmp_path):
    """Through the trainer: 64 samples of one prompt are (nearly) all distinct and the sampler's log-probs equal
    the trainer's; before the fix min_p=0.999 gave 1 distinct response and KL 0, ratio 1, no alarm."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    poison(policy.generation_config, tok)
    t, cap = ppo(tmp_path, tok, policy, one_prompt(tok), per_device_train_batch_size=64, total_episodes=64)
    t.train()
    r, log = cap.rollouts[0], cap.logs[0]
    distinct = {tuple(x[m].tolist()) for x, m in zip(r.responses, r.response_mask)}
    assert len(distinct) > 48
    assert log["rollout/sampler_logprob_diff_max"] < 1e-5
    assert "alarm/generator_mismatch" not in log


# ------------------------------------------------------------------------------------------------ 2. stop "none"
def test_stop_token_none_samples_to_the_length_cap_with_eos_as_an_ordinary_token(tmp_path):
    """EOS is likely (bias +3) and stop_token="none": every response has response_length real tokens, EOS appears
    mid-response with sampled tokens after it (not pads), and the score lands on the last position. Before the fix
    generation stopped at EOS and padded the rest, which was trained on and scored."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0, token_bias={EOS: 3.0})
    t, cap = ppo(tmp_path, tok, policy, one_prompt(tok, 32), per_device_train_batch_size=32, total_episodes=32,
                 stop_token="none", kl_coef=0.0)
    t.train()
    r = cap.rollouts[0]
    assert r.response_mask.all()
    eos_mid = (r.responses[:, :-1] == EOS)
    assert eos_mid.any()
    rows, cols = eos_mid.nonzero(as_tuple=True)
    after = r.responses[rows, cols + 1]
    assert (after != EOS).any() and (after != tok.pad_token_id).any()
    assert torch.equal(r.rewards[:, -1], r.scores) and (r.rewards[:, :-1] == 0).all()
    torch.testing.assert_close(r.sampler_logprobs, r.logprobs, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ 3. dropout
def opt_policy(tok):
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    word_embed_proj_dim=32, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                    eos_token_id=EOS, bos_token_id=EOS, dropout=0.1, attention_dropout=0.1)
    return OPTForCausalLM(cfg)


@pytest.mark.parametrize("family", ["llama_attention_dropout", "opt_dropout"])
def test_dropout_rates_held_as_numbers_are_off(tmp_path, family):
    """Llama's `attention_dropout` and OPT's `dropout` are floats the model applies in training mode (no
    nn.Dropout module). At lr 0 against an identical reference, KL is exactly 0 and the first ratio exactly 1;
    before the fix: KL −0.011, ratio 0.998 (Llama), KL 0.017, ratio 1.0018 (OPT)."""
    tok = tiny_tokenizer()
    policy = (tiny_causal_lm(tok, seed=0, attention_dropout=0.1) if family.startswith("llama")
              else opt_policy(tok))
    reference = copy.deepcopy(policy)
    t, cap = ppo(tmp_path, tok, policy, ref_model=reference, learning_rate=0.0)
    t.train()
    log = cap.logs[0]
    assert log["objective/kl"] == 0.0 and log["objective/kl_k3"] == 0.0
    assert log["policy/ratio_first_minibatch"] == 1.0 and log["val/ratio"] == 1.0
    assert log["rollout/sampler_logprob_diff_max"] < 1e-5


# ------------------------------------------------------------------------------------------------ 6. precision
def test_generation_runs_under_the_losss_autocast(tmp_path):
    """bf16=True on CPU: `generate` runs under bf16 autocast, as the loss does (before the fix only the loss did, so
    the sampler drew from fp32 logits while the trainer's log-probs came from bf16: max |Δ log-prob| 0.095)."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    seen = []
    original = policy.generate

    def generate(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return original(*args, **kwargs)

    policy.generate = generate
    t, cap = ppo(tmp_path, tok, policy, bf16=True, use_cpu=True)
    t.train()
    assert seen and all(seen)
    assert math.isfinite(cap.logs[0]["rollout/sampler_logprob_diff_mean"])


# ------------------------------------------------------------------------------------------------ 7. the metric
class TrainingModeShift(torch.nn.Module):
    """Adds +2 to one logit in training mode only: the sampler (eval mode) and the trainer disagree, but the trainer
    agrees with itself, so the first ratio stays 1 and only the sampler metric can see it."""

    def forward(self, logits):
        return logits + 2.0 * torch.nn.functional.one_hot(torch.tensor(5), logits.shape[-1]) * self.training


def test_the_sampler_metric_sees_what_the_first_ratio_cannot(tmp_path):
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    shift = TrainingModeShift()
    policy.lm_head.register_forward_hook(lambda module, inputs, output: shift.train(module.training)(output))
    t, cap = ppo(tmp_path, tok, policy, learning_rate=0.0)
    with pytest.warns(UserWarning, match="generator_mismatch"):
        t.train()
    log = cap.logs[0]
    assert log["policy/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)  # blind to it
    assert log["rollout/sampler_logprob_diff_mean"] > 0.1  # sees it
    assert log["alarm/generator_mismatch"] == 1.0


def test_the_sampler_metric_is_small_when_sampler_and_trainer_agree(tmp_path):
    tok = tiny_tokenizer()
    t, cap = ppo(tmp_path, tok, tiny_causal_lm(tok, seed=0))
    t.train()
    assert 0.0 <= cap.logs[0]["rollout/sampler_logprob_diff_max"] < 1e-5


def policy_passes_over_responses(policy, T):
    """Counts the policy's no-grad LM-head calls over the T + 1 positions that predict a response: the rollout's
    recomputation of π_old (generation runs the head on one position per step)."""
    calls, head = [], policy.lm_head  # (the reference, a deep copy of the policy, carries a copy of the hook)
    head.register_forward_hook(lambda module, inputs, output: calls.append(1) if module is head
                               and not torch.is_grad_enabled() and output.shape[1] == T + 1 else None)
    return calls


def test_sampler_logprobs_as_pi_old_skip_the_rollouts_policy_pass_and_train_the_same(tmp_path):
    """rollout_logprobs="sampler" (TRL 1.12's π_old, from generate's scores): no policy forward in the rollout, the
    same tokens, and (fp32, where the sampler is the policy to ~1e-6) the same trained weights as "trainer"."""
    runs = {}
    for source in ("trainer", "sampler"):
        tok = tiny_tokenizer()
        policy = tiny_causal_lm(tok, seed=0)
        calls = policy_passes_over_responses(policy, T=8)
        t, cap = ppo(tmp_path / source, tok, policy, total_episodes=16, num_ppo_epochs=2, num_mini_batches=2,
                     rollout_logprobs=source)
        t.train()
        runs[source] = (cap, torch.cat([p.detach().flatten() for p in policy.parameters()]), len(calls))
    (trainer, w_trainer, n_trainer), (sampler, w_sampler, n_sampler) = runs["trainer"], runs["sampler"]
    assert n_trainer == 2 and n_sampler == 0  # one rollout pass per iteration, then none
    assert torch.equal(trainer.rollouts[1].responses, sampler.rollouts[1].responses)
    assert sampler.rollouts[0].logprobs.abs().sum() > 0
    mask = trainer.rollouts[0].response_mask  # (the trainer's log-probs past the stop token are not used)
    torch.testing.assert_close(sampler.rollouts[0].logprobs[mask], trainer.rollouts[0].logprobs[mask], rtol=0,
                               atol=1e-5)
    w_init = torch.cat([p.detach().flatten() for p in tiny_causal_lm(tiny_tokenizer(), seed=0).parameters()])
    assert (w_trainer - w_init).abs().max() > 1e-3  # the runs trained
    assert (w_sampler - w_trainer).abs().max() < 1e-5
    for log in sampler.logs:  # measured on the first minibatch, in the update: the sampler against the trainer
        assert 0 < log["rollout/sampler_logprob_diff_max"] < 1e-5
        assert log["policy/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)


def test_with_sampler_logprobs_the_first_ratio_and_the_sampler_metric_see_a_mismatch(tmp_path):
    """The eval/train-mode shift of `test_the_sampler_metric_sees_what_the_first_ratio_cannot`, with π_old the
    sampler's: the first minibatch's ratio now carries the gap, and the sampler metric (from the update) still sees
    it; generator_mismatch fires."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    shift = TrainingModeShift()
    policy.lm_head.register_forward_hook(lambda module, inputs, output: shift.train(module.training)(output))
    t, cap = ppo(tmp_path, tok, policy, learning_rate=0.0, rollout_logprobs="sampler")
    with pytest.warns(UserWarning, match="generator_mismatch"):
        t.train()
    log = cap.logs[0]
    assert abs(log["policy/ratio_first_minibatch"] - 1.0) > 1e-2
    assert log["rollout/sampler_logprob_diff_mean"] > 0.1
    assert log["alarm/generator_mismatch"] == 1.0


# ------------------------------------------------------------------------------------------------ 5. clipping
def test_the_critics_gradient_does_not_throttle_the_policys_step(tmp_path):
    """max_grad_norm=1, SGD: the policy's step is the same at vf_coef 0.1 and 10 (each part is clipped on its own).
    With one joint norm the policy's step was 0.0299 at vf_coef=0.1 and 0.0003 at vf_coef=10."""
    steps = {}
    for vf_coef in (0.1, 10.0):
        tok = tiny_tokenizer()
        policy, value = tiny_causal_lm(tok, seed=0), tiny_scalar_model(tok, seed=1)
        with torch.no_grad():
            value.score.weight.normal_(0, 1.0)  # a large critic gradient
        before = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
        sgd = torch.optim.SGD(list(policy.parameters()) + list(value.parameters()), lr=0.1)
        t, cap = ppo(tmp_path / str(vf_coef), tok, policy, value=value, vf_coef=vf_coef, max_grad_norm=1.0,
                     optimizers=(sgd, None))
        t.train()
        after = torch.cat([p.detach().flatten() for p in policy.parameters()])
        steps[vf_coef] = (after - before).norm().item()
        assert cap.logs[0]["val/grad_norm"] > 1.0  # the critic's gradient was clipped
    assert steps[0.1] > 0
    assert steps[10.0] == pytest.approx(steps[0.1], rel=1e-4)


# ------------------------------------------------------------------------------------------------ 8. misuse
def test_value_model_init_policy_with_lora_copies_the_plain_backbone(tmp_path):
    from peft import LoraConfig

    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    backbone = {k: v.clone() for k, v in policy.model.state_dict().items()}
    t = PPOTrainer(args=config(tmp_path, value_model_init="policy"), processing_class=tok, model=policy,
                   ref_model=None, reward_model=lambda prompts, completions: [1.0] * len(completions),
                   train_dataset=tiny_prompt_dataset(tok, n=8), value_model=None,
                   peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    critic = t.unwrapped.value_model
    for k, v in critic.model.state_dict().items():
        torch.testing.assert_close(v, backbone[k], rtol=0, atol=0)
    t.train()
    assert any("lora" in n for n, _ in t.unwrapped.policy.named_parameters())


def test_value_model_init_policy_from_a_peft_model_merges_its_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    policy = get_peft_model(tiny_causal_lm(tok, seed=0),
                            LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    merged = copy.deepcopy(policy).merge_and_unload().model.state_dict()
    t = PPOTrainer(args=config(tmp_path, value_model_init="policy"), processing_class=tok, model=policy,
                   ref_model=None, reward_model=lambda prompts, completions: [1.0] * len(completions),
                   train_dataset=tiny_prompt_dataset(tok, n=8), value_model=None)
    for k, v in t.unwrapped.value_model.model.state_dict().items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=0)


def test_value_model_init_reward_model_refuses_a_reward_model_with_another_vocabulary(tmp_path):
    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    other.add_tokens(["extra"])
    reward = tiny_scalar_model(other, seed=2)
    with pytest.raises(ValueError, match=r"value_model_init='reward_model' copies .* own tokenizer with another "
                                         r"vocabulary.*value_model_init='policy'"):
        PPOTrainer(args=config(tmp_path, value_model_init="reward_model"), processing_class=tok,
                   model=tiny_causal_lm(tok), ref_model=None, reward_model=(reward, other),
                   train_dataset=tiny_prompt_dataset(tok, n=8), value_model=None)
    # a tokenizer object of its own with the same vocabulary is fine: the critic reads the same ids
    same = tiny_tokenizer()
    t = PPOTrainer(args=config(tmp_path, value_model_init="reward_model"), processing_class=tok,
                   model=tiny_causal_lm(tok), ref_model=None, reward_model=(tiny_scalar_model(tok, seed=2), same),
                   train_dataset=tiny_prompt_dataset(tok, n=8), value_model=None)
    assert type(t.unwrapped.value_model).__name__ == "LlamaForSequenceClassification"


class Tracked(torch.Tensor):
    """A tensor type the eval collator hands out: a batch that reaches generation still of this type never went
    through `.to(device)` (which returns a plain tensor)."""

    def to(self, *args, **kwargs):
        return super().to(*args, **kwargs).as_subclass(torch.Tensor)


def test_generate_completions_moves_the_batch_to_the_device_and_keeps_the_training_rng(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    t, _ = ppo(tmp_path, tok, tiny_causal_lm(tok), eval_dataset=tiny_prompt_dataset(tok, n=4, seed=3))
    collate = t.eval_dataloader.collate_fn

    def tracked_collate(rows):
        batch = collate(rows)
        return {**batch, "input_ids": batch["input_ids"].as_subclass(Tracked),
                "attention_mask": batch["attention_mask"].as_subclass(Tracked)}

    t.eval_dataloader.collate_fn = tracked_collate
    seen = []
    original = t.sampler.hf.draw  # the one call of HF generate

    def spy(policy, queries, query_mask, *generator):
        seen.append(type(queries) is torch.Tensor and type(query_mask) is torch.Tensor)
        return original(policy, queries.as_subclass(torch.Tensor), query_mask.as_subclass(torch.Tensor), *generator)

    monkeypatch.setattr(t.sampler.hf, "draw", spy)
    state = torch.get_rng_state()
    t.generate_completions()
    assert seen and all(seen)
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------------------------ 10. batch setups
@pytest.mark.parametrize("per_device,ga,minibatches,micro_sizes", [(4, 1, 2, [2]), (4, 3, 2, [4, 2]), (3, 2, 3, [2])])
def test_every_batch_setup_trl_accepts_trains_with_trls_micro_batch_rule(tmp_path, per_device, ga, minibatches,
                                                                         micro_sizes, monkeypatch):
    """TRL's rule: a minibatch is cut into per_device_train_batch_size rows at a time, the last piece possibly
    smaller (a minibatch smaller than per_device_train_batch_size is one micro-batch). Before the fix these setups
    raised a ValueError. One optimizer step per minibatch."""
    tok = tiny_tokenizer()
    policy, value = tiny_causal_lm(tok), tiny_scalar_model(tok)
    adam = torch.optim.Adam(list(policy.parameters()) + list(value.parameters()), lr=1e-3)
    steps = []
    adam.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    B = per_device * ga
    t, cap = ppo(tmp_path, tok, policy, tiny_prompt_dataset(tok, n=B), value=value,
                 per_device_train_batch_size=per_device,
                 gradient_accumulation_steps=ga, num_mini_batches=minibatches, total_episodes=B, num_ppo_epochs=2,
                 optimizers=(adam, None))
    sizes = []
    original = t.update_phase.micro_batch_losses
    monkeypatch.setattr(t.update_phase, "micro_batch_losses",
                        lambda inputs, mb, *a: sizes.append(len(mb)) or original(inputs, mb, *a))
    t.train()
    assert len(steps) == 2 * minibatches
    assert sizes == micro_sizes * (2 * minibatches)
    assert math.isfinite(cap.logs[0]["loss/policy_avg"])


# ------------------------------------------------------------------------------------------------ 11. KV cache
@pytest.mark.parametrize("where", ["rollout", "evaluation"])
def test_generation_uses_the_kv_cache_with_gradient_checkpointing_on(tmp_path, where):
    """After the prompt, each decoding step feeds the model one new token (the KV cache holds the rest), also with
    gradient checkpointing on and the model in training mode: transformers up to 5.23 drop the cache of a
    checkpointed layer in training mode, which evaluation's sampling hit (policy and reference then sampled
    differently: win rate 0.458 for identical models)."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    t, cap = ppo(tmp_path, tok, policy, gradient_checkpointing=True, stop_token="none",
                 eval_dataset=tiny_prompt_dataset(tok, n=1, seed=3))
    widths = []
    policy.model.embed_tokens.register_forward_hook(lambda module, inputs, output: widths.append(inputs[0].shape[1]))
    t.model.train()
    if where == "rollout":
        batch = next(iter(t.dataloader))
        t.rollout(batch["input_ids"], batch["attention_mask"])
    else:
        t.evaluate_policy()
    steps = widths[: t.args.response_length]  # the policy's first generation
    assert steps[1:] == [1] * (t.args.response_length - 1), steps


def test_checkpointing_is_switched_with_the_names_transformers_keeps(tmp_path, recwarn):
    """transformers 5.25 renamed gradient checkpointing to activation checkpointing and warns on the old names (gone
    in v6): trl_ext switches it on for training, off to generate and on again without calling them."""
    tok = tiny_tokenizer()
    policy, value = tiny_causal_lm(tok, seed=0), tiny_scalar_model(tok, seed=1)
    t, _ = ppo(tmp_path, tok, policy, value=value, gradient_checkpointing=True, total_episodes=4)
    t.train()
    old_names = [str(w.message) for w in recwarn if "gradient_checkpointing_" in str(w.message)
                 or "is_gradient_checkpointing" in str(w.message)]
    assert old_names == []
    assert t.model.is_gradient_checkpointing  # on again after the rollout's generation
    assert is_checkpointing(policy) and is_checkpointing(value)


def test_pad_ids_never_reach_the_model():
    """A pad id outside the embedding table ([PAD] added to the tokenizer, not the model): model inputs hold id 0
    at every masked position."""
    queries = torch.tensor([[99, 99, 5, 6], [7, 8, 9, 10]])
    responses = torch.tensor([[11, 99, 99], [12, 13, 99]])
    qm, rm = queries != 99, responses != 99
    inputs = sequence_inputs(queries, qm, responses, rm)
    assert (inputs["input_ids"] < 99).all()
    assert torch.equal(inputs["input_ids"][0], torch.tensor([0, 0, 5, 6, 11, 0, 0]))
