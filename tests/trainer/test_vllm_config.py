"""use_vllm's config and its errors where vLLM is not installed (the engine itself: tests_vllm/, CI environment 3)."""

import pytest

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.models.vllm_sampler import vllm_available
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer


def test_the_sampler_correction_follows_use_vllm_unless_set(tmp_path):
    assert PPOConfig(output_dir=str(tmp_path)).vllm_importance_sampling_correction is False
    assert PPOConfig(output_dir=str(tmp_path), use_vllm=True).vllm_importance_sampling_correction is True
    assert PPOConfig(output_dir=str(tmp_path), use_vllm=True,
                     vllm_importance_sampling_correction=False).vllm_importance_sampling_correction is False
    assert PPOConfig(output_dir=str(tmp_path),
                     vllm_importance_sampling_correction=True).vllm_importance_sampling_correction is True
    # π_old the sampler's: the weights π_old / π_sampler would all be 1
    assert PPOConfig(output_dir=str(tmp_path), use_vllm=True,
                     rollout_logprobs="sampler").vllm_importance_sampling_correction is False
    with pytest.raises(ValueError, match=r"rollout_logprobs='sampler'.*vllm_importance_sampling_correction=False"):
        PPOConfig(output_dir=str(tmp_path), rollout_logprobs="sampler", vllm_importance_sampling_correction=True)


@pytest.mark.parametrize("field, value, match", [
    ("vllm_mode", "remote", "is not 'colocate' .* or 'server'"),
    ("vllm_server_timeout", 0, "must be > 0 seconds"),
    ("vllm_server_base_url", "10.0.0.5:8000", "is not a URL like 'http://10.0.0.5:8000'"),
    ("vllm_server_base_url", "http://a:8000,b:8000", "'b:8000' is not a URL"),
    ("vllm_gpu_memory_utilization", 1.5, "must be in \\(0, 1\\]"),
    ("vllm_kv_cache_gb", 0, "must be > 0 GiB"),
    ("vllm_tensor_parallel_size", 0, "must be >= 1"),
    ("vllm_max_model_length", 4, "must exceed response_length"),
])
def test_vllm_config_errors(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), response_length=8, **{field: value})


def test_use_vllm_without_vllm_installed_says_how_to_install(tmp_path):
    tok = tiny_tokenizer()
    build = lambda: PPOTrainer(  # noqa: E731
        args=PPOConfig(output_dir=str(tmp_path), use_vllm=True, per_device_train_batch_size=2, total_episodes=2,
                       report_to=[], save_strategy="no", bf16=False, disable_tqdm=True),
        processing_class=tok, model=tiny_causal_lm(tok), ref_model=None, reward_model=tiny_scalar_model(tok),
        train_dataset=tiny_prompt_dataset(tok, 2), value_model=tiny_scalar_model(tok))
    if vllm_available():  # (the vLLM environment runs tests_vllm/, where the engine is tested)
        assert build().vllm is not None
    else:
        with pytest.raises(ImportError, match="vLLM is not installed: `pip install -e '.\\[vllm\\]'` in trl_ext"):
            build()


def test_sleep_mode_on_cpu_is_refused_before_any_engine_starts(tmp_path):
    """vLLM has no sleep mode on CPU (its config refuses it; its CPU worker would ignore sleep()): the trainer says so
    at construction, with the fix, whether or not vLLM is installed."""
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True needs a GPU: vLLM has no sleep mode on cpu"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_enable_sleep_mode=True,
                                  per_device_train_batch_size=2, total_episodes=2, report_to=[], save_strategy="no",
                                  bf16=False, disable_tqdm=True),
                   processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=tiny_scalar_model(tok), train_dataset=tiny_prompt_dataset(tok, 2),
                   value_model=tiny_scalar_model(tok))


def test_server_mode_reads_trls_fields_and_refuses_what_it_cannot_sync(tmp_path):
    """vllm_mode='server' with TRL's field names: the URL list, or host:port. A full policy on CPU, whose weights only
    go over NCCL, is refused before any request (the server itself: tests_vllm/test_vllm_server.py)."""
    from trl_ext.models.vllm_server import server_urls

    args = PPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server",
                     vllm_server_base_url="http://10.0.0.5:8000, http://10.0.0.6:8000/")
    assert server_urls(args) == ["http://10.0.0.5:8000", "http://10.0.0.6:8000/"]
    assert server_urls(PPOConfig(output_dir=str(tmp_path), vllm_server_host="node7",
                                 vllm_server_port=8001)) == ["http://node7:8001"]
    defaults = PPOConfig(output_dir=str(tmp_path))
    assert (defaults.vllm_server_host, defaults.vllm_server_port, defaults.vllm_server_timeout,
            defaults.vllm_group_port) == ("0.0.0.0", 8000, 240.0, 51216)  # TRL's GRPOConfig defaults
    tok = tiny_tokenizer()
    build = lambda: PPOTrainer(  # noqa: E731
        args=PPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", per_device_train_batch_size=2,
                       total_episodes=2, report_to=[], save_strategy="no", bf16=False, disable_tqdm=True),
        processing_class=tok, model=tiny_causal_lm(tok), ref_model=None, reward_model=tiny_scalar_model(tok),
        train_dataset=tiny_prompt_dataset(tok, 2), value_model=tiny_scalar_model(tok))
    with pytest.raises(ValueError, match="full \\(non-LoRA\\) policy sends its weights over NCCL .* needs a CUDA "
                                         "device; this trainer runs on cpu. Train a LoRA policy"):
        build()
