"""Every value TRL's PPOConfig accepts is accepted with TRL's meaning, or refused with a reason (issue 27).

TRL 1.12 validates none of its PPO fields. trl_ext checks them in `PPOConfig._validate`; this file lists, for every
TRL field a check touches, the values at the edge of the check: those TRL gives a meaning a run can want (0 where 0
means "off": `missing_eos_penalty=0.0` is "no penalty", which two public PPO scripts pass) are accepted, and those
TRL turns into a run that cannot learn, diverges or crashes are refused with an error that names the value and says
what TRL would have done. A check added on a TRL field without a row here fails `test_every_check_on_a_trl_field_is
_listed`.
"""

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext._trl import PPOConfigBase
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

# (field, value): accepted, kept as given, with TRL's meaning
ACCEPTED = [
    ("missing_eos_penalty", 0.0),  # TRL subtracts 0: no penalty
    ("missing_eos_penalty", None),  # no penalty
    ("missing_eos_penalty", 1.0),
    ("kl_coef", 0.0),  # no KL penalty
    ("vf_coef", 0.0),  # the policy's loss alone
    ("gamma", 0.0),
    ("gamma", 1.0),  # TRL's default
    ("lam", 0.0),  # one-step TD advantages
    ("lam", 1.0),  # Monte-Carlo advantages
    ("cliprange", 1e-3),
    ("cliprange_value", 1e6),  # value clipping out of reach
    ("temperature", 1e-3),  # near-greedy
    ("response_length", 1),
    ("num_ppo_epochs", 1),
    ("num_mini_batches", 1),
    ("local_rollout_forward_batch_size", 1),
    ("total_episodes", 1),
    ("total_episodes", None),
    ("stop_token", "eos"),
    ("stop_token", None),
    ("stop_token_id", 0),  # 0 is a token id like any other
    ("kl_estimator", "k1"),
    ("kl_estimator", "k3"),
]

# (field, value, what the error says): TRL accepts them and its run then fails or cannot learn
REFUSED = [
    ("missing_eos_penalty", -1.0, "rewards running into response_length"),
    ("kl_coef", -0.1, "pays the policy to move away"),
    ("vf_coef", -1.0, "reward the critic's error"),
    ("gamma", 1.5, "grow with the response length"),
    ("gamma", -0.1, "must be in \\[0, 1\\]"),
    ("lam", 1.1, "no longer average"),
    ("lam", -0.1, "no longer average"),
    ("cliprange", 0.0, "no update moves the policy"),
    ("cliprange", -0.2, "no update moves the policy"),
    ("cliprange_value", 0.0, "vf_loss_type='mse'"),
    ("temperature", 0.0, "samples greedily"),
    ("temperature", -1.0, "least likely tokens"),
    ("response_length", 0, "no response"),
    ("num_ppo_epochs", 0, "never updates the policy"),
    ("num_mini_batches", 0, "divides the batch"),
    ("local_rollout_forward_batch_size", 0, "step of TRL's rollout loop"),
    ("total_episodes", 0, "trains no step"),
    ("stop_token", "eot", "stop_token_id"),
    ("kl_estimator", "k4", "\\('k1', 'k2', 'k3'\\)"),
]
REFUSED_TOGETHER = [  # combinations
    ({"stop_token": "eos", "stop_token_id": 0}, "ignores"),  # TRL's `if stop_token and stop_token_id` lets 0 through
    ({"stop_token": "eos", "stop_token_id": 3}, "set only one"),
]
NOT_TRL = {"bf16"}  # a TrainingArguments field whose unset default trl_ext resolves (config.py's docstring)


def make(**kw):
    return PPOConfig(output_dir="/tmp/trl_ext_accepted", bf16=False, report_to="none", **kw)


@pytest.mark.parametrize("field, value", ACCEPTED, ids=[f"{f}={v}" for f, v in ACCEPTED])
def test_values_trl_gives_a_meaning_are_accepted_as_given(field, value):
    assert getattr(make(**{field: value}), field) == value


@pytest.mark.parametrize("field, value, reason", REFUSED, ids=[f"{f}={v}" for f, v, _ in REFUSED])
def test_values_trl_breaks_on_are_refused_with_the_value_and_the_reason(field, value, reason):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}" if isinstance(value, str) else
                                                   f"{field}={value}") + ".*" + reason):
        make(**{field: value})


@pytest.mark.parametrize("fields, reason", REFUSED_TOGETHER)
def test_combinations_trl_resolves_silently_are_refused(fields, reason):
    with pytest.raises(ValueError, match=reason):
        make(**fields)


def _fields_checked_in_validate() -> set[str]:
    """Every `self.<name>` that PPOConfig._validate reads, itself or through the check groups it calls."""
    read, methods = set(), [PPOConfig._validate]
    while methods:
        tree = ast.parse(textwrap.dedent(inspect.getsource(methods.pop())))
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "self"}
        methods += [getattr(PPOConfig, n) for n in names if n.startswith("_check_") and n not in read]
        read |= names
    return read


def test_every_check_on_a_trl_field_is_listed():
    trl_fields = {f.name for f in dataclasses.fields(PPOConfigBase)}
    checked = (_fields_checked_in_validate() & trl_fields) - NOT_TRL
    assert checked, "found no TRL field in PPOConfig._validate: the parse is broken"
    listed = {f for f, *_ in ACCEPTED + REFUSED} | {f for fields, _ in REFUSED_TOGETHER for f in fields}
    assert checked - listed == set(), f"checks on TRL fields without a row here: {sorted(checked - listed)}"
    for field in checked:  # each checked field shows both sides of its check
        assert any(f == field for f, _ in ACCEPTED), field
        assert any(f == field for f, *_ in REFUSED) or any(field in fs for fs, _ in REFUSED_TOGETHER), field


def _trainer(tmp_path, **kw):
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=8, response_length=6,
                     num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True, learning_rate=1e-3, seed=3, **kw)
    return PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                      reward_model=tiny_scalar_model(tok), value_model=tiny_scalar_model(tok, seed=2),
                      train_dataset=tiny_prompt_dataset(tok, 8))


def test_missing_eos_penalty_zero_trains_as_no_penalty(tmp_path):
    """TRL's meaning of 0: the score is unchanged, so the run is the run without a penalty, weight for weight."""
    runs = {}
    for penalty in (None, 0.0):
        trainer = _trainer(tmp_path / str(penalty), missing_eos_penalty=penalty)
        trainer.train()
        runs[penalty] = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
    assert all(torch.equal(runs[None][n], runs[0.0][n]) for n in runs[None])
    # and the penalty does bite when it is not 0 (the comparison above could not pass by accident)
    trainer = _trainer(tmp_path / "1.0", missing_eos_penalty=1.0)
    trainer.train()
    assert any(not torch.equal(runs[None][n], p) for n, p in trainer.model.policy.named_parameters())


def test_missing_eos_penalty_zero_needs_no_stop_token(tmp_path):
    """0 subtracts nothing, so it is no conflict with stop_token='none' (a positive penalty is: no token to test)."""
    _trainer(tmp_path / "zero", stop_token="none", missing_eos_penalty=0.0)
    with pytest.raises(ValueError, match="missing_eos_penalty=1.0 is set but there is no stop token"):
        _trainer(tmp_path / "one", stop_token="none", missing_eos_penalty=1.0)
