"""Mixed precision on the paths GPU users run, checked on CPU: the forwards of the trained module return the compute
dtype (no fp32 copy of the logits), bf16 is chosen only where the hardware has it (the capability faked), fp16 trains
fp32 weights through a GradScaler whose scale the checkpoint keeps (the scaler path faked on CPU), and
full_determinism switches torch's deterministic algorithms on."""

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import loss_input_dtypes, tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=8, response_length=6,
                num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, learning_rate=1e-3)
    base.update(kw)
    return PPOConfig(**base)


def trainer(tmp_path, **kw):
    tok = tiny_tokenizer()
    return PPOTrainer(args=args(tmp_path, **kw), processing_class=tok, model=tiny_causal_lm(tok),
                      ref_model=None, reward_model=tiny_scalar_model(tok, seed=2),
                      value_model=tiny_scalar_model(tok, seed=1), train_dataset=tiny_prompt_dataset(tok, n=8))


def test_bf16_forwards_return_bf16_logits_and_values(tmp_path):
    # accelerate's prepare converts a wrapped module's outputs to fp32: the (b, T+1, V) logits would exist twice
    t = trainer(tmp_path, bf16=True, use_cpu=True)
    with loss_input_dtypes() as seen:
        t.train()
    assert seen == {("policy", "bfloat16"), ("value", "bfloat16")}
    assert all(p.dtype == torch.float32 for p in t.unwrapped.parameters())  # the trained weights stay fp32


def test_fp32_forwards_stay_fp32(tmp_path):
    t = trainer(tmp_path)
    with loss_input_dtypes() as seen:
        t.train()
    assert seen == {("policy", "float32"), ("value", "float32")}


def test_full_determinism_switches_deterministic_algorithms_on(tmp_path):
    # CUDA's attention backward and scatter kernels are nondeterministic unless torch is told otherwise
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        t = trainer(tmp_path, full_determinism=True)
        assert torch.are_deterministic_algorithms_enabled()
        t.train()  # every op of a PPO step has a deterministic kernel (an op without one would raise here)
        assert t.state.global_step == 2
    finally:
        torch.use_deterministic_algorithms(False)


def test_fp16_trains_fp32_weights_through_the_grad_scaler(tmp_path, fp16_on_cpu):
    t = trainer(tmp_path, fp16=True, total_episodes=12)
    assert t.accelerator.scaler is not None
    before = {n: p.detach().clone() for n, p in t.unwrapped.named_parameters()}
    with loss_input_dtypes() as seen:
        t.train()
    assert seen == {("policy", "float16"), ("value", "float16")}
    assert all(p.dtype == torch.float32 for p in t.unwrapped.parameters())
    moved = [n for n, p in t.unwrapped.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("policy.") for n in moved) and any(n.startswith("value_model.") for n in moved)
    # growth_interval=1: each finite step doubles the scale (3 steps: 2^10 -> 2^13 unless a step overflowed)
    assert t.accelerator.scaler.get_scale() != 2.0**10


def test_fp16_trained_weights_in_float16_are_refused_before_the_run(tmp_path, fp16_on_cpu):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="fp16=True with trained weights in float16.*float32"):
        PPOTrainer(args=args(tmp_path, fp16=True), processing_class=tok, model=tiny_causal_lm(tok).half(),
                   ref_model=None, reward_model=tiny_scalar_model(tok, seed=2),
                   value_model=tiny_scalar_model(tok, seed=1).half(), train_dataset=tiny_prompt_dataset(tok, n=8))


def test_fp16_without_a_grad_scaler_is_refused_not_run_in_fp32(tmp_path):
    # accelerate sets fp16 up on GPUs only: on CPU fp16=True would silently train in fp32
    with pytest.raises(ValueError, match="fp16=True on cpu.*bf16=True with use_cpu=True"):
        trainer(tmp_path, fp16=True)


def test_bf16_trained_weights_in_bfloat16_warn(tmp_path):
    tok = tiny_tokenizer()
    with pytest.warns(UserWarning, match="trained weights in bfloat16.*float32"):
        PPOTrainer(args=args(tmp_path, bf16=True, use_cpu=True), processing_class=tok,
                   model=tiny_causal_lm(tok).to(torch.bfloat16), ref_model=None,
                   reward_model=tiny_scalar_model(tok, seed=2), value_model=tiny_scalar_model(tok, seed=1),
                   train_dataset=tiny_prompt_dataset(tok, n=8))


def test_fp16_resume_restores_the_loss_scale(tmp_path, fp16_on_cpu):
    straight = trainer(tmp_path / "straight", fp16=True, total_episodes=12)
    straight.train()
    interrupted = trainer(tmp_path / "run", fp16=True, total_episodes=12, save_strategy="steps", save_steps=1)
    interrupted.train()
    resumed = trainer(tmp_path / "run", fp16=True, total_episodes=12)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    import json

    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "trl_ext_state.json").read_text())["grad_scaler"]
    assert saved["scale"] != 2.0**10  # the scale after two steps, not the initial one
    assert resumed.accelerator.scaler.get_scale() == straight.accelerator.scaler.get_scale()
    for (n, a), b in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b), n
