"""The critic's frozen trunk (`trl_ext.models.FrozenTrunk`): a value model whose embeddings and lower layers are
frozen (`freeze_backbone`) runs them once per rollout; each minibatch of the update runs only the layers above,
over the output the rollout kept. The trained weights and every logged number match the full forward's run."""

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models import FrozenTrunk, freeze_backbone, scalar_head_outputs, sequence_inputs
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer


def frozen_critic(tok, layers_trained=1, **overrides):
    value = tiny_scalar_model(tok, seed=1, num_hidden_layers=3, **overrides)
    freeze_backbone(value, layers_trained)
    return value


def test_the_trunk_is_the_frozen_prefix_and_the_split_forward_is_the_full_one():
    tok = tiny_tokenizer()
    value = frozen_critic(tok, layers_trained=1)
    trunk = FrozenTrunk.of(value)
    assert trunk is not None and trunk.layers == 2
    ids = torch.randint(3, tok.vocab_size, (3, 7))
    q_mask = torch.ones(3, 4, dtype=torch.bool)
    q_mask[0, :2] = False  # left padding
    r_mask = torch.ones(3, 3, dtype=torch.bool)
    r_mask[1, 2] = False  # after a stop token
    inputs = sequence_inputs(ids[:, :4], q_mask, ids[:, 4:], r_mask)
    full = scalar_head_outputs(value, inputs)
    hidden = trunk.hidden_states(inputs)
    split = scalar_head_outputs(value, inputs, trunk, trunk_hidden=hidden)
    assert hidden.shape == (3, 7, value.config.hidden_size)
    torch.testing.assert_close(split, full, atol=1e-6, rtol=1e-5)
    assert len(value.model.layers) == 3  # the layers are put back


def test_no_trunk_when_nothing_is_frozen_or_everything_is_or_the_split_forward_differs(monkeypatch):
    tok = tiny_tokenizer()
    assert FrozenTrunk.of(tiny_scalar_model(tok)) is None  # all trained
    assert FrozenTrunk.of(frozen_critic(tok, layers_trained=0)) is None  # only norm and head: no layer above
    embeds_trained = frozen_critic(tok)
    embeds_trained.model.embed_tokens.requires_grad_(True)
    assert FrozenTrunk.of(embeds_trained) is None
    # a backbone that does more than embed -> layers (here: scales the embeddings, as Gemma does) keeps the full pass
    value = frozen_critic(tok)
    original = type(value.model).forward

    def scaled(self, input_ids=None, inputs_embeds=None, **kw):
        inputs_embeds = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds) * 2.0
        return original(self, inputs_embeds=inputs_embeds, **kw)

    monkeypatch.setattr(type(value.model), "forward", scaled)
    assert FrozenTrunk.of(value) is None


def run(tmp_path, trunk: bool, monkeypatch, **kw):
    if not trunk:
        monkeypatch.setattr(FrozenTrunk, "of", staticmethod(lambda model: None))
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path / str(trunk)), per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, num_mini_batches=2, total_episodes=8, response_length=6,
                     num_ppo_epochs=2, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True, learning_rate=1e-3, logging_steps=1, seed=3, **kw)
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, seed=0), ref_model=None,
                   reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 8),
                   value_model=frozen_critic(tok))
    bottom = t.unwrapped.value_model.model.layers[0]
    calls = []
    bottom.register_forward_hook(lambda *a: calls.append(1))
    t.train()
    monkeypatch.undo()
    return t, len(calls)


@pytest.mark.parametrize("rollout_logprobs", ["trainer", "sampler"])
def test_the_update_runs_the_critics_top_only_and_trains_the_same(tmp_path, monkeypatch, rollout_logprobs):
    ours, ours_calls = run(tmp_path, True, monkeypatch, rollout_logprobs=rollout_logprobs, critic_warmup_steps=1)
    full, full_calls = run(tmp_path, False, monkeypatch, rollout_logprobs=rollout_logprobs, critic_warmup_steps=1)
    assert ours.unwrapped.trunk is not None and full.unwrapped.trunk is None
    steps, minibatch_forwards = 2, 2 * 2 * 2  # 2 iterations x 2 epochs x 2 micro-batches
    assert ours_calls == steps  # the rollouts' passes only (one chunk each)
    assert full_calls == steps + minibatch_forwards
    for a, b in zip(ours.unwrapped.parameters(), full.unwrapped.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    moved = [not torch.equal(a, b) for a, b in zip(ours.unwrapped.value_model.parameters(),
                                                    frozen_critic(tiny_tokenizer()).parameters())]
    assert any(moved)
    logs = [h for h in ours.state.log_history if "loss/value_avg" in h]
    for a, b in zip(logs, [h for h in full.state.log_history if "loss/value_avg" in h]):
        for key in ("loss/value_avg", "val/clipfrac_avg", "val/grad_norm", "objective/scores", "policy/approxkl_avg"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def same_checkpoint(tmp_path, tok):
    """A policy and a critic from one checkpoint (the quickstart's layout): the critic's frozen layers are the
    reference's."""
    from transformers import AutoModelForSequenceClassification

    tiny_causal_lm(tok, seed=0).save_pretrained(tmp_path / "ckpt")
    value = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ckpt", num_labels=1)
    freeze_backbone(value, 1)
    return value


@pytest.mark.parametrize("reference", ["adapter_off", "copy"])
def test_the_reference_pass_gives_the_trunk_and_the_critics_frozen_layers_never_run(tmp_path, monkeypatch, reference):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    def train(share: bool):
        if not share:  # the critic runs its own frozen layers in each rollout (the update still uses its trunk)
            monkeypatch.setattr(FrozenTrunk, "same_weights_as", lambda self, model: False)
        tok = tiny_tokenizer()
        value = same_checkpoint(tmp_path, tok)
        policy = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        args = PPOConfig(output_dir=str(tmp_path / f"{reference}{share}"), per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, num_mini_batches=2, total_episodes=8, response_length=6,
                         num_ppo_epochs=2, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                         disable_tqdm=True, learning_rate=3e-3, logging_steps=1, seed=3)
        t = PPOTrainer(args=args, processing_class=tok, model=policy,
                       ref_model=AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt") if reference == "copy"
                       else None,
                       reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 8),
                       value_model=value, peft_config=peft if reference == "adapter_off" else None)
        calls = []
        t.unwrapped.value_model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
        t.train()
        monkeypatch.undo()
        return t, len(calls)

    shared, shared_calls = train(True)
    own, own_calls = train(False)
    assert shared.trunk_from_reference is not None and own.trunk_from_reference is None
    assert shared_calls == 0 and own_calls == 2  # one rollout pass per iteration without the reference's help
    for a, b in zip(shared.unwrapped.parameters(), own.unwrapped.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    logs = [(a, b) for a, b in zip(shared.state.log_history, own.state.log_history) if "loss/value_avg" in a]
    assert logs and all(a["loss/value_avg"] == pytest.approx(b["loss/value_avg"], rel=1e-5) and
                        a["objective/kl"] == pytest.approx(b["objective/kl"], rel=1e-5, abs=1e-7) for a, b in logs)


def test_a_reference_with_other_weights_gives_no_trunk(tmp_path):
    tok = tiny_tokenizer()
    value = same_checkpoint(tmp_path, tok)
    trunk = FrozenTrunk.of(value)
    assert trunk.same_weights_as(tiny_causal_lm(tok, seed=0))
    other = tiny_causal_lm(tok, seed=0)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert not trunk.same_weights_as(other)
    assert not trunk.same_weights_as(tiny_scalar_model(tok, seed=2, num_hidden_layers=1))  # fewer layers
