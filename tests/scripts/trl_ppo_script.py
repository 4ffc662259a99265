"""A TRL 1.12 user's PPO script, as written for TRL. The tests run it with only its import line changed to
`from trl_ext import PPOConfig, PPOTrainer` (single process, LoRA, and under `accelerate launch`)."""

import argparse

from peft import LoraConfig
from trl.experimental.ppo import PPOConfig, PPOTrainer

from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", required=True)
parser.add_argument("--lora", action="store_true")
parser.add_argument("--save_steps", type=int, default=0, help="also save checkpoints every N steps")
cli = parser.parse_args()

tokenizer = tiny_tokenizer()
policy = tiny_causal_lm(tokenizer, seed=0)
ref_policy = None if cli.lora else tiny_causal_lm(tokenizer, seed=0)
value_model = tiny_scalar_model(tokenizer, seed=1)
reward_model = tiny_scalar_model(tokenizer, seed=2)
train_dataset = tiny_prompt_dataset(tokenizer, n=16)

training_args = PPOConfig(
    output_dir=cli.output_dir,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    num_ppo_epochs=2,
    total_episodes=16,
    response_length=6,
    stop_token="eos",
    learning_rate=1e-3,
    bf16=False,
    report_to=[],
    save_strategy="steps" if cli.save_steps else "no",
    save_steps=cli.save_steps or 500,
    num_sample_generations=0,
    logging_steps=1,
)
trainer = PPOTrainer(
    args=training_args,
    processing_class=tokenizer,
    model=policy,
    ref_model=ref_policy,
    reward_model=reward_model,
    train_dataset=train_dataset,
    value_model=value_model,
    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if cli.lora
    else None,
)
trainer.train()
trainer.save_model(training_args.output_dir)
if trainer.accelerator.is_main_process:
    print("TRAINING DONE")
