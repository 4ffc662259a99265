"""GRPO's config names in PPOConfig (trl_ext/config_grpo.py): every GRPOConfig field is accepted, the aliases set
PPO's fields (two values are an error naming both), the generation batch sizes the rollout batch by hand, and a
GRPO-only option away from its default is refused naming the PPO alternative."""

import dataclasses

import pytest

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.config_grpo import ALIASES, REFUSED
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_tokenizer


def config(**kw):
    return PPOConfig(**{"output_dir": "/tmp/trl_ext_grpo_names", "report_to": [], **kw})


def test_every_grpoconfig_field_is_a_ppoconfig_field():
    """TRL's installed GRPOConfig (1.12 in CI's oldest ends, 1.16 in its newest): every field has a PPOConfig field."""
    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    ppo = {f.name for f in dataclasses.fields(PPOConfig)}
    assert grpo - ppo == set()


@pytest.mark.parametrize("grpo, ppo, value", [("max_completion_length", "response_length", 17),
                                              ("num_iterations", "num_ppo_epochs", 2), ("epsilon", "cliprange", 0.3),
                                              ("epsilon_high", "clip_ratio_high", 0.28),
                                              ("vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max",
                                               5.0)])
def test_a_grpo_name_sets_the_ppo_field_and_reads_back(grpo, ppo, value):
    c = config(**{grpo: value})
    assert getattr(c, ppo) == value and getattr(c, grpo) == value
    c = config(**{ppo: value})  # PPO's name: GRPO's reads it back
    assert getattr(c, grpo) == value
    assert getattr(config(**{grpo: value, ppo: value}), ppo) == value  # the same value twice is one setting


@pytest.mark.parametrize("grpo", sorted(ALIASES))
def test_two_values_for_one_thing_name_both(grpo):
    ppo, default = ALIASES[grpo]
    ppo_value, grpo_value = (7, 9) if isinstance(default, int) else (0.25, 0.35)
    with pytest.raises(ValueError, match=rf"{grpo}={grpo_value}.*{ppo}={ppo_value}.*set one of them"):
        config(**{grpo: grpo_value, ppo: ppo_value})


def test_defaults_stay_trl_1_12_ppos():
    c = config()
    assert (c.response_length, c.num_ppo_epochs, c.cliprange, c.temperature) == (53, 4, 0.2, 0.7)
    assert (c.max_completion_length, c.num_iterations, c.epsilon) == (53, 4, 0.2)


@pytest.mark.parametrize("name, value, alternative", [
    ("top_p", 0.9, "use temperature"), ("top_k", 50, "use temperature"), ("min_p", 0.1, "use temperature"),
    ("repetition_penalty", 1.1, "use temperature"), ("generation_kwargs", {"top_p": 0.9}, "set those fields"),
    ("delta", 2.0, "clip_ratio_c"), ("sync_ref_model", True, "kl_coef"), ("use_adaptive_entropy", True,
                                                                           "entropy_coef"),
    ("disable_dropout", False, "without dropout"), ("use_transformers_continuous_batching", True, "use_vllm=True"),
    ("shuffle_dataset", False, "seeded shuffled order")])
def test_a_grpo_only_option_is_refused_naming_the_ppo_alternative(name, value, alternative):
    with pytest.raises(ValueError, match=rf"{name}=.*GRPOTrainer's option; PPO runs it at .* only"):
        config(**{name: value})
    with pytest.raises(ValueError) as e:
        config(**{name: value})
    assert alternative in str(e.value)
    config(**{name: REFUSED[name][0]})  # GRPO's default changes nothing


def test_json_strings_from_the_command_line():
    c = config(model_init_kwargs='{"dtype": "float32"}', generation_kwargs="{}")
    assert c.model_init_kwargs == {"dtype": "float32"} and c.generation_kwargs is None


def test_steps_per_generation_by_hand():
    # per device 2, accumulation 2: GRPO's step is 4 completions per process; 8 micro-batches per generation is
    # 16 completions per process and 8 / 2 = 4 optimizer steps (PPO's num_mini_batches)
    c = config(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=8)
    assert (c.gradient_accumulation_steps, c.num_mini_batches, c.steps_per_generation) == (8, 4, 8)
    with pytest.raises(ValueError, match="steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2"):
        config(gradient_accumulation_steps=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="num_mini_batches left at 1 \\(it is 2"):
        config(steps_per_generation=4, num_mini_batches=2)
    with pytest.raises(ValueError, match="generation_batch_size=8 and steps_per_generation=2 are both set"):
        config(generation_batch_size=8, steps_per_generation=2)


def _trainer(**kw):
    tok = tiny_tokenizer()
    return PPOTrainer(args=config(save_strategy="no", response_length=4, **kw), processing_class=tok,
                      model=tiny_causal_lm(tok), reward_funcs=lambda prompts, completions, **_: [0.0] * len(prompts),
                      train_dataset=tiny_prompt_dataset(tok, 16))


def test_generation_batch_size_and_max_steps_size_the_run():
    """generation_batch_size 12 = 2 per device x 1 process x 6 micro-batches; accumulation 3: 2 optimizer steps per
    rollout batch of 12. max_steps 5: five iterations."""
    t = _trainer(per_device_train_batch_size=2, gradient_accumulation_steps=3, generation_batch_size=12, max_steps=5)
    a = t.args
    assert (a.batch_size, a.mini_batch_size, a.num_mini_batches, a.gradient_accumulation_steps) == (12, 6, 2, 6)
    assert (a.generation_batch_size, a.steps_per_generation, a.num_total_batches, a.total_episodes) == (12, 6, 5, 60)
    assert t.accelerator.gradient_accumulation_steps == 3  # micro-batches per optimizer step
    with pytest.raises(ValueError, match="generation_batch_size=10 must be a multiple of .* = 4"):
        _trainer(per_device_train_batch_size=4, generation_batch_size=10)
    with pytest.raises(ValueError, match="total_episodes=8 and max_steps=5 both set the run's length"):
        _trainer(total_episodes=8, max_steps=5)


def test_chat_template_kwargs_reach_the_template():
    from datasets import Dataset

    from trl_ext.data.prompts import prepare_prompts

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if thinking %}w1{% endif %}"
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "w2 w3"}]]})
    plain = prepare_prompts(rows, tok).dataset[0]["input_ids"]
    thinking = prepare_prompts(rows, tok, chat_template_kwargs={"thinking": True}).dataset[0]["input_ids"]
    assert thinking == plain + tok.convert_tokens_to_ids(["w1"])


def test_log_completions_writes_every_iterations_rows(tmp_path):
    import json

    for log_completions in (False, True):
        out = tmp_path / str(log_completions)
        _trainer(per_device_train_batch_size=4, total_episodes=12, num_sample_generations=0,
                 log_completions=log_completions, output_dir=str(out)).train()
        assert (out / "samples.jsonl").exists() == log_completions
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 2, 3] and len(rows) == 12
