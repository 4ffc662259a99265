"""Checkpoint files of a PPO run, beyond what transformers' Trainer writes, and what a checkpoint guarantees
(docs/checkpoints.md).

A checkpoint folder `checkpoint-N` holds: the policy (its adapter, with peft) as `save_pretrained` writes it,
`value_model/`, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `async_rollouts_<process>.pt` (async_rollouts'
draws with older policy versions), `trainer_state.json` (global step, episode, log history) and `trl_ext_state.json`
(β controller state, the settings a resumed run must share, the whole config, and the size and sha256 of every other
file: `seal`). It is written into `checkpoint-N.partial` and renamed when complete
and sealed (`staged`), so a run killed mid-save leaves the previous checkpoint intact (`get_last_checkpoint` only sees
complete `checkpoint-N` folders); a write that fails on any process removes the partial folder and says why, with the
free space. A resume verifies the files (`verify`: every file the state lists, with its size and hash, and the files
a resume needs by name, from the checkpoint's own record of the processes that wrote it: `layout_record`); with
`resume_from_checkpoint=True` the newest intact checkpoint is taken, saying which were skipped (`choose_checkpoint`).
A checkpoint resumes on another number of processes where its state is whole (`check_layout`). One timeline per
`output_dir`: resuming from an older checkpoint than the newest moves the later ones into `output_dir/abandoned/`,
and a run that does not resume moves every checkpoint there (`abandon_after`), so an automatic restart continues the
run resumed or started, never another. After a blow-up, `WeightGrowth` tells which checkpoints were saved before it
began (`recovery_advice`).

`Checkpoints` is the run's room: it writes the files inside `staged` (with transformers' own optimizer/RNG writers,
through the trainer) and resumes with `choose_checkpoint`, `read_state`, `check_layout`, `check_compatible`,
`load_trained_weights` and `changed_settings`; the trainer calls `save`, `resume` and `start_timeline`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from contextlib import contextmanager

import torch
from accelerate.utils import broadcast_object_list
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import rotate_checkpoints, set_seed
from transformers.utils import is_peft_available

from .._trl import OnlineTrainerState
from .async_rollouts import load_drawn, save_drawn
from .seeds import regrown_process_seed

TRL_EXT_STATE = "trl_ext_state.json"
VALUE_MODEL_DIR = "value_model"
ABANDONED_DIR = "abandoned"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or must not be loaded; the message names the file and what to do."""


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    """A `save_pretrained` folder's weights (one file or the shards its index lists)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete or not a trl_ext checkpoint.")
        state.update(load_file(path))
    return state


def check_loaded(module: torch.nn.Module, state: dict, result, folder: str) -> None:
    """After `load_state_dict(state, strict=False)`: keys missing from the file must be tied to a key that is present
    (e.g. tied embeddings); anything else is an error."""
    params = dict(module.named_parameters(remove_duplicate=False))
    present = {id(params[k]) for k in state if k in params}
    untied_missing = [k for k in result.missing_keys if k not in params or id(params[k]) not in present]
    if untied_missing or result.unexpected_keys:
        raise ValueError(f"Checkpoint {folder} does not match the model: missing {untied_missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}. Resume with the same model (and peft config) it was "
                         "saved from.")


def load_weights(module: torch.nn.Module, folder: str) -> None:
    """Load a `save_pretrained` folder's weights into an existing module."""
    state = read_weights(folder)
    check_loaded(module, state, module.load_state_dict(state, strict=False), folder)


def load_adapter(peft_model, folder: str) -> None:
    """Load a saved LoRA/peft adapter into the trainer's peft policy (adapter name 'default')."""
    from peft import set_peft_model_state_dict

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint holds no adapter, but the policy is a peft "
                                "model. Resume with the setup the checkpoint was saved from.")
    result = set_peft_model_state_dict(peft_model, load_file(path))
    if result.unexpected_keys:
        raise ValueError(f"Adapter in {folder} does not match the policy's peft config: unexpected "
                         f"{result.unexpected_keys[:5]}.")


def check_compatible(saved: dict, current: dict, checkpoint: str) -> None:
    """Refuse a checkpoint whose run settings differ from this run's (batch geometry, KL control, model shape)."""
    if "batch_size" not in saved and "per_device_train_batch_size" in saved:  # recorded per process before 0.1.1
        batch = saved["per_device_train_batch_size"] * saved["gradient_accumulation_steps"] * saved["world_size"]
        saved = saved | {"batch_size": batch, "mini_batch_size": batch // saved["num_mini_batches"]}
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"Cannot resume from {checkpoint}: it was saved with different settings ("
                         + "; ".join(diffs) + "). Resume with the settings it was saved with, or start a new run "
                         "in another output_dir.")


def _numel(param: torch.Tensor) -> int:
    """A parameter's whole size, also when ZeRO-3 has partitioned it (FSDP2's DTensors report theirs)."""
    return getattr(param, "ds_numel", param.numel())


def run_settings(args, wrapper, num_prompts: int, is_peft: bool, layout: dict) -> dict:
    """What a resumed run must share with the run that saved the checkpoint: the global batch and minibatch, not how
    they are split over processes and micro-batches (`check_layout` decides whether the process count may change)."""
    return {
        "batch_size": args.batch_size, "mini_batch_size": args.mini_batch_size,
        "num_mini_batches": args.num_mini_batches, "num_ppo_epochs": args.num_ppo_epochs,
        "response_length": args.response_length, "seed": args.seed,
        "num_prompts": num_prompts, "kl_controller": args.kl_controller, "peft": is_peft,
        "policy_trainable_parameters": sum(_numel(p) for p in wrapper.policy_parameters() if p.requires_grad),
        "value_parameters": sum(_numel(p) for p in wrapper.value_parameters()),
    } | layout


# How a failed write shows: OSError (open, json), torch's RuntimeError for a full disk ("[enforce fail at
# inline_container.cc] unexpected pos") and safetensors' SafetensorError ("I/O error: No space left on device").
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


@contextmanager
def staged(run_dir: str, step: int, backend, save_total_limit: int | None):
    """Inside: write checkpoint `step` into the folder yielded (`checkpoint-N.partial`, every process); after: the
    main process seals it (`seal`), one rename makes it `checkpoint-N` (an existing `checkpoint-N` is first renamed
    aside, then deleted), and older checkpoints beyond `save_total_limit` go. A write that fails on any process (a
    full disk, a lost mount) fails on every process with a `CheckpointError` naming the folder and the free space; the
    partial folder is removed and the previous checkpoints are left as they were."""
    final = os.path.join(run_dir, f"checkpoint-{step}")
    staging = final + ".partial"
    main = backend.accelerator.is_main_process
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    backend.barrier()
    error = None
    try:
        yield staging
        if main:
            seal(staging)
    except Exception as e:  # noqa: BLE001 — every process must learn of it before any goes on
        error = e
    failed = backend.sum_over_processes(torch.tensor(float(error is not None), device=backend.device))
    if float(failed):
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None and not isinstance(error, WRITE_ERRORS):
            raise error
        raise CheckpointError(write_failure(run_dir, staging, error)) from error
    if main:
        aside = final + ".replaced"
        if os.path.exists(final):
            os.replace(final, aside)  # a kill from here on leaves one whole copy: checkpoint-N or .replaced
        os.replace(staging, final)
        shutil.rmtree(aside, ignore_errors=True)
        rotate_checkpoints(run_dir, save_total_limit=save_total_limit)
    backend.barrier()


def write_failure(run_dir: str, staging: str, error: Exception | None) -> str:
    free = shutil.disk_usage(run_dir).free
    kept = next(iter(checkpoints_newest_first(run_dir)), None)
    need = _folder_bytes(kept) if kept else None
    cause = f"{type(error).__name__}: {error}" if error is not None else "it failed on another process"
    return (f"Writing the checkpoint into {staging} failed ({cause}). The disk of {run_dir} has {free / 2**20:.1f} MiB "
            f"free" + (f"; the last checkpoint took {need / 2**20:.1f} MiB" if need else "") + ". "
            + (f"{kept} is kept, intact. " if kept else "No earlier checkpoint exists. ")
            + "Free space (or lower save_total_limit, or set output_dir on a larger disk) and resume with "
            "resume_from_checkpoint=True.")


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**24), b""):
            digest.update(block)
        os.fsync(f.fileno())  # on disk before the rename that publishes the checkpoint
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    names = (os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)
    return sorted(name for name in names if name != TRL_EXT_STATE)


def seal(folder: str) -> None:
    """Record every file of a written checkpoint (every process's) in its state file: relative path -> size and
    sha256, so a damaged or truncated file is caught on load."""
    path = os.path.join(folder, TRL_EXT_STATE)
    with open(path) as f:
        state = json.load(f)
    state["files"] = {name: {"size": os.path.getsize(os.path.join(folder, name)),
                             "sha256": _sha256(os.path.join(folder, name))} for name in _files(folder)}
    with open(path, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def required_files(world_size: int, engine_saves_optimizer: bool) -> list[str]:
    """The files a resume reads by name (transformers' loaders skip a missing one silently)."""
    rng = ["rng_state.pth"] if world_size == 1 else [f"rng_state_{i}.pth" for i in range(world_size)]
    return ["trainer_state.json", "scheduler.pt", *rng] + ([] if engine_saves_optimizer else ["optimizer.pt"])


def layout_record(world_size: int, engine: dict, per_process: str | None) -> dict:
    """How the processes that write a checkpoint hold its state, kept in it (`processes`): their number, the engine
    (`Backend.checkpoint_engine`: its name, the family of files it writes), why the state is split per process (None:
    whole, any number of processes can resume it) and the files a resume reads by name."""
    return {"world_size": world_size, "engine": engine["name"], "files": engine["files"], "per_process": per_process,
            "required": required_files(world_size, engine["files"] != "whole")}


def saved_layout(state: dict) -> dict:
    """A checkpoint's `layout_record`; for one written before trl_ext kept it, what its settings tell (the engine
    unknown: it resumes on as many processes only)."""
    if "processes" in state:
        return state["processes"]
    world_size = state.get("settings", {}).get("world_size", 1)
    return {"world_size": world_size, "engine": None, "files": None, "required": required_files(world_size, True),
            "per_process": "it was written by a trl_ext that did not record how its state is split"}


def readable(saved_files: str, current_files: str) -> bool:
    """Whether an engine writing `current_files` reads a checkpoint of `saved_files`: its own, or whole files (a plain
    process's or DDP's, FSDP2's FULL_STATE_DICT) under one process, DDP or FSDP2 (`Backend.load_whole_files`)."""
    whole = ("whole", "fsdp2-full")
    return saved_files == current_files or (saved_files in whole and current_files in (*whole, "fsdp2-sharded"))


def check_layout(saved: dict, current: dict, checkpoint: str) -> bool:
    """Refuse, before anything loads, a checkpoint this run's processes cannot read: its state split over another
    number of processes (ZeRO, FSDP2's sharded state dicts, async_rollouts' draws), or another engine's files.
    True where the process count changed (the state is whole: each process re-derives its random streams)."""
    before, now = saved["world_size"], current["world_size"]
    if before != now and saved["per_process"]:
        raise CheckpointError(
            f"Cannot resume from {checkpoint} on {now} process(es): world_size is {now} now and was {before} when "
            f"it was saved under {saved['engine'] or 'an unrecorded engine'}, and {saved['per_process']}. Resume "
            f"with {before} processes (accelerate launch --num_processes {before}) and the same global batch, or "
            "start a new run in another output_dir.")
    if saved["files"] is not None and not readable(saved["files"], current["files"]):
        raise CheckpointError(
            f"Cannot resume from {checkpoint} under {current['engine']}: it was saved under {saved['engine']}, whose "
            f"files {current['engine']} does not read. Resume under {saved['engine']} (its accelerate config), or "
            "start a new run in another output_dir.")
    return before != now


def verify(checkpoint: str) -> str | None:
    """None if `checkpoint` is whole and undamaged; else what is wrong, naming the file. What it must hold comes from
    its own record (`saved_layout`), not from the run that reads it."""
    state_file = os.path.join(checkpoint, TRL_EXT_STATE)
    if not os.path.isfile(state_file):
        return f"{state_file} is missing: not a complete trl_ext checkpoint"
    try:
        with open(state_file) as f:
            state = json.load(f)
        required, files = saved_layout(state)["required"], state.get("files")
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        return f"{state_file} is unreadable ({e})"
    for name in required:
        if not os.path.isfile(os.path.join(checkpoint, name)):
            return f"{os.path.join(checkpoint, name)} is missing"
    if files is None:  # written before trl_ext sealed checkpoints: the names are all that can be checked
        return None
    for name, expected in files.items():
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != expected["size"]:
            return f"{path} has {size} bytes, {expected['size']} were written (truncated or replaced)"
        if _sha256(path) != expected["sha256"]:
            return f"{path} does not match the sha256 recorded when it was written (damaged on disk)"
    return None


def checkpoints_newest_first(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := CHECKPOINT_NAME.match(name))
             and os.path.isdir(os.path.join(output_dir, name))]
    return [os.path.join(output_dir, name) for _, name in sorted(steps, reverse=True)]


def choose_checkpoint(resume_from_checkpoint: str | bool, output_dir: str) -> tuple[str, list]:
    """(the checkpoint folder to resume from, [(skipped folder, why)]): the one given, verified; or with True the
    newest intact `checkpoint-N` in `output_dir`. A damaged one given, or none intact, is a `CheckpointError`."""
    if resume_from_checkpoint is not True:
        checkpoint = str(resume_from_checkpoint)
        problem = verify(checkpoint)
        if problem:
            raise CheckpointError(f"Cannot resume from {checkpoint}: {problem}. Resume from an earlier checkpoint "
                                  f"(or resume_from_checkpoint=True: the newest intact one in {output_dir}).")
        return checkpoint, []
    candidates = checkpoints_newest_first(output_dir)
    if not candidates:
        raise CheckpointError(f"resume_from_checkpoint=True but there is no checkpoint-N folder in {output_dir!r}; "
                              "pass a checkpoint path or train without resuming.")
    skipped = []
    for checkpoint in candidates:
        problem = verify(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append((checkpoint, problem))
    raise CheckpointError(f"resume_from_checkpoint=True but no checkpoint in {output_dir!r} is intact: "
                          + "; ".join(f"{c}: {p}" for c, p in skipped) + ". Start a new run.")


def step_of(checkpoint: str) -> int:
    return int(CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(checkpoint))).group(1))


def abandon_after(output_dir: str, step: int) -> list[str]:
    """Move the checkpoints of `output_dir` later than `step` into `output_dir/abandoned/checkpoint-N-<time>`: a
    resume from an older one gives them up, and a new run (step -1) every one; returns where they went."""
    moved = []
    for later in checkpoints_newest_first(output_dir):
        if step_of(later) <= step:
            break
        target = os.path.join(output_dir, ABANDONED_DIR, f"{os.path.basename(later)}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        while os.path.exists(target):
            target += "+"
        os.replace(later, target)
        moved.append(target)
    return moved


def in_folder(checkpoint: str, output_dir: str) -> bool:
    """Whether `checkpoint` is one of `output_dir`'s timeline (a checkpoint elsewhere gives up none of it)."""
    return os.path.dirname(os.path.abspath(checkpoint)) == os.path.abspath(output_dir)


class WeightGrowth:
    """The norm of the policy's trained weights from one iteration to the next. The first iteration that grows it
    more than `LIMIT`-fold, or makes it non-finite, is where a blow-up began: Adam moves each weight by about the
    learning rate per step, so a healthy iteration changes the norm by a few percent at most, and one that doubles
    it was taken with a learning rate of the weights' own size. Checkpoints saved before that iteration hold weights
    a lower learning rate recovers from; later ones may be finite and still useless (`recovery_advice`)."""

    LIMIT = 2.0

    def __init__(self):
        self.norm: float | None = None  # at the last iteration observed
        self.began: int | None = None  # the iteration the blow-up began at
        self.growth: float | None = None  # how many times the norm grew in it

    def observe(self, step: int, norm: float) -> None:
        """The norm after iteration `step` (or at the start of a run, before any)."""
        if self.norm is not None and self.began is None:
            growth = norm / self.norm if self.norm > 0 else (math.inf if norm > 0 else 1.0)
            if not math.isfinite(norm) or growth > self.LIMIT:
                self.began, self.growth = step, growth
        self.norm = norm

    def state_dict(self) -> dict:
        return {"began": self.began, "growth": self.growth}

    def load_state_dict(self, state: dict) -> None:
        self.began, self.growth = state.get("began"), state.get("growth")


def recovery_advice(output_dir: str, growth: WeightGrowth) -> str:
    """What to do after the weights blew up: the newest checkpoint saved before the blow-up began, or plainly that
    none is known and what to do instead."""
    found = checkpoints_newest_first(output_dir)
    if growth.began is None:
        if not found:
            return "No checkpoint exists: start again with a lower learning_rate."
        return (f"{found[0]} is intact, and no iteration grew the policy's weights more than "
                f"{WeightGrowth.LIMIT:g}-fold: resume from it with a lower learning_rate "
                f"(train(resume_from_checkpoint={found[0]!r})).")
    began = (f"The blow-up began at iteration {growth.began}: the policy's weights grew {growth.growth:.3g}-fold "
             "in it")
    before = [c for c in found if step_of(c) < growth.began]
    after = [os.path.basename(c) for c in found if step_of(c) >= growth.began]
    if after:
        began += f" ({', '.join(reversed(after))} saved since: finite weights, but not ones to resume from)"
    if before:
        return (f"{began}. Resume from {before[0]}, saved before it, with a lower learning_rate: "
                f"train(resume_from_checkpoint={before[0]!r}).")
    return (f"{began}, and no checkpoint in {output_dir} was saved before it. Start a new run with a lower "
            f"learning_rate (it moves this run's checkpoints aside, into {os.path.join(output_dir, ABANDONED_DIR)}).")


def write_state(folder: str, kl_controller, reward_normalizer, settings: dict, processes: dict, grad_scaler=None,
                config: dict | None = None, trainer: dict | None = None) -> None:
    """trl_ext's own state: β's controller, the reward normalizer's statistics, the run's settings, how its processes
    hold the state (`layout_record`), the whole config (`changed_settings`), the trainer's own state (`trainer`:
    whether the critic warmup has ended, `WeightGrowth`) and, under fp16, the GradScaler's loss scale and growth
    tracker (a resumed run scales as the straight one would)."""
    state = {"kl_controller": kl_controller.state_dict(), "reward_normalizer": reward_normalizer.state_dict(),
             "settings": settings, "processes": processes, "config": config or {}, "trainer": trainer or {}}
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler.state_dict()
    with open(os.path.join(folder, TRL_EXT_STATE), "w") as f:
        json.dump(state, f, indent=2)


# Config fields whose values a checkpoint also carries in its state (the optimizer's param groups and the scheduler's
# base learning rates, β's controller): on resume the config wins, and the trainer re-applies them after loading.
CONFIG_OVER_STATE = ("learning_rate", "critic_learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "kl_coef", "kl_target", "kl_horizon")
# Where the run writes and reports, not how it trains: not compared.
NOT_COMPARED = ("output_dir", "logging_dir", "run_name", "report_to", "disable_tqdm", "push_to_hub", "hub_model_id",
                "hub_token", "resume_from_checkpoint", "overwrite_output_dir")


def changed_settings(saved_config: dict, config: dict) -> dict[str, tuple]:
    """{field: (checkpoint's value, this run's)} for every config field that differs from the checkpoint's. The fields
    `run_settings` lists are refused before this (`check_compatible`); every other one applies from this resume on:
    `CONFIG_OVER_STATE` re-applied over the loaded state, the rest read from the config as the run goes."""
    return {k: (saved_config[k], v) for k, v in config.items()
            if k not in NOT_COMPARED and k in saved_config and saved_config[k] != v}


def read_state(checkpoint: str) -> dict:
    state_file = os.path.join(checkpoint, TRL_EXT_STATE)
    if not os.path.isfile(state_file):
        raise ValueError(f"{checkpoint!r} is not a complete trl_ext checkpoint (no {TRL_EXT_STATE}); pass a "
                         "checkpoint-N folder written by trl_ext.")
    with open(state_file) as f:
        return json.load(f)


def load_trained_weights(wrapper, checkpoint: str, is_peft: bool) -> None:
    """The trained weights of a checkpoint that the engine did not restore itself (a shared base loads its own:
    `Backend.load_trained`): the policy (its adapter, with peft) and the value model (a quantized critic's LoRA)."""
    if is_peft:
        load_adapter(wrapper.policy, checkpoint)
    else:
        load_weights(wrapper.policy, checkpoint)
    value_dir = os.path.join(checkpoint, VALUE_MODEL_DIR)
    if is_peft_available() and _is_peft_model(wrapper.value_model):
        load_adapter(wrapper.value_model, value_dir)
    else:
        load_weights(wrapper.value_model, value_dir)


def whole_weights(checkpoint: str, is_peft: bool, saved_engine: str) -> dict[str, torch.Tensor]:
    """A checkpoint's whole weights keyed by the policy-and-value wrapper's parameter names, for an engine that loads
    them sharded (FSDP2: torch's `set_model_state_dict`) from another engine's checkpoint."""
    if is_peft:  # its adapter is saved under peft's names, without the adapter's
        raise CheckpointError(f"Cannot resume from {checkpoint} under FSDP2: it was saved under {saved_engine}, and "
                              "a LoRA policy's adapter resumes under FSDP2 from FSDP2's own checkpoints only. Resume "
                              f"under {saved_engine} (with any number of processes), or start a new run.")
    return ({f"policy.{k}": v for k, v in read_weights(checkpoint).items()}
            | {f"value_model.{k}": v for k, v in read_weights(os.path.join(checkpoint, VALUE_MODEL_DIR)).items()})


def whole_optimizer_state(checkpoint: str, files: str, optimizer, wrapper: torch.nn.Module) -> dict:
    """A checkpoint's whole optimizer state keyed by parameter names (torch's full optimizer state dict), from
    another engine's files: FSDP2's FULL_STATE_DICT file as written, or the `optimizer.pt` of a plain process or DDP,
    whose parameters are numbered across the param groups in order (the same model and settings give this run's
    optimizer the same order)."""
    if files == "fsdp2-full":
        return torch.load(os.path.join(checkpoint, "optimizer.bin"), weights_only=True)
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    names = {id(p): n for n, p in wrapper.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[i]: state for i, state in saved["state"].items()},
            "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                             for group in saved["param_groups"]]}


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


# ------------------------------------------------------------------------------------------------ the run's room
class Checkpoints:
    """Saving and resuming one PPO run: everything a run carries goes into `checkpoint-N` (`save`) and comes back
    from it (`resume`), on as many processes as saved it or, where its state is whole, on another number; a run that
    does not resume starts the timeline of `output_dir` afresh (`start_timeline`).

    `save` and `resume` take the trainer for the state it holds (step, callbacks, β, the reward normalizer, the
    async draws) and for transformers' own writers and readers of the optimizer, scheduler, RNG and model files."""

    def __init__(self, args, backend):
        self.args, self.backend, self.accelerator = args, backend, backend.accelerator

    def layout(self) -> dict:
        """How this run's processes hold a checkpoint's state (`layout_record`)."""
        engine = self.backend.checkpoint_engine()
        per_process = engine["per_process"]
        if self.args.async_rollouts and per_process is None:
            per_process = "async_rollouts saved each process's own draws"
        return layout_record(self.accelerator.num_processes, engine, per_process)

    def settings(self, trainer) -> dict:
        """The settings a resumed run must share with the checkpoint (`run_settings`)."""
        return run_settings(self.args, trainer.unwrapped, trainer.train_dataset_len, trainer.is_peft_model,
                            self.backend.layout_settings())

    def save(self, trainer) -> None:
        """Write `checkpoint-N` atomically (into `checkpoint-N.partial`, then one rename: `staged`), and the model
        card (`output_dir/README.md`), as TRL does. Refused while the trained weights hold NaN/inf."""
        args, state, main = self.args, trainer.state, self.accelerator.is_main_process
        if not self.backend.trained_weights_finite():  # on every process: a collective under several
            raise CheckpointError(
                f"checkpoint-{state.global_step} is not written: the trained weights or the optimizer's state "
                "hold NaN/inf (with on_nonfinite the optimizer never steps on a non-finite gradient, so a step with "
                f"finite gradients overflowed them: learning_rate={args.learning_rate:g} is likely too high). "
                + recovery_advice(args.output_dir, trainer.weight_growth))
        if main:
            trainer._write_model_card()
        with staged(args.output_dir, state.global_step, self.backend, args.save_total_limit) as folder:
            # the policy (its adapter, with peft) and the value model, or a shared base's adapters and value head
            self.backend.save_roles(folder, trainer.processing_class, trainer._save_policy, with_value_model=True)
            # the optimizer and scheduler (DeepSpeed: its engine checkpoint, with the weights; FSDP2: its own files)
            trainer._save_optimizer_and_scheduler(folder)
            trainer._save_rng_state(folder)
            drawn = trainer.rollouts.state(state.global_step)  # async: the draws made with older versions
            if drawn is not None:
                save_drawn(folder, self.accelerator.process_index, drawn)
            if main:
                callbacks = trainer.callback_handler.callbacks + [trainer.control]
                for cb in [cb for cb in callbacks if isinstance(cb, ExportableState)]:
                    state.stateful_callbacks[cb.__class__.__name__] = cb.state()
                state.save_to_json(os.path.join(folder, "trainer_state.json"))
                write_state(folder, trainer.kl_ctl, trainer.reward_normalizer, self.settings(trainer), self.layout(),
                            self.accelerator.scaler, args.to_dict(),
                            trainer={"critic_warmup_ended": trainer.critic_warmup_ended,
                                     "weight_growth": trainer.weight_growth.state_dict()})

    def resume(self, trainer, resume_from_checkpoint: str | bool) -> None:
        """Restore everything a PPO run carries from a checkpoint written by `save`: the one given or the newest
        intact one, its files verified (`choose`), on as many processes as saved it or, where its state is whole, on
        another number (`check_layout`; the random streams re-derived: `_reseed`); the config's changes applied or
        refused by name (`_apply_changed_settings`)."""
        backend, optimizer, scheduler = self.backend, trainer.optimizer, trainer.lr_scheduler
        checkpoint = self.choose(resume_from_checkpoint)
        saved, current = read_state(checkpoint), self.layout()
        layout = saved_layout(saved)
        regrown = check_layout(layout, current, checkpoint)  # before anything loads
        check_compatible(saved["settings"], self.settings(trainer), checkpoint)
        fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in scheduler.optimizer.param_groups]
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if layout["files"] not in (None, current["files"]):  # another engine's whole files (check_layout)
            backend.load_whole_files(checkpoint, layout, optimizer, trainer.is_peft_model)
            scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        elif backend.fsdp:  # not strict: a checkpoint from the critic warmup holds no state for the policy
            backend.load_engine_checkpoint(checkpoint)
            backend.load_fsdp2_optimizer(optimizer, checkpoint)
            scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        else:
            if not backend.load_engine_checkpoint(checkpoint):
                backend.load_trained(checkpoint, trainer.is_peft_model)
            trainer._load_optimizer_and_scheduler(checkpoint)
        trainer._resumed_draws = load_drawn(checkpoint, self.accelerator.process_index)  # async_rollouts' draws
        trainer.kl_ctl.load_state_dict(saved["kl_controller"])
        trainer.reward_normalizer.load_state_dict(saved["reward_normalizer"])
        trainer.critic_warmup_ended = saved.get("trainer", {}).get("critic_warmup_ended", False)
        trainer.weight_growth.load_state_dict(saved.get("trainer", {}).get("weight_growth", {}))
        if self.accelerator.scaler is not None and "grad_scaler" in saved:  # fp16: the loss scale reached
            self.accelerator.scaler.load_state_dict(saved["grad_scaler"])
        restored = OnlineTrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        for name in ("global_step", "episode", "epoch", "log_history", "total_flos"):
            setattr(trainer.state, name, getattr(restored, name))
        if regrown:
            self._reseed(checkpoint, layout["world_size"], trainer.state.global_step)
        else:
            trainer._load_rng_state(checkpoint)
        for cb in trainer.callback_handler.callbacks:  # e.g. the alarms' episode state
            saved_state = restored.stateful_callbacks.get(cb.__class__.__name__)
            if isinstance(cb, ExportableState) and isinstance(saved_state, dict) and hasattr(cb, "load_state"):
                cb.load_state(saved_state)
        self._apply_changed_settings(trainer, saved.get("config", {}), fresh_groups, checkpoint)

    def choose(self, resume_from_checkpoint: str | bool) -> str:
        """The checkpoint to resume from, its files verified on the main process (`choose_checkpoint`) and the
        choice shared with every process; the later checkpoints of the run it gives up are moved into
        `output_dir/abandoned/`."""
        output_dir = self.args.output_dir
        outcome = [None]
        if self.accelerator.is_main_process:
            try:
                checkpoint, skipped = choose_checkpoint(resume_from_checkpoint, output_dir)
                for folder, problem in skipped:
                    print(f"[trl_ext] not resuming from {folder}: {problem}")
                moved = abandon_after(output_dir, step_of(checkpoint)) if in_folder(checkpoint, output_dir) else []
                if moved:
                    print(f"[trl_ext] resuming from {checkpoint}: the later checkpoints (of the run given up, or "
                          f"damaged) are moved aside, to {', '.join(moved)}")
                outcome = [("ok", checkpoint)]
            except CheckpointError as e:
                outcome = [("error", str(e))]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(outcome)
        kind, value = outcome[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def start_timeline(self) -> None:
        """A run that does not resume starts the timeline of `output_dir` afresh: the checkpoints there (an earlier
        run's) move into `output_dir/abandoned/`, so `resume_from_checkpoint=True` later continues this run."""
        if self.accelerator.is_main_process:
            moved = abandon_after(self.args.output_dir, -1)
            if moved:
                print(f"[trl_ext] a new run in {self.args.output_dir} (not resumed): the checkpoints there, of an "
                      f"earlier run, are moved aside, to {', '.join(moved)}. To continue that run instead, "
                      "resume from one of them.")
        self.backend.barrier()

    def _reseed(self, checkpoint: str, saved_processes: int, step: int) -> None:
        """A resume on another number of processes: each process's random streams (python, numpy, torch: the
        minibatch order) re-derived from (seed, process, step), as the saved ones belong to other processes."""
        set_seed(regrown_process_seed(self.args.seed, self.accelerator.process_index, step))
        if self.accelerator.is_main_process:
            print(f"[trl_ext] resuming from {checkpoint}, saved by {saved_processes} process(es), on "
                  f"{self.accelerator.num_processes}: the same global batch of the same prompts goes on; each "
                  "process's random streams are re-derived from (seed, process, step) (docs/checkpoints.md).")

    def _apply_changed_settings(self, trainer, saved_config: dict, fresh_groups: list[dict], checkpoint: str) -> None:
        """Config fields changed since the checkpoint: those its state carries (`CONFIG_OVER_STATE`) re-applied over
        the loaded state — the optimizer's hyperparameters and the schedule's base learning rates, β's controller —
        and every change printed. (The ones a resume cannot take were refused by `check_compatible`.)"""
        args = self.args
        changed = changed_settings(saved_config, args.to_dict())
        if not changed:
            return
        if any(k in changed for k in ("learning_rate", "critic_learning_rate", "weight_decay", "adam_beta1",
                                      "adam_beta2", "adam_epsilon")):
            scheduler = trainer.lr_scheduler
            if not hasattr(scheduler, "lr_lambdas"):
                raise ValueError(f"Cannot resume from {checkpoint} with a changed optimizer setting "
                                 f"({sorted(set(changed) & set(CONFIG_OVER_STATE))}): the scheduler "
                                 f"{type(scheduler).__name__} cannot be re-based. Resume with the checkpoint's values.")
            for group, fresh, lmbda in zip(scheduler.optimizer.param_groups, fresh_groups, scheduler.lr_lambdas):
                group.update({k: v for k, v in fresh.items() if k != "lr"})
                group["lr"] = group["initial_lr"] * lmbda(scheduler.last_epoch)
            scheduler.base_lrs = [g["initial_lr"] for g in scheduler.optimizer.param_groups]
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
        if any(k in changed for k in ("kl_coef", "kl_target", "kl_horizon")):
            state = trainer.kl_ctl.state_dict()
            if "kl_coef" in changed:
                state["value"] = args.kl_coef  # β restarts at the new kl_coef
            if "target" in state:
                state.update(target=args.kl_target, horizon=args.kl_horizon)
            trainer.kl_ctl.load_state_dict(state)
        if self.accelerator.is_main_process:
            lines = [f"{k}: {old!r} -> {new!r}" + (" (re-applied over the checkpoint's state)" if k in
                                                   CONFIG_OVER_STATE else "") for k, (old, new) in changed.items()]
            print(f"[trl_ext] resuming from {checkpoint} with changed settings, which apply from here on: "
                  + "; ".join(lines))
