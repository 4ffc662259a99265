"""PPO with a LoRA policy on 2 processes against one vLLM server (tests_vllm/test_vllm_server.py launches it):
`python -m accelerate.commands.launch --multi_gpu --num_processes 2 server_ddp.py URL OUT`. Each process saves what
its trainer saw to OUT/rank{i}.pt."""

import os
import sys

import torch
from peft import LoraConfig

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


def reward(prompts, completions):
    return [sum(w in {f"w{i}" for i in range(8)} for w in c.split()) / max(len(c.split()), 1) for c in completions]


if __name__ == "__main__":
    url, out = sys.argv[1], sys.argv[2]
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=out, per_device_train_batch_size=4, total_episodes=8 * 3, learning_rate=0.1,
                     num_ppo_epochs=2, response_length=4, logging_steps=1, report_to=[], save_strategy="no",
                     num_sample_generations=0, bf16=False, disable_tqdm=True, seed=0, use_vllm=True,
                     vllm_mode="server", vllm_server_base_url=url, stop_token="none")
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, seed=0, **SIZE), ref_model=None,
                   reward_model=reward, train_dataset=tiny_prompt_dataset(tok, 16),
                   value_model=tiny_scalar_model(tok, **SIZE),
                   peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    loads = []
    load = t.vllm._load
    t.vllm._load = lambda server, again=False: (loads.append(t.vllm.adapter_name), load(server, again))[1]
    t.train()
    torch.save({"world_size": t.accelerator.num_processes, "tag": t.vllm.tag, "syncs": t.vllm.syncs,
                "loads": loads, "adapter": t.vllm.adapter_name, "resyncs": t.vllm.resyncs,
                "logs": [h for h in t.state.log_history if "objective/scores" in h]},
               os.path.join(out, f"rank{t.accelerator.process_index}.pt"))
