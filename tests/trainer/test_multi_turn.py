"""Multi-turn rollouts (trl_ext/trainer/multi_turn.py, trl_ext/core/turns.py): the conversation loop against
hand-built conversations, its caps and errors, and the math over the model's tokens against plain loops."""

import time
from types import SimpleNamespace

import pytest
import torch

from trl_ext.core import compact, compaction, compute_gae, expand, place_turn_rewards, turn_ends
from trl_ext.testing import tiny_chat_tokenizer
from trl_ext.trainer.multi_turn import MultiTurn, RolloutFunction, ToolCallError, ToolTimeoutError

# what Qwen2.5's template puts between an assistant turn that called a tool and the next assistant turn
TOOL_SUFFIX = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
USER_SUFFIX = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call><|im_end|>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def fails(x: int) -> int:
    """A tool that always raises.

    Args:
        x: Anything.
    """
    raise ZeroDivisionError("boom")


def hangs(x: int) -> int:
    """A tool that never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(5)
    return x


def config(**overrides):
    args = dict(response_length=256, max_turn_length=None, max_tool_calling_iterations=None, tool_timeout=5.0,
                tool_errors="feedback", chat_template_kwargs=None)
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def scripted(tok, turns: list[list[str]]):
    """A stand-in for the sampler: row i's k-th call returns turns[i][k] (cut at max_new_tokens), log-prob −0.5 per
    token. Rows are told apart by the order of the open rows, as the loop passes them."""
    calls = {i: 0 for i in range(len(turns))}
    seen = []

    def generate(contexts, max_new_tokens):
        open_rows = [i for i in range(len(turns)) if calls[i] < len(turns[i]) and i not in seen_done]
        out = []
        for i in open_rows[: len(contexts)]:
            ids = ids_of(tok, turns[i][calls[i]])[:max_new_tokens]
            calls[i] += 1
            if calls[i] == len(turns[i]):
                seen_done.add(i)
            out.append((ids, [-0.5] * len(ids)))
        seen.append(len(contexts))
        return out

    seen_done: set = set()
    generate.contexts_per_call = seen
    return generate


def prompts(tok, questions, tools=None):
    from trl_ext.trainer.multi_turn import left_pad

    rows = [ids_of(tok, tok.apply_chat_template([{"role": "user", "content": q}], tools=tools,
                                                 add_generation_prompt=True, tokenize=False)) for q in questions]
    return left_pad(rows, tok.pad_token_id, torch.long)


# ------------------------------------------------------------------------------------------------ core.turns
def test_compaction_moves_model_tokens_to_the_front_and_back():
    model = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    x = torch.arange(12.0).reshape(2, 6)
    index, cmask = compaction(model)
    assert compact(x, index)[cmask].tolist() == [0.0, 1.0, 4.0, 7.0, 8.0, 9.0]
    assert cmask.tolist() == [[True, True, True, False, False, False], [True, True, True, False, False, False]]
    back = expand(compact(x, index), index, cmask)
    assert torch.equal(back, torch.where(model, x, 0.0))


def test_turn_ends_and_turn_rewards_on_hand_built_rows():
    model = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0]], dtype=torch.bool)
    assert turn_ends(model).nonzero().tolist() == [[0, 1], [0, 6], [1, 0], [1, 2], [1, 4]]
    placed = place_turn_rewards([[0.5, 2.0], [1.0, 0.0, -1.0]], model)
    expected = torch.zeros(2, 8)
    expected[0, 1], expected[0, 6], expected[1, 0], expected[1, 4] = 0.5, 2.0, 1.0, -1.0
    assert torch.equal(placed, expected)
    with pytest.raises(ValueError, match="row 0 has 2 model turns but 1 turn rewards"):
        place_turn_rewards([[1.0], [0.0, 0.0, 0.0]], model)


def test_gae_over_model_tokens_skips_tool_tokens():
    """γ, λ < 1: the discount applies once per model token; a plain loop over the model tokens alone agrees, and the
    tools' positions get nothing."""
    g = torch.Generator().manual_seed(0)
    model = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards, values = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    gamma, lam = 0.9, 0.8
    index, cmask = compaction(model)
    adv, ret = compute_gae(compact(rewards, index), compact(values, index), cmask, gamma, lam)
    adv, ret = expand(adv, index, cmask), expand(ret, index, cmask)
    positions = model[0].nonzero().flatten().tolist()  # 0, 1, 5, 6
    expected, next_value, running = {}, 0.0, 0.0
    for t in reversed(positions):
        delta = rewards[0, t].item() + gamma * next_value - values[0, t].item()
        running = delta + gamma * lam * running
        expected[t], next_value = running, values[0, t].item()
    for t in range(8):
        assert adv[0, t].item() == pytest.approx(expected.get(t, 0.0), abs=1e-6)
        assert ret[0, t].item() == pytest.approx(expected[t] + values[0, t].item() if t in expected else 0.0,
                                                 abs=1e-6)


# ------------------------------------------------------------------------------------------------ the loop
def test_tool_call_conversation_matches_the_hand_built_tokens(tok):
    turns = [[CALL.format("add", '{"a": 2, "b": 3}'), "The answer is 5<|im_end|>"], ["No tools: 7<|im_end|>"]]
    engine = MultiTurn(tok, config(), tools=[add], stop_token_id=tok.eos_token_id)
    queries, mask = prompts(tok, ["What is 2 + 3?", "What is 3 + 4?"], tools=[add])
    out = engine.run(queries, mask, {}, scripted(tok, turns))

    first, tool, second = ids_of(tok, turns[0][0]), ids_of(tok, TOOL_SUFFIX.format(5)), ids_of(tok, turns[0][1])
    n = len(first) + len(tool) + len(second)
    assert out.responses[0, :n].tolist() == first + tool + second
    assert out.model_mask[0, :n].tolist() == [True] * len(first) + [False] * len(tool) + [True] * len(second)
    assert not out.model_mask[0, n:].any() and out.context_mask[0].sum() == n
    assert out.sampler_logprobs[0, :n].tolist() == [-0.5] * len(first) + [0.0] * len(tool) + [-0.5] * len(second)
    only = ids_of(tok, turns[1][0])
    assert out.responses[1, : len(only)].tolist() == only and out.model_mask[1].sum() == len(only)
    assert out.turn_rewards == [[0.0, 0.0], [0.0]]
    # TRL's conversational completion: the assistant's call, the tool's result, the answer
    assert out.messages[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert out.messages[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert out.messages[0][2]["content"] == "The answer is 5"
    assert out.metrics | {} == {"turns": 3, "tool_calls": 1, "tool_failures": 0, "truncated": 0,
                                "env_tokens": float(len(tool)), "turn_reward": 0.0, "episodes": 2}
    assert torch.equal(out.queries, queries) and torch.equal(out.query_mask, mask)


def test_a_tool_that_raises_is_the_models_feedback_or_stops_the_run(tok):
    turns = [[CALL.format("fails", '{"x": 1}'), "sorry<|im_end|>"]]
    queries, mask = prompts(tok, ["Try it"], tools=[fails])
    out = MultiTurn(tok, config(), tools=[fails], stop_token_id=tok.eos_token_id).run(
        queries, mask, {}, scripted(tok, turns))
    assert out.messages[0][1] == {"role": "tool", "name": "fails", "content": "{'error': 'boom'}"}
    assert out.metrics["tool_calls"] == 1 and out.metrics["tool_failures"] == 1
    strict = MultiTurn(tok, config(tool_errors="raise"), tools=[fails], stop_token_id=tok.eos_token_id)
    with pytest.raises(ToolCallError, match=r"tool 'fails' raised on row 0 with arguments \{'x': 1\}.*boom"):
        strict.run(queries, mask, {}, scripted(tok, turns))
    # an unknown tool is the model's mistake: it is told so
    out = MultiTurn(tok, config(), tools=[fails], stop_token_id=tok.eos_token_id).run(
        queries, mask, {}, scripted(tok, [[CALL.format("nope", "{}"), "ok<|im_end|>"]]))
    assert out.messages[0][1]["content"] == "{'error': 'Tool nope not found.'}"


def test_a_tool_that_never_returns_stops_the_run_after_tool_timeout(tok):
    queries, mask = prompts(tok, ["Try it"], tools=[hangs])
    engine = MultiTurn(tok, config(tool_timeout=0.2), tools=[hangs], stop_token_id=tok.eos_token_id)
    start = time.monotonic()
    with pytest.raises(ToolTimeoutError, match=r"tool 'hangs' did not return within tool_timeout=0.2 s"):
        engine.run(queries, mask, {}, scripted(tok, [[CALL.format("hangs", '{"x": 1}'), "ok<|im_end|>"]]))
    assert time.monotonic() - start < 3


class Game:
    """Guess the number: feedback after each guess, reward 1 on the turn that guesses it."""

    def __init__(self):
        self.target, self.guesses = None, 0

    def reset(self, target, **row):
        self.target, self.guesses = int(target), 0

    def step(self, completion: str):
        self.guesses += 1
        guess = int(completion.strip() or -1)
        if guess == self.target:
            return None, 1.0
        return ("higher" if guess < self.target else "lower"), 0.0

    def get_reward(self) -> float:
        return float(self.guesses)


def test_environment_step_feedback_turn_rewards_and_get_reward(tok):
    turns = [["3<|im_end|>", "8<|im_end|>", "5<|im_end|>"], ["5<|im_end|>"]]
    engine = MultiTurn(tok, config(), environment_factory=Game, stop_token_id=tok.eos_token_id)
    assert engine.prompt_tools() is None  # step is not a tool: no tools are listed
    queries, mask = prompts(tok, ["Guess", "Guess"])
    out = engine.run(queries, mask, {"target": [5, 5]}, scripted(tok, turns))
    expected = (ids_of(tok, "3<|im_end|>") + ids_of(tok, USER_SUFFIX.format("higher")) + ids_of(tok, "8<|im_end|>")
                + ids_of(tok, USER_SUFFIX.format("lower")) + ids_of(tok, "5<|im_end|>"))
    assert out.responses[0, : len(expected)].tolist() == expected
    assert out.turn_rewards == [[0.0, 0.0, 1.0], [1.0]]
    placed = place_turn_rewards(out.turn_rewards, out.model_mask)
    last = out.model_mask[0].nonzero().flatten()[-1]
    assert placed[0].nonzero().flatten().tolist() == [last.item()] and placed[1].sum() == 1.0
    assert [m["role"] for m in out.messages[0]] == ["assistant", "user", "assistant", "user", "assistant"]
    (reward,) = engine.reward_functions()
    assert reward.__name__ == "Game" and reward(environments=out.environments) == [3.0, 1.0]
    # the pool: two environments built once (one probed at set-up), reset for the next batch
    assert len(engine.pool[None]) == 2


class Endless(Game):
    def step(self, completion: str):
        return "again"


def test_an_environment_that_never_ends_is_ended_by_the_caps(tok):
    queries, mask = prompts(tok, ["Guess"])
    many = [["1<|im_end|>"] * 50]
    out = MultiTurn(tok, config(max_tool_calling_iterations=2), environment_factory=Endless,
                    stop_token_id=tok.eos_token_id).run(queries, mask, {"target": [1]}, scripted(tok, many))
    assert len(out.turn_rewards[0]) == 3 and out.metrics["truncated"] == 0  # 2 rounds of feedback, 3 turns
    out = MultiTurn(tok, config(response_length=60), environment_factory=Endless,
                    stop_token_id=tok.eos_token_id).run(queries, mask, {"target": [1]}, scripted(tok, many))
    assert out.metrics["truncated"] == 1 and out.context_mask.sum() <= 60
    # the feedback that did not fit was not appended: the conversation ends with a model turn
    assert out.model_mask[0, out.context_mask[0].sum() - 1]


def test_turn_and_conversation_length_caps(tok):
    queries, mask = prompts(tok, ["Guess"])
    long_turn = [["1234567890<|im_end|>"]]
    out = MultiTurn(tok, config(max_turn_length=4), environment_factory=Game, stop_token_id=tok.eos_token_id).run(
        queries, mask, {"target": [1]}, scripted(tok, long_turn))
    assert out.model_mask.sum() == 4 and out.metrics["truncated"] == 1  # cut inside the turn: truncated


class Greeter:
    def reset(self, **row):
        return " (be brief)"


def test_reset_text_is_appended_to_the_last_user_message(tok):
    queries, mask = prompts(tok, ["Hello"])
    engine = MultiTurn(tok, config(), environment_factory=Greeter, stop_token_id=tok.eos_token_id)
    out = engine.run(queries, mask, {"prompt": [[{"role": "user", "content": "Hello"}]]},
                     scripted(tok, [["hi<|im_end|>"]]))
    rendered, _ = prompts(tok, ["Hello (be brief)"])
    assert out.queries[out.query_mask].tolist() == rendered[0].tolist()
    with pytest.raises(ToolCallError, match="conversational `prompt` column"):
        engine.run(queries, mask, {}, scripted(tok, [["hi<|im_end|>"]]))


def test_environment_errors(tok):
    class NoReset:
        pass

    with pytest.raises(ValueError, match="NoReset has no callable `reset`"):
        MultiTurn(tok, config(), environment_factory=NoReset, stop_token_id=tok.eos_token_id)

    class BrokenStep(Game):
        def step(self, completion):
            raise KeyError("state")

    queries, mask = prompts(tok, ["Guess"])
    engine = MultiTurn(tok, config(), environment_factory=BrokenStep, stop_token_id=tok.eos_token_id)
    with pytest.raises(ToolCallError, match=r"BrokenStep.step raised KeyError\('state'\)"):
        engine.run(queries, mask, {"target": [1]}, scripted(tok, [["2<|im_end|>"]]))


def test_tools_need_a_template_whose_tool_calls_can_be_parsed():
    from trl_ext.testing import tiny_tokenizer

    plain = tiny_tokenizer()
    with pytest.raises(ValueError, match="need a chat template"):
        MultiTurn(plain, config(), tools=[add], stop_token_id=plain.eos_token_id)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="not one TRL's add_response_schema knows"):
        MultiTurn(plain, config(), tools=[add], stop_token_id=plain.eos_token_id)


def test_rollout_func_contract(tok):
    trainer = SimpleNamespace(processing_class=tok)
    queries, mask = prompts(tok, ["a", "b"])

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[1, 2], [3]], "completion_ids": [[5, 6, 7], [8]], "logprobs": [[-1.0] * 3, [-2.0]],
                "env_mask": [[1, 0, 1], [1]], "label": ["x", "y"]}

    columns = {}
    out = RolloutFunction(rollout_func, trainer, config(), tok.pad_token_id).run(queries, mask, columns, None)
    assert out.model_mask[0, :3].tolist() == [True, False, True] and out.turn_rewards == [[0.0, 0.0], [0.0]]
    assert out.queries[out.query_mask].tolist() == [1, 2, 3] and columns == {"label": ["x", "y"]}

    def too_long(prompts, trainer):
        return {"prompt_ids": [[1]] * 2, "completion_ids": [[5] * 300] * 2, "logprobs": [[0.0] * 300] * 2}

    with pytest.raises(ValueError, match="300 completion tokens for prompt 0, more than response_length=256"):
        RolloutFunction(too_long, trainer, config(), tok.pad_token_id).run(queries, mask, {}, None)

    def missing(prompts, trainer):
        return {"prompt_ids": [[1]] * 2}

    with pytest.raises(ValueError, match=r"keys \['completion_ids', 'logprobs'\]"):
        RolloutFunction(missing, trainer, config(), tok.pad_token_id).run(queries, mask, {}, None)
