"""recipes/ppo_smollm2_arithmetic.py: the verifiable reward, the split, the time budget, and (slow) the recipe end to
end on SmolLM2-135M-Instruct. How far it learns, over 3 seeds: benchmarks/verifiable_vs_grpo.py (docs/results.md)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

import ppo_smollm2_arithmetic as recipe  # noqa: E402


def test_the_reward_reads_the_last_number():
    completions = ["17 + 8 = 25.", "The answer is 25", "25 or 26", "twenty-five", [{"role": "assistant",
                                                                                   "content": "It is 25."}], "-25"]
    assert recipe.correct(completions, [25] * 6) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert recipe.last_number("no digits") is None and recipe.last_number("a 3 b -4") == -4


def test_the_split_holds_every_pair_once():
    train, held_out = recipe.build_datasets()
    assert len(held_out) == recipe.HELD_OUT and len(train) + len(held_out) == (recipe.HIGH - recipe.LOW + 1) ** 2
    questions = [p[0]["content"] for p in list(train["prompt"]) + list(held_out["prompt"])]
    assert len(set(questions)) == len(questions)
    for prompt, answer in zip(list(held_out["prompt"])[:20], list(held_out["answer"])[:20]):
        a, b = (int(x) for x in prompt[0]["content"].split("?")[0].removeprefix("What is ").split(" + "))
        assert a + b == answer
    assert list(recipe.build_datasets()[1]["prompt"]) == list(held_out["prompt"])  # the same split every time


def test_the_prompts_written_for_trl_ext_ppo_load_as_its_dataset_and_reward(tmp_path, monkeypatch):
    """The README's `trl-ext ppo` arithmetic command: --write_datasets, then --dataset_name FOLDER (TRL's
    load_dataset of a folder: train and test splits by file name) and --reward_funcs by dotted path from the root."""
    from datasets import load_dataset

    from trl_ext.scripts.ppo import PPOScriptArguments, reward_functions

    recipe.main(["--write_datasets", str(tmp_path / "data")])
    loaded = load_dataset(str(tmp_path / "data"))
    for split, built in zip(("train", "test"), recipe.build_datasets()):
        assert loaded[split]["prompt"] == built["prompt"] and loaded[split]["answer"] == built["answer"]
    monkeypatch.chdir(ROOT)
    (reward,) = reward_functions(PPOScriptArguments(reward_funcs=["recipes.ppo_smollm2_arithmetic.correct"]))
    assert reward.__module__ == "recipes.ppo_smollm2_arithmetic" and reward(["8 + 9 = 17"], [17]) == [1.0]


def test_the_time_budget_stops_training():
    from transformers import TrainerControl, TrainerState

    callback = recipe.TimeBudget(0.0)
    control = TrainerControl()
    callback.on_train_begin(None, TrainerState(), control)
    callback.on_step_end(None, TrainerState(), control)
    assert control.should_training_stop
    unlimited = recipe.TimeBudget(None)
    control = TrainerControl()
    unlimited.on_train_begin(None, TrainerState(), control)
    unlimited.on_step_end(None, TrainerState(), control)
    assert not control.should_training_stop


@pytest.mark.slow
def test_the_recipe_runs_end_to_end(tmp_path):
    summary = recipe.main(["--output_dir", str(tmp_path), "--total_episodes", "16", "--held_out_size", "8",
                           "--num_generations", "4", "--dynamic_sampling", "true", "--max_num_gen_batches", "2",
                           "--num_ppo_epochs", "1"])
    assert summary["steps"] == 2 and summary["episodes"] == 16
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert (tmp_path / "adapter_model.safetensors").exists()
