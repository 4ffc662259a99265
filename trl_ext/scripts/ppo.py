"""`trl-ext ppo`: the command line of `trl grpo` (TRL's trl/scripts/grpo.py) training with PPO. The same flags:
every `PPOConfig` field (GRPO's names included), every `ModelConfig` flag, `--dataset_name` / `--dataset_config` /
the splits (or a dataset mixture), `--reward_funcs` (names from `trl.rewards` or dotted import paths),
`--reward_model_name_or_path`, `--config` (a YAML file of them), and `--accelerate_config` (a file, or the name of
a config TRL ships: single_gpu, multi_gpu, zero1-3, fsdp1-2) to run under `accelerate launch`.

    trl-ext ppo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \
        --reward_funcs accuracy_reward --use_peft
    python -m trl_ext.scripts.ppo ...        # the same, one process (what accelerate launch runs)

A critic is made for the policy (printed at start-up), as for a GRPO-shaped script (README, "From GRPO to PPO").
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field

from trl import ScriptArguments

# TRL's `trl grpo` registry of reward functions by name (trl/scripts/grpo.py), with the same settings
REWARD_FUNCTIONS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                    "get_soft_overlong_punishment")


@dataclass
class PPOScriptArguments(ScriptArguments):
    """`trl grpo`'s script arguments: the rewards by name or path."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A sequence-classification reward model: a hub id or a local folder (with its tokenizer)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": f"Reward functions: {', '.join(REWARD_FUNCTIONS)} (trl.rewards; get_soft_overlong_punishment "
                  "with max_completion_len=1280, soft_punish_cache=256, as `trl grpo`), or a dotted import path "
                  "(e.g. my_lib.rewards.custom_reward, importable from the current folder)."},
    )


def reward_functions(script_args: PPOScriptArguments) -> list:
    """The rewards the flags name, in `trl grpo`'s order: the reward model first, then the functions."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
                "think_format_reward": think_format_reward,
                "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280,
                                                                             soft_punish_cache=256)}
    funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module, attribute = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module), attribute))
        else:
            raise ValueError(f"--reward_funcs {name!r} is neither one of {list(REWARD_FUNCTIONS)} nor a dotted "
                             "import path (module.function).")
    if not funcs:
        raise ValueError("No reward: pass --reward_funcs and/or --reward_model_name_or_path.")
    return funcs


def main(script_args, training_args, model_args, dataset_args=None):
    """`trl grpo`'s main with PPOTrainer: returns the trained trainer (its model saved to output_dir)."""
    from datasets import load_dataset
    from trl import get_dataset, get_peft_config, get_quantization_config

    from trl_ext import PPOTrainer

    funcs = reward_functions(script_args)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    if dataset_args is not None and dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        raise ValueError("No dataset: pass --dataset_name (a hub id or a local folder) or a dataset mixture.")
    trainer = PPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def make_parser(prog: str | None = None):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from trl_ext import PPOConfig

    parser = TrlParser((PPOScriptArguments, PPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)
    # `trl grpo`'s switch-off flag of a field whose default is True there and "decided by use_vllm" here (None)
    parser.add_argument("--no_vllm_importance_sampling_correction", action="store_false", default=argparse.SUPPRESS,
                        dest="vllm_importance_sampling_correction", help="Set vllm_importance_sampling_correction "
                        "to False.")
    return parser


def accelerate_config(name: str) -> str:
    """--accelerate_config: a file, or the name of an accelerate config TRL ships (trl/accelerate_configs)."""
    import importlib.resources

    if os.path.isfile(name):
        return name
    shipped = importlib.resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")
    if not shipped.is_file():
        names = sorted(p.name.removesuffix(".yaml") for p in importlib.resources.files("trl.accelerate_configs")
                       .iterdir() if p.name.endswith(".yaml"))
        raise ValueError(f"--accelerate_config {name!r} is neither a file nor one of TRL's configs {names}.")
    return str(shipped)


def run(argv: list[str]) -> int:
    """`trl-ext ppo ARGS`: in this process, or with --accelerate_config (and any other `accelerate launch` flag
    the training flags do not take) under `accelerate launch`, as `trl grpo` does."""
    parser = make_parser(prog="trl-ext ppo")
    *parsed, remaining = parser.parse_args_and_config(argv, return_remaining_strings=True)
    if not remaining:
        main(*parsed)
        return 0
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch = list(remaining)
    if "--accelerate_config" in launch:
        at = launch.index("--accelerate_config")
        if at + 1 >= len(launch):
            raise ValueError("--accelerate_config needs a value: a file or a config name (e.g. zero2).")
        launch[at: at + 2] = ["--config_file", accelerate_config(launch[at + 1])]
    script_args = _without(argv, remaining)
    launch_command(launch_command_parser().parse_args(launch + [__file__] + script_args))
    return 0


def _without(argv: list[str], remaining: list[str]) -> list[str]:
    """argv less `remaining`, an ordered subsequence of it (the flags the training script does not take)."""
    rest, out = iter(remaining), []
    current = next(rest, None)
    for arg in argv:
        if current is not None and arg == current:
            current = next(rest, None)
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
