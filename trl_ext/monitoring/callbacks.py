"""Trainer callbacks for trl_ext.

`MetricsFileCallback` writes every logged metrics dict to ``<output_dir>/metrics.jsonl``, one JSON object per line,
so a run can be plotted or compared later without TensorBoard or W&B::

    trainer = PPOTrainer(..., callbacks=[MetricsFileCallback()])

    import pandas as pd
    df = pd.read_json("out/metrics.jsonl", lines=True)
"""

from __future__ import annotations

import json
import math
import numbers
import os

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
TRAIN_SUMMARY_KEY = "train_runtime"  # in the entry that train() logs last, as transformers' Trainer does
SAMPLES_FILE = "samples.jsonl"


def _jsonable(value):
    """A value `json` can write: Python/NumPy/torch numbers as numbers, non-finite floats as null (JSON has no NaN),
    anything else as its string."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # 0-d torch tensor / NumPy scalar
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return str(value)


class MetricsFileCallback(TrainerCallback):
    """Append each `on_log` dict, plus ``"step": state.global_step``, as one JSON line to ``<dir>/metrics.jsonl``.

    Args:
        output_dir: folder for the file; default: the trainer's ``args.output_dir``. Created if missing.
        filename: name of the file inside the folder (default ``metrics.jsonl``).

    One line per PPO step: the entry `train()` logs last (`train_loss`, `train_runtime`, ...) is not written.
    Only the world process zero writes. The file is appended to (a rerun into the same folder adds lines) and each
    line is flushed as it is written, so the file can be followed during training. Numbers are written as JSON
    numbers; NaN/inf become ``null``.
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, filename: str = METRICS_FILE):
        self.output_dir = output_dir
        self.filename = filename

    def path(self, args) -> str:
        """The file this callback writes for training arguments `args`."""
        return os.path.join(self.output_dir if self.output_dir is not None else args.output_dir, self.filename)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or TRAIN_SUMMARY_KEY in logs:
            return  # (the end-of-training entry, TrainOutput's metrics, is not a PPO step's)
        path = self.path(args)
        record = {key: _jsonable(value) for key, value in logs.items()}
        record["step"] = state.global_step
        append_jsonl(path, [record])


def sample_records(rollout, tokenizer, step: int, max_rows: int = 4) -> list[dict]:
    """The first `max_rows` prompts, completions (the model's tokens, decoded) and scores of a rollout, for
    samples.jsonl."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return [{"step": step, "prompt": decode(rollout.queries[i][rollout.query_mask[i]]),
             "completion": decode(rollout.responses[i][rollout.input_mask[i]]), "score": rollout.scores[i].item()}
            for i in range(min(max_rows, len(rollout)))]


def append_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """Append records to a JSON-lines file (created with its folder if missing)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({key: _jsonable(value) for key, value in record.items()}) + "\n")
