"""A GRPO training script in the shape of the public GSM8K "reasoning format" demo (willccbb's grpo_demo.py and the
many scripts copied from it), written here for tests/trl/test_grpo_scripts.py: TRL's GRPOTrainer, run with only the
class and config names changed to trl_ext's PPO.

What it does as those scripts do: conversational prompts (a system prompt asking for <reasoning>/<answer> tags, the
question as the user's turn); an `answer` column cut after "####"; reward functions that read the completions as
messages (`completion[0]["content"]`), the prompts' last user turn and the `answer` column; a `GRPOConfig` built in
Python with the demo's optimizer, schedule, batch and length settings; the model and tokenizer loaded by the script
(EOS as pad) and a LoRA `peft_config` passed to the trainer.

    python grpo_gsm8k.py MODEL_DIR DATASET_DIR OUTPUT_DIR
"""

import re
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

SYSTEM_PROMPT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"


def extract_xml_answer(text: str) -> str:
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def extract_hash_answer(text: str):
    return text.split("####")[1].strip() if "####" in text else None


def get_gsm8k_questions(path, split="train"):
    data = load_dataset(path, split=split)
    return data.map(lambda x: {"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": x["question"]}],
                               "answer": extract_hash_answer(x["answer"])})


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    assert all(prompt[-1]["role"] == "user" for prompt in prompts)
    return [2.0 if extract_xml_answer(r) == a else 0.0 for r, a in zip(responses, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    return [0.5 if extract_xml_answer(c[0]["content"]).isdigit() else 0.0 for c in completions]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    return [0.5 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    def count(text):
        tags = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")
        return sum(0.125 for tag in tags if text.count(tag) == 1)
    return [count(c[0]["content"]) for c in completions]


def main(model_name, dataset_path, output_dir):
    dataset = get_gsm8k_questions(dataset_path)
    training_args = GRPOConfig(
        output_dir=output_dir,
        run_name="gsm8k-grpo",
        learning_rate=5e-4,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        warmup_steps=1,
        lr_scheduler_type="cosine",
        logging_steps=1,
        bf16=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=32,
        num_train_epochs=1,
        save_steps=100,
        max_grad_norm=0.1,
        report_to="none",
        log_on_each_node=False,
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             task_type="CAUSAL_LM", lora_dropout=0.05)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    tokenizer.pad_token = tokenizer.eos_token
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[xmlcount_reward_func, soft_format_reward_func, int_reward_func, correctness_reward_func],
        args=training_args,
        train_dataset=dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(output_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
