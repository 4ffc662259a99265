"""A GRPO training script in the shape of the public "mini R1" Countdown tutorials (philschmid's run_r1_grpo.py and
its many copies), written here for tests/trl/test_grpo_scripts.py: TRL's GRPOTrainer, run with only the class and
config names changed to trl_ext's PPO.

What it does as those scripts do: `TrlParser((ModelConfig, ScriptArguments, GRPOConfig))`; the tokenizer loaded by the
script (EOS as pad); prompts rendered to text by the chat template with an assistant turn begun for the model to
continue (`continue_final_message`); two reward functions that read dataset columns (`target`, `nums`); a train/test
split with the test part as eval_dataset; resuming from the last checkpoint in output_dir; `train_result.metrics`
logged and saved, `save_state`, `trainer.model.config.use_cache = True`, `save_model`, the tokenizer saved, a model
card with tags on the main process.
"""

import os
import re
from dataclasses import dataclass

from datasets import load_dataset
from transformers import AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config


@dataclass
class ScriptArguments:
    dataset_id_or_path: str = "Jiayi-Pan/Countdown-Tasks-3to4"
    dataset_splits: str = "train"
    tokenizer_name_or_path: str = None


def r1_messages(numbers, target):
    """The conversation the prompt renders: the assistant's turn begun with "<think>" for the model to continue."""
    return [
        {"role": "system", "content": "You are a helpful assistant. You think first, then answer."},
        {"role": "user", "content": f"Using the numbers {numbers}, create an equation that equals {target}. "
                                    "Show your work in <think> </think> tags and the equation in <answer> "
                                    "</answer> tags."},
        {"role": "assistant", "content": "Let me solve this step by step.\n<think>"},
    ]


def format_reward_func(completions, target, **kwargs):
    """1 for "<think>...</think>\n<answer>...</answer>" (the prompt opened the <think>), else 0."""
    pattern = r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)</think>\n<answer>([\s\S]*?)</answer>$"
    return [1.0 if re.search(pattern, "<think>" + c, re.DOTALL) else 0.0 for c in completions]


def equation_reward_func(completions, target, nums, **kwargs):
    """1 for an answer equation that uses each number once and equals the target."""
    rewards = []
    for completion, goal, numbers in zip(completions, target, nums):
        match = re.search(r"<answer>(.*?)</answer>", "<think>" + completion)
        equation = match.group(1).strip() if match else ""
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
        try:
            ok = (match is not None and used == sorted(numbers) and re.match(r"^[\d+\-*/().\s]+$", equation)
                  and abs(float(eval(equation, {"__builtins__": None}, {})) - float(goal)) < 1e-5)
        except Exception:
            ok = False
        rewards.append(1.0 if ok else 0.0)
    return rewards


def grpo_function(model_args, script_args, training_args):
    tokenizer = AutoTokenizer.from_pretrained(script_args.tokenizer_name_or_path or model_args.model_name_or_path,
                                              revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    dataset = load_dataset(script_args.dataset_id_or_path, split=script_args.dataset_splits)
    dataset = dataset.shuffle(seed=42)

    def generate_r1_prompt(numbers, target):
        prompt = tokenizer.apply_chat_template(r1_messages(numbers, target), tokenize=False,
                                               continue_final_message=True)
        return {"prompt": prompt, "target": target, "nums": numbers}

    dataset = dataset.map(lambda x: generate_r1_prompt(x["nums"], x["target"]))
    split = dataset.train_test_split(test_size=0.1)
    train_dataset, test_dataset = split["train"], split["test"]

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[format_reward_func, equation_reward_func],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset,
        peft_config=get_peft_config(model_args),
    )

    last_checkpoint = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) \
        else None
    train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    trainer.model.config.use_cache = True
    trainer.save_model(training_args.output_dir)
    training_args.distributed_state.wait_for_everyone()
    tokenizer.save_pretrained(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(tags=["rl", "grpo", "tutorial"])


def main():
    parser = TrlParser((ModelConfig, ScriptArguments, GRPOConfig))
    model_args, script_args, training_args = parser.parse_args_and_config()
    grpo_function(model_args, script_args, training_args)


if __name__ == "__main__":
    main()
