"""A PPO training script as users wrote them for TRL's PPOTrainer (written for these tests, after four public
projects' scripts: a domain fine-tune with a chat template, two course projects with a frozen local reward model, a
LoRA-wrapped policy plus a full reference, a 4-bit base with the LoRA adapter of an SFT checkpoint, an eval split).
It is written with TRL 1.12's import; tests/trl/test_user_scripts.py runs it with trl_ext's import line instead, and
unchanged on TRL's own trainer.

    python ppo_training.py --model_name_or_path M --reward_model_path RM --dataset_name DATA --output_dir OUT
        [--policy full|lora_wrapped|sft_adapter --sft_adapter_path A --load_in_4bit --dtype float32]
        [--reward model|rule] [--chat] [--eval_samples N --eval_strategy steps --eval_steps 1]
        [PPOConfig flags: --missing_eos_penalty 0.0 --num_ppo_epochs 4 --gradient_accumulation_steps 4 ...]
"""

from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from datasets import load_dataset
from peft import PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import SequenceClassifierOutput
from trl import ModelConfig, get_peft_config, get_quantization_config
from trl import ScriptArguments as TRLScriptArguments
from trl.experimental.ppo import PPOConfig, PPOTrainer

from trl_ext import get_kbit_device_map  # removed from trl in 1.8; PPO scripts load their 4-bit models themselves


@dataclass
class ScriptArguments(TRLScriptArguments):
    policy: str = field(default="full", metadata={"help": "full, lora_wrapped or sft_adapter"})
    sft_adapter_path: str | None = field(default=None)
    reward: str = field(default="model", metadata={"help": "model (a frozen local reward model) or rule"})
    chat: bool = field(default=False, metadata={"help": "prompts as chat messages, through the chat template"})
    eval_samples: int = field(default=0)


class RuleRewardModel(PreTrainedModel):
    """A rule-based reward model: no backbone; it decodes the ids and scores the text (+1 per 'is', -0.1 per word),
    returning logits of shape (B, 1)."""

    config_class = PretrainedConfig

    def __init__(self, tokenizer):
        super().__init__(PretrainedConfig())
        self.tokenizer = tokenizer
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        scores = [text.split().count("is") - 0.1 * len(text.split()) for text in texts]
        return SequenceClassifierOutput(logits=torch.tensor(scores, device=input_ids.device)[:, None])


if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()

    ################ Model & Tokenizer
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)  # Qwen-style: pads on the right
    if script_args.policy == "sft_adapter":  # the SFT checkpoint: a 4-bit base and its LoRA adapter
        kwargs = dict(dtype=dtype, quantization_config=get_quantization_config(model_args),
                      device_map=get_kbit_device_map())
        base = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
        policy = PeftModel.from_pretrained(base, script_args.sft_adapter_path, is_trainable=True)
        ref_policy = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
        ref_policy = PeftModel.from_pretrained(ref_policy, script_args.sft_adapter_path).eval()  # frozen SFT model
        peft_config = None
    elif script_args.policy == "lora_wrapped":  # the user wraps the policy; the reference is a full copy
        policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype),
                                get_peft_config(model_args))
        ref_policy = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
        peft_config = None
    else:
        policy = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
        ref_policy = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
        peft_config = get_peft_config(model_args)
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    if script_args.reward == "rule":
        reward_model = RuleRewardModel(tokenizer)
    else:
        reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path,
                                                                          num_labels=1)
        reward_model.requires_grad_(False)

    ################ Dataset
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                           split=script_args.dataset_train_split)
    if script_args.eval_samples:
        split = dataset.train_test_split(test_size=script_args.eval_samples, seed=0)
        train_dataset, eval_dataset = split["train"], split["test"]
    else:
        train_dataset, eval_dataset = dataset, None

    def tokenize(row):
        if script_args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
            return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
        return {"input_ids": tokenizer(row["prompt"])["input_ids"]}

    with PartialState().local_main_process_first():
        train_dataset = train_dataset.map(tokenize, remove_columns=train_dataset.column_names)
        if eval_dataset is not None:
            eval_dataset = eval_dataset.map(tokenize, remove_columns=eval_dataset.column_names)

    ################ Training
    trainer = PPOTrainer(args=training_args, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, value_model=value_model, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, peft_config=peft_config)
    trained = trainer.model.policy
    before = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    trainer.train()
    moved = sum(not torch.equal(before[n], p.detach()) for n, p in trained.named_parameters() if n in before)
    trainer.save_model(training_args.output_dir)
    if PartialState().is_main_process:
        print(f"POLICY MOVED {moved} of {len(before)}")
        print("SCRIPT DONE")
