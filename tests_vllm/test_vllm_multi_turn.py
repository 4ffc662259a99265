"""Multi-turn rollouts sampled by vLLM (colocated; the server's in test_vllm_server.py): each turn drawn by the engine
with the whole conversation as its prompt, the engine's log-probs of the model's tokens the trainer's, the tokens
between turns (the environment's) context only."""

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


def two_turns(prompts, trainer):
    """TRL's rollout_func: a turn, the environment's words "no ok", a second turn; sampled by trainer.generate_turns
    (the trainer's sampler: here the vLLM engine)."""
    tok = trainer.processing_class
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    note = tok("no ok")["input_ids"]
    first = trainer.generate_turns(prompt_ids, 3)
    second = trainer.generate_turns([p + ids + note for p, (ids, _) in zip(prompt_ids, first)], 3)
    out = {"prompt_ids": prompt_ids, "completion_ids": [], "logprobs": [], "env_mask": []}
    for (a, la), (b, lb) in zip(first, second):
        out["completion_ids"].append(a + note + b)
        out["logprobs"].append(la + [0.0] * len(note) + lb)
        out["env_mask"].append([1] * len(a) + [0] * len(note) + [1] * len(b))
    return out


def reward(prompts, completions):
    return [float("yes" in c.split()) for c in completions]


def test_multi_turn_rollouts_with_a_colocated_engine(tmp_path):
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=16, num_ppo_epochs=1,
                     response_length=8, logging_steps=1, report_to=[], save_strategy="no", num_sample_generations=0,
                     bf16=False, disable_tqdm=True, seed=0, use_vllm=True, vllm_kv_cache_gb=0.05, stop_token="none")
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, **SIZE), ref_model=None,
                   reward_model=reward, train_dataset=tiny_prompt_dataset(tok, 16),
                   value_model=tiny_scalar_model(tok, **SIZE), rollout_func=two_turns)
    t.train()
    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["multi_turn/turns_mean"] == 2.0 and log["multi_turn/env_tokens_mean"] == 2.0
        # the engine's log-probs of the model's tokens are the trainer's, read over the whole conversation
        assert log["rollout/sampler_logprob_diff_max"] < 1e-4
