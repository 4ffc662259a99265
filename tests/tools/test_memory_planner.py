"""The memory planner (trl_ext/tools/memory.py), its CLI subcommand, the 7B recipe configs and the CPU validation."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from trl_ext.tools.cli import main
from trl_ext.tools.memory import (
    GIB,
    PRESETS,
    ModelShape,
    PlanConfig,
    estimate_memory,
    load_shape,
    quantized_bytes_per_param,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "recipes", "qlora_7b")
TINY = ModelShape("tiny", hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=10)


def _load_benchmark(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- hand-computed numbers


def test_nf4_bytes_per_param():
    # 4 bits + one absmax per 64 weights: 8-bit with double quant (plus an fp32 scale per 256 absmaxes), fp32 without
    assert quantized_bytes_per_param("nf4") == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    assert round(quantized_bytes_per_param("nf4"), 3) == 0.516
    assert quantized_bytes_per_param("nf4", double_quant=False) == 0.5625
    assert quantized_bytes_per_param("bf16") == 2 and quantized_bytes_per_param("fp32") == 4


def test_tiny_shape_parameter_and_lora_counts():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 64+32+32+64+128+128+128 = 576
    assert TINY.linear_params == 2 * 576
    # + embeddings 10x8, lm_head 10x8, norms (2 per layer + 1) x 8
    assert TINY.num_parameters() == 1152 + 80 + 80 + 40
    assert TINY.num_parameters(lm_head=False) == 1152 + 80 + 40
    # LoRA r=2: r·(in + out): q 2·16, k 2·12, v 2·12, o 2·16, gate/up/down 2·24 each -> 256 per layer
    assert TINY.lora_params(2, PlanConfig().lora_targets) == 2 * 256
    assert TINY.lora_params(2, PlanConfig(lora_target_modules=["q_proj", "v_proj"]).lora_targets) == 2 * (32 + 24)


def test_static_memory_of_a_tiny_shared_plan():
    plan = PlanConfig(layout="shared", lora_r=2, per_device_train_batch_size=1, gradient_accumulation_steps=3,
                      local_rollout_forward_batch_size=3, max_prompt_length=5, response_length=7)
    est = estimate_memory(TINY, plan)
    values = list(est.static.values())
    assert values[0] == int(1152 * (0.5 + 1 / 64 + 4 / (64 * 256)))  # nf4 linears
    assert values[1] == (80 + 80 + 40) * 2  # embeddings, lm_head, norms in bf16
    assert values[2] == 2 * 512 * (4 + 8)  # policy + critic adapters: fp32 weights + two fp32 Adam states
    assert values[3] == 8 * (4 + 8) + 8 * 4  # value head (trained) + reward head (frozen)
    assert values[4] == 512 * 4  # frozen reward adapter
    training = est.phases[-1]
    assert training.extra_static == 2 * 512 * 4 + 8 * 4  # fp32 gradients of the trained parameters
    # KV cache: 2 (k, v) · L · 3 sequences · (5 + 7) tokens · kv dim 4 · 2 bytes
    kv = [v for k, v in est.phases[0].terms.items() if k.startswith("KV cache")]
    assert kv == [2 * 2 * 3 * 12 * 4 * 2]


def test_separate_layout_holds_three_bases_and_no_reward_adapter():
    separate = estimate_memory(TINY, PlanConfig(layout="separate", lora_r=2))
    bases = [k for k in separate.static if "base:" in k]
    assert len(bases) == 6  # (linears, rest) for policy, critic, reward
    assert not any("reward adapter" in k for k in separate.static)
    # critic and reward bases have no lm_head: their "rest" is embeddings + norms only
    rest = [v for k, v in separate.static.items() if "embeddings" in k]
    assert rest == [(80 + 80 + 40) * 2, (80 + 40) * 2, (80 + 40) * 2]
    # for a 7B model, three 4-bit bases outweigh one base plus a frozen reward adapter
    mistral = PRESETS["mistral-7b"]
    assert (estimate_memory(mistral, PlanConfig(layout="separate")).static_bytes
            > estimate_memory(mistral, PlanConfig(layout="shared")).static_bytes + 4 * GIB)


@pytest.mark.parametrize("name, billions", [("llama-2-7b", 6.74), ("llama-3-8b", 8.03), ("mistral-7b", 7.24),
                                            ("qwen2.5-7b", 7.62)])
def test_preset_parameter_counts(name, billions):
    assert round(PRESETS[name].num_parameters() / 1e9, 2) == billions


def test_llama_2_7b_exact_count_and_lora_size():
    assert PRESETS["llama-2-7b"].num_parameters() == 6_738_415_616
    # r=16 on all 7 linear kinds: 32 layers · 16 · (4·(4096+4096) + 3·(4096+11008)) = 39,976,960 (~40M, 0.6 GiB
    # trained with fp32 weights, gradients and Adam states)
    assert PRESETS["llama-2-7b"].lora_params(16, PlanConfig().lora_targets) == 39_976_960


def test_config_json_is_read(tmp_path):
    # Qwen2.5-7B's config.json fields; q/k/v biases come from model_type qwen2
    config = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
              "tie_word_embeddings": False}
    path = tmp_path / "qwen" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    shape = load_shape(str(path))
    assert shape.num_parameters() == PRESETS["qwen2.5-7b"].num_parameters()
    assert load_shape(str(path.parent)).name == "qwen"  # a folder holding config.json works too
    assert ModelShape.from_config({**config, "model_type": "llama"}).attention_bias is False


# ------------------------------------------------------------------------------------------- the activation model


def _saved_bytes(model, inputs):
    """Bytes of the tensors autograd saves for backward in one forward (parameters excluded, storages counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype, autocast", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_saved_activations_per_layer_match_autograd(dtype, autocast):
    """The planner's per-layer saved-for-backward bytes, against what autograd really saves for HF's Llama with peft
    LoRA (fp32: inputs shared by q/k/v; bf16 without autocast: peft's fp32 cast per layer; bf16 under autocast: the
    bf16 recast per layer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_ext.tools.memory import _layer_saved_per_token

    shape = ModelShape("t", 64, 160, 3, 4, 2, 50)
    plan = PlanConfig(base_dtype=dtype, compute_dtype=dtype, autocast=autocast, lora_r=4, max_prompt_length=24,
                      response_length=8)
    torch.manual_seed(0)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = LlamaForCausalLM(LlamaConfig(**shape.to_config(), pad_token_id=0)).to(torch_dtype)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    b, S = 2, 32
    mask = torch.ones(b, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as in PPO batches
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        measured = _saved_bytes(model, {"input_ids": torch.randint(1, 50, (b, S)), "attention_mask": mask})
    a = 4 if dtype == "fp32" else 2
    per_token = sum(_layer_saved_per_token(shape, plan, a, S).values())
    planned = shape.num_hidden_layers * b * S * per_token
    assert planned == pytest.approx(measured, rel=0.05)


def test_checkpointing_and_chunking_lower_the_training_peak():
    shape = PRESETS["mistral-7b"]
    base = dict(layout="shared", per_device_train_batch_size=4, gradient_accumulation_steps=4)
    on = estimate_memory(shape, PlanConfig(**base, gradient_checkpointing=True))
    off = estimate_memory(shape, PlanConfig(**base, gradient_checkpointing=False))
    assert on.phases[-1].name.startswith("training step (with")
    assert on.phase_total(on.phases[-1]) < off.phase_total(off.phases[-1])
    # the table's alternative row is the other setting, computed the same way
    assert on.phase_total(on.alternative_training) == off.phase_total(off.phases[-1])
    # a large vocabulary: the logits matter
    chunked = estimate_memory(PRESETS["llama-3-8b"], PlanConfig(**base, chunked_logits=True))
    full = estimate_memory(PRESETS["llama-3-8b"], PlanConfig(**base, chunked_logits=False))
    assert chunked.peak_bytes < full.peak_bytes
    for c, f in zip(chunked.phases[1:], full.phases[1:3]):  # policy+value and reference scoring
        assert c.activations < f.activations
    # twice the micro-batch, same rollout batch: more activation memory, same static memory
    big = estimate_memory(shape, PlanConfig(**{**base, "per_device_train_batch_size": 8,
                                               "gradient_accumulation_steps": 2}))
    assert big.static_bytes == on.static_bytes and big.peak_bytes > on.peak_bytes


# ------------------------------------------------------------------------------------------- padding-free plans


def test_packed_passes_by_hand():
    """forward_pass: padded rows, packed rows without a budget, and a budget's worst packing (rows of
    min_prompt_length + T tokens, the remainder a row of its own)."""
    from trl_ext.tools.memory import forward_pass

    base = dict(max_prompt_length=32, response_length=64)
    padded = forward_pass(PlanConfig(**base), rows=4)
    assert (padded.tokens, padded.logit_positions, padded.mask) == (4 * 96, 4 * 65, 96)
    packed = forward_pass(PlanConfig(**base, padding_free=True), rows=4)
    assert (packed.tokens, packed.logit_positions, packed.mask) == (384, 4 * 64, 384)
    # 200 tokens, prompts of 1: 3 rows of 1 + 64 (192 response tokens) and a row of 5 (4 response tokens)
    worst = forward_pass(PlanConfig(**base, padding_free=True, max_tokens_per_micro_batch=200), rows=8)
    assert (worst.tokens, worst.logit_positions, worst.mask) == (200, 196, 200)
    # prompts of at least 32: 2 rows of 96 and 8 tokens that cannot hold a response
    long_prompts = forward_pass(PlanConfig(**base, padding_free=True, max_tokens_per_micro_batch=200,
                                           min_prompt_length=32), rows=8)
    assert (long_prompts.tokens, long_prompts.logit_positions) == (200, 128)
    # a budget above what the rows can hold: the rows at full length
    few = forward_pass(PlanConfig(**base, padding_free=True, max_tokens_per_micro_batch=1000), rows=2)
    assert (few.tokens, few.logit_positions) == (192, 128)


def test_a_token_budget_bounds_the_training_step_by_tokens():
    shape = PRESETS["llama-3-8b"]
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=8, max_prompt_length=512,
                response_length=256, padding_free=True, min_prompt_length=512)
    rows = estimate_memory(shape, PlanConfig(**base))
    # a budget of the 4 rows' tokens (and prompts as long as in the padded plan): the same training step
    same = estimate_memory(shape, PlanConfig(**base, max_tokens_per_micro_batch=4 * 768))
    assert same.phase_total(same.phases[-1]) == rows.phase_total(rows.phases[-1])
    # twice the budget costs more; shorter prompts make the worst packing hold more response tokens (logits)
    double = estimate_memory(shape, PlanConfig(**base, max_tokens_per_micro_batch=8 * 768))
    short = estimate_memory(shape, PlanConfig(**{**base, "min_prompt_length": 1}, max_tokens_per_micro_batch=8 * 768))
    assert rows.phase_total(rows.phases[-1]) < double.phase_total(double.phases[-1]) < short.phase_total(
        short.phases[-1])
    # the static part and generation do not depend on how the passes are packed
    assert double.static_bytes == rows.static_bytes
    assert double.phase_total(double.phases[0]) == rows.phase_total(rows.phases[0])


def test_bad_token_budgets_are_errors():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4096 needs padding_free: true"):
        PlanConfig(max_tokens_per_micro_batch=4096)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=300 cannot hold the longest row: "
                       "max_prompt_length \\+ response_length = 512"):
        PlanConfig(padding_free=True, max_tokens_per_micro_batch=300)
    with pytest.raises(ValueError, match="needs chunked_logits: true"):
        PlanConfig(padding_free=True, chunked_logits=False)
    with pytest.raises(ValueError, match="min_prompt_length=300 is above max_prompt_length=256"):
        PlanConfig(min_prompt_length=300)


def test_largest_response_length_is_the_last_that_fits():
    from dataclasses import replace

    from trl_ext.tools.memory import largest_response_length

    plan = PlanConfig.from_file(_recipe("shared_16gb"))
    for name in ("llama-3-8b", "mistral-7b"):
        T = largest_response_length(PRESETS[name], plan, 16)
        assert estimate_memory(PRESETS[name], replace(plan, response_length=T)).fits(16)
        assert not estimate_memory(PRESETS[name], replace(plan, response_length=T + 1)).fits(16)
    # a token budget caps it at the longest row the budget holds
    budget = replace(plan, padding_free=True, max_tokens_per_micro_batch=1024)
    assert largest_response_length(PRESETS["mistral-7b"], budget, 24) == 1024 - plan.max_prompt_length
    # nothing fits a 1 GB GPU: the base alone is larger
    assert largest_response_length(PRESETS["mistral-7b"], plan, 1) == 0


@pytest.mark.parametrize("recipe, gib", [("shared_24gb", 24), ("shared_16gb", 16), ("shared_12gb", 12),
                                         ("separate_24gb", 24)])
def test_recipe_comments_state_the_longest_response_that_fits(recipe, gib):
    from trl_ext.tools.memory import largest_response_length

    plan = PlanConfig.from_file(_recipe(recipe))
    with open(_recipe(recipe)) as fh:
        text = fh.read()
    assert f"# Longest response that fits {gib} GB" in text
    stated = dict(re.findall(r"#\s+(\S+)\s+longest response\s+(\d+) tokens", text))
    assert stated == {name: str(largest_response_length(shape, plan, gib)) for name, shape in PRESETS.items()}


def test_cli_plans_a_token_budget(capsys):
    assert main(["estimate-memory", _recipe("shared_16gb"), "--max_tokens_per_micro_batch", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["padding_free"] and data["plan"]["max_tokens_per_micro_batch"] == 4096
    plan = PlanConfig.from_file(_recipe("shared_16gb"))
    packed = PlanConfig(**{**data["plan"]})
    assert data["peak_bytes"] == estimate_memory(PRESETS["mistral-7b"], packed).peak_bytes
    assert data["peak_bytes"] != estimate_memory(PRESETS["mistral-7b"], plan).peak_bytes
    assert main(["estimate-memory", _recipe("shared_16gb"), "--max_tokens_per_micro_batch", "4096"]) == 0
    out = capsys.readouterr().out
    assert "padding-free with at most 4096 tokens a pass" in out and "4096 packed tokens" in out
    assert re.search(r"longest response that fits, the rest as planned: 24 GB: \d+ tokens", out)
    assert main(["estimate-memory", _recipe("shared_16gb"), "--max_tokens_per_micro_batch", "100"]) == 2
    assert "cannot hold the longest row" in capsys.readouterr().err
    assert main(["estimate-memory", _recipe("shared_16gb"), "--max_tokens_per_micro_batch", "0"]) == 2
    assert "max_tokens_per_micro_batch=0 must be a positive int" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- recipes


def _recipe(name):
    return os.path.join(RECIPES, f"{name}.yaml")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_shared_16gb_recipe_fits_16gb(preset):
    est = estimate_memory(PRESETS[preset], PlanConfig.from_file(_recipe("shared_16gb")))
    assert est.fits(16)
    assert est.verdicts()["16 GB"].startswith("fits")


@pytest.mark.parametrize("recipe, gib", [("shared_24gb", 24), ("shared_12gb", 12), ("separate_24gb", 24)])
def test_other_recipes_fit_their_gpu(recipe, gib):
    for shape in PRESETS.values():
        assert estimate_memory(shape, PlanConfig.from_file(_recipe(recipe))).fits(gib), (recipe, shape.name)


@pytest.mark.parametrize("recipe", ["shared_24gb", "shared_16gb", "shared_12gb", "separate_24gb"])
def test_recipe_comments_state_the_planners_current_estimate(recipe):
    plan = PlanConfig.from_file(_recipe(recipe))
    with open(_recipe(recipe)) as fh:
        stated = re.findall(r"#\s+(\S+)\s+peak\s+([\d.]+), needed\s+([\d.]+)", fh.read())
    assert sorted(name for name, _, _ in stated) == sorted(PRESETS)
    for name, peak, needed in stated:
        est = estimate_memory(PRESETS[name], plan)
        assert (float(peak), float(needed)) == (round(est.peak_bytes / GIB, 1), round(est.required_bytes / GIB, 1))


def test_recipe_keys_are_ppo_config_fields_where_they_exist():
    import dataclasses

    from trl_ext import PPOConfig

    ppo_fields = {f.name for f in dataclasses.fields(PPOConfig)}
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                "local_rollout_forward_batch_size", "max_prompt_length", "response_length", "gradient_checkpointing",
                "optim"):
        assert key in ppo_fields
        assert key in {f.name for f in dataclasses.fields(PlanConfig)}


# ------------------------------------------------------------------------------------------- CLI and errors


def test_cli_prints_the_table(capsys):
    assert main(["estimate-memory", _recipe("shared_16gb")]) == 0
    out = capsys.readouterr().out
    assert "model mistral-7b" in out and "phase: generation (KV cache)" in out
    assert re.search(r"16 GB: fits", out)
    assert main(["estimate-memory", _recipe("shared_16gb"), "--model", "llama-2-7b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "llama-2-7b"
    plan = PlanConfig.from_file(_recipe("shared_16gb"))
    assert data["peak_bytes"] == estimate_memory(PRESETS["llama-2-7b"], plan).peak_bytes


def test_cli_all_presets_summary(capsys):
    assert main(["estimate-memory", _recipe("shared_12gb"), "--all-presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + len(PRESETS)
    plan = PlanConfig.from_file(_recipe("shared_12gb"))
    for line, (name, shape) in zip(lines[1:], PRESETS.items()):
        est = estimate_memory(shape, plan)
        assert line.split()[:3] == [name, f"{est.peak_bytes / GIB:.1f}", f"{est.required_bytes / GIB:.1f}"]
        assert line.split()[-3:] == ["fits" if est.fits(g) else "no" for g in (24, 16, 12)]


def test_cli_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "trl_ext.tools.cli", "estimate-memory", _recipe("shared_12gb"),
                           "--model", "qwen2.5-7b"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "qwen2.5-7b" in proc.stdout and "12 GB:" in proc.stdout


def test_unknown_preset_names_the_known_ones(capsys):
    with pytest.raises(ValueError, match="known presets: llama-2-7b, llama-3-8b, mistral-7b, qwen2.5-7b"):
        ModelShape.from_preset("llama-7b")
    assert main(["estimate-memory", _recipe("shared_16gb"), "--model", "gpt-2"]) == 2
    err = capsys.readouterr().err
    assert "'gpt-2'" in err and "llama-2-7b" in err


def test_bad_plan_files_are_errors(tmp_path, capsys):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("model: mistral-7b\nper_device_batch_size: 4\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['per_device_batch_size'\]"):
        PlanConfig.from_file(str(bad_key))
    assert main(["estimate-memory", str(bad_key)]) == 2
    assert "per_device_batch_size" in capsys.readouterr().err
    assert main(["estimate-memory", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    no_model = tmp_path / "b.json"
    no_model.write_text(json.dumps({"layout": "shared"}))
    assert main(["estimate-memory", str(no_model)]) == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="layout='both' must be 'shared' or 'separate'"):
        PlanConfig(layout="both")
    with pytest.raises(ValueError, match="base_dtype='int4'"):
        PlanConfig(base_dtype="int4")
    with pytest.raises(ValueError, match="per_device_train_batch_size=0 must be a positive int"):
        PlanConfig(per_device_train_batch_size=0)
    with pytest.raises(ValueError, match=r"unknown \['qkv_proj'\]"):
        PlanConfig(lora_target_modules=["qkv_proj"])
    with pytest.raises(ValueError, match="optim='rmsprop'"):
        PlanConfig(optim="rmsprop")


def test_report_subcommand_still_exists(capsys):
    assert main(["report", "/nonexistent/run"]) == 2
    assert "trl-ext report: error" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- benchmarks


def test_gpu_benchmark_fails_clearly_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run for real")
    bench = _load_benchmark("memory_7b_gpu")
    assert bench.main(["--model", "llama-2-7b"]) == 2
    assert "CUDA" in capsys.readouterr().err
    # its estimate part runs anywhere
    plan = bench.benchmark_plan(PlanConfig.from_file(_recipe("shared_16gb")), iterations=2)
    est = estimate_memory(PRESETS["llama-2-7b"], plan)
    assert est.peak_bytes > 0 and plan.layout == "shared"


def _validation():
    return _load_benchmark("validate_memory_cpu")


def _shortened(config: dict) -> dict:
    """Padded rows at half the benchmark's sequences, 16 + 32 tokens: bf16 is emulated on CPUs without AVX-512 BF16,
    2-3x the time of fp32 at the benchmark's 32 + 64. The packed rows keep the benchmark's (the planner's packed
    update is 11 % under the trainer's at 2 rows of 48 tokens in 96)."""
    return {} if config.get("padding_free") else dict(max_prompt_length=16, response_length=32)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(_validation().CONFIGS))
def test_the_planner_is_within_10_percent_of_the_real_trainer_in_every_phase(config):
    """The real PPOTrainer on CPU (fp32 and bf16 autocast, separate and shared layouts, LoRA, nf4, checkpointing),
    its live tensor bytes per phase against the planner's static + phase."""
    bench = _validation()
    (result,) = bench.validate([config], **_shortened(bench.CONFIGS[config]))
    assert {row["phase"] for row in result["rows"]} >= {"generation", "policy_and_value", "reference", "update"}
    assert abs(result["static"]["error"]) < 0.01, bench.format_report([result])
    for row in result["rows"]:
        assert abs(row["error"]) < 0.10, bench.format_report([result])


def test_the_rollout_batch_is_ppoconfigs_local_batch_size():
    # PPOConfig: per_device_train_batch_size x gradient_accumulation_steps, split into num_mini_batches minibatches
    plan = PlanConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=2)
    assert plan.local_batch_size == 8


def test_log_prob_chunks_are_at_most_the_response_length():
    shape = PRESETS["llama-2-7b"]
    short, long = (estimate_memory(shape, PlanConfig(response_length=r, logits_chunk_size=64)) for r in (16, 64))
    chunk_term = lambda est: next(v for p in est.phases if p.name.startswith("scoring: reference")  # noqa: E731
                                  for k, v in p.terms.items() if "log-probs" in k)
    assert chunk_term(short) * 4 == chunk_term(long)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_gpu_benchmark_code_path_runs_on_cpu_with_a_tiny_4bit_model(layout):
    """The benchmark's 4-bit model building and its PPO run through trl_ext.PPOTrainer, on CPU (nf4 works there)."""
    bench = _load_benchmark("memory_7b_gpu")
    shape = ModelShape("tiny4bit", 64, 128, 2, 4, 2, 300)
    plan = PlanConfig(layout=layout, compute_dtype="fp32", lora_r=4, per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, local_rollout_forward_batch_size=2, max_prompt_length=6,
                      response_length=2)
    model = bench.build_4bit_llama(shape, plan, "cpu")
    import bitsandbytes as bnb

    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 7 * shape.num_hidden_layers
    assert all(m.weight.quant_state is not None for m in linears)  # quantized, not merely wrapped
    result = bench.run(shape, plan, iterations=1, device="cpu")
    # what ran, not how fast: the seconds are kept unrounded (a tiny run once rounded to 0.0 and failed here)
    assert result["estimate"]["peak_gib"] > 0 and result["measured"]["iterations"] == 1
    assert 0 < result["measured"]["train_seconds"] < float("inf")
    assert "(PPO iterations: 1)" in bench.format_result(result)
