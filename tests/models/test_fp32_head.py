"""cast_lm_head_to_fp32 (TRL's GRPO field): the policy's LM head returns fp32 logits under bf16 autocast, computed from
fp32 hidden states and weights; its parameters, names and copies are unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models import FP32Head, cast_lm_head_to_fp32
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer


def test_the_head_computes_in_fp32_under_autocast():
    tok = tiny_tokenizer()
    model = tiny_causal_lm(tok)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(input_ids=ids).logits
    names = [n for n, _ in model.named_parameters()]
    cast_lm_head_to_fp32(model)
    assert isinstance(model.get_output_embeddings(), FP32Head)
    assert [n for n, _ in model.named_parameters()] == names and model.lm_head.weight.dtype == torch.float32
    hidden = {}
    model.lm_head.register_forward_pre_hook(lambda module, args: hidden.setdefault("h", args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(hidden["h"].float(), model.lm_head.weight.float()), rtol=0, atol=0)
    assert (logits - plain.float()).abs().max() > 0  # bf16 rounding gone
    assert isinstance(copy.deepcopy(model).get_output_embeddings(), FP32Head)  # (the async sampler's copy)
    cast_lm_head_to_fp32(model)  # twice: no change


def test_the_trainer_casts_the_policy_and_a_separate_reference(tmp_path):
    tok = tiny_tokenizer()
    policy, ref = tiny_causal_lm(tok), tiny_causal_lm(tok)
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=4,
                     report_to=[], save_strategy="no", num_sample_generations=0, bf16=True, use_cpu=True,
                     disable_tqdm=True, cast_lm_head_to_fp32=True)
    t = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref,
                   reward_model=lambda prompts, completions: [1.0] * len(completions),
                   train_dataset=tiny_prompt_dataset(tok, 8), value_model=tiny_scalar_model(tok))
    assert isinstance(policy.get_output_embeddings(), FP32Head) and isinstance(ref.get_output_embeddings(), FP32Head)
    t.train()  # a step under bf16 autocast with fp32 logits


def test_a_head_that_is_not_a_plain_linear_is_refused():
    tok = tiny_tokenizer()
    model = tiny_causal_lm(tok)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True needs .* plain nn.Linear"):
        cast_lm_head_to_fp32(model)
