"""Multi-turn PPO in the trainer: TRL's `tools`, `environment_factory` and `rollout_func` arguments; the rollout's
masks, rewards and advantages over hand-built conversations; zero gradients on the environment's tokens; a run whose
conversations are one turn equals the single-turn run; runs that train and resume; the documented errors."""

import re
import sys
from pathlib import Path

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.core import compact, compaction, compute_gae, expand, masked_whiten, turn_ends
from trl_ext.testing import tiny_causal_lm, tiny_chat_tokenizer, tiny_scalar_model
from trl_ext.trainer.update import policy_terms, value_terms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multi_turn import CALL, TOOL_SUFFIX, USER_SUFFIX, add, ids_of, scripted  # noqa: E402

POSITIONS = dict(max_position_embeddings=2048)


class Twice:
    """Two turns: feedback "again" (turn reward 0.5) after the first, the end (reward 1.0) after the second."""

    def __init__(self):
        self.turns = 0

    def reset(self, **row):
        self.turns = 0

    def step(self, completion: str):
        self.turns += 1
        return ("again", 0.5) if self.turns == 1 else (None, 1.0)

    def get_reward(self) -> float:
        return float(self.turns)


class OneTurn:
    """Ends after the model's first turn: the conversation is the single-turn response."""

    def reset(self, **row):
        return None

    def step(self, completion: str):
        return None


def digits(completions, **kwargs) -> list[float]:
    """TRL's convention: the share of digits in the conversation's text."""
    texts = [" ".join(m["content"] for m in c if m["role"] == "assistant") if isinstance(c, list) else c
             for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def dataset(n=8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}"}] for i in range(n)],
                              "target": [i % 3 for i in range(n)]})


def trainer(tmp_path, reward=digits, environment_factory=Twice, tools=None, rollout_func=None, eos_bias=5.0,
            layout="whole", **overrides):
    """layout: "whole" models, a "lora" policy, or a "shared" 4-bit base (policy and critic adapters of one base)."""
    tok = tiny_chat_tokenizer()
    args = PPOConfig(**{**dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_ppo_epochs=1,
                               num_mini_batches=1, response_length=48, report_to=[], save_strategy="no",
                               num_sample_generations=0, bf16=False, disable_tqdm=True, seed=0, total_episodes=8,
                               logging_steps=1, kl_coef=0.1, learning_rate=1e-3), **overrides})
    model, value_model, peft_config = (tiny_causal_lm(tok, token_bias={tok.eos_token_id: eos_bias}, **POSITIONS),
                                       tiny_scalar_model(tok, **POSITIONS), None)
    if layout == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    elif layout == "shared":
        from peft import LoraConfig

        from trl_ext.models import build_shared_base
        from trl_ext.testing import tiny_4bit_causal_lm

        lora = dict(lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        model = build_shared_base(tiny_4bit_causal_lm(tok, tmp_path / "base", **POSITIONS),
                                  policy_lora=LoraConfig(r=4, **lora), critic_lora=LoraConfig(r=2, **lora))
        value_model = None
    return PPOTrainer(args=args, processing_class=tok, model=model, ref_model=None, reward_model=reward,
                      train_dataset=dataset(), value_model=value_model, peft_config=peft_config, tools=tools,
                      environment_factory=environment_factory, rollout_func=rollout_func)


def first_batch(t):
    batch = next(iter(t.dataloader))
    return batch["input_ids"], batch["attention_mask"], {k: v for k, v in batch.items()
                                                         if k not in ("input_ids", "attention_mask")}


def scripted_rollout(t, turns):
    t.sampler.turn_generator = lambda step, draw=0, seed=None: scripted(t.processing_class, turns)
    return t.rollout(*first_batch(t))


TURNS = [["12<|im_end|>", "3<|im_end|>"], ["ab<|im_end|>", "4<|im_end|>"], ["5<|im_end|>", "x<|im_end|>"],
         ["6<|im_end|>", "7<|im_end|>"]]


def test_the_rollout_trains_on_model_tokens_and_places_the_rewards(tmp_path):
    t = trainer(tmp_path)
    r = scripted_rollout(t, TURNS)
    tok = t.processing_class
    feedback = ids_of(tok, USER_SUFFIX.format("again"))
    for b, (one, two) in enumerate(TURNS):
        first, second = ids_of(tok, one), ids_of(tok, two)
        n = len(first) + len(feedback) + len(second)
        assert r.responses[b, :n].tolist() == first + feedback + second
        model = [True] * len(first) + [False] * len(feedback) + [True] * len(second)
        assert r.response_mask[b, :n].tolist() == model and not r.response_mask[b, n:].any()
        assert r.context_mask[b, :n].all() and not r.context_mask[b, n:].any()
    env = r.context_mask & ~r.response_mask
    for name in ("logprobs", "ref_logprobs", "values", "kl", "rewards", "advantages", "returns"):
        assert (getattr(r, name)[env] == 0).all(), name  # nothing of the environment's tokens is kept
    # the rewards: −β·KL on model tokens, the turn reward 0.5 on turn 1's last token, and 1.0 + the conditioned
    # score (digits + get_reward's 2 turns) on the conversation's last model token
    ends = turn_ends(r.response_mask)
    expected = -0.1 * r.kl
    expected = expected + torch.where(ends, 0.5, 0.0)
    last = ends & ~torch.cumsum(ends.flip(1), 1).flip(1).gt(1)  # the last turn end of each row
    expected[ends & ~last] = expected[ends & ~last]  # (turn 1's 0.5 already in)
    expected[last] += 1.0 - 0.5 + r.scores
    torch.testing.assert_close(r.rewards, expected * r.response_mask)
    assert r.source_scores[:, 1].tolist() == [2.0] * 4  # get_reward: the environment's state (two turns)
    # GAE over the model tokens alone: a plain recomputation on the compacted rows
    index, cmask = compaction(r.response_mask)
    adv, ret = compute_gae(compact(r.rewards, index), compact(r.values, index), cmask, 1.0, 0.95)
    adv = masked_whiten(adv, cmask) * cmask
    torch.testing.assert_close(r.advantages, expand(adv, index, cmask))
    torch.testing.assert_close(r.returns, expand(ret, index, cmask))
    assert r.draw_metrics["multi_turn/turns_mean"] == 2.0
    assert r.draw_metrics["multi_turn/turn_reward_mean"] == 1.5
    assert r.draw_metrics["multi_turn/env_tokens_mean"] == len(feedback)


def test_the_reward_functions_get_trls_conversational_completions(tmp_path):
    seen = {}

    def record(completions, environments, **kwargs):
        seen["completions"], seen["environments"] = completions, environments
        return [0.0] * len(completions)

    t = trainer(tmp_path, reward=record)
    scripted_rollout(t, TURNS)
    assert seen["completions"][0] == [{"role": "assistant", "content": "12"}, {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "3"}]
    assert all(isinstance(e, Twice) for e in seen["environments"])


def test_the_losses_give_the_environments_tokens_no_gradient(tmp_path):
    """The policy loss with the entropy bonus and the KL loss, and the value loss: d loss / d logit is 0 at every
    position that predicts a tool or environment token, and not 0 at the model's."""
    t = trainer(tmp_path, entropy_coef=0.1, beta=0.1)
    r = scripted_rollout(t, TURNS)
    T = r.responses.shape[1]
    logits = torch.randn(len(r), T + 1, len(t.processing_class), requires_grad=True)
    loss, _, _ = policy_terms(logits, r, t.args, r.response_mask.sum().float())
    loss.backward()
    per_position = logits.grad[:, :-1].abs().sum(-1)  # position t predicts response token t
    env = r.context_mask & ~r.response_mask
    assert (per_position[env] == 0).all() and (per_position[r.response_mask] > 0).all()
    values = torch.randn(len(r), T + 1, requires_grad=True)
    v_loss, _ = value_terms(values, r, t.args, r.response_mask.sum().float())
    v_loss.backward()
    assert (values.grad[:, :-1][env] == 0).all()
    assert (values.grad[:, :-1][r.response_mask] != 0).float().mean() > 0.5  # (0 where the clipped term wins)


def test_one_turn_conversations_are_the_single_turn_run(tmp_path):
    """An environment that ends every conversation after the model's first turn: the same rollout (responses,
    log-probs, rewards, advantages) and the same weights after training as the run without one."""
    def run(path, environment_factory):
        t = trainer(path, environment_factory=environment_factory, eos_bias=2.0)
        r = t.rollout(*first_batch(t))
        t.train()
        return t, r

    single, r1 = run(tmp_path / "single", None)
    multi, r2 = run(tmp_path / "multi", OneTurn)
    mask = r1.response_mask
    for name in ("responses", "response_mask", "values", "kl", "rewards", "advantages", "returns", "scores"):
        torch.testing.assert_close(getattr(r2, name), getattr(r1, name), rtol=0, atol=0, msg=name)
    for name in ("logprobs", "ref_logprobs"):  # (what the single-turn rollout holds after the stop token is unused)
        torch.testing.assert_close(getattr(r2, name) * mask, getattr(r1, name) * mask, rtol=0, atol=0, msg=name)
    assert torch.equal(r2.context_mask, mask)
    for a, b in zip(single.unwrapped.policy.parameters(), multi.unwrapped.policy.parameters()):
        assert torch.equal(a, b)


def test_a_tool_calling_rollout_masks_the_tool_result(tmp_path):
    turns = [[CALL.format("add", '{"a": 2, "b": 3}'), "5<|im_end|>"]] * 4
    t = trainer(tmp_path, environment_factory=None, tools=[add], response_length=160)
    r = scripted_rollout(t, turns)
    tok = t.processing_class
    call, result = ids_of(tok, turns[0][0]), ids_of(tok, TOOL_SUFFIX.format(5))
    assert r.response_mask[0, : len(call) + len(result) + 2].tolist() == [True] * len(call) + [False] * len(
        result) + [True] * 2
    assert r.draw_metrics["tools/call_frequency"] == 1.0
    assert r.draw_metrics["tools/failure_frequency"] == 0.0
    # the prompt lists the tool (the chat template's system message)
    assert "<tools>" in tok.decode(r.queries[0][r.query_mask[0]]) and '"name": "add"' in tok.decode(r.queries[0])


@pytest.mark.parametrize("extra", [{}, {"padding_free": True}, {"rollout_logprobs": "sampler"},
                                   {"mask_truncated_completions": True, "missing_eos_penalty": 1.0}])
def test_multi_turn_runs_train_and_log_their_metrics(tmp_path, extra):
    t = trainer(tmp_path, **extra)
    t.train()
    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    for log in logs:
        assert 1.0 <= log["multi_turn/turns_mean"] <= 2.0
        assert 0.0 <= log["multi_turn/truncated_frac"] <= 1.0 and log["multi_turn/env_tokens_mean"] >= 0
        # a last turn cut by a cap (rollout/truncation_rate) is one way a length cap ends an episode
        assert log["rollout/truncation_rate"] <= log["multi_turn/truncated_frac"]
        assert all(torch.isfinite(torch.tensor(v)) for v in log.values() if isinstance(v, float))


@pytest.mark.parametrize("layout", ["lora", "shared"])
def test_lora_and_a_shared_4bit_base_train_on_conversations(tmp_path, layout):
    """Two-turn conversations (scripted turns) with a LoRA policy, and with one 4-bit base for policy, reference and
    critic: the environment's tokens are left out, the adapters train."""
    t = trainer(tmp_path, layout=layout)
    t.sampler.turn_generator = lambda step, draw=0, seed=None: scripted(t.processing_class, TURNS)
    before = {n: p.detach().clone() for n, p in t.unwrapped.policy.named_parameters() if p.requires_grad}
    t.train()
    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(log["multi_turn/turns_mean"] == 2.0 for log in logs)
    assert all(log["multi_turn/env_tokens_mean"] == len(ids_of(t.processing_class, USER_SUFFIX.format("again")))
               for log in logs)
    after = dict(t.unwrapped.policy.named_parameters())
    assert before and any(not torch.equal(v, after[n]) for n, v in before.items())


def test_dynamic_sampling_redraws_conversations(tmp_path):
    """Groups of 2 conversations; a reward constant for the first prompts' groups: those are redrawn (each draw a
    multi-turn rollout of its own) and the batch stays full."""
    def constant_for_some(completions, prompts, **kwargs):  # TRL's convention: the messages
        return [0.0 if p[0]["content"] in ("Say 0", "Say 1") else float(len(str(c))) for p, c in
                zip(prompts, completions)]

    t = trainer(tmp_path, reward=constant_for_some, num_generations=2, dynamic_sampling=True, max_num_gen_batches=3)
    t.train()
    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert logs and all(1 <= log["rollout/dynamic_draws"] <= 3 for log in logs)
    assert all(1.0 <= log["multi_turn/turns_mean"] <= 2.0 for log in logs)


def test_a_resumed_multi_turn_run_is_the_uninterrupted_one(tmp_path):
    straight = trainer(tmp_path / "a", total_episodes=12)
    straight.train()
    interrupted = trainer(tmp_path / "b", total_episodes=12, save_strategy="steps", save_steps=1)
    interrupted.train()
    resumed = trainer(tmp_path / "b", total_episodes=12)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    for a, b in zip(straight.unwrapped.policy.parameters(), resumed.unwrapped.policy.parameters()):
        assert torch.equal(a, b)


def test_rollout_func_conversations_train(tmp_path):
    """TRL's rollout_func: the user's loop, sampling with trainer.generate_turns; env_mask marks the model's tokens;
    extra fields reach the reward functions."""
    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        first = trainer.generate_turns(prompt_ids, 8)
        note = ids_of(tok, USER_SUFFIX.format("more"))
        second = trainer.generate_turns([p + ids + note for p, (ids, _) in zip(prompt_ids, first)], 8)
        completion_ids, logprobs, env_mask = [], [], []
        for (a, la), (b, lb) in zip(first, second):
            completion_ids.append(a + note + b)
            logprobs.append(la + [0.0] * len(note) + lb)
            env_mask.append([1] * len(a) + [0] * len(note) + [1] * len(b))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                "env_mask": env_mask, "turns": [2] * len(prompts)}

    seen = []

    def reward(completions, turns, **kwargs):
        seen.append(turns)
        return [float(len(c)) for c in completions]

    t = trainer(tmp_path, reward=reward, environment_factory=None, rollout_func=rollout_func)
    t.train()
    assert seen and seen[0] == [2, 2, 2, 2]
    log = next(h for h in t.state.log_history if "objective/scores" in h)
    assert log["multi_turn/env_tokens_mean"] > 0


def test_multi_turn_errors_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="rollout_func makes the conversations itself"):
        trainer(tmp_path, rollout_func=lambda p, t: {}, environment_factory=Twice)
    with pytest.raises(ValueError, match="set async_rollouts=False"):
        trainer(tmp_path, async_rollouts=True)
    with pytest.raises(ValueError, match=re.escape("or None with an environment_factory whose environments define "
                                                   "get_reward")):
        trainer(tmp_path, reward=None, environment_factory=OneTurn)
    tok = tiny_chat_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, response_length=8)
    with pytest.raises(ValueError, match="drop eval_dataset"):
        PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, **POSITIONS), ref_model=None,
                   reward_model=digits, train_dataset=dataset(), eval_dataset=dataset(),
                   value_model=tiny_scalar_model(tok, **POSITIONS), environment_factory=Twice)
    for bad, match in [(dict(max_tool_calling_iterations=-1), "max_tool_calling_iterations=-1 must be >= 0"),
                       (dict(max_turn_length=0), "max_turn_length=0 must be >= 1"),
                       (dict(tool_timeout=0), "tool_timeout=0 must be > 0"),
                       (dict(tool_errors="ignore"), "tool_errors='ignore' is not one of")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            PPOConfig(output_dir=str(tmp_path), report_to=[], **bad)


def test_reward_model_none_with_an_environment_reward(tmp_path):
    t = trainer(tmp_path, reward=None)
    assert t.reward_scorer.names == ["Twice"]
    r = scripted_rollout(t, TURNS)
    assert r.source_scores[:, 0].tolist() == [2.0] * 4
