"""QLoRA PPO of a 7-8B model on one GPU (24, 16 or 12 GB), from a recipe config of recipes/qlora_7b/.

    python recipes/ppo_qlora_7b.py --config recipes/qlora_7b/shared_16gb.yaml \\
        --model_name_or_path mistralai/Mistral-7B-Instruct-v0.2 --reward_adapter runs/rm-adapter \\
        --dataset_name trl-lib/tldr --output_dir runs/qlora-7b

What it does, in order:

1. Reads the config (`--config`, a YAML of `trl_ext.memory.PlanConfig` fields, the file `trl-ext estimate-memory`
   reads) and maps its keys:
   - PPOConfig's names (`per_device_train_batch_size`, `gradient_accumulation_steps`, `num_mini_batches`,
     `local_rollout_forward_batch_size`, `max_prompt_length`, `response_length`, `gradient_checkpointing`, `optim`)
     -> those PPOConfig fields;
   - `base_dtype`, `bnb_4bit_use_double_quant`, `compute_dtype` -> `BitsAndBytesConfig(load_in_4bit=True,
     bnb_4bit_quant_type=base_dtype, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=compute_dtype)` (int8:
     `load_in_8bit`; bf16/fp16/fp32: no quantization), and `compute_dtype` -> PPOConfig `bf16`/`fp16` (autocast);
   - `lora_r`, `lora_target_modules` -> `LoraConfig(r, target_modules)` (`--lora_alpha`, default 2·r);
   - `layout` (shared | separate), `model` (the planner's preset, used when the model's own config.json cannot be
     read), and the planner-only keys (`chunked_logits`, `logits_chunk_size`, `cuda_overhead_gib`, ...).
   Every key is also a flag, and a flag given on the command line wins over the YAML (`--response_length 128`,
   `--lora_r 8`, `--compute_dtype fp16`); any other PPOConfig field is a flag too (`--learning_rate`, `--kl_coef`).
   A YAML key that is not a PlanConfig field is an error naming it (the file must stay readable by the planner).
2. Before loading anything, prints the planner's estimate (trl_ext/memory.py) for this config and the model's shape
   (its config.json), and on a CUDA machine compares it with the GPU's free memory, with a warning if it won't fit.
3. Loads the model(s) and trains:
   - `layout: shared`: one 4-bit base (`trl_ext.models.build_shared_base`): the policy and critic are LoRA adapters
     of it, the reference is the base with adapters disabled, the value head is a fp32 linear on its hidden states;
     the reward is a frozen adapter (`--reward_adapter`), a separate 4-bit reward model (`--reward_model_path`) or a
     built-in function (`--reward_function vader`, for smoke tests);
   - `layout: separate`: policy = 4-bit base + LoRA (reference = its adapter disabled), critic = its own 4-bit
     sequence-classification model (`--value_model_path`, default the policy's base) to which trl_ext gives LoRA on
     every linear layer (the policy's r and alpha) and a trained fp32 score head, reward = a 4-bit reward model
     (`--reward_model_path`, or the base + `--reward_adapter`) or `--reward_function`.
4. Saves the trained adapters and heads to `--output_dir`, and prints `torch.cuda.max_memory_allocated()` next to the
   planner's estimate (also written to `output_dir/memory.json`).

`--reward_adapter` is the folder peft's `save_pretrained` wrote for a LoRA sequence-classification model on the same
base (TRL's RewardTrainer with `peft_config=LoraConfig(task_type="SEQ_CLS", ...)`): `adapter_config.json` and
`adapter_model.safetensors` with the `score` head.

Prompts (`--dataset_name`): a hub dataset, a local data file (.jsonl/.json/.csv/.parquet with a `prompt` column) or
folder, read by recipes/ppo_tldr.py's loader (its hub errors: `HubUnavailableError` naming what failed and the
fixes). Default: the 80 shipped opinion prompts (recipes/data/opinion_prompts.jsonl). Text prompts are rendered with
the tokenizer's chat template when it has one (`--prompt_format auto`).

Outputs: shared: `policy/`, `critic/` (peft adapters: `PeftModel.from_pretrained(base, output_dir + "/policy")`),
`value_head.safetensors`; separate: the policy adapter at the top level and `critic/`; both: the tokenizer,
metrics.jsonl, samples.jsonl, memory.json.

Status: run end to end on CPU only, on a tiny random Llama in nf4 (tests/test_qlora_recipe.py); not yet run on a GPU
or on a 7B model (see recipes/qlora_7b/README.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_RECIPES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_RECIPES))  # trl_ext from a checkout, uninstalled
sys.path.insert(0, _RECIPES)  # ppo_tldr.py and sentiment.py, whatever the working directory

from ppo_tldr import HubUnavailableError, hub_load, load_prompt_splits, load_tokenizer  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402

from trl_ext import PPOConfig  # noqa: E402
from trl_ext.memory import (  # noqa: E402
    GIB,
    ModelShape,
    PlanConfig,
    estimate_memory,
    load_shape,
    quantized_bytes_per_param,
)

DEFAULT_PROMPTS = os.path.join(_RECIPES, "data", "opinion_prompts.jsonl")
MEMORY_FILE = "memory.json"

PPO_FIELDS = frozenset(f.name for f in dataclasses.fields(PPOConfig))
PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(PlanConfig))
# Plan keys that are flags of this script (ScriptArguments); the PPOConfig-named ones are PPOConfig's flags.
SCRIPT_PLAN_KEYS = ("layout", "base_dtype", "bnb_4bit_use_double_quant", "compute_dtype", "lora_r",
                    "lora_target_modules")
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig fields. The plan keys among them (layout ... lora_target_modules) default
    to the YAML's values; given on the command line, they win."""

    config: str | None = field(
        default=None, metadata={"help": "Recipe config: recipes/qlora_7b/{shared_24gb,shared_16gb,shared_12gb,"
                                "separate_24gb}.yaml or your own file of trl_ext.memory.PlanConfig fields."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder of the model PPO starts from (an SFT/instruct "
                                "model), with its tokenizer. Required."})
    reward_adapter: str | None = field(
        default=None, metadata={"help": "Folder of a LoRA sequence-classification reward adapter trained on the same "
                                "base (peft save_pretrained of RewardTrainer's model): the reward, frozen."})
    reward_function: str | None = field(
        default=None, metadata={"help": "A built-in reward function instead of a reward model: 'vader' (positive "
                                "sentiment of the completion, needs vaderSentiment). For smoke tests."})
    reward_tokenizer_path: str | None = field(
        default=None, metadata={"help": "Tokenizer of a --reward_model_path that does not share the policy's "
                                "tokenizer (the text is re-tokenized for it)."})
    value_model_path: str | None = field(
        default=None, metadata={"help": "layout separate: the model the critic starts from (e.g. the reward model). "
                                "Unset: --model_name_or_path with a fresh, zeroed value head."})
    dataset_name: str = field(
        default=DEFAULT_PROMPTS, metadata={"help": "Hub dataset name, local data file (.jsonl/.json/.csv/.parquet, a "
                                           "`prompt` column) or folder. Default: the shipped opinion prompts."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name, if any."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="validation", metadata={"help": "Split to evaluate on (with "
                                                                     "--eval_strategy steps)."})
    eval_samples: int = field(default=64, metadata={"help": "Evaluate on the first N prompts of the test split."})
    prompt_format: str = field(
        default="auto", metadata={"help": "Text prompts: 'chat' (one user message, rendered with the chat template), "
                                  "'text' (as is), 'auto' (chat if the tokenizer has a chat template)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha. Unset: 2 x lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. 'sdpa', 'flash_attention_2'."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with custom code from the hub."})
    # plan keys (unset: the YAML's value)
    layout: str | None = field(default=None, metadata={"help": "'shared' or 'separate' (YAML: layout)."})
    base_dtype: str | None = field(default=None, metadata={"help": "nf4, fp4, int8, bf16, fp16, fp32 (YAML)."})
    bnb_4bit_use_double_quant: bool | None = field(default=None, metadata={"help": "Double quantization (YAML)."})
    compute_dtype: str | None = field(
        default=None, metadata={"help": "bf16, fp16 or fp32: bnb_4bit_compute_dtype and PPOConfig bf16/fp16 (YAML). "
                                "fp16 on GPUs without bf16 (T4, V100); fp32 for CPU smoke runs."})
    lora_r: int | None = field(default=None, metadata={"help": "LoRA rank (YAML)."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "'all-linear' or comma-separated names, e.g. 'q_proj,v_proj' (YAML)."})


# Not tuned on a 7B (no GPU run yet): the learning rate is ~10x the full-model rate of Huang et al. (2024), as usual
# for LoRA; the rest are trl_ext's/TRL's defaults made explicit.
RECIPE_DEFAULTS = dict(
    output_dir="runs/ppo-qlora-7b",
    sft_model_path=None,  # TRL's default names a hub model; this recipe takes --model_name_or_path
    reward_model_path=None,
    learning_rate=3e-5,
    total_episodes=10_000,
    num_ppo_epochs=4,
    kl_coef=0.05,
    temperature=0.7,
    missing_eos_penalty=1.0,
    value_head_init="zero",
    eval_strategy="no",
    save_strategy="steps",
    save_steps=100,
    logging_steps=1,
    report_to="none",
)


# ------------------------------------------------------------------------------------------------ config


def read_recipe_config(path: str) -> dict:
    """The YAML's keys, checked: every key a PlanConfig field, every value valid (PlanConfig's own checks)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path!r} does not exist; use one of recipes/qlora_7b/*.yaml.")
    import yaml

    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of keys, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - PLAN_FIELDS)
    if unknown:
        ppo = [k for k in unknown if k in PPO_FIELDS]
        hint = (f" PPOConfig fields that the memory plan does not use ({', '.join(ppo)}) go on the command line "
                f"(--{ppo[0]} ...), so that `trl-ext estimate-memory` can still read the file." if ppo else "")
        raise ValueError(f"--config {path!r}: unknown key(s) {unknown}.{hint} Known keys: {sorted(PLAN_FIELDS)}.")
    PlanConfig.from_dict(raw, source=path)  # value checks
    if raw.get("lora_dtype", "fp32") != "fp32":
        raise ValueError(f"--config {path!r}: lora_dtype={raw['lora_dtype']!r}; this recipe trains adapters in fp32 "
                         "(peft's default): remove the key or set it to fp32.")
    if raw.get("chunked_logits", True) is not True:
        raise ValueError(f"--config {path!r}: chunked_logits=false plans TRL 1.12's forwards; trl_ext always computes "
                         "the logits of the response positions only and log-probs in chunks: set it to true.")
    from trl_ext.models import LOGPROB_CHUNK

    if raw.get("logits_chunk_size", LOGPROB_CHUNK) != LOGPROB_CHUNK:
        raise ValueError(f"--config {path!r}: logits_chunk_size={raw['logits_chunk_size']}, but trl_ext takes "
                         f"log-probs {LOGPROB_CHUNK} positions at a time: set it to {LOGPROB_CHUNK}.")
    return raw


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` in argv (the last one), else None."""
    value = None
    for i, token in enumerate(argv):
        if token == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(f"--{name}="):
            value = token.split("=", 1)[1]
    return value


def _flag_set(argv: list[str], name: str) -> bool:
    """Whether a boolean flag is on: `--name`, `--name True`, `--name=true` (HfArgumentParser's forms)."""
    for i, token in enumerate(argv):
        if token == f"--{name}":
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            return following.startswith("--") or following.lower() in ("true", "1", "yes")
        if token.startswith(f"--{name}="):
            return token.split("=", 1)[1].lower() in ("true", "1", "yes")
    return False


def _bf16_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, PlanConfig]:
    """Command line + the YAML -> (ScriptArguments, trl_ext.PPOConfig, the PlanConfig of this run).

    Precedence: command line > YAML > RECIPE_DEFAULTS > PPOConfig's defaults. The returned plan holds the final
    values (after command-line overrides), so the memory estimate describes the run that happens."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**RECIPE_DEFAULTS)
    config = _flag_value(argv, "config")
    if config is None:
        if {"-h", "--help"} & set(argv):
            parser.parse_args_into_dataclasses(args=argv)  # prints the help and exits
        raise ValueError("--config is required: one of recipes/qlora_7b/{shared_24gb,shared_16gb,shared_12gb,"
                         "separate_24gb}.yaml (or your own file of trl_ext.memory.PlanConfig fields).")
    raw = read_recipe_config(config)

    defaults = {k: v for k, v in raw.items() if k in PPO_FIELDS or k in SCRIPT_PLAN_KEYS}
    if isinstance(defaults.get("lora_target_modules"), list):
        defaults["lora_target_modules"] = ",".join(defaults["lora_target_modules"])
    # mixed precision follows compute_dtype unless --bf16/--fp16 is given
    compute = _flag_value(argv, "compute_dtype") or raw.get("compute_dtype", PlanConfig.compute_dtype)
    if not any(token.split("=", 1)[0] in ("--bf16", "--fp16") for token in argv):
        autocast = raw.get("autocast")
        defaults["bf16"] = compute == "bf16" and autocast is not False
        defaults["fp16"] = compute == "fp16" and autocast is not False
        if defaults["bf16"] and not _bf16_available() and not _flag_set(argv, "use_cpu"):
            import torch

            where = (f"this GPU ({torch.cuda.get_device_name()}) does not support bf16" if torch.cuda.is_available()
                     else "this machine has no CUDA GPU")
            raise ValueError(f"compute_dtype=bf16 ({config}) trains in bf16 autocast, but {where}. Pass "
                             "--compute_dtype fp16 on a GPU without bf16 (T4, V100), or --compute_dtype fp32 for a "
                             "CPU smoke run.")
    parser.set_defaults(**defaults)
    script_args, args = parser.parse_args_into_dataclasses(args=argv)

    if not script_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required: the hub name or local folder of the model to train "
                         "(e.g. mistralai/Mistral-7B-Instruct-v0.2).")
    if args.sft_model_path:
        raise ValueError(f"--sft_model_path {args.sft_model_path!r}: this recipe takes the model as "
                         "--model_name_or_path.")
    rewards = {"--reward_adapter": script_args.reward_adapter, "--reward_model_path": args.reward_model_path,
               "--reward_function": script_args.reward_function}
    given = [flag for flag, value in rewards.items() if value]
    if len(given) != 1:
        raise ValueError(f"Give exactly one reward: --reward_adapter FOLDER (a LoRA reward adapter on the same base), "
                         f"--reward_model_path NAME (a reward model) or --reward_function vader; got "
                         f"{', '.join(given) or 'none'}.")
    adapter = script_args.reward_adapter
    if adapter and not os.path.isfile(os.path.join(os.path.expanduser(adapter), "adapter_model.safetensors")):
        raise FileNotFoundError(f"--reward_adapter {adapter!r} is not a folder holding adapter_model.safetensors: pass "
                                "the folder peft's save_pretrained wrote for a LoRA sequence-classification reward "
                                "model on the same base (e.g. trainer.model.save_pretrained(FOLDER) after TRL's "
                                "RewardTrainer with peft_config=LoraConfig(task_type='SEQ_CLS', ...)).")
    if script_args.reward_function and script_args.reward_function not in REWARD_FUNCTIONS:
        raise ValueError(f"--reward_function {script_args.reward_function!r} is not one of "
                         f"{sorted(REWARD_FUNCTIONS)}.")
    if script_args.prompt_format not in ("auto", "chat", "text"):
        raise ValueError(f"--prompt_format {script_args.prompt_format!r} is not one of 'auto', 'chat', 'text'.")

    final = dict(raw)
    final.update({k: getattr(script_args, k) for k in SCRIPT_PLAN_KEYS if getattr(script_args, k) is not None})
    final.update({k: getattr(args, k) for k in PLAN_FIELDS & PPO_FIELDS})
    final["optim"] = getattr(args.optim, "value", args.optim)  # TrainingArguments turns it into an enum
    final["lora_target_modules"] = lora_targets(final.get("lora_target_modules", PlanConfig.lora_target_modules))
    final["autocast"] = bool(args.bf16 or args.fp16)
    if final.get("max_prompt_length") is None:
        raise ValueError(f"max_prompt_length is unset: set it in {config} or pass --max_prompt_length (the memory "
                         "plan needs the prompt length).")
    plan = PlanConfig.from_dict(final, source=config)
    if script_args.value_model_path and plan.layout == "shared":
        raise ValueError("--value_model_path is for layout separate; with a shared base the critic is an adapter of "
                         "it. Use --layout separate, or drop --value_model_path.")
    return script_args, args, plan


def lora_targets(value) -> str | list[str]:
    """'all-linear', or a list of module names from a list or a comma-separated string."""
    if isinstance(value, str):
        return value if value == "all-linear" else [t.strip() for t in value.split(",") if t.strip()]
    return list(value)


def quantization_config(plan: PlanConfig):
    """BitsAndBytesConfig of the plan's base_dtype (None for an unquantized base)."""
    import torch
    from transformers import BitsAndBytesConfig

    compute = getattr(torch, TORCH_DTYPES[plan.compute_dtype])
    if plan.base_dtype in ("nf4", "fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=plan.base_dtype,
                                  bnb_4bit_use_double_quant=plan.bnb_4bit_use_double_quant,
                                  bnb_4bit_compute_dtype=compute)
    if plan.base_dtype == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def weights_dtype(plan: PlanConfig):
    """dtype of what is not quantized (embeddings, lm_head, norms; all of an unquantized base)."""
    import torch

    name = (plan.non_quantized_dtype or plan.compute_dtype) if plan.is_quantized else plan.base_dtype
    return getattr(torch, TORCH_DTYPES[name])


def lora_config(plan: PlanConfig, script_args: ScriptArguments):
    from peft import LoraConfig

    return LoraConfig(r=plan.lora_r, lora_alpha=script_args.lora_alpha or 2 * plan.lora_r,
                      lora_dropout=script_args.lora_dropout, target_modules=lora_targets(plan.lora_target_modules),
                      task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------------ memory plan


def model_shape(name: str, plan: PlanConfig) -> tuple[ModelShape | None, str]:
    """(the model's shape for the planner, where it came from): its config.json (a local folder, or the hub), else
    the YAML's `model` preset, else None."""
    note = ""
    try:
        if os.path.isdir(os.path.expanduser(name)):
            return load_shape(os.path.expanduser(name)), f"{name}/config.json"
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name).to_dict()
        text = config.get("text_config") or config
        return ModelShape.from_config(text, name=name), f"config.json of {name}"
    except Exception as error:  # noqa: BLE001 - any failure here only means "plan with the preset"
        note = f"could not read the config of {name!r} ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
    if plan.model:
        return load_shape(plan.model), f"the config's `model: {plan.model}` ({note})"
    return None, note


def extra_reward_model_bytes(shape: ModelShape, plan: PlanConfig) -> int:
    """A separate reward model next to a shared base (the shared plan counts a reward adapter instead): its
    quantized decoder linears and its unquantized embeddings and norms (no lm_head)."""
    if plan.is_quantized:
        linear = shape.linear_params * quantized_bytes_per_param(plan.base_dtype, plan.bnb_4bit_use_double_quant)
        rest = {"bf16": 2, "fp16": 2, "fp32": 4}[plan.non_quantized_dtype or plan.compute_dtype]
    else:
        linear = shape.linear_params * {"bf16": 2, "fp16": 2, "fp32": 4}[plan.base_dtype]
        rest = {"bf16": 2, "fp16": 2, "fp32": 4}[plan.base_dtype]
    return int(linear + (shape.num_parameters(lm_head=False) - shape.linear_params) * rest)


def size(num_bytes: float) -> str:
    """'7.03 GiB', or MiB below 0.1 GiB (tiny test models)."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= 0.1 * GIB else f"{num_bytes / 2**20:.1f} MiB"


def gpu_fit(required_bytes: float, free_bytes: int, total_bytes: int, gpu: str) -> tuple[bool, str]:
    """(fits, message) for a run that needs `required_bytes` (planner peak + headroom) on a GPU with `free_bytes`
    free. Pure arithmetic, so it is tested without a GPU."""
    need, free, total = required_bytes / GIB, free_bytes / GIB, total_bytes / GIB
    if required_bytes <= free_bytes:
        return True, (f"[recipe] GPU {gpu}: {free:.1f} GiB free of {total:.1f} GiB; the plan needs {need:.1f} GiB "
                      f"-> fits ({free - need:.1f} GiB spare)")
    return False, (
        f"[recipe] WARNING: this run will probably NOT fit: the plan needs {need:.1f} GiB (peak + headroom) but GPU "
        f"{gpu} has {free:.1f} GiB free of {total:.1f} GiB ({need - free:.1f} GiB short). Use a smaller config "
        "(recipes/qlora_7b/shared_12gb.yaml), or lower --local_rollout_forward_batch_size, "
        "--per_device_train_batch_size, --response_length or --max_prompt_length; free the GPU of other processes. "
        "`trl-ext estimate-memory CONFIG --model PRESET` shows which phase dominates.")


def report_memory_plan(script_args: ScriptArguments, plan: PlanConfig) -> dict:
    """Print the planner's estimate for this run (and, with CUDA, whether it fits the GPU's free memory); returns
    the figures (empty when no shape is known)."""
    shape, source = model_shape(script_args.model_name_or_path, plan)
    if shape is None:
        print(f"[recipe] memory plan: none ({source}, and the config has no `model` preset)", flush=True)
        return {}
    estimate = estimate_memory(shape, plan)
    extra = extra_reward_model_bytes(shape, plan) if plan.layout == "shared" and not script_args.reward_adapter \
        and not script_args.reward_function else 0
    required = estimate.required_bytes + extra * (1 + plan.fragmentation)
    print(f"[recipe] memory plan (trl_ext.memory) for {shape.name} ({shape.num_parameters() / 1e9:.2f}B params; "
          f"shape from {source}), layout {plan.layout}, {plan.base_dtype} base, rollout batch "
          f"{plan.local_batch_size} of {plan.max_prompt_length} + {plan.response_length} tokens, micro-batch "
          f"{plan.per_device_train_batch_size}, forward chunks of {plan.local_rollout_forward_batch_size}:", flush=True)
    print(f"[recipe]   peak {size(estimate.peak_bytes)} (estimated torch.cuda.max_memory_allocated, in "
          f"'{estimate.peak_phase.name}'); needed on the GPU {size(estimate.required_bytes)} (+ "
          f"{plan.cuda_overhead_gib:g} GiB CUDA context, {plan.fragmentation:.0%} fragmentation); "
          + "; ".join(f"{k}: {v}" for k, v in estimate.verdicts().items()), flush=True)
    if extra:
        print(f"[recipe]   + a separate reward model next to the shared base: ~{size(extra)} more "
              f"(needed: {size(required)})", flush=True)
    if plan.layout == "separate" and script_args.reward_function:
        print("[recipe]   (the separate plan counts a reward model; with a reward function the run needs less)",
              flush=True)
    figures = {"model": shape.name, "shape_source": source, "plan_peak_bytes": estimate.peak_bytes,
               "plan_peak_phase": estimate.peak_phase.name, "plan_required_bytes": required,
               "plan_extra_reward_model_bytes": extra}
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        fits, message = gpu_fit(required, free, total, torch.cuda.get_device_name())
        print(message, flush=True)
        figures.update(gpu=torch.cuda.get_device_name(), gpu_free_bytes=free, gpu_total_bytes=total, fits=fits)
    return figures


# ------------------------------------------------------------------------------------------------ models


def vader_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Positive sentiment of the completion (VADER compound score in [-1, 1]); recipes/sentiment.py."""
    import sentiment

    return sentiment.vader_reward(prompts, completions)


REWARD_FUNCTIONS: dict[str, Callable] = {"vader": vader_reward}


def load_model(what: str, name: str, flag: str, model_class, plan: PlanConfig, script_args: ScriptArguments,
               **kwargs):
    """`model_class.from_pretrained(name)` quantized as the plan says, on the GPU when there is one, with
    bitsandbytes' CPU repacking of 4-bit weights off (it breaks LoRA gradients; trl_ext.models)."""
    import torch

    from trl_ext.models import disable_bnb_cpu_repack

    kwargs.update(dtype=weights_dtype(plan), attn_implementation=script_args.attn_implementation,
                  trust_remote_code=script_args.trust_remote_code)
    quant = quantization_config(plan)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    model = hub_load(what, name, lambda: model_class.from_pretrained(name, **kwargs), flag)
    disable_bnb_cpu_repack(model)
    return model


def load_scalar_model(what: str, name: str, flag: str, plan, script_args, pad_token_id: int):
    """A 1-output sequence-classification model (reward or critic), quantized like the base."""
    from transformers import AutoModelForSequenceClassification

    model = load_model(what, name, flag, AutoModelForSequenceClassification, plan, script_args, num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    return model


def frozen(model):
    model.requires_grad_(False)
    return model.eval()


def build_models(script_args: ScriptArguments, args: PPOConfig, plan: PlanConfig, tokenizer) -> dict[str, Any]:
    """The PPOTrainer's model arguments for the plan's layout: model, ref_model, value_model, reward_model,
    peft_config."""
    from transformers import AutoModelForCausalLM

    name = script_args.model_name_or_path
    lora = lora_config(plan, script_args)
    reward: Any = REWARD_FUNCTIONS.get(script_args.reward_function)
    if args.reward_model_path:  # a separate reward model, either layout
        reward = frozen(load_scalar_model("reward model", args.reward_model_path, "--reward_model_path", plan,
                                          script_args, tokenizer.pad_token_id))
        if script_args.reward_tokenizer_path:
            reward = (reward, load_tokenizer(script_args.reward_tokenizer_path, script_args.trust_remote_code,
                                             "--reward_tokenizer_path"))

    if plan.layout == "shared":
        from trl_ext.models import build_shared_base

        base = load_model("base model", name, "--model_name_or_path", AutoModelForCausalLM, plan, script_args)
        shared = build_shared_base(base, policy_lora=lora, critic_lora=lora, reward_adapter=script_args.reward_adapter,
                                   value_head_init="zero")
        if script_args.reward_adapter:
            reward = shared.reward_model  # the base with the frozen reward adapter and its head
        return dict(model=shared, ref_model=None, value_model=None, reward_model=reward, peft_config=None)

    # separate: policy (4-bit + LoRA; the reference is the policy with its adapter disabled), critic, reward
    policy = load_model("policy", name, "--model_name_or_path", AutoModelForCausalLM, plan, script_args)
    value_name = script_args.value_model_path or name
    critic = load_scalar_model("value model", value_name, "--value_model_path" if script_args.value_model_path
                               else "--model_name_or_path", plan, script_args, tokenizer.pad_token_id)
    critic.score.float()  # a fp32 head over the 4-bit backbone (the planner counts it so)
    if not plan.is_quantized:  # trl_ext trains an unquantized critic in full; the plan has it train LoRA + head
        from peft import get_peft_model

        critic = get_peft_model(critic, dataclasses.replace(lora, task_type="SEQ_CLS"))
    # trl_ext gives a 4-bit critic LoRA on every linear layer (the policy's r and alpha) and trains its score head
    # (trl_ext.models.lora_for_quantized_value_model), never its embeddings and norms
    if plan.is_quantized and lora_targets(plan.lora_target_modules) != "all-linear":
        print(f"[recipe] note: the critic's LoRA covers all linear layers (trl_ext's rule for quantized critics), the "
              f"policy's only {plan.lora_target_modules}", flush=True)
    if script_args.reward_adapter:
        from peft import PeftModel

        rm_base = load_scalar_model("reward model base", name, "--model_name_or_path", plan, script_args,
                                    tokenizer.pad_token_id)
        reward = frozen(hub_load("reward adapter", script_args.reward_adapter,
                                 lambda: PeftModel.from_pretrained(rm_base, script_args.reward_adapter),
                                 "--reward_adapter"))
    return dict(model=policy, ref_model=None, value_model=critic, reward_model=reward, peft_config=lora)


def prompt_datasets(script_args: ScriptArguments, args: PPOConfig, tokenizer):
    """(train, eval or None): `prompt` columns (or `input_ids`); text prompts become one user message when the
    tokenizer has a chat template (--prompt_format auto) or always (chat)."""
    train, test = load_prompt_splits(script_args, evaluate=args.eval_strategy != "no")
    chat = script_args.prompt_format == "chat" or (script_args.prompt_format == "auto"
                                                   and getattr(tokenizer, "chat_template", None))

    def as_chat(ds):
        if ds is None or not chat or "prompt" not in ds.column_names or not isinstance(ds[0]["prompt"], str):
            return ds
        return ds.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})

    return as_chat(train), as_chat(test)


# ------------------------------------------------------------------------------------------------ the run


def build_trainer(script_args: ScriptArguments, args: PPOConfig, plan: PlanConfig):
    """Tokenizer, prompts, models -> a trl_ext.PPOTrainer."""
    from trl_ext import PPOTrainer

    tokenizer = load_tokenizer(script_args.model_name_or_path, script_args.trust_remote_code)
    train_dataset, eval_dataset = prompt_datasets(script_args, args, tokenizer)  # fail fast, before the weights
    models = build_models(script_args, args, plan, tokenizer)
    return PPOTrainer(args=args, processing_class=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      **models)


def save(trainer, args: PPOConfig) -> None:
    """The trained parts: shared -> policy/, critic/, value_head.safetensors; separate -> the policy adapter and
    critic/ (its LoRA and score head). The tokenizer with them."""
    trainer.save_model(args.output_dir)
    if trainer.shared is None and trainer.is_world_process_zero():
        trainer.unwrapped.value_model.save_pretrained(os.path.join(args.output_dir, "critic"))
        trainer.processing_class.save_pretrained(args.output_dir)


def run(script_args: ScriptArguments, args: PPOConfig, plan: PlanConfig,
        on_built: Callable[[Any], None] | None = None) -> dict:
    """Print the memory plan, build, train, save; returns the summary. `on_built(trainer)` runs before training."""
    import torch
    from transformers import set_seed

    figures = report_memory_plan(script_args, plan)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    set_seed(args.seed)  # value heads and LoRA matrices are drawn while building, before the trainer seeds anything
    trainer = build_trainer(script_args, args, plan)
    print(f"[recipe] QLoRA PPO ({plan.layout} layout): {args.num_total_batches} steps x {args.batch_size} rollouts, "
          f"{script_args.model_name_or_path}, reward "
          f"{script_args.reward_adapter or args.reward_model_path or script_args.reward_function}, "
          f"lr={args.learning_rate}, kl_coef={args.kl_coef}, device={trainer.accelerator.device} -> {args.output_dir}",
          flush=True)
    if on_built is not None:
        on_built(trainer)
    start = time.time()
    trainer.train()
    wall = time.time() - start
    save(trainer, args)

    measured = torch.cuda.max_memory_allocated() if cuda else None
    logs = [entry for entry in trainer.state.log_history if "objective/scores" in entry]
    scores = [entry["objective/scores"] for entry in logs]
    summary = {
        "layout": plan.layout, "steps": len(logs), "wall_s": wall,
        "first_score": scores[0] if scores else math.nan, "last_score": scores[-1] if scores else math.nan,
        "last_kl": logs[-1]["objective/kl"] if logs else math.nan,
        "measured_max_memory_allocated": measured, **figures,
    }
    peak = figures.get("plan_peak_bytes")
    if measured is not None:
        vs = f"; planner's peak {size(peak)} (measured/planned {measured / peak:.2f})" if peak else ""
        memory = f"torch.cuda.max_memory_allocated {size(measured)}{vs}"
    else:
        memory = "no CUDA: GPU memory not measured" + (f" (planner's peak on a GPU: {size(peak)})" if peak else "")
    with open(os.path.join(args.output_dir, MEMORY_FILE), "w") as fh:
        json.dump({"config": script_args.config, "plan": dataclasses.asdict(plan), **summary}, fh, indent=1,
                  default=str)
    print(f"[recipe] done: {summary['steps']} steps in {wall:.0f} s; mean score {summary['first_score']:+.3f} -> "
          f"{summary['last_score']:+.3f}, KL {summary['last_kl']:.3f}; {memory}; adapters in {args.output_dir}",
          flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    script_args, args, plan = parse_args(argv)
    return run(script_args, args, plan)


if __name__ == "__main__":
    try:
        parsed = parse_args()
    except (ValueError, FileNotFoundError) as error:  # a bad flag or config: the message names it and the fix
        sys.exit(f"[recipe] error: {error}")
    try:
        run(*parsed)
    except HubUnavailableError as error:
        sys.exit(f"[recipe] error: {error}")  # the message says what and how to fix it; no traceback
