"""What the recipes share: the command line, loading by hub name or path with errors that say the fix, the run folder.

    from trl import ModelConfig
    from trl_ext import PPOConfig
    from trl_ext.scripts import CPU_DEFAULTS, load_tokenizer, parse_args

    script_args, args, model_args = parse_args((ScriptArguments, PPOConfig, ModelConfig), dict(CPU_DEFAULTS, ...))

- `parse_args`: TRL's `TrlParser` (every field a flag, `--config run.yaml`), with the recipe's defaults under both;
  `CPU_DEFAULTS` / `LORA_DEFAULTS`: what the short CPU recipes set.
- `hub_load` / `HubUnavailableError`: "the hub is unreachable and NAME is not cached" or "no such repository" as one
  message naming what failed, the flag and the fixes. transformers and datasets say this in a traceback whose last
  line often names neither (datasets: `ConnectionError: Couldn't reach ...`; transformers: an `OSError` about a
  `config.json`), so the recipes wrap their loads with it.
- `load_tokenizer`, `load_prompt_splits`: a left-padding tokenizer with a pad token; prompt datasets from the hub, a
  data file, a folder of split files or a `save_to_disk` folder.
- `load_dtype`: TRL's `--dtype` as `from_pretrained` takes it, checked against the precision flags.
- `clear_run_files`, `write_json`: a run folder that holds one run (JSON lines:
  `trl_ext.monitoring.callbacks.append_jsonl`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

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


# PPOConfig settings of the short CPU recipes: fp32, no tracker, no checkpoints, a log line per step, a constant
# learning rate, no gradient checkpointing (TRL defaults it on; on CPU memory is plentiful, recomputation costs time).
CPU_DEFAULTS = dict(bf16=False, report_to="none", save_strategy="no", num_sample_generations=0, logging_steps=1,
                    lr_scheduler_type="constant", gradient_checkpointing=False)
# trl.ModelConfig settings of their LoRA policies: rank 8 on every linear layer, no dropout.
LORA_DEFAULTS = dict(use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules="all-linear")


def load_dtype(model_args, args=None):
    """TRL ModelConfig's `--dtype` as `from_pretrained(dtype=...)` takes it: "auto", None or a torch dtype.

    With `args` (a PPOConfig): a bf16 or fp16 load keeps what the recipe trains in fp32 (LoRA adapters, a critic's
    top layers: `trl_ext.models.freeze_backbone`), and the two meet under the Accelerator's autocast, so `--dtype
    bfloat16` needs `--bf16 true` (`float16`: `--fp16 true`); without it the first forward would fail on mixed
    dtypes, so this says so before anything is loaded."""
    import torch

    name = model_args.dtype
    if name in ("auto", None):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {name!r} is not a torch dtype: use auto, float32, bfloat16 or float16.")
    flag = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if args is not None and flag is not None and not getattr(args, flag):
        cpu = " --use_cpu true" if flag == "bf16" and not torch.cuda.is_available() else ""
        raise ValueError(f"--dtype {name} loads the frozen weights in {name} and keeps the trained ones in float32; "
                         f"they run together under autocast: add --{flag} true{cpu}, or drop --dtype for float32.")
    return dtype


class HubUnavailableError(RuntimeError):
    """A model, tokenizer or dataset given by hub name could not be loaded: the hub is unreachable and the name is not
    cached, or the hub has no such repository (or denies access). The message names it and gives the fixes."""


def parse_args(dataclass_types: tuple, defaults: dict, argv: list[str] | None = None) -> tuple:
    """The instances of `dataclass_types` from the command line (TRL's `TrlParser`). Precedence: the command line,
    then a `--config` YAML, then `defaults` (the recipe's), then the dataclasses' own defaults."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types)
    parser.set_defaults(**defaults)
    parsed = tuple(parser.parse_args_and_config(args=argv))
    for instance in parsed:
        # ModelConfig takes `--lora_target_modules q_proj v_proj` and turns a single name into a bare string; the
        # recipes took "q_proj,v_proj". peft reads a string as one pattern for the whole module path, which matches
        # nothing: make it a list of names ("all-linear" stays)
        targets = getattr(instance, "lora_target_modules", None)
        if isinstance(targets, str) and targets != "all-linear":
            instance.lora_target_modules = [t.strip() for t in targets.split(",") if t.strip()]
    return parsed


# ------------------------------------------------------------------------------------------------ loading by name


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(tuple(DATA_FILE_BUILDERS)) or name.count("/") > 1


def _hub_failure(error: BaseException) -> str | None:
    """'unreachable', 'not_found', or None (a failure that has nothing to do with reaching the hub)."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain).lower()
    if names & UNREACHABLE_ERRORS or "couldn't connect" in text or "couldn't reach" in text:
        return "unreachable"
    if names & NOT_FOUND_ERRORS or "is not a valid model identifier" in text:
        return "not_found"
    return None


def hub_load(what: str, name: str, load: Callable[[], T], flag: str, repo_type: str = "model") -> T:
    """`load()` a model, tokenizer or dataset given by `name` (a hub name or a local path), turning "the hub is
    unreachable" and "no such repository" into a HubUnavailableError that names `what`, `name`, `flag` and the fixes.

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
            why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "there is no connection to it"
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


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--model_name_or_path",
                   revision: str | None = None):
    """The tokenizer, left-padding, with a pad token (`trl_ext.data.prompts.left_padding_tokenizer`), or the error
    that names the flag when the hub cannot give it."""
    from ..data.prompts import left_padding_tokenizer

    return hub_load("tokenizer", name, lambda: left_padding_tokenizer(name, trust_remote_code, revision), flag)


def load_prompt_splits(script_args, evaluate: bool, eval_samples: int = -1):
    """(train, eval or None) prompt datasets from TRL's `ScriptArguments` fields (`dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`), keeping only the `prompt` (or `input_ids`) column; the eval split cut
    to its first `eval_samples` rows (-1: all).

    `dataset_name` may be a hub name, a data file (its `train` split), a folder of data files named by split, or a
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
            hint = " (or --eval_strategy no)." if flag == "--dataset_test_split" else "."
            raise ValueError(f"{flag} {split_name!r}: the dataset {name!r} has no such split; it has "
                             f"{sorted(splits)}. Pass one of them{hint}")
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
    if eval_samples > 0:
        test = test.select(range(min(eval_samples, len(test))))
    return train, test


# ------------------------------------------------------------------------------------------------ the run folder


def clear_run_files(output_dir, names: Iterable[str]) -> list[str]:
    """Delete the files `names` of an earlier run in `output_dir` (the trainer appends to metrics.jsonl, so a stale
    one would mix two runs in the dashboard); returns the names deleted."""
    removed = []
    for name in names:
        path = Path(output_dir) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def write_json(path, record: dict) -> None:
    """`record` as JSON, nested dicts and lists included, its values as metrics.jsonl writes them (non-finite floats
    as null: `trl_ext.monitoring.callbacks._jsonable`)."""
    from ..monitoring.callbacks import _jsonable

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return _jsonable(value)

    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(record), f, indent=2)
