"""Shared-base QLoRA PPO (trl_ext.models.build_shared_base) and memory discipline on every path, on a tiny Llama
quantized to nf4 by bitsandbytes on CPU: only adapters and heads train, the reference is the base, the reward adapter
stays frozen, 4-bit LoRA gradients equal those of a dequantized fp32 copy, checkpointing recomputes each role with
its own adapter."""

import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.core import token_logprobs
from trl_ext.models import (
    CRITIC,
    POLICY,
    REWARD,
    Padded,
    build_shared_base,
    disable_bnb_cpu_repack,
    response_logprobs,
    scalar_head_outputs,
    sequence_inputs,
)
from trl_ext.monitoring.diagnostics import WALL_CLOCK_KEYS
from trl_ext.testing import (
    quantized_4bit,
    tiny_4bit_causal_lm,
    tiny_causal_lm,
    tiny_prompt_dataset,
    tiny_scalar_model,
    tiny_tokenizer,
)

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def lora(**kw):
    return LoraConfig(**{**LORA, **kw})


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, total_episodes=8, response_length=5,
                num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, learning_rate=1e-2, seed=0, gradient_checkpointing=True)
    base.update(kw)
    return PPOConfig(**base)


def save_reward_adapter(base_folder, out, seed=5):
    """A reward adapter as TRL's RewardTrainer + peft saves one: a SEQ_CLS LoRA on the same base, head included."""
    torch.manual_seed(seed)
    rm = AutoModelForSequenceClassification.from_pretrained(str(base_folder), num_labels=1)
    prm = get_peft_model(rm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS",
                                        init_lora_weights=False))
    prm.save_pretrained(str(out))
    return out


def shared_setup(tmp_path, reward=True, policy_init=True):
    tok = tiny_tokenizer()
    base = tiny_4bit_causal_lm(tok, tmp_path / "base")
    reward_adapter = save_reward_adapter(tmp_path / "base", tmp_path / "rm") if reward else None
    torch.manual_seed(0)
    shared = build_shared_base(base, policy_lora=lora(init_lora_weights=policy_init),
                               critic_lora=lora(r=2, init_lora_weights=policy_init),
                               reward_adapter=reward_adapter)
    return tok, shared


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def linear4bit_layers(model):
    return [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]


# ---------------------------------------------------------------------------------------------------- training
def test_shared_base_ppo_trains_only_adapters_and_heads(tmp_path):
    tok, shared = shared_setup(tmp_path)
    before = snapshot(shared)
    t = PPOTrainer(args=args(tmp_path), processing_class=tok, model=shared, ref_model=None,
                   reward_model=shared.reward_model, train_dataset=tiny_prompt_dataset(tok, 8), value_model=None)
    # the optimizer holds exactly the policy and critic adapters and the value head
    in_optimizer = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    expected = shared.adapter_parameters(POLICY) + shared.adapter_parameters(CRITIC) + [shared.value_model.score.weight]
    assert in_optimizer == {id(p) for p in expected}
    assert linear4bit_layers(shared)
    assert all(not layer.support_avx512bf16_for_cpu for layer in linear4bit_layers(shared))
    t.train()

    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss/policy_avg"])) for h in logs)
    after = snapshot(shared)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    trained = {k for k in before if (f".{POLICY}." in k or f".{CRITIC}." in k) and "lora_" in k}
    trained.add("value_model.score.weight")
    assert changed <= trained, sorted(changed - trained)[:5]  # nothing but adapters and the value head moved
    assert any(f".{POLICY}." in k for k in changed) and any(f".{CRITIC}." in k for k in changed)
    assert "value_model.score.weight" in changed
    frozen_reward = [k for k in before if f".{REWARD}." in k or k.startswith("_reward_model.")]
    assert frozen_reward and all(torch.equal(before[k], after[k]) for k in frozen_reward)  # bitwise
    # checkpointing is still on for the base (policy and critic) after generation turned it off and on again
    assert shared.policy.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing for layer in shared.decoder.layers)
    assert shared.policy.active_adapter == POLICY


def test_shared_base_with_the_samplers_logprobs_as_pi_old(tmp_path):
    """rollout_logprobs="sampler": the rollout runs the critic adapter alone (role="value"), π_old is the sampler's,
    and the update's first minibatch measures the sampler against the trainer's policy adapter."""
    tok, shared = shared_setup(tmp_path)
    t = PPOTrainer(args=args(tmp_path, rollout_logprobs="sampler", logging_steps=1), processing_class=tok,
                   model=shared, ref_model=None, reward_model=shared.reward_model,
                   train_dataset=tiny_prompt_dataset(tok, 8), value_model=None)
    t.train()
    logs = [h for h in t.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    for log in logs:
        assert 0 < log["rollout/sampler_logprob_diff_max"] < 1e-4
        assert abs(log["policy/ratio_first_minibatch"] - 1) < 1e-4


def test_reference_logprobs_are_the_base_models(tmp_path):
    """The rollout's ref log-probs equal those of the same 4-bit base loaded fresh, without any adapter; the policy's
    (non-zero LoRA) differ."""
    tok, shared = shared_setup(tmp_path, reward=False, policy_init=False)
    t = PPOTrainer(args=args(tmp_path, total_episodes=4), processing_class=tok, model=shared, ref_model=None,
                   reward_model=lambda p, c: [float(len(x)) for x in c], train_dataset=tiny_prompt_dataset(tok, 4),
                   value_model=None)
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    fresh = quantized_4bit(AutoModelForCausalLM, tmp_path / "base")
    inputs = sequence_inputs(r.queries, r.query_mask, r.responses, r.response_mask)
    with torch.no_grad():
        base_logprobs = response_logprobs(fresh, inputs, r.responses, t.args.temperature)
    m = r.response_mask
    torch.testing.assert_close(r.ref_logprobs[m], base_logprobs[m], rtol=0, atol=1e-5)
    assert (r.logprobs[m] - r.ref_logprobs[m]).abs().max() > 1e-2  # the policy adapter is not the identity


def test_reward_role_scores_like_the_reward_model_it_was_trained_as(tmp_path):
    """shared.reward_model (base + frozen 'reward' adapter + its head) scores like the 4-bit sequence-classification
    model with the saved adapter loaded by peft."""
    tok, shared = shared_setup(tmp_path)
    reference = PeftModel.from_pretrained(
        quantized_4bit(AutoModelForSequenceClassification, tmp_path / "base", num_labels=1), str(tmp_path / "rm"))
    ids = torch.randint(3, 70, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1}
    with torch.no_grad():
        ours = scalar_head_outputs(shared.reward_model, inputs)
        theirs = scalar_head_outputs(reference, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().max() > 0.01
    assert shared.policy.active_adapter == POLICY  # switched back after scoring


# ---------------------------------------------------------------------------------------------------- gradients
def _dequantized_fp32_copy(quantized, folder):
    """The same model in fp32 with every Linear4bit weight replaced by its dequantized value."""
    import bitsandbytes.functional as bnbf

    fp32 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    modules = dict(fp32.named_modules())
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
                modules[name.replace(".base_layer", "")].weight.copy_(weight)
    return fp32


def _role_gradients(shared, inputs, responses, weights):
    """Gradients of Σ w·log π (policy adapter) and Σ w·V (critic adapter + head), each backward in its context."""
    for p in shared.trainable_parameters():
        p.grad = None
    T = responses.shape[1]
    with shared.adapter(POLICY):
        logits = shared(**inputs, logits_to_keep=T + 1, role="policy")
        (token_logprobs(logits[:, -T - 1 : -1], responses) * weights).sum().backward()
    with shared.adapter(CRITIC):
        values = shared(**inputs, role="value")[:, -T - 1 : -1]
        (values * weights).sum().backward()
    return [p.grad.clone() for p in shared.trainable_parameters()]


def _batch(T=4):
    g = torch.Generator().manual_seed(1)
    queries = torch.randint(3, 70, (2, 5), generator=g)
    responses = torch.randint(3, 70, (2, T), generator=g)
    ones = torch.ones_like(queries, dtype=torch.bool)
    inputs = sequence_inputs(queries, ones, responses, torch.ones_like(responses, dtype=torch.bool))
    return inputs, responses, torch.randn(2, T, generator=g)


def test_lora_gradients_on_4bit_match_a_dequantized_fp32_copy(tmp_path):
    tok, shared = shared_setup(tmp_path, reward=False, policy_init=False)
    with torch.no_grad():
        shared.value_model.score.weight.normal_()
    base = shared.policy.get_base_model()
    # the pitfall's trigger: a no-grad forward in eval mode (bitsandbytes would repack the 4-bit weights here)
    shared.eval()
    inputs, responses, weights = _batch()
    with torch.no_grad():
        shared(**inputs)
    shared.train()
    assert linear4bit_layers(base) and all(not m.support_avx512bf16_for_cpu for m in linear4bit_layers(base))
    grads_4bit = _role_gradients(shared, inputs, responses, weights)

    fp32 = build_shared_base(_dequantized_fp32_copy(base, tmp_path / "base"), policy_lora=lora(), critic_lora=lora(r=2))
    for name in (POLICY, CRITIC):
        set_peft_model_state_dict(fp32.policy, get_peft_model_state_dict(shared.policy, adapter_name=name),
                                  adapter_name=name)
    fp32.value_model.score.load_state_dict(shared.value_model.score.state_dict())
    grads_fp32 = _role_gradients(fp32, inputs, responses, weights)
    assert len(grads_4bit) == len(grads_fp32) > 0
    for a, b in zip(grads_4bit, grads_fp32):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_without_the_fix_an_eval_forward_corrupts_lora_gradients_on_avx512bf16_cpus(tmp_path):
    """Shows what disable_bnb_cpu_repack prevents: on a CPU with AVX512-BF16, bitsandbytes repacks the 4-bit
    weights on a no-grad eval forward and later LoRA gradients differ; afterwards the helper refuses the model."""
    from bitsandbytes.functional import has_avx512bf16

    tok = tiny_tokenizer()
    base = tiny_4bit_causal_lm(tok, tmp_path / "base")
    for m in linear4bit_layers(base):
        m.support_avx512bf16_for_cpu = has_avx512bf16()  # bitsandbytes' default
    torch.manual_seed(0)
    model = get_peft_model(base, lora(init_lora_weights=False))
    inputs, responses, weights = _batch()

    def grads():
        model.zero_grad()
        logits = model(**inputs, use_cache=False).logits[:, -5:-1]
        (token_logprobs(logits, responses) * weights).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    clean = grads()
    model.eval()
    with torch.no_grad():
        model(**inputs, use_cache=False)
    model.train()
    if has_avx512bf16():
        assert (grads() - clean).abs().max() > 1e-3  # silently wrong gradients
        with pytest.raises(ValueError, match="already repacked"):
            disable_bnb_cpu_repack(model)
    else:
        torch.testing.assert_close(grads(), clean)


def test_checkpointing_recomputes_each_role_with_its_own_adapter(tmp_path):
    """With gradient checkpointing the decoder layers run twice per role (forward, recompute in backward), and the
    gradients equal those without checkpointing: each role's backward runs with its adapter active. (The hook sits
    inside the layer: transformers checkpoints `forward`, so hooks on the layer itself run once.)"""
    tok, shared = shared_setup(tmp_path, reward=False, policy_init=False)
    with torch.no_grad():
        shared.value_model.score.weight.normal_()
    inputs, responses, weights = _batch()
    calls = []
    shared.decoder.layers[0].mlp.register_forward_pre_hook(lambda module, a: calls.append(shared.policy.active_adapter))
    shared.train()
    plain = _role_gradients(shared, inputs, responses, weights)
    assert calls == [POLICY, CRITIC]
    calls.clear()
    shared.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _role_gradients(shared, inputs, responses, weights)
    assert calls == [POLICY, POLICY, CRITIC, CRITIC]  # each recompute with the role's own adapter
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b)

    # the hazard this avoids: one backward of the summed losses after both contexts closed recomputes the critic's
    # layers with the policy adapter active. Here (critic r=2, policy r=4) torch notices the shapes differ; with
    # equal ranks the critic's gradients would silently come from the wrong adapter.
    T = responses.shape[1]
    with shared.adapter(POLICY):
        logits = shared(**inputs, logits_to_keep=T + 1, role="policy")
    with shared.adapter(CRITIC):
        values = shared(**inputs, role="value")[:, -T - 1 : -1]
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        ((token_logprobs(logits[:, -T - 1 : -1], responses) + values) * weights).sum().backward()


def test_trainer_shared_losses_with_checkpointing_equal_those_without(tmp_path):
    """PPOTrainer's shared-base update step gives the same gradients with gradient_checkpointing on and off."""
    tok, shared = shared_setup(tmp_path, reward=False, policy_init=False)
    t = PPOTrainer(args=args(tmp_path, total_episodes=4), processing_class=tok, model=shared, ref_model=None,
                   reward_model=lambda p, c: [float(len(x)) for x in c], train_dataset=tiny_prompt_dataset(tok, 4),
                   value_model=None)
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    inputs = sequence_inputs(r.queries, r.query_mask, r.responses, r.response_mask)
    shared.train()
    with torch.no_grad():
        shared.value_model.score.weight.normal_()  # a zero head would give the critic adapter zero gradients

    def grads():
        for p in shared.trainable_parameters():
            p.grad = None
        t.update_phase.micro_batch_losses(Padded.of(inputs, r.response_mask), r, critic_only=False,
                                          denominator=None, loss_scale=1.0, vf_coef=t.vf_coef)
        return [p.grad.clone() for p in shared.trainable_parameters()]

    calls = []
    shared.decoder.layers[0].mlp.register_forward_pre_hook(lambda module, a: calls.append(shared.policy.active_adapter))
    checkpointed = grads()
    assert calls == [POLICY, POLICY, CRITIC, CRITIC]
    shared.gradient_checkpointing_disable()
    plain = grads()
    assert all(g.abs().max() > 0 for g in plain)
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------- plain path
def test_plain_path_qlora_policy_and_a_4bit_value_model(tmp_path):
    """The drop-in path with a 4-bit policy + peft_config and a 4-bit value model: the value model gets LoRA and
    its head, its embeddings and norms stay out of the optimizer; checkpointing is on for both; a step trains."""
    tok = tiny_tokenizer()
    policy = tiny_4bit_causal_lm(tok, tmp_path / "policy")
    tiny_scalar_model(tok, hidden_size=64, intermediate_size=128).save_pretrained(str(tmp_path / "value"))
    value = quantized_4bit(AutoModelForSequenceClassification, tmp_path / "value", num_labels=1)
    t = PPOTrainer(args=args(tmp_path, total_episodes=4), processing_class=tok, model=policy, ref_model=None,
                   reward_model=lambda p, c: [float(len(x)) for x in c], train_dataset=tiny_prompt_dataset(tok, 4),
                   value_model=value, peft_config=lora())
    critic = t.unwrapped.value_model
    assert isinstance(critic, PeftModel)
    names = {id(p): n for n, p in t.model.named_parameters()}
    in_optimizer = sorted(names[id(p)] for g in t.optimizer.param_groups for p in g["params"])
    assert in_optimizer and all("lora_" in n or "modules_to_save" in n for n in in_optimizer), in_optimizer
    assert not any("embed_tokens" in n or "norm" in n for n in in_optimizer)
    assert t.unwrapped.policy.is_gradient_checkpointing and critic.is_gradient_checkpointing
    head = critic.base_model.model.score.modules_to_save["default"].weight
    before = head.detach().clone()
    t.train()
    assert not torch.equal(before, head)
    # generation turned checkpointing off and back on: still on, for both
    assert t.unwrapped.policy.is_gradient_checkpointing and critic.is_gradient_checkpointing


def test_shared_base_errors(tmp_path):
    tok, shared = shared_setup(tmp_path, reward=False)
    common = dict(processing_class=tok, reward_model=lambda p, c: [0.0] * len(c),
                  train_dataset=tiny_prompt_dataset(tok, 4))
    with pytest.raises(ValueError, match="pass ref_model=None"):
        PPOTrainer(args=args(tmp_path), model=shared, ref_model=tiny_scalar_model(tok), value_model=None, **common)
    with pytest.raises(ValueError, match="pass value_model=None"):
        PPOTrainer(args=args(tmp_path), model=shared, ref_model=None, value_model=tiny_scalar_model(tok), **common)
    with pytest.raises(ValueError, match="pass peft_config=None"):
        PPOTrainer(args=args(tmp_path), model=shared, ref_model=None, value_model=None, peft_config=lora(), **common)
    with pytest.raises(ValueError, match="has no reward adapter"):
        _ = shared.reward_model
    with pytest.raises(ValueError, match="modules_to_save"):
        build_shared_base(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                          lora(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="takes the plain base model"):
        build_shared_base(shared.policy, lora())
    with pytest.raises(ValueError, match="is loaded in 4-bit/8-bit and has no adapter"):
        PPOTrainer(args=args(tmp_path), model=quantized_4bit(AutoModelForCausalLM, tmp_path / "base"), ref_model=None,
                   value_model=tiny_scalar_model(tok, hidden_size=64, intermediate_size=128), **common)


def test_shared_base_saves_and_restores_its_trained_parts(tmp_path):
    tok, shared = shared_setup(tmp_path, reward=False, policy_init=False)
    with torch.no_grad():
        shared.value_model.score.weight.normal_()
    trained = [p.detach().clone() for p in shared.trainable_parameters()]
    shared.save_pretrained(str(tmp_path / "saved"))
    assert {"policy", "critic", "value_head.safetensors"} <= set(os.listdir(tmp_path / "saved"))
    with torch.no_grad():
        for p in shared.trainable_parameters():
            p.zero_()
    shared.load_trained(str(tmp_path / "saved"))
    for p, q in zip(shared.trainable_parameters(), trained):
        assert torch.equal(p, q)
    # the saved policy adapter loads onto the base with plain peft
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                                         str(tmp_path / "saved" / "policy"))
    assert sum(p.numel() for n, p in reloaded.named_parameters() if "lora_" in n) == \
        sum(p.numel() for p in shared.policy_parameters())


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.slow
def test_shared_base_run_resumes_to_the_same_weights(tmp_path):
    """Checkpoint after step 1, resume on a freshly built shared base: the same weights and logs as a straight run."""
    def make(name, **kw):
        tok, shared = shared_setup(tmp_path / name)
        trainer = PPOTrainer(args=args(tmp_path / name, logging_steps=1, **kw), processing_class=tok, model=shared,
                             ref_model=None, reward_model=shared.reward_model,
                             train_dataset=tiny_prompt_dataset(tok, 8), value_model=None)
        return shared, trainer

    straight_shared, straight = make("a")
    straight.train()
    _, first = make("b", save_strategy="steps", save_steps=1)
    first.add_callback(_StopAt(1))
    first.train()
    assert (tmp_path / "b" / "run" / "checkpoint-1" / "policy" / "adapter_model.safetensors").exists()
    resumed_shared, resumed = make("b", save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "run" / "checkpoint-1"))

    assert resumed.state.global_step == straight.state.global_step == 2
    for p, q in zip(resumed_shared.trainable_parameters(), straight_shared.trainable_parameters()):
        assert torch.equal(p, q)
    logs = lambda t: [{k: v for k, v in h.items() if k not in WALL_CLOCK_KEYS} for h in t.state.log_history  # noqa: E731
                      if "objective/scores" in h]
    assert logs(resumed) == logs(straight)


def test_the_heads_sit_where_the_final_hidden_states_come_out():
    # device_map="auto" over two GPUs puts the embeddings on the first and the final norm and lm_head on the last;
    # "meta" stands in for that last device here
    from trl_ext.models import build_shared_base

    tok = tiny_tokenizer()
    base = tiny_causal_lm(tok, hidden_size=64, intermediate_size=128)
    base.model.norm.to("meta")
    base.lm_head.to("meta")
    shared = build_shared_base(base, policy_lora=LoraConfig(r=2, target_modules=["q_proj"]))
    assert shared.value_model.score.weight.device.type == "meta"
