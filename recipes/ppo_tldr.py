"""PPO on TL;DR summarisation for 1-8B models on GPUs: the recipe of Huang et al. (2024), run with trl_ext.

Reddit posts ("SUBREDDIT: ... TITLE: ... POST: ... TL;DR:") are the prompts; the policy starts from a supervised
(SFT) summariser, a reward model trained on human preferences scores its summaries, and PPO raises that score under a
KL penalty towards the SFT model. The defaults reproduce the 1B setting of

    [H] S. Huang, M. Noukhovitch, A. Hosseini, K. Rasul, W. Wang, L. Tunstall. "The N+ Implementation Details of RLHF
        with PPO: A Case Study on TL;DR Summarization", 2024, arXiv:2403.17031. Values read from its code,
        github.com/vwxyzjn/summarize_from_feedback_details: `summarize_from_feedback_details/ppo_left_padding_new.py`
        (`Args`, `PpoHParams`) and `sbatches/ppo_left_padding.sbatch` (batch sizes per model size);
    [T] TRL's own version of this recipe, `examples/scripts/ppo/ppo_tldr.py` (models, dataset, launch lines), and
        TRL 1.12's `PPOConfig` defaults, which follow [H].

Defaults (each row is checked by tests/test_gpu_recipes.py against what the parser gives):

| flag | default | source |
|---|---|---|
| `--sft_model_path` | `cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr` | [T]; [H]'s SFT checkpoint for Pythia-1B |
| `--reward_model_path` | `cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr` | [T]; [H]'s reward model for Pythia-1B |
| `--model_name_or_path` | `EleutherAI/pythia-1b-deduped` | [T]: the tokenizer comes from the base model |
| `--dataset_name` | `trl-lib/tldr` | [T] (`prompt` column: Reddit posts ending in "TL;DR:") |
| `--dataset_test_split` | `validation` | [T] |
| `--learning_rate` | `3e-6` | [H] `lr = 3e-6`; [T] |
| `--lr_scheduler_type` | `linear` | [H] `lrnow = frac * args.lr`: linear decay to 0, no warmup |
| `--adam_epsilon` | `1e-5` | [H] `eps = 1e-5` (AdamW) |
| `--total_episodes` | `1000000` | [H] `total_episodes = 1000000`; [T]'s multi-GPU launch line |
| `--per_device_train_batch_size` | `16` | [H] sbatch, Pythia-1B: `local_micro_batch_size=16` |
| `--gradient_accumulation_steps` | `4` | [H] sbatch, Pythia-1B: 8 GPUs x 16 x 4 = 512 rollouts per PPO batch |
| `--num_mini_batches` | `1` | [H] `nminibatches = 1` |
| `--num_ppo_epochs` | `4` | [H] `noptepochs = 4` |
| `--local_rollout_forward_batch_size` | `64` | [H] sbatch, Pythia-1B |
| `--response_length` | `53` | [H] `response_length = 53` (the SFT summaries' length cap) |
| `--temperature` | `0.7` | [H] `temperature = 0.7` |
| `--stop_token` | `eos` | [H] `truncate_token = "eos"`; [T] `--stop_token eos` |
| `--missing_eos_penalty` | `1.0` | the "EOS trick": [H] `non_eos_penalty=True`, `penalty_reward_value=-1`; [T] |
| `--kl_coef` | `0.05` | [H] `kl_coef = 0.05` |
| `--kl_estimator` | `k1` | [H] `kl = logprobs - ref_logprobs` |
| `--whiten_rewards` | `False` | [H]'s released `..._nowhiten_reward__tldr` runs (script default True) |
| `--vf_coef` | `0.1` | [H] `vf_coef = 0.1` |
| `--cliprange` | `0.2` | [H] `cliprange = 0.2` |
| `--cliprange_value` | `0.2` | [H] `cliprange_value = 0.2` |
| `--gamma` | `1.0` | [H] `gamma = 1` |
| `--lam` | `0.95` | [H] `lam = 0.95` |
| `--max_prompt_length` | `512` | [T] drops prompts over 512 tokens; [H]'s queries are cut to 512 tokens |
| `--prompt_truncation` | `drop` | [T] (filters them out rather than cutting them) |
| `--eval_strategy` | `steps` | [T] `--eval_strategy steps --eval_steps 100` |
| `--eval_steps` | `100` | [T] |
| `--ds3_gather_for_generation` | `True` | TRL's default (see DeepSpeed ZeRO-3 below) |
| value model | a second copy of the reward model, head kept | [H] `ScalarModel.from_pretrained(rm_path)`; [T] |
| reference policy | a frozen copy of the SFT model (with `--use_peft`: the policy with its adapter off) | [H], [T] |

Differences from [H] worth knowing: [H] *replaces* the score of a summary without EOS by -1, trl_ext (like TRL)
*subtracts* `missing_eos_penalty` from it. [H] samples all 53 tokens and cuts after the first EOS; trl_ext stops at the
EOS, which gives the same responses, masks and scores. [H] pads with a new `[PAD]` token; this recipe pads with EOS
when the tokenizer has no pad token (trl_ext builds masks from positions, never from `== pad_token_id`, so pad == EOS
is safe). `--critic_warmup_steps` (trl_ext) is 0, as in [H].

Batch sizes for other sizes ([H] sbatch, 8 GPUs, 512 rollouts per PPO batch): Pythia-2.8B
`--per_device_train_batch_size 4 --gradient_accumulation_steps 16 --local_rollout_forward_batch_size 32`; Pythia-6.9B
`1 / 64 / 4` with ZeRO-3. On fewer GPUs, keep the 512-rollout batch by raising `--gradient_accumulation_steps` (1 GPU,
1B: 32), or accept a smaller batch. For 7-8B models on one GPU: `--use_peft --load_in_4bit` (QLoRA policy; the reference
is the policy with its adapter off); the value model stays a full, trainable copy of the reward model.

Run it (see recipes/accelerate_configs/README.md for every launch mode):

    python recipes/ppo_tldr.py --output_dir runs/ppo-tldr                                  # one GPU
    accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero2.yaml recipes/ppo_tldr.py \\
        --output_dir runs/ppo-tldr                                                          # 8 GPUs, ZeRO-2

DeepSpeed ZeRO-3: generation needs whole weights, and `--ds3_gather_for_generation` (default True) gathers them on each
GPU for the length of a rollout; set `--ds3_gather_for_generation False` when the model does not fit on one GPU
(generation then runs sharded, much slower).

Models and data by name come from the Hugging Face Hub. When the hub cannot be reached (no network, `HF_HUB_OFFLINE=1`)
and the name is not in the local cache, the recipe stops with a message naming what failed and the fixes: connect,
download once with `hf download NAME` (`huggingface-cli download NAME` in older huggingface_hub; add
`--repo-type dataset` for the data), or pass a local folder (`--sft_model_path /path/to/folder`) or a local data file or
folder (`--dataset_name /path/to/prompts.jsonl`, a `prompt` column; a folder of `train.jsonl` + `validation.jsonl`, or
one saved with `DatasetDict.save_to_disk`). A single data file is the `train` split; pass `--eval_strategy no` or give
a folder with a test split.

It writes to `--output_dir`: the policy (or its LoRA adapter), the tokenizer, metrics.jsonl and samples.jsonl
(always; `--report_to wandb` or `tensorboard` adds a tracker, the recipe's default is `none`). Mixed precision comes
from `--bf16` (unset: bf16 wherever the GPU supports it), which the configs' `mixed_precision: bf16` matches.
Arguments are parsed before any model loads, so under a DeepSpeed launch `TrainingArguments` has already set up ZeRO-3,
which then partitions each model as it loads (untested: no GPU was available, see recipes/accelerate_configs/README.md).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from transformers import HfArgumentParser  # noqa: E402

from trl_ext import PPOConfig  # noqa: E402

T = TypeVar("T")

# Data files that `--dataset_name` may point at, and the `datasets` builder that reads each.
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# Exceptions (by class name, anywhere in the chain of causes) that mean "the hub could not be reached and the files
# are not cached". Names, not imports: they come from huggingface_hub, datasets, requests, httpx and socket, whose
# module layouts change between releases.
UNREACHABLE_ERRORS = {
    "LocalEntryNotFoundError",  # huggingface_hub: offline (HF_HUB_OFFLINE=1) or no connection, not in the cache
    "OfflineModeIsEnabled",     # huggingface_hub / datasets with HF_HUB_OFFLINE=1
    "ConnectionError",          # builtins (datasets: "Couldn't reach 'x' on the Hub"), requests
    "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutError",  # httpx, requests, builtins
    "gaierror",                 # socket: name resolution failed
}
# ... and those that mean "the hub answered: no such repository, or no access to it".
NOT_FOUND_ERRORS = {"RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError", "DatasetNotFoundError"}


class HubUnavailableError(RuntimeError):
    """A model, tokenizer or dataset given by hub name could not be loaded: the hub is unreachable and the name is not
    cached, or the hub has no such repository (or denies access). The message names it and gives the fixes."""


@dataclass
class ScriptArguments:
    """Recipe options that are not PPOConfig fields. The SFT policy and the reward model are PPOConfig's own
    `--sft_model_path` and `--reward_model_path` (as in TRL)."""

    model_name_or_path: str | None = field(
        default="EleutherAI/pythia-1b-deduped",
        metadata={"help": "Hub name or local folder of the tokenizer (the SFT model's base model). Unset (pass ''): "
                  "the tokenizer saved with --sft_model_path."},
    )
    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Hub name or local folder the value model starts from. Unset: --reward_model_path (Huang "
                  "et al.: the critic starts as a copy of the reward model)."},
    )
    reward_tokenizer_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer of a reward model that does not share the policy's tokenizer (the text is then "
                  "re-tokenized for it). Unset: the reward model reads the policy's token ids."},
    )
    dataset_name: str = field(
        default="trl-lib/tldr",
        metadata={"help": "Hub dataset name, a local data file (.jsonl/.json/.csv/.parquet) or a local folder "
                  "(data files named by split, or a `save_to_disk` folder). Needs a `prompt` column (or `input_ids`)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name, if any."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="validation", metadata={"help": "Split to evaluate on (used when --eval_strategy is not 'no')."}
    )
    eval_samples: int = field(
        default=256,
        metadata={"help": "Evaluate on the first N prompts of the test split (each eval samples from the policy and "
                  "the reference for every one); -1: all of them."},
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Weights' dtype when loading: 'float32' (master weights; --bf16 trains in bf16 autocast), "
                  "'bfloat16', 'float16' or 'auto'."},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "e.g. 'sdpa', 'flash_attention_2'. Unset: transformers' default."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with custom code from the hub."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter on the policy instead of all of it."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names for LoRA (e.g. 'query_key_value,dense'), or 'all-linear'."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "Load the policy in 4-bit NF4 (bitsandbytes) and train a LoRA adapter on it (QLoRA); "
                  "needs --use_peft. The reward and value models load in --dtype."},
    )


# Huang et al. (2024) / TRL's ppo_tldr.py: every value, with its source, is in the table of the module docstring.
RECIPE_DEFAULTS = dict(
    output_dir="runs/ppo-tldr",
    sft_model_path="cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr",
    reward_model_path="cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr",
    learning_rate=3e-6,
    lr_scheduler_type="linear",
    adam_epsilon=1e-5,
    total_episodes=1_000_000,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,
    num_mini_batches=1,
    num_ppo_epochs=4,
    local_rollout_forward_batch_size=64,
    response_length=53,
    temperature=0.7,
    stop_token="eos",
    missing_eos_penalty=1.0,
    kl_coef=0.05,
    kl_estimator="k1",
    whiten_rewards=False,
    vf_coef=0.1,
    cliprange=0.2,
    cliprange_value=0.2,
    gamma=1.0,
    lam=0.95,
    max_prompt_length=512,
    prompt_truncation="drop",
    eval_strategy="steps",
    eval_steps=100,
    ds3_gather_for_generation=True,
    logging_steps=1,
    report_to="none",
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    """Command line -> (ScriptArguments, trl_ext.PPOConfig), with the recipe's defaults (RECIPE_DEFAULTS)."""
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    parser.set_defaults(**RECIPE_DEFAULTS)
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    if script_args.load_in_4bit and not script_args.use_peft:
        raise ValueError("--load_in_4bit quantizes the policy, which can then only train through an adapter: add "
                         "--use_peft (or drop --load_in_4bit).")
    if script_args.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ValueError(f"--dtype {script_args.dtype!r} is not one of 'float32', 'bfloat16', 'float16', 'auto'.")
    if script_args.eval_samples == 0 or script_args.eval_samples < -1:
        raise ValueError(f"--eval_samples {script_args.eval_samples} must be a positive number of prompts, or -1 for "
                         "all of them (use --eval_strategy no to skip evaluation).")
    return script_args, args


# ------------------------------------------------------------------------------------------------ loading by name


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(tuple(DATA_FILE_BUILDERS)) or name.count("/") > 1


def _error_chain(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _hub_failure(error: BaseException) -> str | None:
    """'unreachable', 'not_found', or None (a failure that has nothing to do with reaching the hub)."""
    chain = _error_chain(error)
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain).lower()
    if names & UNREACHABLE_ERRORS or "couldn't connect" in text or "couldn't reach" in text:
        return "unreachable"
    if names & NOT_FOUND_ERRORS or "is not a valid model identifier" in text:
        return "not_found"
    return None


def hub_load(what: str, name: str, load: Callable[[], T], flag: str, repo_type: str = "model") -> T:
    """`load()` a model, tokenizer or dataset given by `name` (a hub name or a local path), turning "the hub is
    unreachable" and "no such repository" into a HubUnavailableError that names `what`, `name` and the fixes.

    A name that exists on disk is loaded as is (its errors are not hub errors). A name that looks like a path but
    does not exist is a FileNotFoundError, without asking the hub."""
    if os.path.exists(os.path.expanduser(name)):
        return load()
    if _looks_like_path(name):
        raise FileNotFoundError(f"The {what} {flag} {name!r} looks like a local path, but there is nothing there. "
                                "Check the path (or pass a hub name such as 'org/name').")
    try:
        return load()
    except Exception as error:  # noqa: BLE001 - classified below; anything else is re-raised unchanged
        failure = _hub_failure(error)
        if failure is None:
            raise
        from huggingface_hub import constants

        kind = "--repo-type dataset " if repo_type == "dataset" else ""
        local = ("a local data file or folder: `--dataset_name /path/to/prompts.jsonl` (a `prompt` column) or a "
                 "folder of train.jsonl + validation.jsonl" if repo_type == "dataset"
                 else f"a local folder: `{flag} /path/to/folder` (saved with save_pretrained)")
        if failure == "unreachable":
            why = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "there is no connection to it")
            message = (
                f"Cannot load the {what} {name!r} ({flag}): the Hugging Face Hub is unreachable ({why}) and "
                f"{name!r} is not in the local cache ({constants.HF_HUB_CACHE}).\n"
                "Fix, one of:\n"
                "  - connect to the hub (and unset HF_HUB_OFFLINE) and run again;\n"
                f"  - download it once where the hub is reachable: `hf download {kind}{name}` (older huggingface_hub: "
                f"`huggingface-cli download {kind}{name}`), then copy the cache here; HF_HUB_OFFLINE=1 then works;\n"
                f"  - pass {local}."
            )
        else:
            message = (
                f"Cannot load the {what} {name!r} ({flag}): the Hugging Face Hub has no such {repo_type} repository, "
                "or it is gated/private and you are not logged in.\n"
                f"Fix: check the name; for a gated or private repository run `hf auth login` (and accept its terms on "
                f"the hub); or pass {local}."
            )
        raise HubUnavailableError(message) from error


def _dtype(name: str):
    import torch

    return name if name == "auto" else getattr(torch, name)


def load_tokenizer(name: str, trust_remote_code: bool, flag: str = "--model_name_or_path"):
    """The tokenizer, left-padding, with a pad token (its EOS token if it had none, as Pythia's and Llama's)."""
    from transformers import AutoTokenizer

    tokenizer = hub_load("tokenizer", name, lambda: AutoTokenizer.from_pretrained(
        name, padding_side="left", trust_remote_code=trust_remote_code), flag)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # trl_ext masks by position, so pad == EOS is safe
    return tokenizer


def load_scalar_model(what: str, name: str, flag: str, script_args: ScriptArguments, pad_token_id: int):
    """A reward or value model: a sequence-classification model with one output."""
    from transformers import AutoModelForSequenceClassification

    model = hub_load(what, name, lambda: AutoModelForSequenceClassification.from_pretrained(
        name, num_labels=1, dtype=_dtype(script_args.dtype), attn_implementation=script_args.attn_implementation,
        trust_remote_code=script_args.trust_remote_code), flag)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    return model


def load_policy(name: str, script_args: ScriptArguments):
    """The SFT policy, in --dtype, or in 4-bit NF4 with --load_in_4bit."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=_dtype(script_args.dtype), attn_implementation=script_args.attn_implementation,
                                  trust_remote_code=script_args.trust_remote_code)
    if script_args.load_in_4bit:
        import torch
        from accelerate import PartialState
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if script_args.dtype in ("float32", "auto") else _dtype(script_args.dtype)
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=compute,
                                                           bnb_4bit_use_double_quant=True)
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": PartialState().local_process_index}  # each process its own GPU
    policy = hub_load("SFT policy", name, lambda: AutoModelForCausalLM.from_pretrained(name, **kwargs),
                      "--sft_model_path")
    if script_args.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)  # the trainer sets it
    return policy


def load_prompt_splits(script_args: ScriptArguments, evaluate: bool):
    """(train, eval or None) prompt datasets, keeping only the `prompt` (or `input_ids`) column.

    `--dataset_name` may be a hub name, a data file (the `train` split), a folder of data files named by split, or a
    `save_to_disk` folder."""
    from datasets import Dataset, load_dataset, load_from_disk

    name = script_args.dataset_name
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        builder = DATA_FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ValueError(f"--dataset_name {name!r}: unknown data file type; use one of "
                             f"{sorted(DATA_FILE_BUILDERS)} (or a folder, or a hub name).")
        splits = load_dataset(builder, data_files={"train": path})
    elif os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                     for f in ("dataset_dict.json", "state.json")):
        splits = load_from_disk(path)
    else:
        splits = hub_load("dataset", name, lambda: load_dataset(name, name=script_args.dataset_config),
                          "--dataset_name", repo_type="dataset")
    if isinstance(splits, Dataset):
        splits = {"train": splits}

    def split(split_name: str, flag: str):
        if split_name not in splits:
            raise ValueError(f"{flag} {split_name!r}: the dataset {name!r} has no such split; it has "
                             f"{sorted(splits)}. Pass one of them" + (" (or --eval_strategy no)." if
                                                                      flag == "--dataset_test_split" else "."))
        ds = splits[split_name]
        column = "input_ids" if "input_ids" in ds.column_names else "prompt"
        if column not in ds.column_names:
            raise ValueError(f"The {split_name!r} split of {name!r} has columns {ds.column_names} but no `prompt` "
                             "(text or chat messages) or `input_ids` column; rename the prompt column to `prompt`.")
        return ds.select_columns([column])

    train = split(script_args.dataset_train_split, "--dataset_train_split")
    if not evaluate:
        return train, None
    test = split(script_args.dataset_test_split, "--dataset_test_split")
    if script_args.eval_samples > 0:
        test = test.select(range(min(script_args.eval_samples, len(test))))
    return train, test


def peft_config_of(script_args: ScriptArguments):
    if not script_args.use_peft:
        return None
    from peft import LoraConfig

    targets = script_args.lora_target_modules
    return LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=script_args.lora_dropout,
                      target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
                      task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------------ the run


def main(argv: list[str] | None = None) -> dict:
    from transformers import set_seed

    script_args, args = parse_args(argv)
    set_seed(args.seed)  # anything drawn while building (new heads, LoRA matrices) follows the seed

    # 1. tokenizer and prompts first: they fail fast, before gigabytes of weights are read
    tokenizer = load_tokenizer(script_args.model_name_or_path or args.sft_model_path, script_args.trust_remote_code,
                               "--model_name_or_path" if script_args.model_name_or_path else "--sft_model_path")
    train_dataset, eval_dataset = load_prompt_splits(script_args, evaluate=args.eval_strategy != "no")

    # 2. models: SFT policy, reward model, value model (a second copy of the reward model, loaded from disk rather
    #    than deep-copied, so that ZeRO-3's partitioned loading works for it too)
    policy = load_policy(args.sft_model_path, script_args)
    reward_model = load_scalar_model("reward model", args.reward_model_path, "--reward_model_path", script_args,
                                     tokenizer.pad_token_id)
    value_path = script_args.value_model_path or args.reward_model_path
    value_model = load_scalar_model("value model", value_path, "--value_model_path" if script_args.value_model_path
                                    else "--reward_model_path", script_args, tokenizer.pad_token_id)
    reward = reward_model
    if script_args.reward_tokenizer_path:
        reward = (reward_model, load_tokenizer(script_args.reward_tokenizer_path, script_args.trust_remote_code,
                                               "--reward_tokenizer_path"))

    from trl_ext import PPOTrainer

    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # a frozen copy of the SFT policy; with --use_peft the policy with its adapter disabled
        reward_model=reward,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config_of(script_args),
    )
    if trainer.is_world_process_zero():
        print(f"[recipe] PPO on TL;DR: {args.num_total_batches} steps x {args.batch_size} rollouts "
              f"({args.world_size} process(es)), policy {args.sft_model_path}, reward {args.reward_model_path}, "
              f"lr={args.learning_rate}, kl_coef={args.kl_coef}, device={trainer.accelerator.device} "
              f"-> {args.output_dir}", flush=True)

    start = time.time()
    trainer.train()
    wall = time.time() - start
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)

    logs = [entry for entry in trainer.state.log_history if "objective/scores" in entry]
    scores = [entry["objective/scores"] for entry in logs]
    summary = {
        "steps": len(logs),
        "wall_s": wall,
        "first_score": scores[0] if scores else math.nan,
        "last_score": scores[-1] if scores else math.nan,
        "last_kl": logs[-1]["objective/kl"] if logs else math.nan,
    }
    if trainer.is_world_process_zero():
        print(f"[recipe] done: {summary['steps']} steps in {wall:.0f} s; mean score {summary['first_score']:+.3f} -> "
              f"{summary['last_score']:+.3f}, KL {summary['last_kl']:.3f}; model and metrics.jsonl in "
              f"{args.output_dir}", flush=True)
    return summary


if __name__ == "__main__":
    try:
        main()
    except HubUnavailableError as error:
        sys.exit(f"[recipe] error: {error}")  # the message says what and how to fix it; no traceback
