"""trl_ext/trainer/backend.py on one process: the DeepSpeed config it writes, per-role clipping (also through
DeepSpeed's gradient accessors, with a loss scale), the frozen optimizer groups of critic warmup, and the layer classes
FSDP wraps. The engines themselves run in tests/trainer/test_scale_out.py (2 CPU processes)."""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_ext.models import PolicyAndValueWrapper
from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer
from trl_ext.trainer.backend import (
    clip_role_grads_,
    deepspeed_batch_config,
    frozen_groups,
    fsdp2_unsharded,
    group_roles,
)


def test_deepspeed_config_gets_the_ppo_batch_and_no_clipping_of_its_own():
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    deepspeed_batch_config(config, micro_batch=4, accumulation=3, processes=2, max_grad_norm=1.0)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 24 and config["gradient_clipping"] == 0.0
    same = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}  # values that agree are accepted
    deepspeed_batch_config(same, 4, 3, 2, max_grad_norm=1.0)
    assert same["gradient_clipping"] == 0.0 and same["train_batch_size"] == 24


@pytest.mark.parametrize("key, value, match", [
    ("train_micro_batch_size_per_gpu", 8, "train_micro_batch_size_per_gpu=8, but this PPO run needs 4"),
    ("gradient_accumulation_steps", 1, "gradient_accumulation_steps=1, but this PPO run needs 3"),
    ("gradient_clipping", 0.5, "gradient_clipping=0.5, but trl_ext clips the policy and the critic each to "
                               "max_grad_norm=1.0"),
])
def test_deepspeed_config_that_contradicts_the_run_is_an_error(key, value, match):
    with pytest.raises(ValueError, match=match):
        deepspeed_batch_config({key: value}, 4, 3, 2, max_grad_norm=1.0)


def _params(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("max_norm", [0.5, 100.0, float("inf")])
def test_role_clipping_is_torch_clip_grad_norm(max_norm):
    ours, reference = _params(0, 3.0), _params(0, 3.0)
    norm = clip_role_grads_(ours, max_norm, deepspeed=False)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm).item()
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 1.0
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_role_clipping_through_deepspeeds_accessors_unscales_the_norm():
    """DeepSpeed's accessors (plain tensors here, as `p.grad` is set) with gradients still multiplied by an fp16
    loss scale: the logged norm and the clipping threshold are those of the unscaled gradients."""
    scale = 1024.0
    scaled, plain = _params(1, 3.0 * scale), _params(1, 3.0)
    norm = clip_role_grads_(scaled, 0.5, deepspeed=True, loss_scale=scale)
    expected = torch.nn.utils.clip_grad_norm_(plain, 0.5).item()
    assert norm == pytest.approx(expected, rel=1e-5) and expected > 0.5
    for a, b in zip(scaled, plain):  # clipped like the unscaled gradients, still scaled (DeepSpeed unscales later)
        torch.testing.assert_close(a.grad / scale, b.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("deepspeed", [False, True])
def test_dropping_a_roles_gradients(deepspeed):
    params = _params(2)
    assert clip_role_grads_(params, 1.0, deepspeed=deepspeed, drop=True) == 0.0
    for p in params:
        assert p.grad is None if not deepspeed else torch.count_nonzero(p.grad) == 0


def test_a_process_holding_no_part_of_a_role_all_reduces_a_zero_on_the_training_device(monkeypatch):
    # ZeRO-1/2 without a fragment of this role on this process: its zero joins the norm's all-reduce, and NCCL takes
    # tensors on the GPU only, so the zero is made on the training device ("meta" stands in for cuda here)
    class Reduced(Exception):
        pass

    def all_reduce(tensor):
        raise Reduced(tensor.device)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    params = [torch.nn.Parameter(torch.randn(3))]  # no gradient, no DeepSpeed fragment on this process
    with pytest.raises(Reduced) as reduced:
        clip_role_grads_(params, 1.0, deepspeed=True, device=torch.device("meta"))
    assert reduced.value.args[0] == torch.device("meta")


def test_frozen_groups_leave_the_policy_and_its_optimizer_state_untouched():
    """What ZeRO-1/2 hands the torch optimizer: one tensor per group. The policy's group steps at learning rate 0 with
    zero gradients (weight decay on): its weights are bit-identical and its Adam state is gone afterwards, as if the
    step had skipped it; the critic's group trains."""
    policy, value = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([{"params": [policy], "lr": 0.1, "role": "policy"},
                                   {"params": [value], "lr": 0.1, "role": "value"}], weight_decay=0.5)
    zero = SimpleNamespace(optimizer=optimizer)
    before, value_before = policy.detach().clone(), value.detach().clone()
    for _ in range(2):
        policy.grad, value.grad = torch.zeros(6), torch.ones(4)
        with frozen_groups(zero, [0], active=True):
            assert optimizer.param_groups[0]["lr"] == 0.0
            optimizer.step()
    assert torch.equal(policy, before) and not torch.equal(value, value_before)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert policy not in optimizer.state and int(optimizer.state[value]["step"]) == 2
    with frozen_groups(zero, [0], active=False):  # after warmup: an ordinary step
        policy.grad = torch.ones(6)
        optimizer.step()
    assert not torch.equal(policy, before) and int(optimizer.state[policy]["step"]) == 1


def test_group_roles():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}],
                                lr=0.1)
    optimizer.param_groups[2]["params"].append(a)
    assert group_roles(optimizer, [a], [b]) == ["policy", "value", "mixed"]


@pytest.mark.parametrize("peft", [False, True])
def test_fsdp_wraps_the_models_own_layer_classes(peft):
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok)
    if peft:
        policy = get_peft_model(policy, LoraConfig(r=2, target_modules="all-linear"))
    wrapper = PolicyAndValueWrapper(policy, tiny_scalar_model(tok))
    assert wrapper._no_split_modules == ["LlamaDecoderLayer"]


def test_fsdp2_unsharded_is_a_no_op_without_fsdp():
    model = torch.nn.Linear(2, 2)
    with fsdp2_unsharded(model):
        assert model(torch.ones(1, 2)).shape == (1, 2)
