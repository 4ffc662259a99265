"""trl_ext.PPOConfig: TRL's fields keep their meaning; bad values are clear errors; bf16 default works on CPU."""

import dataclasses

import pytest
import torch

from trl_ext import PPOConfig
from trl_ext._trl import PPOConfigBase
from trl_ext.config import bf16_in_hardware


def test_is_trl_config_with_every_trl_field():
    """On the base in use (TRL 1.12's PPOConfig, or trl_ext's copy of its fields on newer TRL)."""
    assert issubclass(PPOConfig, PPOConfigBase)
    ours = {f.name for f in dataclasses.fields(PPOConfig)}
    assert {f.name for f in dataclasses.fields(PPOConfigBase)} <= ours


def test_default_bf16_does_not_fail_without_a_gpu(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path))
    assert args.bf16 is bf16_in_hardware()
    assert args.stop_token is None and args.kl_estimator == "k1"


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str):
    """A CUDA GPU of `capability` as torch reports it; torch.cuda.is_bf16_supported() says True, as it does on T4 and
    V100 (it counts emulation)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("capability, name, native", [((7, 5), "Tesla T4", False), ((7, 0), "Tesla V100", False),
                                                      ((8, 0), "A100", True), ((8, 9), "RTX 4090", True)])
def test_bf16_is_native_from_compute_capability_8(monkeypatch, capability, name, native):
    fake_gpu(monkeypatch, capability, name)
    assert bf16_in_hardware() is native


def test_unset_bf16_is_off_on_a_t4_and_explicit_bf16_there_warns(monkeypatch, tmp_path):
    fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    # PPOConfig's own resolution, before TrainingArguments (which would look for a real GPU) runs
    monkeypatch.setattr("trl_ext.config.PPOConfigBase.__post_init__", lambda self: None)
    assert PPOConfig(output_dir=str(tmp_path)).bf16 is False
    assert PPOConfig(output_dir=str(tmp_path), fp16=True).bf16 is False
    with pytest.warns(UserWarning, match=r"bf16=True on Tesla T4 \(compute capability 7.5\).*fp16=True"):
        assert PPOConfig(output_dir=str(tmp_path), bf16=True).bf16 is True
    fake_gpu(monkeypatch, (8, 0), "A100")
    assert PPOConfig(output_dir=str(tmp_path)).bf16 is True


def test_explicit_bf16_is_kept(tmp_path):
    assert PPOConfig(output_dir=str(tmp_path), bf16=True, use_cpu=True).bf16 is True
    assert PPOConfig(output_dir=str(tmp_path), bf16=False).bf16 is False


def test_trl_fields_keep_their_values(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), kl_coef=0.2, cliprange=0.1, vf_coef=0.5, gamma=0.99, lam=0.9,
                     response_length=17, num_ppo_epochs=2, temperature=0.9, stop_token_id=5, bf16=False)
    assert (args.kl_coef, args.cliprange, args.vf_coef, args.gamma, args.lam) == (0.2, 0.1, 0.5, 0.99, 0.9)
    assert (args.response_length, args.num_ppo_epochs, args.temperature, args.stop_token_id) == (17, 2, 0.9, 5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_accepted(tmp_path, estimator):
    assert PPOConfig(output_dir=str(tmp_path), kl_estimator=estimator, bf16=False).kl_estimator == estimator


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kl_estimator", "k4", r"kl_estimator='k4'.*\('k1', 'k2', 'k3'\)"),
        ("stop_token", "eot", r"stop_token='eot'.*stop_token_id"),
        ("kl_coef", -0.1, r"kl_coef=-0.1 must be >= 0"),
        ("cliprange", 0.0, r"cliprange=0.0 must be > 0"),
        ("cliprange_value", -1.0, r"cliprange_value=-1.0 must be > 0"),
        ("gamma", 1.5, r"gamma=1.5 must be in \[0, 1\]"),
        ("lam", -0.1, r"lam=-0.1 must be in \[0, 1\]"),
        ("vf_coef", -1.0, r"vf_coef=-1.0 must be >= 0"),
        ("temperature", 0.0, r"temperature=0.0 must be > 0"),
        ("response_length", 0, r"response_length=0 must be >= 1"),
        ("num_ppo_epochs", 0, r"num_ppo_epochs=0 must be >= 1"),
        ("num_mini_batches", 0, r"num_mini_batches=0 must be >= 1"),
        ("local_rollout_forward_batch_size", 0, r"local_rollout_forward_batch_size=0 must be >= 1"),
        ("missing_eos_penalty", -1.0, r"missing_eos_penalty=-1.0 must be >= 0"),
        ("total_episodes", 0, r"total_episodes=0 must be >= 1"),
        ("rollout_logprobs", "engine", r"rollout_logprobs='engine'.*\('trainer', 'sampler'\)"),
    ],
)
def test_bad_values_are_clear_errors(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), bf16=False, **{field: value})


def test_stop_token_and_stop_token_id_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="set only one"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, stop_token="eos", stop_token_id=3)


def test_every_fields_help_prints():
    """`python recipes/quickstart.py --help` formats each field's help with argparse's % expansion (a bare "20% x" in
    the adaptive controller's help was a TypeError there)."""
    from transformers import HfArgumentParser

    text = HfArgumentParser(PPOConfig).format_help()
    assert "--rollout_logprobs" in text and "--kl_horizon" in text
