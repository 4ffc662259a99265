"""TRL's reward-function convention, as GRPOTrainer calls reward functions (issue 13): keyword arguments (prompts,
completions, completion_ids, the dataset's columns, trainer_state), conversational completions for conversational
prompts, None for "not applicable", async functions; `trl.rewards` functions as they are; a reward model given as a
path. Functions in trl_ext's own (prompts, completions) form keep getting text."""

import asyncio
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl.rewards import think_format_reward

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.rewards import RewardScorer
from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
CONVERSATIONS = [[{"role": "user", "content": "w1 w2"}], [{"role": "user", "content": "hello"}]]


def think_tokenizer():
    tok = tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    return tok


def batch_of(tok, prompts: list[str], completions: list[str]):
    """Left-padded queries and right-padded responses (each ending in EOS) as the trainer hands them to rewards."""
    q = [tok(p)["input_ids"] for p in prompts]
    r = [tok(c)["input_ids"] + [tok.eos_token_id] for c in completions]
    Q, T = max(map(len, q)), max(map(len, r))
    queries = torch.tensor([[tok.pad_token_id] * (Q - len(x)) + x for x in q])
    responses = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in r])
    qm = torch.tensor([[False] * (Q - len(x)) + [True] * len(x) for x in q])
    rm = torch.tensor([[True] * len(x) + [False] * (T - len(x)) for x in r])
    return queries, qm, responses, rm


def test_trl_rewards_function_gets_conversational_completions():
    tok = think_tokenizer()
    batch = batch_of(tok, ["user w1 w2", "user hello"], ["<think> a </think> yes", "no <think> a"])
    combined, per = RewardScorer(think_format_reward, tok)(*batch, extra_columns={"prompt": CONVERSATIONS})
    assert combined.tolist() == [1.0, 0.0]
    assert list(per) == ["think_format_reward"]


def test_keyword_convention_receives_what_grpo_passes():
    tok = think_tokenizer()
    batch = batch_of(tok, ["user w1 w2", "user hello"], ["yes ok", "no"])
    seen = {}

    def by_keyword(completions, completion_ids, answer, trainer_state, prompts, **kwargs):
        seen.update(completions=completions, completion_ids=completion_ids, answer=answer, state=trainer_state,
                    prompts=prompts, kwargs=kwargs)
        return [float(len(ids)) for ids in completion_ids]

    def keyword_only(*, completion_ids, answer):
        return [float(a) for a in answer]

    state = object()
    combined, per = RewardScorer([by_keyword, keyword_only], tok)(
        *batch, extra_columns={"prompt": CONVERSATIONS, "answer": [3, 4], "prompt_text": ["x", "y"]},
        trainer_state=state)
    assert seen["prompts"] == CONVERSATIONS  # the dataset's own prompts
    assert seen["completions"] == [[{"role": "assistant", "content": "yes ok"}],
                                   [{"role": "assistant", "content": "no"}]]
    ids = [r[m].tolist() for r, m in zip(batch[2], batch[3])]
    assert seen["completion_ids"] == ids and ids[1][-1] == tok.eos_token_id  # up to and including the stop token
    assert seen["answer"] == [3, 4] and seen["state"] is state
    assert seen["kwargs"] == {"prompt_text": ["x", "y"]}  # every other column; "prompt" arrives as `prompts`
    assert per["by_keyword"].tolist() == [3.0, 2.0] and per["keyword_only"].tolist() == [3.0, 4.0]


def test_text_prompts_give_text_completions_and_the_dataset_prompt():
    tok = think_tokenizer()
    batch = batch_of(tok, ["w1 w2", "hello"], ["yes ok", "no"])
    seen = {}

    def f(completions, prompts, **kwargs):
        seen.update(completions=completions, prompts=prompts)
        return [0.0, 0.0]

    RewardScorer(f, tok)(*batch, extra_columns={"prompt": ["Original one?", "Original two?"]})
    assert seen == {"completions": ["yes ok", "no"], "prompts": ["Original one?", "Original two?"]}


def test_functions_in_trl_exts_own_form_keep_getting_text_on_conversational_prompts():
    tok = think_tokenizer()
    batch = batch_of(tok, ["w1 w2", "hello"], ["yes ok", "no"])
    seen = {}

    def vader_like(prompts, completions, **_):
        seen.update(prompts=prompts, completions=completions)
        return [float(len(c)) for c in completions]

    RewardScorer(vader_like, tok)(*batch, extra_columns={"prompt": CONVERSATIONS})
    assert seen == {"prompts": ["w1 w2", "hello"], "completions": ["yes ok", "no"]}  # decoded, as before


def test_none_is_left_out_of_the_weighted_sum():
    tok = think_tokenizer()
    batch = batch_of(tok, ["w1", "w2", "w3"], ["yes", "no", "ok"])

    def sometimes(completions, **kwargs):
        return [1.0, None, 3.0]

    def always(completions, **kwargs):
        return [10.0, 20.0, 30.0]

    combined, per = RewardScorer([sometimes, always], tok, reward_weights=[2.0, 0.5])(*batch)
    assert combined.tolist() == [7.0, 10.0, 21.0]  # row 1: only `always` scores it
    assert math.isnan(per["sometimes"][1]) and per["sometimes"][[0, 2]].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match=r"every reward returned None for rows \[1\]"):
        RewardScorer(sometimes, tok)(*batch)


def test_async_functions_are_awaited_together_also_inside_a_running_event_loop():
    tok = think_tokenizer()
    batch = batch_of(tok, ["w1", "w2"], ["yes", "no ok"])
    order = []

    async def slow(completions, **kwargs):
        order.append("slow start")
        await asyncio.sleep(0.05)
        order.append("slow end")
        return [1.0, 2.0]

    async def fast(completions, **kwargs):
        order.append("fast start")
        return [float(len(c)) for c in completions]

    scorer = RewardScorer([slow, fast], tok)
    combined, per = scorer(*batch)
    assert per["slow"].tolist() == [1.0, 2.0] and per["fast"].tolist() == [3.0, 5.0]
    assert order[:2] == ["slow start", "fast start"]  # gathered: fast ran while slow slept

    async def inside_a_loop():  # a notebook's running loop
        return scorer(*batch)[0]

    assert asyncio.run(inside_a_loop()).tolist() == combined.tolist()

    async def broken(completions, **kwargs):
        raise KeyError("kaput")

    with pytest.raises(RuntimeError, match="reward function 'broken' failed"):
        RewardScorer(broken, tok)(*batch)


def test_a_reward_model_given_as_a_path_loads_as_grpo_loads_it(tmp_path):
    tok = think_tokenizer()
    rm = tiny_scalar_model(tok, seed=2)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    batch = batch_of(tok, ["w1 w2", "hello"], ["yes ok", "no"])
    by_path = RewardScorer(str(tmp_path / "rm"), tok)
    assert by_path.names == [str(tmp_path / "rm")]
    (name, model), = by_path.models.items()
    assert by_path.tokenizer_of(name) is not None  # it reads text through its own tokenizer, as GRPO's does
    from transformers import AutoTokenizer

    as_tuple = RewardScorer((rm, AutoTokenizer.from_pretrained(tmp_path / "rm")), tok)
    torch.testing.assert_close(by_path(*batch)[0], as_tuple(*batch)[0], rtol=0, atol=1e-5)


class Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "objective/scores" in logs:
            self.logs.append(dict(logs))


def test_trl_reward_functions_train_on_conversational_prompts(tmp_path):
    """think_format_reward (trl.rewards, as it is) and a keyword-only function that reads completion_ids, a dataset
    column and trainer_state, on conversational prompts, through the trainer."""
    tok = think_tokenizer()
    think, close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    policy = tiny_causal_lm(tok, seed=0, token_bias={think: 2.0, close: 2.0, tok.eos_token_id: 1.0})
    steps = []

    def shorter_is_better(*, completion_ids, target_length, trainer_state, **kwargs):
        steps.append(trainer_state.global_step)
        return [-abs(len(ids) - t) for ids, t in zip(completion_ids, target_length)]

    dataset = Dataset.from_dict({"prompt": CONVERSATIONS * 4, "target_length": [3, 5] * 4})
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=16, response_length=6,
                     num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True, logging_steps=1, learning_rate=1e-3)
    logs = Logs()
    t = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None,
                   reward_model=[think_format_reward, shorter_is_better], value_model=tiny_scalar_model(tok),
                   train_dataset=dataset, callbacks=[logs])
    t.train()
    assert len(logs.logs) == 2 and steps == [0, 1]
    for log in logs.logs:
        assert 0.0 <= log["objective/scores/think_format_reward"] <= 1.0
        assert log["objective/scores/shorter_is_better"] <= 0.0
