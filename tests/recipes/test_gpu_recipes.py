"""Tests for the GPU recipe (recipes/ppo_tldr.py), the loaders it runs on (trl_ext.scripts) and the accelerate configs
(recipes/accelerate_configs/).

No GPU and no model hub here: the configs are checked with accelerate's own loader, the hub errors with the hub forced
offline (`huggingface_hub.constants.HF_HUB_OFFLINE`, which blocks every hub request), and the recipe runs end to end
(slow test) on tiny local stand-ins for the SFT policy, the reward model and the TL;DR prompts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from trl import get_peft_config

from trl_ext import scripts

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ppo_tldr.py"
CONFIGS = REPO / "recipes" / "accelerate_configs"

sys.path.insert(0, str(RECIPE.parent))
import ppo_tldr as recipe  # noqa: E402

sys.path.remove(str(RECIPE.parent))


# ---------------------------------------------------------------------------------------------- accelerate configs

# file -> (distributed_type, num_processes)
EXPECTED_CONFIGS = {
    "single_gpu.yaml": ("NO", 1),
    "multi_gpu.yaml": ("MULTI_GPU", 8),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 8),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 8),
    "fsdp.yaml": ("FSDP", 8),
}


def test_the_shipped_configs_are_the_tested_ones():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_config_loads_with_accelerates_loader(name):
    config = load_config_from_file(str(CONFIGS / name))  # what `accelerate launch --config_file` calls
    distributed_type, num_processes = EXPECTED_CONFIGS[name]
    assert config.distributed_type.value == distributed_type
    assert config.num_processes == num_processes
    assert config.mixed_precision == "bf16"
    assert config.num_machines == 1 and config.use_cpu is False


def test_deepspeed_configs_zero_stages():
    zero2 = load_config_from_file(str(CONFIGS / "deepspeed_zero2.yaml")).deepspeed_config
    zero3 = load_config_from_file(str(CONFIGS / "deepspeed_zero3.yaml")).deepspeed_config
    assert zero2["zero_stage"] == 2 and zero2["zero3_init_flag"] is False
    assert zero3["zero_stage"] == 3 and zero3["zero3_init_flag"] is True  # models load partitioned
    assert zero3["zero3_save_16bit_model"] is True  # save_model writes one consolidated checkpoint
    for ds in (zero2, zero3):
        assert ds["offload_optimizer_device"] == "none" and ds["offload_param_device"] == "none"


def _wrapper(causal_cls, scalar_cls, config):
    from trl_ext.models import PolicyAndValueWrapper

    scalar_config = type(config)(**{**config.to_dict(), "num_labels": 1})
    return PolicyAndValueWrapper(causal_cls(config), scalar_cls(scalar_config))


def test_fsdp_config_wraps_the_layer_classes_of_any_policy_and_value_model():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    fsdp = load_config_from_file(str(CONFIGS / "fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False  # else unwrapped reward/ref models lack weights on rank > 0
    # no class named: accelerate's wrap policy takes the wrapper's `_no_split_modules` (the policy's and the value
    # model's own), so every layer of either architecture gets its own shard group and nothing else does
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    neox = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)
    llama = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32)
    for causal, scalar, config, layer in ((GPTNeoXForCausalLM, GPTNeoXForSequenceClassification, neox, "GPTNeoXLayer"),
                                          (LlamaForCausalLM, LlamaForSequenceClassification, llama,
                                           "LlamaDecoderLayer")):
        wrapper = _wrapper(causal, scalar, config)
        wraps = fsdp2_prepare_auto_wrap_policy(plugin, wrapper)
        wrapped = [type(m).__name__ for m in wrapper.modules() if wraps(m)]
        assert wrapped == [layer] * 4  # 2 layers of the policy, 2 of the value model


def test_configs_readme_gives_each_launch_line_and_says_what_was_run():
    readme = (CONFIGS / "README.md").read_text()
    for name in EXPECTED_CONFIGS:
        assert f"accelerate launch --config_file recipes/accelerate_configs/{name} recipes/ppo_tldr.py" in readme
    assert "None of these configs has been run on a GPU" in readme
    for test in re.findall(r"tests/((?:\w+/)?test_\w+\.py)::(test_\w+)", readme):  # every test it cites exists
        assert f"def {test[1]}(" in (REPO / "tests" / test[0]).read_text(), test


# ---------------------------------------------------------------------------------------------- arguments


def test_defaults_are_huang_et_al_2024():
    """The 1B TL;DR setting of Huang et al. (2024, arXiv:2403.17031), read from their code (module docstring)."""
    script_args, args, model_args = recipe.parse_args([])
    assert args.sft_model_path == "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    assert args.reward_model_path == "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr"
    assert model_args.model_name_or_path == "EleutherAI/pythia-1b-deduped"
    assert script_args.dataset_name == "trl-lib/tldr"
    assert (script_args.dataset_train_split, script_args.dataset_test_split) == ("train", "validation")
    assert args.learning_rate == 3e-6 and args.adam_epsilon == 1e-5 and args.lr_scheduler_type.value == "linear"
    assert args.total_episodes == 1_000_000
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches) == (16, 4, 1)
    assert args.local_rollout_forward_batch_size == 64
    assert args.num_ppo_epochs == 4
    assert args.response_length == 53 and args.temperature == 0.7
    assert args.stop_token == "eos" and args.missing_eos_penalty == 1.0
    assert args.kl_coef == 0.05 and args.kl_estimator == "k1" and args.whiten_rewards is False
    assert (args.vf_coef, args.cliprange, args.cliprange_value, args.gamma, args.lam) == (0.1, 0.2, 0.2, 1.0, 0.95)
    assert args.max_prompt_length == 512 and args.prompt_truncation == "drop"
    assert args.ds3_gather_for_generation is True
    assert args.critic_warmup_steps == 0  # Huang et al. had none


def test_docstring_table_is_what_the_parser_gives():
    """Every `--flag` | `value` row of the module docstring's table parses to the recipe's default, and every recipe
    default is in the table (so the documented sources cover every knob the recipe changes)."""
    rows = re.findall(r"^\| `(--\w+)` \| `([^`]*)` \|", recipe.__doc__, flags=re.M)
    assert len(rows) >= 30
    defaults = recipe.parse_args([])
    for flag, value in rows:
        parsed = recipe.parse_args([flag, value])
        name = flag[2:]
        # the instance (ScriptArguments, PPOConfig or ModelConfig) that has the field
        given, default = next((p, d) for p, d in zip(parsed, defaults) if hasattr(p, name))
        assert getattr(given, name) == getattr(default, name), (flag, value, getattr(default, name))
    documented = {flag[2:] for flag, _ in rows}
    undocumented = set(recipe.RECIPE_DEFAULTS) - documented - {"output_dir", "logging_steps", "report_to"}
    assert not undocumented, f"recipe defaults without a row in the docstring table: {undocumented}"


def test_flags_override_and_bad_combinations_are_errors():
    script_args, args, model_args = recipe.parse_args(["--kl_coef", "0.1", "--use_peft", "--lora_r", "8",
                                                       "--response_length", "64", "--ds3_gather_for_generation",
                                                       "False"])
    assert args.kl_coef == 0.1 and args.response_length == 64 and args.ds3_gather_for_generation is False
    assert model_args.use_peft is True and model_args.lora_r == 8
    peft_config = get_peft_config(model_args)  # TRL's helper, as the recipe calls it
    assert peft_config.r == 8 and peft_config.task_type == "CAUSAL_LM" and peft_config.target_modules == "all-linear"
    assert get_peft_config(recipe.parse_args([])[2]) is None
    with pytest.raises(ValueError, match="--use_peft"):
        recipe.parse_args(["--load_in_4bit"])
    with pytest.raises(SystemExit):  # ModelConfig's choices: argparse names the value and the choices
        recipe.parse_args(["--dtype", "fp8"])


# ---------------------------------------------------------------------------------------------- stand-ins


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _tldr_rows(n: int, seed: int) -> list[dict]:
    """TL;DR-shaped prompts in the tiny tokenizer's words, with a reference summary column (dropped by the recipe)."""
    import random

    from trl_ext.testing import WORDS

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        title = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
        post = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
        rows.append({"prompt": f"SUBREDDIT: r/w{i % 60} TITLE: {title} POST: {post} TL;DR:", "completion": " ok"})
    return rows


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """Local folders standing in for the hub names: SFT policy (+ tokenizer), reward model, TL;DR prompts."""
    from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("tldr_standins")
    tokenizer = tiny_tokenizer()
    for folder, model in (("sft", tiny_causal_lm(tokenizer, seed=0)), ("rm", tiny_scalar_model(tokenizer, seed=1))):
        model.save_pretrained(root / folder)
        tokenizer.save_pretrained(root / folder)
    (root / "data").mkdir()
    _write_jsonl(root / "data" / "train.jsonl", _tldr_rows(16, seed=0))
    _write_jsonl(root / "data" / "validation.jsonl", _tldr_rows(6, seed=1))
    _write_jsonl(root / "prompts.jsonl", _tldr_rows(8, seed=2))
    return root


def test_load_in_4bit_loads_the_policy_in_nf4(standins):
    """--use_peft --load_in_4bit (QLoRA for 7-8B policies on one GPU): the policy's linear layers are 4-bit NF4."""
    pytest.importorskip("bitsandbytes")
    script_args, args, model_args = recipe.parse_args(["--use_peft", "--load_in_4bit", "--sft_model_path",
                                                       str(standins / "sft"), "--reward_model_path",
                                                       str(standins / "rm")])
    policy, _, _ = recipe.load_models(args, script_args, model_args, pad_token_id=0)
    q_proj = policy.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear4bit" and q_proj.weight.quant_type == "nf4"
    assert policy.is_loaded_in_4bit


@pytest.mark.parametrize("flags, trained, frozen", [
    (["--dtype", "bfloat16", "--bf16", "true", "--use_cpu", "true"], "float32", "bfloat16"),
    (["--dtype", "float16", "--fp16", "true"], "float32", "float16"),
    (["--dtype", "float32"], "float32", "float32"),
])
def test_half_precision_loads_what_trains_whole_in_fp32(standins, flags, trained, frozen):
    """--dtype is for the frozen reward model; the policy and the value model train whole, so they load in fp32 (a
    GradScaler refuses fp16 gradients; bf16 AdamW loses small updates); with --use_peft the policy's base is frozen."""
    paths = ["--sft_model_path", str(standins / "sft"), "--reward_model_path", str(standins / "rm")]
    script_args, args, model_args = recipe.parse_args(flags + paths)
    policy, reward_model, value_model = recipe.load_models(args, script_args, model_args, pad_token_id=0)
    assert {str(p.dtype) for p in policy.parameters()} == {f"torch.{trained}"}
    assert {str(p.dtype) for p in value_model.parameters()} == {f"torch.{trained}"}
    assert {str(p.dtype) for p in reward_model.parameters()} == {f"torch.{frozen}"}
    script_args, args, model_args = recipe.parse_args(flags + paths + ["--use_peft"])
    policy, _, _ = recipe.load_models(args, script_args, model_args, pad_token_id=0)
    assert {str(p.dtype) for p in policy.parameters()} == {f"torch.{frozen}"}  # the adapter comes with the trainer


def test_half_precision_dtype_without_mixed_precision_is_an_error(standins):
    script_args, args, model_args = recipe.parse_args(["--dtype", "float16", "--sft_model_path", str(standins / "sft")])
    with pytest.raises(ValueError, match="--dtype float16 .* add --fp16 true"):
        recipe.load_models(args, script_args, model_args, pad_token_id=0)


def _main_argv(standins, out, *flags):
    return ["--output_dir", str(out), "--model_name_or_path", str(standins / "sft"),
            "--sft_model_path", str(standins / "sft"), "--reward_model_path", str(standins / "rm"),
            "--dataset_name", str(standins / "data"), "--eval_strategy", "no", "--total_episodes", "8",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--local_rollout_forward_batch_size", "4", "--response_length", "8", "--num_ppo_epochs", "1",
            "--save_strategy", "no", "--disable_tqdm", "True", "--learning_rate", "1e-3", *flags]


@pytest.mark.slow
def test_recipe_trains_in_fp16_through_the_grad_scaler(standins, tmp_path, fp16_on_cpu):
    """--dtype float16 --fp16 true, accelerate's fp16 path (autocast + GradScaler) faked on CPU: 2 steps, and the policy
    moved (before the fix: "Attempting to unscale FP16 gradients" at the first step)."""
    out = tmp_path / "run"
    summary = recipe.main(_main_argv(standins, out, "--dtype", "float16", "--fp16", "true"))
    assert summary["steps"] == 2
    _assert_moved(standins, out)


@pytest.mark.slow
def test_recipe_trains_in_bf16_on_fp32_master_weights(standins, tmp_path):
    out = tmp_path / "run"
    summary = recipe.main(_main_argv(standins, out, "--dtype", "bfloat16", "--bf16", "true", "--use_cpu", "true"))
    assert summary["steps"] == 2
    _assert_moved(standins, out, share=0.5)  # fp32 master weights: most weights move (bf16 AdamW moved 3.4 %)


def _assert_moved(standins, out, share: float = 0.0):
    import torch
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(standins / "sft").state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    changed = sum(int((before[k] != after[k].to(before[k].dtype)).sum()) for k in before)
    total = sum(v.numel() for v in before.values())
    assert changed > share * total, (changed, total)
    assert all(v.dtype == torch.float32 for v in after.values())


# ---------------------------------------------------------------------------------------------- hub errors


@pytest.fixture
def offline_hub(monkeypatch):
    """HF_HUB_OFFLINE=1 inside this process: huggingface_hub's HTTP session refuses every request."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _assert_clear_hub_message(message: str, name: str, flag: str) -> None:
    assert name in message and flag in message
    assert "Hugging Face Hub is unreachable" in message and "HF_HUB_OFFLINE=1 is set" in message
    assert "hf download" in message and "/path/to/" in message  # the fixes: download, or a local path


def test_tokenizer_by_name_with_the_hub_offline_is_a_clear_error(offline_hub):
    with pytest.raises(scripts.HubUnavailableError) as info:
        scripts.load_tokenizer("trl-ext-tests/not-cached-tokenizer", trust_remote_code=False)
    _assert_clear_hub_message(str(info.value), "trl-ext-tests/not-cached-tokenizer", "--model_name_or_path")


def test_dataset_by_name_with_the_hub_offline_is_a_clear_error(offline_hub):
    script_args, _, _ = recipe.parse_args(["--dataset_name", "trl-ext-tests/not-cached-tldr"])
    with pytest.raises(scripts.HubUnavailableError) as info:
        scripts.load_prompt_splits(script_args, evaluate=True)
    message = str(info.value)
    _assert_clear_hub_message(message, "trl-ext-tests/not-cached-tldr", "--dataset_name")
    assert "--repo-type dataset" in message and "prompts.jsonl" in message


@pytest.mark.parametrize("flag, what", [("--sft_model_path", "SFT policy"), ("--reward_model_path", "reward model")])
def test_models_by_name_with_the_hub_offline_are_clear_errors(offline_hub, standins, tmp_path, flag, what):
    """main() with everything local except one model: it names that model, after loading the local ones."""
    argv = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(standins / "sft"),
            "--dataset_name", str(standins / "data"), "--sft_model_path", str(standins / "sft"),
            "--reward_model_path", str(standins / "rm"), flag, "trl-ext-tests/not-cached-model"]
    with pytest.raises(scripts.HubUnavailableError) as info:
        recipe.main(argv)
    message = str(info.value)
    _assert_clear_hub_message(message, "trl-ext-tests/not-cached-model", flag)
    assert message.startswith(f"Cannot load the {what} ")


def test_hub_load_not_found_path_like_and_other_errors():
    def missing_repo():  # transformers' message when the hub answers "no such repository"
        raise OSError("org/typo is not a local folder and is not a valid model identifier listed on "
                      "'https://huggingface.co/models'")

    with pytest.raises(scripts.HubUnavailableError, match=r"'org/typo' \(--sft_model_path\).*no such model repository"):
        scripts.hub_load("SFT policy", "org/typo", missing_repo, "--sft_model_path")

    def broken_config():
        raise ValueError("config.json: unknown model_type 'nope'")

    with pytest.raises(ValueError, match="unknown model_type"):  # not a hub failure: passed through unchanged
        scripts.hub_load("SFT policy", "org/model", broken_config, "--sft_model_path")

    calls = []
    with pytest.raises(FileNotFoundError, match="'./no/such/folder'.*nothing there"):
        scripts.hub_load("SFT policy", "./no/such/folder", lambda: calls.append(1), "--sft_model_path")
    assert calls == []  # a path is never sent to the hub


def test_cli_exits_with_the_message_and_no_traceback(tmp_path):
    """`python recipes/ppo_tldr.py` with the hub offline and a hub name: exit status 1, the message, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    name = "trl-ext-tests/not-cached-base-model"
    proc = subprocess.run([sys.executable, str(RECIPE), "--output_dir", str(tmp_path / "out"),
                           "--model_name_or_path", name], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"[recipe] error: Cannot load the tokenizer '{name}' (--model_name_or_path)" in proc.stderr
    assert "hub" in proc.stderr.lower()
    assert not (tmp_path / "out").exists()  # failed before anything was written


# ---------------------------------------------------------------------------------------------- local data


def test_local_data_file_folder_and_saved_dataset(standins, tmp_path):
    from datasets import Dataset, DatasetDict

    def splits(name, evaluate=True, *extra):
        script_args, _, _ = recipe.parse_args(["--dataset_name", str(name), *extra])
        return scripts.load_prompt_splits(script_args, evaluate, script_args.eval_samples)

    # a folder of train.jsonl + validation.jsonl: both splits, only the prompt column, eval capped by --eval_samples
    train, test = splits(standins / "data", True, "--eval_samples", "4")
    assert (len(train), len(test)) == (16, 4) and train.column_names == ["prompt"] == test.column_names
    assert train[0]["prompt"].endswith("TL;DR:")

    # one data file: the train split; evaluation then needs a test split, and the error says how to go on
    train, test = splits(standins / "prompts.jsonl", False)
    assert len(train) == 8 and test is None
    with pytest.raises(ValueError, match=r"--dataset_test_split 'validation'.*\['train'\].*--eval_strategy no"):
        splits(standins / "prompts.jsonl", True)

    # a save_to_disk folder, pre-tokenized (TRL 1.12's form): `input_ids` is kept as the prompt column
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_dict({"input_ids": [[3, 4], [5]], "lengths": [2, 1]}),
                 "test": Dataset.from_dict({"input_ids": [[6]], "lengths": [1]})}).save_to_disk(str(saved))
    train, test = splits(saved, True, "--dataset_test_split", "test")
    assert train.column_names == ["input_ids"] and train["input_ids"] == [[3, 4], [5]] and len(test) == 1

    # no prompt column: the error names the columns and the fix
    bad = tmp_path / "bad.jsonl"
    _write_jsonl(bad, [{"text": "a"}])
    with pytest.raises(ValueError, match=r"columns \['text'\].*rename the prompt column to `prompt`"):
        splits(bad, False)


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_recipe_trains_end_to_end_on_cpu(standins, tmp_path):
    """`accelerate launch --config_file single_gpu.yaml --cpu` of the recipe, with the Huang et al. defaults except the
    sizes: 2 PPO steps of 4 rollouts on local stand-ins, evaluation every step, then save. ~30 s on 2 busy cores."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "single_gpu.yaml"),
           "--cpu", "--mixed_precision", "no", str(RECIPE),
           "--output_dir", str(out), "--model_name_or_path", str(standins / "sft"),
           "--sft_model_path", str(standins / "sft"), "--reward_model_path", str(standins / "rm"),
           "--dataset_name", str(standins / "data"), "--eval_samples", "4", "--per_device_eval_batch_size", "4",
           "--eval_steps", "1", "--total_episodes", "8", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "1", "--local_rollout_forward_batch_size", "4", "--response_length", "8",
           "--num_ppo_epochs", "1", "--save_strategy", "no", "--disable_tqdm", "True"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # everything is local: nothing may reach for the hub
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[recipe] done: 2 steps" in proc.stdout

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "val/explained_variance"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["objective/kl_coef"] == pytest.approx(0.05)
        # the EOS trick: the mean score is the reward model's mean minus 1.0 per response without EOS
        raw = [v for k, v in r.items() if k.startswith("objective/scores/")]
        assert len(raw) == 1
        assert r["objective/scores"] == pytest.approx(raw[0] - 1.0 * r["rollout/truncation_rate"], abs=1e-5)
        assert "eval/win_rate_vs_ref" in r  # evaluated on the validation split every step
    # learning rate 3e-6, decayed linearly to 0 over the 2 steps (logged before each step's scheduler update)
    assert [r["lr"] for r in records] == pytest.approx([3e-6, 1.5e-6])

    # the trained policy was saved, and it moved away from the SFT stand-in
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(standins / "sft").state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before)
    assert (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_recipe_under_the_multi_gpu_config_with_two_cpu_processes(standins, tmp_path):
    """`multi_gpu.yaml` (DDP) with 2 processes on CPU (gloo): each PPO step gathers 2 x 4 rollouts, every process
    evaluates its share of the prompts, rank 0 saves. ~35 s on 2 busy cores."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_gpu.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", str(RECIPE),
           "--output_dir", str(out), "--model_name_or_path", str(standins / "sft"),
           "--sft_model_path", str(standins / "sft"), "--reward_model_path", str(standins / "rm"),
           "--dataset_name", str(standins / "data"), "--eval_samples", "4", "--per_device_eval_batch_size", "2",
           "--eval_steps", "1", "--total_episodes", "16", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "1", "--local_rollout_forward_batch_size", "4", "--response_length", "8",
           "--num_ppo_epochs", "1", "--save_strategy", "no", "--disable_tqdm", "True"]
    # ACCELERATE_USE_CPU: DDP over gloo on CPU (`--cpu` with --num_processes 2 would start one process)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 steps x 8 rollouts (2 process(es))" in proc.stdout
    assert proc.stdout.count("[recipe] done: 2 steps") == 1  # printed by rank 0 only

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["episode"]) for r in records] == [(1, 8), (2, 16)]
    for r in records:
        for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "eval/score"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
    assert (out / "model.safetensors").is_file()


def test_the_7_8b_advice_names_a_config_the_planner_fits_on_its_gpu():
    """docs/scale-out.md's advice for 7-8B models on one GPU: the config it names, with the planner's figures as
    stated, fits that GPU (the recipe's own layout, a full critic beside a full reward model, does not)."""
    from trl_ext.tools.memory import GIB, PRESETS, PlanConfig, estimate_memory

    text = (REPO / "docs" / "scale-out.md").read_text()
    advice = re.search(r"for 7-8B models on one GPU use\s+`recipes/ppo_qlora_7b\.py --config "
                       r"recipes/qlora_7b/(\w+_(\d+)gb)\.yaml`.*?Llama-3-8B: ([\d.]+) GiB, ([\d.]+) GiB with headroom",
                       text, re.S)
    assert advice, "docs/scale-out.md no longer gives the 7-8B advice in the tested form"
    name, gpu, peak, needed = advice.group(1), int(advice.group(2)), float(advice.group(3)), float(advice.group(4))
    est = estimate_memory(PRESETS["llama-3-8b"], PlanConfig.from_file(str(REPO / "recipes" / "qlora_7b" /
                                                                         f"{name}.yaml")))
    assert (round(est.peak_bytes / GIB, 1), round(est.required_bytes / GIB, 1)) == (peak, needed)
    assert all(estimate_memory(shape, est.plan).fits(gpu) for shape in PRESETS.values())
    assert "recipes/ppo_qlora_7b.py" in recipe.__doc__
