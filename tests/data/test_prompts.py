"""trl_ext.data.prompts: TRL's prompt forms (text, conversational, tokenized) tokenized for PPO, and the left-padding
collator (attention mask from the prompt lengths, never from `== pad_token_id`)."""

import pytest
import torch
from datasets import Dataset, DatasetDict, Features, Json
from torch.utils.data import DataLoader

from trl_ext.data.prompts import LeftPaddingCollator, PreparedPrompts, prepare_prompts
from trl_ext.testing import tiny_tokenizer

# Every piece of the rendered template is a word of the tiny vocabulary: the role as "yes" (user) / "no" (other),
# the content, "<eos>" after each message (as real chat templates do), and "ok" as the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}yes{% else %}no{% endif %} {{ m['content'] }} <eos> "
    "{% endfor %}{% if add_generation_prompt %}ok{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hello w1 w2"}],
    [{"role": "system", "content": "w3"}, {"role": "user", "content": "the world is good"}],
    [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": "a"}],
]
TEXTS = [  # CONVERSATIONS rendered by hand
    "yes hello w1 w2 <eos> ok",
    "no w3 <eos> yes the world is good <eos> ok",
    "yes w4 <eos> no w5 w6 <eos> yes a <eos> ok",
]
ANSWERS = ["a1", "a2", "a3"]


def chat_tokenizer(**kw):
    tok = tiny_tokenizer(**kw)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def ids_of(tok, text):
    return [tok.convert_tokens_to_ids(w) for w in text.split()]


def three_forms(tok):
    ids = [ids_of(tok, t) for t in TEXTS]
    return {
        "text": Dataset.from_dict({"prompt": TEXTS, "answer": ANSWERS}),
        "conversational": Dataset.from_dict({"prompt": CONVERSATIONS, "answer": ANSWERS}),
        "tokenized": Dataset.from_dict({"input_ids": ids, "answer": ANSWERS}),
    }, ids


def rows(dataset):
    return [dataset[i] for i in range(len(dataset))]


# ------------------------------------------------------------------------------------------------ the three forms
def test_the_three_forms_give_identical_prompts_and_batches():
    tok = chat_tokenizer()
    forms, expected_ids = three_forms(tok)
    assert all(t != tok.unk_token_id for ids in expected_ids for t in ids)  # every word is in the vocabulary
    collator = LeftPaddingCollator(tok, extra_columns=["answer"])
    batches = {}
    for form, dataset in forms.items():
        prepared = prepare_prompts(dataset, tok)
        assert isinstance(prepared, PreparedPrompts)
        assert prepared.form == form
        assert (prepared.num_truncated, prepared.num_dropped) == (0, 0)
        assert list(prepared.dataset["input_ids"]) == expected_ids
        assert all(type(t) is int for ids in prepared.dataset["input_ids"] for t in ids)
        assert list(prepared.dataset["answer"]) == ANSWERS
        if form == "tokenized":
            assert sorted(prepared.dataset.column_names) == ["answer", "input_ids"]
        else:
            assert sorted(prepared.dataset.column_names) == ["answer", "input_ids", "prompt", "prompt_text"]
            assert list(prepared.dataset["prompt_text"]) == TEXTS
        assert prepared.extra_columns == [c for c in prepared.dataset.column_names if c != "input_ids"]
        batches[form] = collator(rows(prepared.dataset))

    reference = batches["tokenized"]
    width = max(map(len, expected_ids))
    assert reference["input_ids"].shape == (3, width) and reference["input_ids"].dtype == torch.long
    assert reference["attention_mask"].dtype == torch.long
    for form in ("text", "conversational"):
        assert torch.equal(batches[form]["input_ids"], reference["input_ids"])
        assert torch.equal(batches[form]["attention_mask"], reference["attention_mask"])
        assert batches[form]["answer"] == ANSWERS
    for i, ids in enumerate(expected_ids):
        pad = width - len(ids)
        assert reference["input_ids"][i].tolist() == [tok.pad_token_id] * pad + ids
        assert reference["attention_mask"][i].tolist() == [0] * pad + [1] * len(ids)


def test_text_prompts_get_the_tokenizers_default_special_tokens_and_chat_prompts_do_not():
    from tokenizers import processors

    tok = chat_tokenizer()
    # a tokenizer that adds a BOS (here: "a") by default, like Llama's; a template that writes it itself
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="a $A", special_tokens=[("a", 68)])
    tok.chat_template = "a " + CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("a") == 68
    text = prepare_prompts(Dataset.from_dict({"prompt": ["hello w1"]}), tok).dataset[0]["input_ids"]
    assert text == ids_of(tok, "a hello w1")
    chat = prepare_prompts(Dataset.from_dict({"prompt": [CONVERSATIONS[0]]}), tok).dataset[0]["input_ids"]
    assert chat == ids_of(tok, "a " + TEXTS[0])  # one BOS, from the template


def test_input_ids_win_over_prompt_and_are_used_as_is():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"prompt": ["hello"], "input_ids": [[5, 1, 0, 7]]})
    prepared = prepare_prompts(ds, tok)
    assert prepared.form == "tokenized"
    assert prepared.dataset[0] == {"prompt": "hello", "input_ids": [5, 1, 0, 7]}


def test_pre_padded_input_ids_keep_only_the_positions_their_own_mask_marks():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"input_ids": [[0, 0, 5, 6], [7, 8, 9, 0]], "attention_mask": [[0, 0, 1, 1], [1, 1, 1, 0]]})
    prepared = prepare_prompts(ds, tok)
    assert prepared.dataset.column_names == ["input_ids"]
    assert list(prepared.dataset["input_ids"]) == [[5, 6], [7, 8, 9]]


def test_a_torch_formatted_dataset_is_read_as_python_values():
    tok = chat_tokenizer()
    forms, expected_ids = three_forms(tok)
    prepared = prepare_prompts(forms["tokenized"].with_format("torch"), tok)
    assert list(prepared.dataset["input_ids"]) == expected_ids


def test_num_proc_gives_the_same_result():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"prompt": TEXTS * 4, "answer": ANSWERS * 4})
    one = prepare_prompts(ds, tok, max_prompt_length=7, truncation="drop")
    two = prepare_prompts(ds, tok, max_prompt_length=7, truncation="drop", num_proc=2)
    assert (one.num_dropped, two.num_dropped) == (8, 8)
    assert list(one.dataset["input_ids"]) == list(two.dataset["input_ids"]) == [ids_of(tok, TEXTS[0])] * 4
    left = prepare_prompts(ds, tok, max_prompt_length=7, num_proc=2)
    assert left.num_truncated == 8 and len(left.dataset) == 12


# ------------------------------------------------------------------------------------------------ truncation
@pytest.mark.parametrize("form", ["text", "conversational", "tokenized"])
def test_left_truncation_keeps_the_last_tokens(form):
    tok = chat_tokenizer()
    forms, expected_ids = three_forms(tok)
    lengths = [len(ids) for ids in expected_ids]
    assert lengths == [6, 10, 11]
    prepared = prepare_prompts(forms[form], tok, max_prompt_length=8)
    assert (prepared.num_truncated, prepared.num_dropped) == (2, 0)
    if form == "conversational":  # the chat header before the first message's content ("no", "yes") is kept
        expected = [expected_ids[0], expected_ids[1][:1] + expected_ids[1][-7:],
                    expected_ids[2][:1] + expected_ids[2][-7:]]
    else:  # no leading special token: the last 8 tokens
        expected = [expected_ids[0], expected_ids[1][-8:], expected_ids[2][-8:]]
    assert list(prepared.dataset["input_ids"]) == expected
    assert list(prepared.dataset["answer"]) == ANSWERS
    if form != "tokenized":
        assert list(prepared.dataset["prompt_text"]) == TEXTS  # the text before truncation
    # a prompt exactly max_prompt_length long is kept whole
    assert prepare_prompts(forms[form], tok, max_prompt_length=11).num_truncated == 0


def test_left_truncation_keeps_the_bos_token_and_cuts_after_it():
    """A tokenizer that adds BOS: left truncation keeps BOS (and any leading special token) and cuts the oldest
    tokens after it (TRL 1.12-style ids[-limit:] would cut BOS off)."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    ids = tok("w1 w2 w3 w4 w5 w6")["input_ids"]
    assert ids[0] == bos and len(ids) == 7
    for form, ds in (("text", Dataset.from_dict({"prompt": ["w1 w2 w3 w4 w5 w6"]})),
                     ("tokenized", Dataset.from_dict({"input_ids": [ids]}))):
        prepared = prepare_prompts(ds, tok, max_prompt_length=4)
        assert prepared.dataset["input_ids"][0] == [bos] + ids[-3:], form
        assert prepared.num_truncated == 1
    with pytest.raises(ValueError, match=r"max_prompt_length=1 leaves no room .* first 1 tokens"):
        prepare_prompts(Dataset.from_dict({"input_ids": [ids]}), tok, max_prompt_length=1)


def test_left_truncation_keeps_a_chat_templates_header_and_system_prompt():
    """A template that adds a default system prompt (as SmolLM2's and Llama-3's do): truncation keeps it and the
    user header, and cuts the oldest words of the user's message."""
    tok = tiny_tokenizer()
    tok.chat_template = ("no w9 w9 w9 <eos> {% for m in messages %}yes {{ m['content'] }} <eos> {% endfor %}"
                         "{% if add_generation_prompt %}ok{% endif %}")
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "w1 w2 w3 w4 w5 w6"}]]})
    full = prepare_prompts(ds, tok).dataset["input_ids"][0]
    assert [tok.convert_ids_to_tokens(t) for t in full[:6]] == ["no", "w9", "w9", "w9", "<eos>", "yes"]
    cut = prepare_prompts(ds, tok, max_prompt_length=10).dataset["input_ids"][0]
    assert cut == full[:6] + full[-4:]  # header (6) + "w5 w6 <eos> ok"
    assert tok.decode(cut) == "no w9 w9 w9 <eos> yes w5 w6 <eos> ok"


@pytest.mark.parametrize("form", ["text", "conversational", "tokenized"])
def test_drop_truncation_removes_long_prompts(form):
    tok = chat_tokenizer()
    forms, expected_ids = three_forms(tok)
    prepared = prepare_prompts(forms[form], tok, max_prompt_length=10, truncation="drop")
    assert (prepared.num_truncated, prepared.num_dropped) == (0, 1)
    assert list(prepared.dataset["input_ids"]) == expected_ids[:2]
    assert list(prepared.dataset["answer"]) == ANSWERS[:2]  # extra columns stay aligned with their prompts


def test_dropping_every_prompt_is_an_error():
    tok = chat_tokenizer()
    forms, _ = three_forms(tok)
    with pytest.raises(ValueError, match=r"All 3 prompts are longer than max_prompt_length=5 .*shortest has 6"):
        prepare_prompts(forms["text"], tok, max_prompt_length=5, truncation="drop")


@pytest.mark.parametrize("bad", [0, -1])
def test_max_prompt_length_must_be_positive(bad):
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=rf"max_prompt_length={bad}: it must be a positive"):
        prepare_prompts(three_forms(tok)[0]["text"], tok, max_prompt_length=bad)


def test_unknown_truncation_is_an_error():
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=r"truncation='right'.*'left'.*'drop'"):
        prepare_prompts(three_forms(tok)[0]["text"], tok, max_prompt_length=4, truncation="right")


# ------------------------------------------------------------------------------------------------ collator
def test_extra_columns_pass_through_the_collator():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"prompt": TEXTS, "answer": ANSWERS, "id": [10, 11, 12], "meta": [{"k": 1}] * 3})
    prepared = prepare_prompts(ds, tok)
    collator = LeftPaddingCollator(tok, extra_columns=["answer", "id", "prompt_text"])
    batch = collator(rows(prepared.dataset))
    assert set(batch) == {"input_ids", "attention_mask", "answer", "id", "prompt_text"}  # "meta" not asked for
    assert batch["answer"] == ANSWERS and batch["id"] == [10, 11, 12] and batch["prompt_text"] == TEXTS
    assert LeftPaddingCollator(tok, extra_columns="answer")(rows(prepared.dataset))["answer"] == ANSWERS


def test_collator_through_a_dataloader():
    tok = chat_tokenizer()
    prepared = prepare_prompts(three_forms(tok)[0]["conversational"], tok)
    loader = DataLoader(prepared.dataset, batch_size=2, collate_fn=LeftPaddingCollator(tok, ["answer"]))
    batches = list(loader)
    assert [b["answer"] for b in batches] == [ANSWERS[:2], ANSWERS[2:]]
    assert batches[0]["input_ids"].shape == (2, 10) and batches[1]["input_ids"].shape == (1, 11)


def test_prompt_tokens_equal_to_pad_eos_keep_attention():
    tok = chat_tokenizer(pad_is_eos=True)
    assert tok.pad_token_id == tok.eos_token_id
    eos = tok.eos_token_id
    # the chat template puts <eos> inside prompts; a text prompt may also start or end with it
    ds = Dataset.from_dict({"prompt": ["<eos> w1", "w2 <eos>", "<eos>", TEXTS[1]]})
    prepared = prepare_prompts(ds, tok)
    batch = LeftPaddingCollator(tok)(rows(prepared.dataset))
    expected = [ids_of(tok, t) for t in ["<eos> w1", "w2 <eos>", "<eos>", TEXTS[1]]]
    width = 10
    for i, ids in enumerate(expected):
        pad = width - len(ids)
        assert batch["input_ids"][i].tolist() == [eos] * pad + ids
        assert batch["attention_mask"][i].tolist() == [0] * pad + [1] * len(ids)
    assert ((batch["input_ids"] == eos) & (batch["attention_mask"] == 1)).sum() == 1 + 1 + 1 + 2


def test_collator_left_pads_whatever_the_padding_side():
    tok = chat_tokenizer(padding_side="right")
    assert tok.padding_side == "right"
    batch = LeftPaddingCollator(tok)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert tok.padding_side == "right"  # left untouched


def test_collator_honours_a_rows_own_attention_mask():
    tok = chat_tokenizer()
    batch = LeftPaddingCollator(tok)([{"input_ids": [5, 6, 0], "attention_mask": [1, 1, 0]},
                                      {"input_ids": torch.tensor([7, 8, 9])}])
    assert batch["input_ids"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]


# ------------------------------------------------------------------------------------------------ errors
def test_no_prompt_or_input_ids_column_is_an_error():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"question": ["hello"], "answer": ["a"]})
    with pytest.raises(ValueError, match=r"neither a 'prompt' nor an 'input_ids' column \(columns found: "
                                         r"\['question', 'answer'\]\)\. Accepted forms: .*text.*conversational"
                                         r".*tokenized"):
        prepare_prompts(ds, tok)


def test_conversational_prompts_need_a_chat_template():
    tok = tiny_tokenizer()
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"conversational .* no chat template\. Set one: `tokenizer\.chat_template"):
        prepare_prompts(Dataset.from_dict({"prompt": CONVERSATIONS}), tok)


def test_mixed_prompts_are_an_error():
    tok = chat_tokenizer()
    mixed = Dataset.from_dict({"prompt": [TEXTS[0], CONVERSATIONS[0]]}, features=Features({"prompt": Json()}))
    with pytest.raises(ValueError, match=r"Mixed prompts: row 1 is a conversational prompt but the dataset's first "
                                         r"row is a text prompt"):
        prepare_prompts(mixed, tok)
    mixed = Dataset.from_dict({"prompt": [CONVERSATIONS[0], TEXTS[0]]}, features=Features({"prompt": Json()}))
    with pytest.raises(ValueError, match=r"Mixed prompts: row 1 is a text prompt but .* first row is a conversational"):
        prepare_prompts(mixed, tok)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"prompt": ["hello", ""]}, r"Row 1 of the dataset has an empty 'prompt'"),
        ({"prompt": ["", "hello"]}, r"Row 0 of the dataset has an empty 'prompt'"),
        ({"prompt": ["hello", None]}, r"Row 1 of the dataset has no 'prompt' \(it is None\)"),
        ({"prompt": ["hello", "   "]}, r"Row 1 of the dataset: the prompt '   ' tokenizes to no tokens"),
        ({"prompt": [CONVERSATIONS[0], []]}, r"Row 1 of the dataset has an empty 'prompt'"),
        ({"prompt": [[{"role": "user", "content": "w1"}], [{"content": "w2"}]]},
         r"Row 1 of the dataset: 'prompt' holds a message without a string 'role'"),
        ({"prompt": [["w1", "w2"]]}, r"Row 0 of the dataset: 'prompt' is a list of str, which is not a prompt"),
        ({"input_ids": [[5, 6], []]}, r"Row 1 of the dataset has an empty 'input_ids'"),
        ({"input_ids": [[5, 6], None]}, r"Row 1 of the dataset has no 'input_ids'"),
        ({"input_ids": [[[5, 6]]]}, r"Row 0 of the dataset: 'input_ids' holds \[5, 6\]; it must be a flat list"),
        ({"input_ids": [[5, -1]]}, r"Row 0 of the dataset: 'input_ids' holds -1"),
        ({"input_ids": [[5, 6]], "attention_mask": [[0, 0]]}, r"Row 0 of the dataset has an empty 'input_ids'"),
        ({"input_ids": [[5, 6]], "attention_mask": [[1]]}, r"'attention_mask' does not match 'input_ids'"),
    ],
    ids=["empty-text", "empty-first", "none-text", "blank-text", "empty-messages", "message-without-role",
         "list-of-str", "empty-ids", "none-ids", "nested-ids", "negative-id", "all-masked", "mask-length"],
)
def test_missing_empty_or_malformed_prompts_are_errors(data, match):
    with pytest.raises(ValueError, match=match):
        prepare_prompts(Dataset.from_dict(data), chat_tokenizer())


def test_empty_dataset_is_an_error():
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=r"The prompt dataset is empty"):
        prepare_prompts(Dataset.from_dict({"prompt": []}), tok)


def test_prompt_text_column_clash_is_an_error():
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=r"already has a 'prompt_text' column"):
        prepare_prompts(Dataset.from_dict({"prompt": ["w1"], "prompt_text": ["x"]}), tok)


def test_wrong_dataset_types_are_errors():
    tok = chat_tokenizer()
    ds = Dataset.from_dict({"prompt": ["w1"]})
    with pytest.raises(TypeError, match=r"one split.*dataset\['train'\]"):
        prepare_prompts(DatasetDict({"train": ds}), tok)
    with pytest.raises(TypeError, match=r"IterableDataset"):
        prepare_prompts(ds.to_iterable_dataset(), tok)
    with pytest.raises(TypeError, match=r"takes a datasets\.Dataset, got list"):
        prepare_prompts([{"prompt": "w1"}], tok)
    with pytest.raises(TypeError, match=r"max_prompt_length must be an int or None"):
        prepare_prompts(ds, tok, max_prompt_length=2.5)


def test_collator_errors():
    tok = chat_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    with pytest.raises(ValueError, match=r"no pad token.*tokenizer\.pad_token = tokenizer\.eos_token"):
        LeftPaddingCollator(tok)
    collator = LeftPaddingCollator(chat_tokenizer(), extra_columns=["answer"])
    with pytest.raises(ValueError, match=r"empty batch"):
        collator([])
    with pytest.raises(ValueError, match=r"Batch row 0 has no 'input_ids' .*prepare_prompts"):
        collator([{"prompt": "w1", "answer": "a"}])
    with pytest.raises(ValueError, match=r"Batch row 1 has an empty prompt"):
        collator([{"input_ids": [5], "answer": "a"}, {"input_ids": [], "answer": "b"}])
    with pytest.raises(ValueError, match=r"extra column 'answer' is missing from batch row 1"):
        collator([{"input_ids": [5], "answer": "a"}, {"input_ids": [6]}])
    with pytest.raises(ValueError, match=r"extra_columns cannot include \['attention_mask'\]"):
        LeftPaddingCollator(chat_tokenizer(), extra_columns=["attention_mask"])
