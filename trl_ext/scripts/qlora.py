"""Runs from a memory-plan config: a YAML of `trl_ext.tools.memory.PlanConfig` fields (recipes/qlora_7b/*.yaml, the file
`trl-ext estimate-memory` reads) turned into the PPOConfig, BitsAndBytesConfig and LoraConfig of a run, and the
planner's estimate printed before anything loads (with, on a CUDA machine, whether it fits the GPU's free memory).
recipes/ppo_qlora_7b.py is the command line on top.

The YAML is not TRL's `--config` file: its keys are the planner's, some of which are no flags (`chunked_logits`,
`cuda_overhead_gib`, `model`), and the same file must stay readable by the planner. `parse_plan_args` maps it:
PPOConfig's names -> those fields; `base_dtype`, `bnb_4bit_use_double_quant`, `compute_dtype` -> the quantization
config (and `compute_dtype` -> bf16/fp16 autocast); `lora_r`, `lora_target_modules` -> the LoRA config; `layout`.
Every plan key is also a flag; the command line wins over the YAML.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from ..config import PPOConfig
from ..tools.memory import GIB, ModelShape, PlanConfig, estimate_memory, load_shape, quantized_bytes_per_param
from . import hub_load, load_tokenizer

PPO_FIELDS = frozenset(f.name for f in dataclasses.fields(PPOConfig))
PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(PlanConfig))
# Plan keys that are flags of the script's own dataclass; the PPOConfig-named ones are PPOConfig's flags.
SCRIPT_PLAN_KEYS = ("layout", "base_dtype", "bnb_4bit_use_double_quant", "compute_dtype", "lora_r",
                    "lora_target_modules")
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


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
    from ..models import LOGPROB_CHUNK

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



def parse_plan_args(script_class, defaults: dict, argv: list[str] | None = None) -> tuple:
    """Command line + the `--config` YAML -> (script_class instance, trl_ext.PPOConfig, the PlanConfig of this run).

    `script_class` is a dataclass with a `config` field and the plan keys of SCRIPT_PLAN_KEYS as fields defaulting to
    None. Precedence: command line > YAML > `defaults` (the recipe's) > PPOConfig's defaults. The returned plan holds
    the final values (after command-line overrides), so the memory estimate describes the run that happens."""
    from transformers import HfArgumentParser

    from ..config import bf16_in_hardware

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((script_class, PPOConfig))
    parser.set_defaults(**defaults)
    config = _flag_value(argv, "config")
    if config is None:
        if {"-h", "--help"} & set(argv):
            parser.parse_args_into_dataclasses(args=argv)  # prints the help and exits
        raise ValueError("--config is required: one of recipes/qlora_7b/{shared_24gb,shared_16gb,shared_12gb,"
                         "separate_24gb}.yaml (or your own file of trl_ext.tools.memory.PlanConfig fields).")
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
        if defaults["bf16"] and not bf16_in_hardware() and not _flag_set(argv, "use_cpu"):
            import torch

            where = (f"this GPU ({torch.cuda.get_device_name()}) does not support bf16" if torch.cuda.is_available()
                     else "this machine has no CUDA GPU")
            raise ValueError(f"compute_dtype=bf16 ({config}) trains in bf16 autocast, but {where}. Pass "
                             "--compute_dtype fp16 on a GPU without bf16 (T4, V100), or --compute_dtype fp32 for a "
                             "CPU smoke run.")
    parser.set_defaults(**defaults)
    script_args, args = parser.parse_args_into_dataclasses(args=argv)

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
    return script_args, args, plan



def lora_targets(value) -> str | list[str]:
    """'all-linear', or a list of module names from a list or a comma-separated string."""
    if isinstance(value, str):
        return value if value == "all-linear" else [t.strip() for t in value.split(",") if t.strip()]
    return list(value)


def model_config(plan: PlanConfig, lora_alpha: int | None = None, lora_dropout: float = 0.0):
    """The plan as TRL's `ModelConfig`, for TRL's `get_quantization_config` and `get_peft_config`: 4-bit
    (`base_dtype` nf4/fp4, computing in `compute_dtype`) or 8-bit quantization, and a LoRA adapter of the plan's rank
    and target modules (alpha 2 x r unless given)."""
    from trl import ModelConfig

    config = ModelConfig(load_in_4bit=plan.base_dtype in ("nf4", "fp4"), load_in_8bit=plan.base_dtype == "int8",
                         bnb_4bit_quant_type=plan.base_dtype if plan.base_dtype in ("nf4", "fp4") else "nf4",
                         use_bnb_nested_quant=plan.bnb_4bit_use_double_quant, dtype=TORCH_DTYPES[plan.compute_dtype],
                         use_peft=True, lora_r=plan.lora_r, lora_alpha=lora_alpha or 2 * plan.lora_r,
                         lora_dropout=lora_dropout, lora_task_type="CAUSAL_LM")
    # ModelConfig turns a one-name list into the bare name, which peft reads as a pattern for the whole module path
    config.lora_target_modules = lora_targets(plan.lora_target_modules)
    return config


def quantization_config(plan: PlanConfig):
    """BitsAndBytesConfig of the plan's base_dtype (None for an unquantized base): TRL's `get_quantization_config`."""
    from trl import get_quantization_config

    return get_quantization_config(model_config(plan))


def weights_dtype(plan: PlanConfig):
    """dtype of what is not quantized (embeddings, lm_head, norms; all of an unquantized base)."""
    import torch

    name = (plan.non_quantized_dtype or plan.compute_dtype) if plan.is_quantized else plan.base_dtype
    return getattr(torch, TORCH_DTYPES[name])


def lora_config(plan: PlanConfig, lora_alpha: int | None = None, lora_dropout: float = 0.0):
    """The policy's LoraConfig: the plan's rank and target modules, alpha 2 x r unless given (TRL's
    `get_peft_config`)."""
    from trl import get_peft_config

    return get_peft_config(model_config(plan, lora_alpha, lora_dropout))


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


def report_memory_plan(script_args, plan: PlanConfig) -> dict:
    """Print the planner's estimate for this run (and, with CUDA, whether it fits the GPU's free memory); returns the
    figures (empty when no shape is known). Reads `script_args.model_name_or_path`, `.reward_adapter` and
    `.reward_function`."""
    shape, source = model_shape(script_args.model_name_or_path, plan)
    if shape is None:
        print(f"[recipe] memory plan: none ({source}, and the config has no `model` preset)", flush=True)
        return {}
    estimate = estimate_memory(shape, plan)
    extra = extra_reward_model_bytes(shape, plan) if plan.layout == "shared" and not script_args.reward_adapter \
        and not script_args.reward_function else 0
    required = estimate.required_bytes + extra * (1 + plan.fragmentation)
    print(f"[recipe] memory plan (trl_ext.tools.memory) for {shape.name} ({shape.num_parameters() / 1e9:.2f}B params; "
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


def load_model(what: str, name: str, flag: str, model_class, plan: PlanConfig, script_args,
               trust_remote_code: bool, **kwargs):
    """`model_class.from_pretrained(name)` quantized as the plan says, on the GPU when there is one, with
    bitsandbytes' CPU repacking of 4-bit weights off (it breaks LoRA gradients; trl_ext.models)."""
    import torch

    from ..models import disable_bnb_cpu_repack

    kwargs.update(dtype=weights_dtype(plan), attn_implementation=script_args.attn_implementation,
                  trust_remote_code=trust_remote_code)
    quant = quantization_config(plan)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    model = hub_load(what, name, lambda: model_class.from_pretrained(name, **kwargs), flag)
    disable_bnb_cpu_repack(model)
    return model


def load_scalar_model(what: str, name: str, flag: str, plan, script_args, trust_remote_code: bool,
                      pad_token_id: int):
    """A 1-output sequence-classification model (reward or critic), quantized like the base."""
    from transformers import AutoModelForSequenceClassification

    model = load_model(what, name, flag, AutoModelForSequenceClassification, plan, script_args, trust_remote_code,
                       num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    return model


def frozen(model):
    model.requires_grad_(False)
    return model.eval()


def build_models(script_args, args: PPOConfig, plan: PlanConfig, tokenizer, reward_function=None) -> dict[str, Any]:
    """The PPOTrainer's model arguments for the plan's layout: model, ref_model, value_model, reward_model,
    peft_config. `script_args` gives model_name_or_path, reward_adapter, reward_tokenizer_path, value_model_path,
    lora_alpha, lora_dropout, attn_implementation; `args` trust_remote_code; `args.reward_model_path` a reward model,
    `reward_function` a reward function (one of the three)."""
    from transformers import AutoModelForCausalLM

    name = script_args.model_name_or_path
    lora = lora_config(plan, script_args.lora_alpha, script_args.lora_dropout)
    reward: Any = reward_function
    if args.reward_model_path:  # a separate reward model, either layout
        reward = frozen(load_scalar_model("reward model", args.reward_model_path, "--reward_model_path", plan,
                                          script_args, args.trust_remote_code, tokenizer.pad_token_id))
        if script_args.reward_tokenizer_path:
            reward = (reward, load_tokenizer(script_args.reward_tokenizer_path, args.trust_remote_code,
                                             "--reward_tokenizer_path"))

    if plan.layout == "shared":
        from ..models import build_shared_base

        base = load_model("base model", name, "--model_name_or_path", AutoModelForCausalLM, plan, script_args,
                          args.trust_remote_code)
        shared = build_shared_base(base, policy_lora=lora, critic_lora=lora, reward_adapter=script_args.reward_adapter,
                                   value_head_init="zero")
        if script_args.reward_adapter:
            reward = shared.reward_model  # the base with the frozen reward adapter and its head
        return dict(model=shared, ref_model=None, value_model=None, reward_model=reward, peft_config=None)

    # separate: policy (4-bit + LoRA; the reference is the policy with its adapter disabled), critic, reward
    policy = load_model("policy", name, "--model_name_or_path", AutoModelForCausalLM, plan, script_args,
                        args.trust_remote_code)
    value_name = script_args.value_model_path or name
    critic = load_scalar_model("value model", value_name, "--value_model_path" if script_args.value_model_path
                               else "--model_name_or_path", plan, script_args, args.trust_remote_code,
                               tokenizer.pad_token_id)
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
                                    args.trust_remote_code, tokenizer.pad_token_id)
        reward = frozen(hub_load("reward adapter", script_args.reward_adapter,
                                 lambda: PeftModel.from_pretrained(rm_base, script_args.reward_adapter),
                                 "--reward_adapter"))
    return dict(model=policy, ref_model=None, value_model=critic, reward_model=reward, peft_config=lora)
