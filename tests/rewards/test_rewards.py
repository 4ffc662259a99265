"""trl_ext.rewards: RewardScorer (shared-tokenizer models, models with their own tokenizer, functions with dataset
columns, weighted combinations, errors) and RewardNormalizer."""

import json
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.modeling_outputs import SequenceClassifierOutput

from trl_ext.rewards import RewardNormalizer, RewardScorer, score_responses
from trl_ext.testing import WORDS, tiny_scalar_model, tiny_tokenizer

# ------------------------------------------------------------------------------------------------------ fixtures

PROMPTS = [["w1", "w2"], ["hello", "world", "w3", "w4"], ["good"]]
COMPLETIONS = [["yes", "ok", "w5"], ["no"], ["the", "a", "is", "w7", "w8"]]
CHAT_TEMPLATE = "{{ bos_token }} {% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"


def policy_batch(tok):
    """Left-padded queries and right-aligned responses as the trainer builds them: each completion ends with EOS,
    and a junk word after the EOS sits outside the response mask (it must never be scored or decoded)."""
    q_ids = [tok.convert_tokens_to_ids(p) for p in PROMPTS]
    Q = max(map(len, q_ids))
    queries = torch.full((len(q_ids), Q), tok.pad_token_id)
    query_mask = torch.zeros(len(q_ids), Q, dtype=torch.bool)
    for i, ids in enumerate(q_ids):
        queries[i, Q - len(ids):] = torch.tensor(ids)
        query_mask[i, Q - len(ids):] = True
    r_ids = [tok.convert_tokens_to_ids(c) + [tok.eos_token_id] for c in COMPLETIONS]
    T = max(map(len, r_ids)) + 1
    responses = torch.full((len(r_ids), T), tok.pad_token_id)
    response_mask = torch.zeros(len(r_ids), T, dtype=torch.bool)
    for i, ids in enumerate(r_ids):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = True
        responses[i, len(ids)] = tok.convert_tokens_to_ids("bad")  # after the stop token: cut
    return queries, query_mask, responses, response_mask


def other_tokenizer(padding_side="right", chat_template=None, pad=True):
    """A word-level tokenizer unlike tiny_tokenizer: other specials, reversed word order, a larger vocabulary, and
    it adds a BOS token `<s>` (with add_special_tokens=True)."""
    specials = ["<unk>", "<s>", "</s>"] + (["<pad>"] if pad else [])
    words = list(reversed(WORDS)) + ["user", "assistant", ":", "x1", "x2", "x3"]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    kwargs = {"pad_token": "<pad>"} if pad else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  padding_side=padding_side, **kwargs)
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def direct_score(model, tok, text, add_special_tokens):
    """The RM's own forward on one unpadded row (HF pools at the last token when there is no padding)."""
    ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tok.unk_token_id not in ids, text
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.fixture(scope="module")
def policy_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(policy_tok):
    return policy_batch(policy_tok)


@pytest.fixture(scope="module")
def rm(policy_tok):
    return tiny_scalar_model(policy_tok, seed=1).eval()


# --------------------------------------------------------------------------------------- (a) shared tokenizer

@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_shared_tokenizer_model_equals_score_responses(pad_is_eos):
    tok = tiny_tokenizer(pad_is_eos=pad_is_eos)
    model = tiny_scalar_model(tok, seed=1).eval()
    b = policy_batch(tok)
    combined, per_source = RewardScorer(model, tok)(*b)
    expected = score_responses(model, tok, *b)
    assert combined.dtype == torch.float32 and combined.shape == (3,)
    torch.testing.assert_close(combined, expected, rtol=0, atol=0)
    assert list(per_source) == ["LlamaForSequenceClassification"]
    torch.testing.assert_close(per_source["LlamaForSequenceClassification"], expected, rtol=0, atol=0)


def test_policy_tokenizer_given_as_reward_tokenizer_scores_ids_directly(policy_tok, batch, rm):
    a, _ = RewardScorer((rm, policy_tok), policy_tok)(*batch)
    torch.testing.assert_close(a, score_responses(rm, policy_tok, *batch), rtol=0, atol=0)


class KeywordRewardModel(PreTrainedModel):
    """A rule-based reward model as users write them (a PreTrainedModel with no backbone and no `score` head): its
    forward decodes the ids and returns `logits` (B, 1): +1 per "yes", -1 per "no", -10 per "bad" (the junk after
    the stop token, which it must never see), and `words` adds the number of words it read."""

    config_class = PretrainedConfig

    def __init__(self, tokenizer, words=False):
        super().__init__(PretrainedConfig())
        self.tokenizer, self.words = tokenizer, words
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device to follow, as a real module would have

    def forward(self, input_ids, attention_mask=None):
        texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        values = [t.split().count("yes") - t.split().count("no") - 10 * t.split().count("bad")
                  + (len(t.split()) if self.words else 0) for t in texts]
        return SequenceClassifierOutput(logits=torch.tensor(values, dtype=torch.float32)[:, None] + self.anchor)


class IdsOnly(torch.nn.Module):
    """A bare module whose forward takes the ids alone and returns (B,) or (B, 1) as `shape` says."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, input_ids):
        score = (input_ids == 7).sum(1).float()  # how many times token 7 occurs
        return score if self.shape == "B" else score[:, None]


def test_a_rule_based_reward_module_is_scored_on_the_policys_ids(policy_tok, batch):
    """Issue 27: refused before ("no `score` head"); TRL 1.12 raises AttributeError on it."""
    combined, per_source = RewardScorer(KeywordRewardModel(policy_tok), policy_tok)(*batch)
    torch.testing.assert_close(combined, torch.tensor([1.0, -1.0, 0.0]), rtol=0, atol=0)  # by hand: COMPLETIONS
    assert list(per_source) == ["KeywordRewardModel"]
    # it reads the prompt and the completion, no padding (pad id at masked positions, skipped) and nothing after
    # the stop token: the words it counts are those of PROMPTS + COMPLETIONS
    words, _ = RewardScorer(KeywordRewardModel(policy_tok, words=True), policy_tok)(*batch)
    expected = [len(p) + len(c) + (c.count("yes") - c.count("no")) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(words, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=0)
    torch.testing.assert_close(score_responses(KeywordRewardModel(policy_tok), policy_tok, *batch), combined)


@pytest.mark.parametrize("shape", ["B", "B1"])
def test_a_module_returning_a_tensor_is_scored(policy_tok, batch, shape):
    queries, query_mask, responses, response_mask = batch
    combined, _ = RewardScorer(IdsOnly(shape), policy_tok)(*batch)
    ids = torch.cat([queries.masked_fill(~query_mask, -1), responses.masked_fill(~response_mask, -1)], 1)
    torch.testing.assert_close(combined, (ids == 7).sum(1).float(), rtol=0, atol=0)


class Returns(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, input_ids, attention_mask):
        return self.make(input_ids)


@pytest.mark.parametrize("make, what", [
    (lambda ids: torch.zeros(ids.shape[0], 2), r"its output has shape \(3, 2\) for a batch of 3"),
    (lambda ids: SequenceClassifierOutput(logits=torch.zeros(*ids.shape, 1)),
     r"`logits` has shape \(3, \d+, 1\) for a batch of 3"),
    (lambda ids: [0.0] * ids.shape[0], r"is a list, not a tensor"),
])
def test_a_module_output_that_is_no_score_per_row_names_its_shape_and_the_fix(policy_tok, batch, make, what):
    with pytest.raises(ValueError, match=what + r".*return `logits` of shape \(B, 1\).*or a tensor of shape \(B,\)"):
        RewardScorer(Returns(make), policy_tok)(*batch)


# ---------------------------------------------------------------------------------------- (b) own tokenizer

def tiny_gpt2_rm(tok):
    """GPT-2 has absolute position embeddings: left padding without position ids from the mask would change its
    output (Llama's RoPE is shift-invariant and would not show it)."""
    torch.manual_seed(7)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=1,
                        pad_token_id=tok.pad_token_id)
    return GPT2ForSequenceClassification(config).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_own_tokenizer_model_equals_scoring_the_retokenized_text(policy_tok, batch, padding_side, arch):
    rm_tok = other_tokenizer(padding_side=padding_side)
    assert rm_tok.convert_tokens_to_ids("w1") != policy_tok.convert_tokens_to_ids("w1")
    assert rm_tok("w1")["input_ids"] == [rm_tok.bos_token_id, rm_tok.convert_tokens_to_ids("w1")]
    rm2 = tiny_scalar_model(rm_tok, seed=5).eval() if arch == "llama" else tiny_gpt2_rm(rm_tok)
    combined, _ = RewardScorer(rm2, policy_tok, reward_tokenizers=[rm_tok])(*batch)
    # by hand: prompt + completion (the junk after the stop token cut), no special tokens, one unpadded row each
    expected = [direct_score(rm2, rm_tok, " ".join(p + c), True) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(combined, torch.tensor(expected), rtol=0, atol=1e-5)
    # it really differs from reading the policy's ids (the vocabularies differ)
    assert len(rm_tok) != len(policy_tok)


def test_own_tokenizer_forms_are_equivalent(policy_tok, batch, rm):
    rm_tok = other_tokenizer()
    rm2 = tiny_scalar_model(rm_tok, seed=5).eval()
    by_list, _ = RewardScorer([rm, rm2], policy_tok, reward_tokenizers=[None, rm_tok])(*batch)
    by_dict, _ = RewardScorer([rm, rm2], policy_tok,
                              reward_tokenizers={"LlamaForSequenceClassification_2": rm_tok})(*batch)
    by_tuple, per = RewardScorer([rm, (rm2, rm_tok)], policy_tok)(*batch)
    torch.testing.assert_close(by_list, by_dict, rtol=0, atol=0)
    torch.testing.assert_close(by_list, by_tuple, rtol=0, atol=0)
    single, _ = RewardScorer((rm2, rm_tok), policy_tok)(*batch)  # one (model, tokenizer) reward
    torch.testing.assert_close(single, per["LlamaForSequenceClassification_2"], rtol=0, atol=0)


def test_own_tokenizer_without_pad_token_is_padded_by_hand(policy_tok, batch):
    rm_tok = other_tokenizer(pad=False)
    assert rm_tok.pad_token_id is None
    rm2 = tiny_scalar_model(rm_tok, seed=5, pad_token_id=None).eval()
    combined, _ = RewardScorer((rm2, rm_tok), policy_tok)(*batch)
    expected = [direct_score(rm2, rm_tok, " ".join(p + c), True) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(combined, torch.tensor(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_own_tokenizer_with_chat_template_scores_the_rendered_conversation(policy_tok, batch, padding_side,
                                                                          monkeypatch):
    rm_tok = other_tokenizer(padding_side=padding_side, chat_template=CHAT_TEMPLATE)
    rm2 = tiny_scalar_model(rm_tok, seed=6).eval()
    rendered, seen_messages = [], []
    real = rm_tok.apply_chat_template

    def spy(messages, **kwargs):
        seen_messages.append(messages)
        out = real(messages, **kwargs)
        rendered.append(out)
        return out

    monkeypatch.setattr(rm_tok, "apply_chat_template", spy)
    combined, _ = RewardScorer((rm2, rm_tok), policy_tok)(*batch)

    manual = [f"<s> user : {' '.join(p)} </s> assistant : {' '.join(c)} </s> " for p, c in zip(PROMPTS, COMPLETIONS)]
    assert seen_messages == [[{"role": "user", "content": " ".join(p)},
                              {"role": "assistant", "content": " ".join(c)}] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rendered == manual
    expected = [direct_score(rm2, rm_tok, text, False) for text in manual]  # the template rendered the BOS
    torch.testing.assert_close(combined, torch.tensor(expected), rtol=0, atol=1e-5)


def test_own_tokenizer_encoder_model_pools_its_own_way(policy_tok, batch):
    rm_tok = other_tokenizer()
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=len(rm_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        num_labels=1, pad_token_id=rm_tok.pad_token_id, max_position_embeddings=64)).eval()
    combined, per = RewardScorer((bert, rm_tok), policy_tok)(*batch)
    expected = [direct_score(bert, rm_tok, " ".join(p + c), True) for p, c in zip(PROMPTS, COMPLETIONS)]
    torch.testing.assert_close(combined, torch.tensor(expected), rtol=0, atol=1e-5)
    assert list(per) == ["BertForSequenceClassification"]


# ------------------------------------------------------------------------------------- (c) functions + columns

def test_functions_get_the_columns_they_accept(policy_tok, batch):
    calls = {}

    def with_answer(prompts, completions, answer):
        calls["with_answer"] = (prompts, completions, answer)
        return [float(a) for a in answer]

    def plain(prompts, completions):
        calls["plain"] = (prompts, completions)
        return [float(len(c.split())) for c in completions]

    def everything(prompts, completions, **kwargs):
        calls["everything"] = kwargs
        return [0.0] * len(prompts)

    def optional(prompts, completions, level=7):
        calls["optional"] = level
        return [float(x) for x in level] if isinstance(level, list) else [float(level)] * len(prompts)

    columns = {"answer": [1, 2, 3], "level": [4, 5, 6], "source": ["a", "b", "c"]}
    combined, per = RewardScorer([with_answer, plain, everything, optional], policy_tok)(*batch,
                                                                                          extra_columns=columns)
    prompts = [" ".join(p) for p in PROMPTS]
    completions = [" ".join(c) for c in COMPLETIONS]  # stop token and the junk after it are cut
    assert calls["with_answer"] == (prompts, completions, [1, 2, 3])
    assert calls["plain"] == (prompts, completions)
    # **kwargs gets every column and TRL's extras: the completion ids (cut after the stop token) and trainer_state
    ids = [r[m].tolist() for r, m in zip(batch[2], batch[3])]
    assert calls["everything"] == {**columns, "completion_ids": ids, "trainer_state": None}
    assert calls["optional"] == [4, 5, 6]
    assert per["plain"].tolist() == [3.0, 1.0, 5.0]
    assert per["with_answer"].tolist() == [1.0, 2.0, 3.0]

    # without extra columns: optional keyword keeps its default, **kwargs gets TRL's extras only
    RewardScorer([plain, everything, optional], policy_tok)(*batch)
    assert calls["everything"] == {"completion_ids": ids, "trainer_state": None} and calls["optional"] == 7


def test_function_missing_a_required_column_names_it(policy_tok, batch):
    def needs_answer(prompts, completions, answer):
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match=r"needs_answer.*\['answer'\]"):
        RewardScorer(needs_answer, policy_tok)(*batch, extra_columns={"other": [1, 2, 3]})


def test_extra_column_of_wrong_length_is_an_error(policy_tok, batch):
    with pytest.raises(ValueError, match="'answer' has 2 values for a batch of 3"):
        RewardScorer(lambda p, c, answer: [0.0] * 3, policy_tok)(*batch, extra_columns={"answer": [1, 2]})


def test_column_named_like_the_prompts_parameter_of_a_kwargs_function_is_an_error(policy_tok, batch):
    def everything(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match="rename"):
        RewardScorer(everything, policy_tok)(*batch, extra_columns={"completions": ["a", "b", "c"]})


def test_function_that_cannot_take_prompts_and_completions_is_a_type_error(policy_tok):
    with pytest.raises(TypeError, match="prompts, completions"):
        RewardScorer(lambda text: [0.0], policy_tok)  # one positional parameter, not TRL's `completions`
    with pytest.raises(TypeError, match="TRL calls reward functions by keyword"):
        RewardScorer(lambda completions, /, **kwargs: [0.0], policy_tok)


# ------------------------------------------------------------------------------------- (d) weighted combination

def test_weighted_function_and_model(policy_tok, batch, rm):
    def length(prompts, completions):
        return [float(len(c.split())) for c in completions]

    scorer = RewardScorer([length, rm], policy_tok, reward_weights=[0.5, -2.0])
    combined, per = scorer(*batch)
    assert scorer.names == ["length", "LlamaForSequenceClassification"] == list(per)
    s1, s2 = torch.tensor([3.0, 1.0, 5.0]), score_responses(rm, policy_tok, *batch)
    torch.testing.assert_close(per["length"], s1)
    torch.testing.assert_close(per["LlamaForSequenceClassification"], s2, rtol=0, atol=0)
    torch.testing.assert_close(combined, 0.5 * s1 - 2.0 * s2)
    assert scorer.weights == [0.5, -2.0]


def test_default_weights_are_one(policy_tok, batch, rm):
    combined, per = RewardScorer([lambda p, c: [1.0, 2.0, 3.0], rm], policy_tok)(*batch)
    torch.testing.assert_close(combined, per["<lambda>"] + per["LlamaForSequenceClassification"])


def test_names_are_unique(policy_tok, rm):
    named = tiny_scalar_model(policy_tok, seed=2)
    named.config._name_or_path = "org/my-rm"

    def f(prompts, completions):
        return [0.0] * len(prompts)

    scorer = RewardScorer([f, f, rm, rm, named, lambda p, c: [0.0], f], policy_tok)
    assert scorer.names == ["f", "f_2", "LlamaForSequenceClassification", "LlamaForSequenceClassification_2",
                            "org/my-rm", "<lambda>", "f_3"]
    assert list(scorer.models) == ["LlamaForSequenceClassification", "LlamaForSequenceClassification_2",
                                   "org/my-rm"]


# ------------------------------------------------------------------------------------------------------ errors

def test_raising_function_is_a_runtime_error_naming_it(policy_tok, batch):
    def flaky(prompts, completions):
        raise KeyError("kaput")

    with pytest.raises(RuntimeError, match=r"reward function 'flaky' failed: 'kaput'") as info:
        RewardScorer(flaky, policy_tok)(*batch)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("output, problem", [
    ([1.0, 2.0], "returned 2 scores for 3 completions"),
    ([1.0, float("nan"), 2.0], "non-finite"),
    ([1.0, float("inf"), 2.0], "non-finite"),
    ([1.0, "2.0", 3.0], "non-numbers"),
    ([1.0, None, 3.0], "every reward returned None for rows [1]"),  # None: not applicable (TRL's convention)
    ("1.0", "must return a list of floats"),
    (3.0, "must return a list of floats"),
])
def test_bad_function_output_is_a_value_error_naming_it(policy_tok, batch, output, problem):
    def bad_reward(prompts, completions):
        return output

    with pytest.raises(ValueError, match="bad_reward") as info:
        RewardScorer(bad_reward, policy_tok)(*batch)
    assert problem in str(info.value)


def test_tensor_output_is_accepted(policy_tok, batch):
    combined, _ = RewardScorer(lambda p, c: torch.tensor([1.0, 2.0, 3.0]), policy_tok)(*batch)
    assert combined.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("weights", [[1.0], [1.0, 2.0, 3.0], [1.0, float("nan")], [1.0, float("inf")],
                                     [1.0, "2"], "12"])
def test_bad_weights_are_value_errors(policy_tok, rm, weights):
    with pytest.raises(ValueError, match="reward_weights"):
        RewardScorer([lambda p, c: [0.0], rm], policy_tok, reward_weights=weights)


@pytest.mark.parametrize("reward", [42, None, [lambda p, c: [0.0], 3.5]])
def test_reward_that_is_neither_module_nor_callable_is_a_type_error(policy_tok, reward):
    with pytest.raises(TypeError, match="neither"):
        RewardScorer(reward, policy_tok)


def test_a_string_that_is_no_reward_model_folder_is_an_error_naming_it(policy_tok, tmp_path):
    with pytest.raises(ValueError, match=r"reward_model='.*nothing-here' is a string, so it is loaded as a reward "
                                         r"model .* and that failed"):
        RewardScorer(str(tmp_path / "nothing-here"), policy_tok)


def test_bad_reward_tokenizers(policy_tok, rm):
    f = lambda p, c: [0.0]  # noqa: E731
    with pytest.raises(ValueError, match="match no reward"):
        RewardScorer(rm, policy_tok, reward_tokenizers={"nope": other_tokenizer()})
    with pytest.raises(ValueError, match="2 entries for 1 rewards"):
        RewardScorer(rm, policy_tok, reward_tokenizers=[None, None])
    with pytest.raises(ValueError, match="is a function"):
        RewardScorer(f, policy_tok, reward_tokenizers=[other_tokenizer()])
    with pytest.raises(TypeError, match="is a tokenizer"):
        RewardScorer([rm, other_tokenizer()], policy_tok)


def test_non_finite_model_score_is_a_value_error(policy_tok, batch):
    model = tiny_scalar_model(policy_tok, seed=1).eval()
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*non-finite"):
        RewardScorer(model, policy_tok)(*batch)


# ------------------------------------------------------------------------------------------- RewardNormalizer

def test_none_is_identity():
    s = torch.tensor([3.0, -1.0, 7.5])
    assert torch.equal(RewardNormalizer()(s), s)


def test_fixed_by_hand():
    s = torch.tensor([3.0, -1.0, 7.5])
    out = RewardNormalizer("fixed", mean=2.0, std=4.0)(s)
    torch.testing.assert_close(out, torch.tensor([0.25, -0.75, 1.375]))


def test_running_matches_torch_over_the_history():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 5 for n in (1, 3, 1, 6, 2)]
    norm, history = RewardNormalizer("running"), []
    for i, b in enumerate(batches):
        out = norm(b)
        history.append(b)
        h = torch.cat(history).double()
        if h.numel() < 2:  # fewer than 2 scores seen: std = 1
            expected = b.double() - h.mean()
        else:  # sample std (n - 1), torch.std's default
            expected = (b.double() - h.mean()) / h.std(unbiased=True)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6, msg=f"batch {i}")
        assert norm.count == h.numel()
        assert math.isclose(norm.running_mean, h.mean().item(), rel_tol=1e-9, abs_tol=1e-9)


def test_update_and_normalize_separately():
    norm = RewardNormalizer("running")
    norm.update(torch.tensor([0.0, 2.0, 4.0]))  # e.g. the scores gathered from all processes
    before = norm.state_dict()
    torch.testing.assert_close(norm.normalize(torch.tensor([2.0, 4.0])), torch.tensor([0.0, 1.0]))
    assert norm.state_dict() == before  # normalize does not update


@pytest.mark.parametrize("mode, kwargs", [("none", {}), ("fixed", {"mean": 1.0, "std": 0.5}), ("running", {})])
def test_clip_applies_in_every_mode(mode, kwargs):
    s = torch.tensor([-100.0, 0.0, 1.0, 100.0])
    out = RewardNormalizer(mode, clip=1.0, **kwargs)(s)
    unclipped = RewardNormalizer(mode, **kwargs)(s)
    torch.testing.assert_close(out, unclipped.clamp(-1.0, 1.0))
    assert out.abs().max() == 1.0 and unclipped.abs().max() > 1.0


def test_state_round_trip_continues_running_stats():
    a, b, c = torch.tensor([1.0, 2.0, 6.0]), torch.tensor([-3.0, 0.5]), torch.tensor([4.0, 4.0, -1.0])
    first = RewardNormalizer("running", clip=3.0)
    first(a), first(b)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able
    resumed = RewardNormalizer("running", clip=3.0)
    resumed.load_state_dict(state)
    uninterrupted = RewardNormalizer("running", clip=3.0)
    uninterrupted(a), uninterrupted(b)
    torch.testing.assert_close(resumed(c), uninterrupted(c), rtol=0, atol=0)
    assert resumed.state_dict() == uninterrupted.state_dict()


@pytest.mark.parametrize("kwargs", [{"mode": "zscore"}, {"std": 0.0}, {"std": -1.0}, {"clip": 0.0},
                                    {"clip": -2.0}, {"std": float("nan")}, {"mean": float("inf")}])
def test_bad_settings_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        RewardNormalizer(**kwargs)


def test_non_finite_scores_and_bad_state_are_value_errors():
    norm = RewardNormalizer("running")
    with pytest.raises(ValueError, match="non-finite"):
        norm(torch.tensor([1.0, float("nan")]))
    assert norm.count == 0  # nothing merged
    with pytest.raises(ValueError):
        norm.load_state_dict({"count": 3})
    with pytest.raises(ValueError):
        norm.load_state_dict({"count": 3, "running_mean": 0.0, "m2": -1.0})
