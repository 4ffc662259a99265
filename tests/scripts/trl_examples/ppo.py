"""TRL 1.12's examples/scripts/ppo/ppo.py, step by step, as a TRL user runs it (written for these tests; the flags
are TRL's). tests/trl/test_trl_drop_in.py runs it with only the import line changed to trl_ext's, on offline stand-ins.

    python ppo.py --dataset_name DATA --dataset_train_split descriptiveness --output_dir OUT \
        --per_device_train_batch_size 4 --total_episodes 16 --model_name_or_path M --sft_model_path M \
        --reward_model_path RM --missing_eos_penalty 1.0 [--use_peft]
"""

import shutil

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config, get_quantization_config
from trl.experimental.ppo import PPOConfig, PPOTrainer

if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    # models and tokenizer: a [PAD] token added to the tokenizer, not to the models
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    model_kwargs = dict(revision=model_args.model_revision, attn_implementation=model_args.attn_implementation,
                        dtype=dtype)
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        model_kwargs["quantization_config"] = quantization_config
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1,
                                                                     **model_kwargs)
    reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1,
                                                                      **model_kwargs)
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
    peft_config = get_peft_config(model_args)
    ref_policy = (AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
                  if peft_config is None else None)

    # data: the last 100 prompts (here: 8) held out for evaluation, tokenized without padding
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                           split=script_args.dataset_train_split)
    eval_samples = 8
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))

    def prepare_dataset(dataset, tokenizer):
        def tokenize(element):
            return {"input_ids": tokenizer(element["prompt"], padding=False)["input_ids"]}

        return dataset.map(tokenize, batched=True, remove_columns=dataset.column_names,
                           num_proc=training_args.dataset_num_proc)

    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    trainer = PPOTrainer(args=training_args, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, value_model=value_model, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, peft_config=peft_config)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.generate_completions()
    if PartialState().is_main_process:
        print("EXAMPLE DONE")
