"""padding_free=True and max_tokens_per_micro_batch (issue 31): every pass over packed rows gives the padded path's
numbers, and a token budget the update of the row split it replaces.

Each run is one PPO iteration (2 epochs x 2 minibatches x 2 micro-batches) of a tiny Llama on 8 ragged prompts whose
answers stop at EOS at different lengths (an EOS logit bias), so padding is on both sides of every row; fp32 on CPU,
tolerance 1e-5. The optimizer is SGD (lr 0.1): the weights then differ by lr x the gradients' difference. Adam's
first step, lr·g/(|g| + ε), turns float noise in a gradient near ε into a visible step and would compare only that."""

import copy

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.data.batches import balanced_partition, token_budget_groups
from trl_ext.models import (
    Packing,
    build_shared_base,
    check_padding_free,
    freeze_backbone,
    lm_logits,
    sequence_inputs,
)
from trl_ext.testing import tiny_4bit_causal_lm, tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

EOS = 1
TOL = 1e-5


def models(tok, layout):
    policy = tiny_causal_lm(tok, seed=0, token_bias={EOS: 1.5})
    reward = tiny_scalar_model(tok, seed=2)
    if layout == "trunk":  # the critic is the policy's backbone, its lower layer frozen: FrozenTrunk from the reference
        config = copy.deepcopy(policy.config)
        config.num_labels = 1
        value = AutoModelForSequenceClassification.from_config(config)
        value.model.load_state_dict(policy.model.state_dict())
        freeze_backbone(value, 1)
    else:
        value = tiny_scalar_model(tok, seed=1)
    return policy, reward, value


def train(tmp_path, layout="full", **kw):
    """One iteration; -> (first rollout, the trained weights flattened, the micro-batches' packed lengths)."""
    tok = tiny_tokenizer()
    settings = dict(output_dir=str(tmp_path / layout), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                    num_mini_batches=2, num_ppo_epochs=2, total_episodes=8, response_length=8, optim="sgd",
                    learning_rate=0.1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                    disable_tqdm=True, logging_steps=1, seed=0)
    settings.update(kw)
    args = PPOConfig(**settings)
    dataset = tiny_prompt_dataset(tok, n=8, min_words=1, max_words=6)
    extra = {}
    if layout == "shared":
        base = tiny_4bit_causal_lm(tok, tmp_path / "base")
        torch.manual_seed(0)
        lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        model = build_shared_base(base, policy_lora=LoraConfig(**lora), critic_lora=LoraConfig(**{**lora, "r": 2}))
        reward, value = tiny_scalar_model(tok, seed=2), None
    else:
        model, reward, value = models(tok, layout)
        if layout == "lora":
            extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                              init_lora_weights=False)
    trainer = PPOTrainer(args=args, processing_class=tok, model=model, ref_model=None, reward_model=reward,
                         train_dataset=dataset, value_model=value, **extra)
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)  # see the module docstring
    rollouts, tokens = [], []
    original_rollout, original_losses = trainer.rollout_phase.run, trainer.update_phase.micro_batch_losses
    trainer.rollout_phase.run = lambda *a, **k: rollouts.append(original_rollout(*a, **k)) or rollouts[-1]

    def losses(rows, micro, *a):
        tokens.append(rows.num_tokens if isinstance(rows, Packing) else int(rows.inputs["attention_mask"].sum()))
        return original_losses(rows, micro, *a)

    trainer.update_phase.micro_batch_losses = losses
    trainer.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return rollouts[0], torch.cat([p.detach().float().flatten() for p in params]), tokens


def assert_same_rollout(a, b):
    mask = a.response_mask
    assert torch.equal(a.responses, b.responses) and torch.equal(mask, b.response_mask)
    for name in ("logprobs", "ref_logprobs", "values", "advantages", "returns"):
        torch.testing.assert_close(getattr(a, name) * mask, getattr(b, name) * mask, atol=TOL, rtol=0, msg=name)
    torch.testing.assert_close(a.scores, b.scores, atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", ["full", "lora", "trunk", "shared"])
def test_padding_free_gives_the_padded_rollout_and_update(tmp_path, layout):
    """Log-probs, reference log-probs, values, scores and the weights after the update: padded == packed. The rows
    really are ragged (padding on both sides) and the packed micro-batches really hold their real tokens only."""
    padded, w_padded, t_padded = train(tmp_path / "padded", layout)
    packed, w_packed, t_packed = train(tmp_path / "packed", layout, padding_free=True)
    lengths = padded.response_mask.sum(1)
    assert lengths.min() < lengths.max() and (lengths < 8).any(), lengths  # answers stop at different lengths
    assert (~padded.query_mask).any(), "some prompt is left-padded"
    assert_same_rollout(padded, packed)
    assert (w_padded - w_packed).abs().max() < TOL
    assert t_padded == t_packed  # the same rows, so the same real tokens per micro-batch ...
    assert all(t < 2 * (padded.queries.shape[1] + 8) for t in t_packed)  # ... fewer than a padded micro-batch's


def test_a_token_budget_gives_the_update_of_the_row_split(tmp_path):
    """Micro-batches of at most 16 real tokens (the longest row fits; more micro-batches, of any row count) give the
    weights of 2-row micro-batches: the loss keeps its token mean over the whole minibatch."""
    _, rows, _ = train(tmp_path / "rows", padding_free=True)
    _, budget, tokens = train(tmp_path / "budget", padding_free=True, max_tokens_per_micro_batch=16)
    assert max(tokens) <= 16 and len(tokens) > 8, tokens  # 2 epochs x 2 minibatches x 2 micro-batches by rows
    assert (rows - budget).abs().max() < TOL


def test_token_budget_groups_fill_consecutive_rows_and_match_a_count():
    assert token_budget_groups([5, 5, 3, 7, 2], 10) == [[0, 1], [2, 3], [4]]
    # as many groups as another process needs: the groups with the most tokens halved
    assert token_budget_groups([5, 5, 3, 7, 2], 10, groups=4) == [[0], [1], [2, 3], [4]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=6 is smaller than row 3's 7 tokens"):
        token_budget_groups([5, 5, 3, 7, 2], 6)


def test_balanced_partition_by_hand():
    """balance_batch's split of a minibatch's rows (all processes'): equal row counts, the longest row first to the
    part with the fewest tokens that has room."""
    # 10, 9, 8, 2, 2, 1 into 2 parts of 3: 10 -> A; 9 -> B; 8 -> B (9 < 10); 2 -> A (10 < 17); 2 -> A (12 < 17);
    # A is full: 1 -> B. Tokens 14 and 18; the processes' own halves [10, 9, 8] / [2, 2, 1] were 27 and 5
    assert balanced_partition([10, 9, 8, 2, 2, 1], 2) == [[0, 3, 4], [1, 2, 5]]
    assert balanced_partition([3, 3, 3, 3], 4) == [[0], [1], [2], [3]]
    # greedy: 12 -> A, 11 -> B, 10 -> B, 8 -> A, 8 -> A (full), 4 -> B: 28 and 25 tokens; the consecutive split
    # [8, 8, 10] / [12, 11, 4] holds 26 and 27, so it stays
    assert balanced_partition([8, 8, 10, 12, 11, 4], 2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="5 rows do not split into 2 parts of equal size"):
        balanced_partition([1, 2, 3, 4, 5], 2)


def test_packing_round_trips_by_hand():
    """Two rows, left-padded prompts, right-padded responses: the packed ids, position ids, kept positions and
    targets written out by hand, and unpacking puts each value back in its padded place."""
    queries = torch.tensor([[0, 7, 8], [5, 6, 9]])
    query_mask = torch.tensor([[False, True, True], [True, True, True]])
    responses = torch.tensor([[3, 1, 0], [4, 4, 1]])
    response_mask = torch.tensor([[True, True, False], [True, True, True]])
    inputs = sequence_inputs(queries, query_mask, responses, response_mask)
    p = Packing.of(inputs, response_mask)
    assert p.inputs["input_ids"].tolist() == [[7, 8, 3, 1, 5, 6, 9, 4, 4, 1]]
    assert p.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    assert p.inputs["attention_mask"] is None
    assert p.keep.tolist() == [1, 2, 6, 7, 8] and p.targets.tolist() == [3, 1, 4, 4, 1]
    values = torch.arange(10.0)[None]
    assert p.unpack(values).tolist() == [[0, 0, 1, 2, 3, 0], [4, 5, 6, 7, 8, 9]]
    assert p.responses(values[0, p.keep]).tolist() == [[1, 2, 0], [6, 7, 8]]
    assert p.last_tokens(values).tolist() == [3, 9]


def test_a_model_whose_attention_ignores_position_ids_is_refused_by_name(tmp_path):
    """OPT takes its positions from the attention mask, not from position ids: packed, one row would attend to the
    one before it. The probe at construction finds the difference and names the model class; GPT-2 passes it."""
    tok = tiny_tokenizer()
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   ffn_dim=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=1))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64))
    check_padding_free(gpt2.eval(), "policy", lm_logits)
    with pytest.raises(ValueError, match="padding_free=True: the policy \\(OPTForCausalLM"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=2,
                                  response_length=4, report_to=[], save_strategy="no", bf16=False,
                                  num_sample_generations=0, padding_free=True),
                   processing_class=tok, model=opt, ref_model=None, reward_model=lambda p, c: [0.0] * len(p),
                   train_dataset=tiny_prompt_dataset(tok, n=4), value_model=tiny_scalar_model(tok))


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=64 .* set padding_free=True"):
        PPOConfig(output_dir=str(tmp_path), max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0 must be a positive"):
        PPOConfig(output_dir=str(tmp_path), padding_free=True, max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="balance_batch=True .* set padding_free=True"):
        PPOConfig(output_dir=str(tmp_path), balance_batch=True)
    tok = tiny_tokenizer()
    policy, reward, value = models(tok, "full")
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=10 cannot hold the longest row"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=2,
                                  response_length=8, report_to=[], save_strategy="no", bf16=False,
                                  num_sample_generations=0, padding_free=True, max_tokens_per_micro_batch=10),
                   processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                   train_dataset=tiny_prompt_dataset(tok, n=4), value_model=value)


def test_a_real_model_passes_the_probe():
    """SmolLM2-135M in fp32: the two layouts round differently (2e-4 on logits up to 36), within the probe's
    tolerance, and its value-model layout too."""
    from transformers import AutoModelForSequenceClassification

    from trl_ext.embedded import load_smollm2, smollm2_path
    from trl_ext.models import scalar_head_outputs

    policy, _ = load_smollm2()
    check_padding_free(policy.eval(), "policy", lm_logits)
    value = AutoModelForSequenceClassification.from_pretrained(smollm2_path(), num_labels=1)
    check_padding_free(value.eval(), "value_model", scalar_head_outputs)
