"""Host syncs on the hot path: each read of a device value on the host (`bool(tensor)`, `.item()`, `.tolist()`,
`float(tensor)`) stalls a GPU until its queue drains. trl_ext's own reads must not grow with the micro-batches of an
update or with the rows of a rollout: the training step's statistics skip masked_mean's emptiness check, and the
rewards and vLLM read a batch's token ids once. Counted on CPU by wrapping those Tensor methods; only reads whose
caller is in trl_ext count (transformers' own, e.g. its attention-mask check per forward, are not ours to remove)."""

import collections
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

PACKAGE = str(Path(__import__("trl_ext").__file__).parent)
READS = ("__bool__", "item", "tolist", "__int__", "__float__")


@contextmanager
def host_reads():
    """Inside: a Counter of (method, trl_ext file, line) for each host read whose caller is in trl_ext."""
    counts, saved = collections.Counter(), {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                counts[(name, Path(caller.f_code.co_filename).name, caller.f_lineno)] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def reads(micro: int, rows: int, reward: str, tmp_path) -> tuple[int, int]:
    """(trl_ext's host reads in one rollout of `rows` rows, in one update of rows / micro micro-batches, one step)."""
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                     gradient_accumulation_steps=rows // micro, total_episodes=rows, response_length=6,
                     num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True)
    reward_model = (tiny_scalar_model(tok, seed=2) if reward == "model" else
                    lambda prompts, completions, completion_ids, **kw: [float(len(c)) for c in completion_ids])
    trainer = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                         reward_model=reward_model, value_model=tiny_scalar_model(tok, seed=1),
                         train_dataset=tiny_prompt_dataset(tok, n=rows))
    batch = next(iter(trainer.dataloader))
    with host_reads() as in_rollout:
        rollout = trainer.rollout(batch["input_ids"], batch["attention_mask"])
    with host_reads() as in_update:
        trainer.ppo_update(rollout)
    return sum(in_rollout.values()), sum(in_update.values())


@pytest.mark.parametrize("reward", ["model", "function"])
def test_trl_exts_host_reads_do_not_grow_with_micro_batches_or_rows(reward, tmp_path):
    rollout_8, update_4 = reads(2, 8, reward, tmp_path / "a")  # 8 rows; 4 micro-batches, one optimizer step
    rollout_16, update_8 = reads(2, 16, reward, tmp_path / "b")  # 16 rows; 8 micro-batches, one optimizer step
    assert rollout_16 == rollout_8, (rollout_8, rollout_16)
    assert update_8 == update_4, (update_4, update_8)
    assert update_4 <= 4, update_4  # per optimizer step: the two roles' gradient norms (and nothing per micro-batch)
