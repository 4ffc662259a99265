"""recipes/ppo_smollm2_multiturn.py: the addition game's feedback and reward, and (slow) the recipe end to end on
SmolLM2-135M-Instruct. How far it learns, over 3 seeds: docs/results.md, "Multi-turn"."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

import ppo_smollm2_multiturn as recipe  # noqa: E402


def test_the_game_gives_feedback_until_the_sum():
    game = recipe.AdditionGame()
    game.reset(answer=25, prompt="ignored")
    assert game.step("17 + 8 = 26.") == "No, 26 is too high. Try again."
    assert game.step("Sorry, it is 20") == "No, 20 is too low. Try again."
    assert game.step("twenty-five") == "Reply with a number."
    assert game.get_reward() == 0.0 and not game.solved
    assert game.step("It is 25.") is None  # solved: the episode ends
    assert game.get_reward() == 1.0 and game.tries == 4
    game.reset(answer=3)
    assert game.get_reward() == 0.0 and game.tries == 0


@pytest.mark.slow
def test_the_recipe_runs_end_to_end(tmp_path):
    summary = recipe.main(["--output_dir", str(tmp_path), "--total_episodes", "8", "--held_out_size", "8",
                           "--padding_free", "true"])
    assert summary["steps"] == 1 and summary["episodes"] == 8
    assert 0 <= summary["success_before"] <= 1 and 0 <= summary["success_after"] <= 1
    assert 1 <= summary["turns_before"] <= 3 and 1 <= summary["turns_after"] <= 3
    assert (tmp_path / "adapter_model.safetensors").exists()
