"""recipes/ppo_qlora_7b.py and trl_ext/scripts/qlora.py: the recipe YAMLs mapped onto PPOConfig, BitsAndBytesConfig and
LoraConfig; command-line overrides; errors; the planner's estimate printed before loading; and (slow) the recipe end
to end on CPU with a tiny random Llama loaded in nf4, in both layouts, checking that only the adapters and heads train
and that they are saved."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
import torch
import yaml

from trl_ext.scripts import qlora
from trl_ext.tools.memory import GIB, PRESETS, PlanConfig, estimate_memory, load_shape

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ppo_qlora_7b.py"
CONFIGS = sorted((REPO / "recipes" / "qlora_7b").glob("*.yaml"))

sys.path.insert(0, str(RECIPE.parent))
import ppo_qlora_7b as recipe  # noqa: E402

sys.path.remove(str(RECIPE.parent))

PPO_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
            "local_rollout_forward_batch_size", "max_prompt_length", "response_length", "gradient_checkpointing")


def parse(config, *extra, tmp_path, reward=("--reward_function", "vader")):
    return recipe.parse_args(["--config", str(config), "--model_name_or_path", "org/model", *reward,
                              "--output_dir", str(tmp_path / "out"), *extra])


def test_the_four_configs_ship():
    assert [c.name for c in CONFIGS] == ["separate_24gb.yaml", "shared_12gb.yaml", "shared_16gb.yaml",
                                         "shared_24gb.yaml"]


# ------------------------------------------------------------------------------------------- YAML -> configs


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_yaml_maps_onto_ppo_bnb_and_lora_configs(config, tmp_path):
    raw = yaml.safe_load(config.read_text())
    # bf16 autocast needs a bf16 GPU or use_cpu (TrainingArguments' rule); mapping is what is checked here
    script_args, args, plan = parse(config, "--use_cpu", "True", tmp_path=tmp_path)

    for key in PPO_KEYS:
        assert getattr(args, key) == raw[key], key
    assert str(getattr(args.optim, "value", args.optim)) == raw["optim"]
    assert args.bf16 is (raw["compute_dtype"] == "bf16") and args.fp16 is False

    bnb = qlora.quantization_config(plan)
    assert raw["base_dtype"] == "nf4"
    assert bnb.load_in_4bit and not bnb.load_in_8bit
    assert bnb.bnb_4bit_quant_type == raw["base_dtype"]
    assert bnb.bnb_4bit_use_double_quant is raw["bnb_4bit_use_double_quant"]
    assert bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert qlora.weights_dtype(plan) == torch.bfloat16  # embeddings/lm_head/norms in the compute dtype

    lora = qlora.lora_config(plan, script_args.lora_alpha, script_args.lora_dropout)
    assert lora.r == raw["lora_r"] and lora.target_modules == raw["lora_target_modules"] == "all-linear"
    assert lora.lora_alpha == 2 * raw["lora_r"] and lora.task_type == "CAUSAL_LM"
    assert plan.layout == raw["layout"]

    # the recipe plans exactly what `trl-ext estimate-memory CONFIG` plans
    planner = PlanConfig.from_file(str(config))
    for shape in PRESETS.values():
        ours, theirs = estimate_memory(shape, plan), estimate_memory(shape, planner)
        assert (ours.peak_bytes, ours.required_bytes) == (theirs.peak_bytes, theirs.required_bytes)


def test_command_line_overrides_win_over_the_yaml(tmp_path):
    config = REPO / "recipes" / "qlora_7b" / "shared_16gb.yaml"
    script_args, args, plan = parse(
        config, "--per_device_train_batch_size", "2", "--response_length", "8", "--max_prompt_length", "16",
        "--local_rollout_forward_batch_size", "2", "--gradient_checkpointing", "False", "--lora_r", "4",
        "--lora_alpha", "4", "--lora_target_modules", "q_proj,v_proj", "--layout", "separate",
        "--compute_dtype", "fp32",
        "--bnb_4bit_use_double_quant", "False", "--kl_coef", "0.2", tmp_path=tmp_path)
    assert (args.per_device_train_batch_size, args.response_length, args.max_prompt_length,
            args.local_rollout_forward_batch_size, args.gradient_checkpointing) == (2, 8, 16, 2, False)
    assert args.gradient_accumulation_steps == 8  # not overridden: the YAML's
    assert args.kl_coef == 0.2 and args.bf16 is False and args.fp16 is False  # fp32: no autocast
    assert (plan.per_device_train_batch_size, plan.response_length, plan.max_prompt_length, plan.lora_r,
            plan.layout, plan.compute_dtype, plan.autocast, plan.gradient_checkpointing) == (
        2, 8, 16, 4, "separate", "fp32", False, False)
    bnb = qlora.quantization_config(plan)
    assert bnb.bnb_4bit_compute_dtype == torch.float32 and bnb.bnb_4bit_use_double_quant is False
    lora = qlora.lora_config(plan, script_args.lora_alpha, script_args.lora_dropout)
    assert (lora.r, lora.lora_alpha, set(lora.target_modules)) == (4, 4, {"q_proj", "v_proj"})
    assert qlora.weights_dtype(plan) == torch.float32


def test_compute_dtype_fp16_sets_fp16_autocast(tmp_path):
    config = REPO / "recipes" / "qlora_7b" / "shared_12gb.yaml"
    _, args, plan = parse(config, "--compute_dtype", "fp16", tmp_path=tmp_path)
    assert args.fp16 is True and args.bf16 is False and plan.autocast is True
    assert qlora.quantization_config(plan).bnb_4bit_compute_dtype == torch.float16


def _yaml(tmp_path, **changes):
    raw = yaml.safe_load((REPO / "recipes" / "qlora_7b" / "shared_12gb.yaml").read_text())
    raw.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lora_rank'\]"):
        parse(_yaml(tmp_path, lora_rank=8), tmp_path=tmp_path)
    # a PPOConfig field the plan does not hold: named, with the flag to use instead
    with pytest.raises(ValueError, match=r"\['kl_coef'\].*--kl_coef"):
        parse(_yaml(tmp_path, kl_coef=0.1), tmp_path=tmp_path)
    with pytest.raises(ValueError, match="layout='both'"):
        parse(_yaml(tmp_path, layout="both"), tmp_path=tmp_path)
    with pytest.raises(ValueError, match="chunked_logits"):
        parse(_yaml(tmp_path, chunked_logits=False), tmp_path=tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        parse(tmp_path / "missing.yaml", tmp_path=tmp_path)


@pytest.mark.slow  # a fresh interpreter imports transformers and trl: ~10-20 s
def test_the_command_reports_a_bad_config_without_a_traceback(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, str(RECIPE), "--config", str(_yaml(tmp_path, lora_rank=8)),
                             "--model_name_or_path", "m", "--reward_function", "vader", "--compute_dtype", "fp32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "[recipe] error:" in result.stderr and "['lora_rank']" in result.stderr
    assert "Traceback" not in result.stderr


def test_argument_errors_name_the_fix(tmp_path, monkeypatch):
    config = _yaml(tmp_path)
    with pytest.raises(ValueError, match="--config is required"):
        recipe.parse_args(["--model_name_or_path", "m", "--reward_function", "vader"])
    with pytest.raises(ValueError, match="--model_name_or_path is required"):
        recipe.parse_args(["--config", str(config), "--reward_function", "vader", "--compute_dtype", "fp32"])
    with pytest.raises(ValueError, match="exactly one reward.*got none"):
        parse(config, "--compute_dtype", "fp32", tmp_path=tmp_path, reward=())
    with pytest.raises(ValueError, match="got --reward_adapter, --reward_function"):
        parse(config, "--compute_dtype", "fp32", "--reward_adapter", "rm", tmp_path=tmp_path)
    with pytest.raises(ValueError, match="'sentiment' is not one of"):
        parse(config, "--compute_dtype", "fp32", tmp_path=tmp_path, reward=("--reward_function", "sentiment"))
    with pytest.raises(FileNotFoundError, match="'no-adapter' is not a folder holding adapter_model.safetensors"):
        parse(config, "--compute_dtype", "fp32", tmp_path=tmp_path, reward=("--reward_adapter", "no-adapter"))
    with pytest.raises(ValueError, match="--value_model_path is for layout separate"):
        parse(config, "--compute_dtype", "fp32", "--value_model_path", "rm", tmp_path=tmp_path)
    # bf16 autocast where there is no bf16 GPU: named, with the two fixes
    monkeypatch.setattr("trl_ext.config.bf16_in_hardware", lambda: False)
    with pytest.raises(ValueError, match="compute_dtype=bf16.*--compute_dtype fp16.*--compute_dtype fp32"):
        parse(config, tmp_path=tmp_path)
    for use_cpu in (["--use_cpu"], ["--use_cpu", "True"], ["--use_cpu=true"]):  # TrainingArguments' CPU bf16
        assert parse(config, *use_cpu, tmp_path=tmp_path)[1].bf16 is True


README_PRESETS = ("llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b")


def readme_rows() -> dict[str, str]:
    """The rows of recipes/qlora_7b/README.md's table as they should read: each config's GPU, layout, batch sizes,
    lengths, and the planner's peak / needed GiB for each preset."""
    rows = {}
    for config in CONFIGS:
        plan = PlanConfig.from_file(str(config))
        cells = [f"`{config.name}`", f"{config.stem.split('_')[1][:-2]} GB", plan.layout,
                 f"{plan.per_device_train_batch_size} × {plan.gradient_accumulation_steps} = {plan.local_batch_size}",
                 str(plan.local_rollout_forward_batch_size), f"{plan.max_prompt_length} + {plan.response_length}"]
        for preset in README_PRESETS:
            est = estimate_memory(PRESETS[preset], plan)
            cells.append(f"{est.peak_bytes / GIB:.1f} / {est.required_bytes / GIB:.1f}")
        rows[config.stem] = "| " + " | ".join(cells) + " |"
    return rows


def test_readme_table_states_each_configs_values_and_the_planners_estimate():
    """recipes/qlora_7b/README.md: batch sizes and lengths equal the YAML's, peak / needed equal the planner's.
    When the planner changes, the failure message holds the rows to paste."""
    text = (REPO / "recipes" / "qlora_7b" / "README.md").read_text().split("**The longest response")[0]
    header = re.search(r"^\| config \|.*$", text, re.M)[0]
    assert tuple(c.strip() for c in header.strip("|").split("|"))[-4:] == README_PRESETS
    stated = {name: line for line, name in re.findall(r"^(\| `(\w+)\.yaml` \|.*)$", text, re.M)}
    expected = readme_rows()
    assert stated == expected, "rows to paste into recipes/qlora_7b/README.md:\n" + "\n".join(expected.values())
    for name in expected:  # and every config fits its GPU for every preset
        plan = PlanConfig.from_file(str(REPO / "recipes" / "qlora_7b" / f"{name}.yaml"))
        assert all(estimate_memory(PRESETS[p], plan).fits(int(name.split("_")[1][:-2])) for p in README_PRESETS)


def test_readme_states_the_longest_response_each_config_fits():
    """recipes/qlora_7b/README.md's second table: the planner's largest_response_length on the config's GPU."""
    from trl_ext.tools.memory import largest_response_length

    text = (REPO / "recipes" / "qlora_7b" / "README.md").read_text().split("**The longest response")[1]
    stated = {name: line for line, name in re.findall(r"^(\| `(\w+)\.yaml` \|.*)$", text, re.M)}
    expected = {}
    for config in CONFIGS:
        plan, gib = PlanConfig.from_file(str(config)), int(config.stem.split("_")[1][:-2])
        cells = [f"`{config.name}`", f"{gib} GB"] + [str(largest_response_length(PRESETS[p], plan, gib))
                                                     for p in README_PRESETS]
        expected[config.stem] = "| " + " | ".join(cells) + " |"
    assert stated == expected, "rows to paste into recipes/qlora_7b/README.md:\n" + "\n".join(expected.values())


# ------------------------------------------------------------------------------------------- the memory plan


def test_planner_estimate_is_printed_for_the_models_shape(tmp_path, capsys):
    """The shape comes from the model folder's config.json; the printed peak and need are the planner's."""
    config = REPO / "recipes" / "qlora_7b" / "shared_16gb.yaml"
    folder = tmp_path / "llama-3-8b-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **PRESETS["llama-3-8b"].to_config()}))
    script_args, _, plan = parse(config, "--use_cpu", "True", tmp_path=tmp_path)
    script_args.model_name_or_path = str(folder)
    figures = qlora.report_memory_plan(script_args, plan)
    out = capsys.readouterr().out
    expected = estimate_memory(PRESETS["llama-3-8b"], PlanConfig.from_file(str(config)))
    assert figures["plan_peak_bytes"] == expected.peak_bytes
    assert f"peak {expected.peak_bytes / GIB:.2f} GiB" in out
    assert f"needed on the GPU {expected.required_bytes / GIB:.2f} GiB" in out
    assert "16 GB: fits" in out and "shape from" in out and "llama-3-8b-like" in out
    # the numbers the YAML's comment states for llama-3-8b (peak 8.9, needed 10.6)
    stated = re.search(r"llama-3-8b\s+peak\s+([\d.]+), needed\s+([\d.]+)", config.read_text())
    assert (float(stated[1]), float(stated[2])) == (round(expected.peak_bytes / GIB, 1),
                                                    round(expected.required_bytes / GIB, 1))


def test_without_a_readable_config_the_yaml_preset_is_planned(tmp_path, capsys):
    config = REPO / "recipes" / "qlora_7b" / "shared_12gb.yaml"
    script_args, _, plan = parse(config, "--use_cpu", "True", tmp_path=tmp_path)
    script_args.model_name_or_path = str(tmp_path / "not-there")  # not a folder, not a hub name
    figures = qlora.report_memory_plan(script_args, plan)
    out = capsys.readouterr().out
    assert "`model: mistral-7b`" in out and "could not read the config" in out
    assert figures["plan_peak_bytes"] == estimate_memory(PRESETS["mistral-7b"], plan).peak_bytes


def test_a_separate_reward_model_next_to_a_shared_base_is_added(tmp_path, capsys):
    config = REPO / "recipes" / "qlora_7b" / "shared_12gb.yaml"
    _, _, plan = parse(config, "--use_cpu", "True", tmp_path=tmp_path)
    shape = PRESETS["llama-2-7b"]
    extra = qlora.extra_reward_model_bytes(shape, plan)
    # 4-bit linears with double quant (0.516 B/param) + bf16 embeddings and norms (no lm_head), by hand
    by_hand = shape.linear_params * (0.5 + (1 + 4 / 256) / 64) + (32000 * 4096 + 65 * 4096) * 2
    assert extra == pytest.approx(by_hand, rel=1e-9)
    assert 3.3 * GIB < extra < 3.4 * GIB  # 3.36 GiB


def test_gpu_fit_warns_when_the_plan_exceeds_free_memory():
    fits, message = qlora.gpu_fit(10 * GIB, 8 * GIB, 16 * GIB, "RTX A4000")
    assert not fits and "WARNING" in message and "2.0 GiB short" in message and "shared_12gb.yaml" in message
    fits, message = qlora.gpu_fit(10 * GIB, 12.5 * GIB, 16 * GIB, "RTX A4000")
    assert fits and "fits (2.5 GiB spare)" in message and "WARNING" not in message


# ------------------------------------------------------------------------------------------- end to end (CPU)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny random Llama and its tokenizer saved to a folder (the 'hub model'), a LoRA reward adapter on it saved
    as RewardTrainer + peft saves one, a tiny separate reward model, and a jsonl of prompts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from trl_ext.testing import WORDS, tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("qlora")
    tok = tiny_tokenizer()
    tiny_causal_lm(tok, hidden_size=64, intermediate_size=128).save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_pretrained(str(root / "base"), num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    peft_rm = get_peft_model(rm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="SEQ_CLS", init_lora_weights=False))
    peft_rm.save_pretrained(str(root / "rm_adapter"))
    tiny_scalar_model(tok, seed=3, hidden_size=64, intermediate_size=128).save_pretrained(str(root / "rm"))
    with open(root / "prompts.jsonl", "w") as fh:
        for i in range(8):
            fh.write(json.dumps({"prompt": " ".join(WORDS[(3 * i + j) % 60] for j in range(2 + i % 3))}) + "\n")
    return root


def _tiny_argv(root, out, layout, reward):
    config = REPO / "recipes" / "qlora_7b" / ("separate_24gb.yaml" if layout == "separate" else "shared_16gb.yaml")
    return ["--config", str(config),
            "--model_name_or_path", str(root / "base"), *reward, "--dataset_name", str(root / "prompts.jsonl"),
            "--output_dir", str(out), "--compute_dtype", "fp32", "--lora_r", "4",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--local_rollout_forward_batch_size", "2", "--total_episodes", "4", "--response_length", "8",
            "--max_prompt_length", "16", "--num_ppo_epochs", "1", "--learning_rate", "1e-2", "--save_strategy", "no",
            "--disable_tqdm", "True", "--seed", "0", "--temperature", "1.0"]


def _snapshot(*modules):
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]


def _changed(before, after):
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.slow
def test_shared_layout_end_to_end_with_a_reward_adapter(tiny_folders, tmp_path, capsys):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    out = tmp_path / "out"
    script_args, args, plan = recipe.parse_args(_tiny_argv(tiny_folders, out, "shared",
                                                           ["--reward_adapter", str(tiny_folders / "rm_adapter")]))
    seen = {}

    def on_built(trainer):
        seen["trainer"] = trainer
        seen["before"] = _snapshot(trainer.shared)[0]

    summary = recipe.run(script_args, args, plan, on_built=on_built)
    printed = capsys.readouterr().out
    trainer = seen["trainer"]
    shared = trainer.shared

    # the planner's estimate for the tiny model's shape was printed before loading
    expected = estimate_memory(load_shape(str(tiny_folders / "base")), plan)
    assert f"peak {expected.peak_bytes / 2**20:.1f} MiB" in printed  # the tiny model's plan, in MiB
    assert printed.index("memory plan") < printed.index("QLoRA PPO (shared layout)")
    assert "no CUDA: GPU memory not measured" in printed or torch.cuda.is_available()

    # it trained: 2 steps, finite losses; the base is 4-bit and the reward is the frozen adapter
    assert summary["steps"] == 2 and all(
        torch.isfinite(torch.tensor(h["loss/policy_avg"])) for h in trainer.state.log_history if "loss/policy_avg" in h)
    assert shared.policy.get_base_model().is_loaded_in_4bit
    assert trainer.reward_model is shared.reward_model

    # only the policy and critic adapters and the value head changed; base weights, reward adapter and head did not
    changed = _changed(seen["before"], _snapshot(shared)[0])
    allowed = {k for k in seen["before"] if ((".policy." in k or ".critic." in k) and "lora_" in k)}
    allowed.add("value_model.score.weight")
    assert changed and changed <= allowed, sorted(changed - allowed)[:5]
    assert any(".policy." in k for k in changed) and any(".critic." in k for k in changed)
    assert "value_model.score.weight" in changed

    # the trained parts were saved, and the saved policy adapter is the trained one
    assert {"policy", "critic", "value_head.safetensors", "memory.json", "metrics.jsonl"} <= set(os.listdir(out))
    saved = load_file(str(out / "policy" / "adapter_model.safetensors"))
    trained = get_peft_model_state_dict(shared.policy, adapter_name="policy")
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)
    memory = json.loads((out / "memory.json").read_text())
    assert memory["plan_peak_bytes"] == expected.peak_bytes and memory["plan"]["layout"] == "shared"


@pytest.mark.slow
def test_separate_layout_end_to_end_with_a_reward_model(tiny_folders, tmp_path, capsys):
    from peft import PeftModel

    out = tmp_path / "out"
    script_args, args, plan = recipe.parse_args(_tiny_argv(tiny_folders, out, "separate",
                                                           ["--reward_model_path", str(tiny_folders / "rm")]))
    seen = {}

    def on_built(trainer):
        seen["trainer"] = trainer
        seen["before"], seen["reward_before"] = _snapshot(trainer.unwrapped, trainer.reward_model)

    summary = recipe.run(script_args, args, plan, on_built=on_built)
    printed = capsys.readouterr().out
    trainer = seen["trainer"]
    wrapper = trainer.unwrapped
    expected = estimate_memory(load_shape(str(tiny_folders / "base")), plan)
    assert f"peak {expected.peak_bytes / 2**20:.1f} MiB" in printed
    assert summary["steps"] == 2

    # three 4-bit models: the policy (LoRA), the critic (LoRA given by trl_ext + its score head), the reward model
    assert isinstance(wrapper.policy, PeftModel) and isinstance(wrapper.value_model, PeftModel)
    for model in (wrapper.policy.get_base_model(), wrapper.value_model.get_base_model(), trainer.reward_model):
        assert model.is_loaded_in_4bit
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled

    changed = _changed(seen["before"], _snapshot(wrapper)[0])
    allowed = {k for k in seen["before"] if "lora_" in k or "modules_to_save" in k}
    assert changed and changed <= allowed, sorted(changed - allowed)[:5]
    assert any(k.startswith("policy.") and "lora_" in k for k in changed)
    assert any(k.startswith("value_model.") and "lora_" in k for k in changed)
    assert any("score.modules_to_save" in k for k in changed)
    assert not _changed(seen["reward_before"], _snapshot(trainer.reward_model)[0])  # the reward model is frozen

    # the policy adapter at the top level, the critic's LoRA + head in critic/
    assert {"adapter_model.safetensors", "adapter_config.json", "critic", "memory.json"} <= set(os.listdir(out))
    assert (out / "critic" / "adapter_model.safetensors").exists()
    memory = json.loads((out / "memory.json").read_text())
    assert memory["plan"]["layout"] == "separate" and memory["plan_peak_bytes"] == expected.peak_bytes
