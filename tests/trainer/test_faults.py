"""Faults a long PPO run meets (docs/checkpoints.md): non-finite updates, SIGTERM/SIGINT, damaged, incomplete and
stale checkpoints, changed settings on resume, a full disk, and inputs that can only fail later. Each test injects
the fault into a tiny run and checks what the user gets: no NaN stepped into or saved, a checkpoint at the signal,
every damaged file refused by name, the newest intact checkpoint taken, the run's timeline kept."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trl_ext.testing import tiny_prompt_dataset, tiny_tokenizer
from trl_ext.trainer.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from test_training_state import StopAt, comparable, config, flat, make_trainer, step_logs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def saved_run(out, steps=3, peft=False, **kw):
    """A run of 4 iterations stopped after `steps`, with a checkpoint at every iteration."""
    t = make_trainer(config(out, save_strategy="steps", save_steps=1, **kw), peft=peft, callbacks=[StopAt(steps)])
    t.train()
    return t


def straight_run(out, peft=False, **kw):
    t = make_trainer(config(out, **kw), peft=peft)
    t.train()
    return t


def same_run(a, b):
    assert torch.equal(flat(a.unwrapped.policy), flat(b.unwrapped.policy))
    assert torch.equal(flat(a.unwrapped.value_model), flat(b.unwrapped.value_model))
    assert comparable(step_logs(a)) == comparable(step_logs(b))


# --- 1. non-finite updates ----------------------------------------------------------------------------------------

def all_finite(trainer):
    return all(torch.isfinite(p).all() for p in trainer.unwrapped.parameters())


def test_a_learning_rate_that_overflows_the_weights_stops_the_run_and_no_nan_is_saved(tmp_path):
    """checkpoint-1 is written after the step that overflowed (its weights are ~1e30: finite, useless): the error says
    no checkpoint precedes the blow-up, and following it (a new run, a lower learning rate) trains on."""
    t = make_trainer(config(tmp_path, learning_rate=1e30, save_strategy="steps", save_steps=1, max_skipped_steps=2))
    with pytest.raises(FloatingPointError, match=r"Iteration 2: .*NaN/inf.*learning_rate=1e\+30 too high\. The "
                                                 r"blow-up began at iteration 1: the policy's weights grew .*-fold in "
                                                 r"it \(checkpoint-1 saved since.*\), and no checkpoint in .* was "
                                                 r"saved before it\. Start a new run with a lower learning_rate"):
        t.train()
    skipped = [h["update/skipped_steps"] for h in step_logs(t)]
    assert skipped and skipped[-1] >= 1, skipped
    for folder in tmp_path.glob("checkpoint-*"):  # whatever was saved holds finite weights
        weights = __import__("safetensors.torch", fromlist=["load_file"]).load_file(folder / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), folder
    again = make_trainer(config(tmp_path, learning_rate=1e-3, save_strategy="steps", save_steps=1))
    again.train()  # the advice followed: a new run in the same folder
    assert again.state.global_step == 4 and all_finite(again)
    assert len(list((tmp_path / "abandoned").iterdir())) == 1  # the blown-up run's checkpoint-1, moved aside


def test_the_advice_after_a_blow_up_names_a_checkpoint_that_recovers(tmp_path):
    """A run resumed from checkpoint-2 with learning_rate=1e30 overflows the weights at iteration 3 and saves the
    finite, useless checkpoint-3; iteration 4 stops. The error names checkpoint-2 (saved before the blow-up began),
    and resuming from it with a lower learning rate trains on to the end."""
    import re

    saved_run(tmp_path, steps=2)
    blown = make_trainer(config(tmp_path, learning_rate=1e30, save_strategy="steps", save_steps=1,
                                max_skipped_steps=2))
    with pytest.raises(FloatingPointError, match=r"The blow-up began at iteration 3: the policy's weights grew "
                                                 r".*-fold in it \(checkpoint-3 saved since") as error:
        blown.train(resume_from_checkpoint=True)
    assert (tmp_path / "checkpoint-3").is_dir()
    advised = re.search(r"Resume from (\S+), saved before it, with a lower learning_rate: "
                        r"train\(resume_from_checkpoint='(\S+)'\)", str(error.value))
    assert advised and advised.group(1) == advised.group(2) == str(tmp_path / "checkpoint-2"), str(error.value)
    recovered = make_trainer(config(tmp_path, learning_rate=1e-3))
    recovered.train(resume_from_checkpoint=advised.group(2))
    assert recovered.state.global_step == 4 and all_finite(recovered)
    assert all(abs(h["objective/scores"]) < 1e3 for h in step_logs(recovered))
    same_run(recovered, straight_run(tmp_path / "straight"))  # checkpoint-2 of the healthy run: the same run


def test_a_reward_out_of_range_skips_the_steps_and_raises_the_alarm(tmp_path):
    def huge(prompts, completions, **kw):
        return [1e30] * len(completions)

    t = make_trainer(config(tmp_path, total_episodes=8), reward_model=huge)
    before = flat(t.unwrapped.value_model)
    with pytest.warns(UserWarning, match="nonfinite_update"):
        t.train()
    logs = step_logs(t)
    assert [h["update/skipped_steps"] for h in logs] == [2.0, 2.0]  # each optimizer step: 2 epochs x 1 minibatch
    assert torch.equal(flat(t.unwrapped.value_model), before) and all_finite(t)  # no step taken on inf
    assert any(a.name == "nonfinite_update" for a in t.alarms_raised)

    strict = make_trainer(config(tmp_path / "strict", on_nonfinite="error"), reward_model=huge)
    with pytest.raises(FloatingPointError, match=r"at iteration 1; on_nonfinite='error'.*largest \|score\| is 1e\+30"):
        strict.train()
    bounded = make_trainer(config(tmp_path / "bounded", max_skipped_steps=3), reward_model=huge)
    with pytest.raises(FloatingPointError, match=r"at iteration 2; 3 optimizer steps in a row were skipped"):
        bounded.train()


def test_non_finite_weights_are_never_written_into_a_checkpoint(tmp_path):
    t = saved_run(tmp_path, steps=1)
    with torch.no_grad():
        next(t.unwrapped.policy.parameters()).view(-1)[0] = float("nan")
    t.state.global_step = 2
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is not written.*checkpoint-1 is intact"):
        t._save_checkpoint(t.model, trial=None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]


def test_bad_on_nonfinite_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite='ignore' is not one of"):
        config(tmp_path, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="max_skipped_steps=0 must be >= 1"):
        config(tmp_path, max_skipped_steps=0)


# --- 2. SIGTERM and Ctrl-C ----------------------------------------------------------------------------------------

SIGNAL_SCRIPT = '''
import os, sys, time
sys.path.insert(0, {tests!r})
from transformers import TrainerCallback
from test_training_state import config, make_trainer

class Announce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:  # tell the test, and let the signal arrive inside this iteration
            open(os.path.join(args.output_dir, "AT-2"), "w").close()
            for _ in range(100):
                time.sleep(0.05)
make_trainer(config({out!r}, save_strategy="steps", save_steps=3{extra}), callbacks=[Announce()]).train()
print("TRAIN RETURNED")
'''


def signal_at_iteration_2(tmp_path, sig, extra: str = "") -> tuple[Path, str]:
    """Run SIGNAL_SCRIPT (its config + `extra` settings) in a process of its own, send `sig` inside iteration 2, and
    check it saved checkpoint-2 and exited 0 without returning from train(). Returns its output folder and stdout."""
    out = tmp_path / "run"
    script = tmp_path / "signal_me.py"
    script.write_text(SIGNAL_SCRIPT.format(tests=str(ROOT / "tests" / "trainer"), out=str(out), extra=extra))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "AT-2").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached iteration 2"
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"saved {out / 'checkpoint-2'} at iteration 2 of 4; exiting with status 0" in stdout, stdout
    assert "TRAIN RETURNED" not in stdout  # the process exits: a script's next line (save_model, push) never runs
    return out, stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_saves_a_checkpoint_exits_0_and_the_resume_is_exact(tmp_path, sig):
    out, _ = signal_at_iteration_2(tmp_path, sig)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # save_steps=3: only the signal's

    resumed = make_trainer(config(out, save_strategy="steps", save_steps=3))
    resumed.train(resume_from_checkpoint=True)
    same_run(resumed, straight_run(tmp_path / "straight"))


def test_signal_handlers_are_restored_after_train(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    make_trainer(config(tmp_path, total_episodes=4)).train()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# --- 3, 4. incomplete and damaged checkpoints ---------------------------------------------------------------------

def flip(path: Path, count: int = 64) -> None:
    """Flip `count` bytes in the middle of a file (bit rot; the size stays)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "optimizer.pt missing": ("optimizer.pt", "delete"),
    "scheduler.pt missing": ("scheduler.pt", "delete"),
    "rng_state.pth missing": ("rng_state.pth", "delete"),
    "trainer_state.json missing": ("trainer_state.json", "delete"),
    "model truncated": ("model.safetensors", "truncate"),
    "model rot": ("model.safetensors", "flip"),
    "value model rot": ("value_model/model.safetensors", "flip"),
    "optimizer rot": ("optimizer.pt", "flip"),
    "rng rot": ("rng_state.pth", "flip"),
}


def damage(folder: Path, name: str, how: str) -> Path:
    path = folder / name
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        flip(path)
    return path


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    saved_run(out, steps=3)
    return out


def test_every_damage_to_a_checkpoint_is_refused_naming_the_file(three_checkpoints, tmp_path):
    import shutil

    for label, (name, how) in DAMAGES.items():
        out = tmp_path / label.replace(" ", "_")
        shutil.copytree(three_checkpoints, out)
        path = damage(out / "checkpoint-3", name, how)
        t = make_trainer(config(out))
        with pytest.raises(CheckpointError, match=f"Cannot resume from {out / 'checkpoint-3'}: {path}") as e:
            t.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        expected = {"delete": "is missing", "truncate": "bytes", "flip": "sha256"}[how]
        assert expected in str(e.value), (label, str(e.value))


def test_resume_true_falls_back_to_the_newest_intact_checkpoint_and_says_so(three_checkpoints, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    damage(out / "checkpoint-3", "optimizer.pt", "flip")
    damage(out / "checkpoint-2", "rng_state.pth", "delete")
    resumed = make_trainer(config(out))
    resumed.train(resume_from_checkpoint=True)
    said = capsys.readouterr().out
    assert f"not resuming from {out / 'checkpoint-3'}: {out / 'checkpoint-3' / 'optimizer.pt'} does not match" in said
    assert f"not resuming from {out / 'checkpoint-2'}: {out / 'checkpoint-2' / 'rng_state.pth'} is missing" in said
    same_run(resumed, straight_run(tmp_path / "straight"))  # from checkpoint-1, the same run


def test_no_intact_checkpoint_is_an_error_listing_each(three_checkpoints, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    for step in (1, 2, 3):
        damage(out / f"checkpoint-{step}", "scheduler.pt", "delete")
    with pytest.raises(CheckpointError, match="no checkpoint in .* is intact: .*checkpoint-3.*checkpoint-1"):
        make_trainer(config(out)).train(resume_from_checkpoint=True)


def test_a_checkpoint_records_the_size_and_sha256_of_every_file(three_checkpoints):
    import hashlib

    folder = three_checkpoints / "checkpoint-3"
    files = json.loads((folder / "trl_ext_state.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                     and p.name != "trl_ext_state.json")
    assert sorted(files) == on_disk and {"optimizer.pt", "value_model/model.safetensors"} <= set(files)
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_lora_checkpoints_damaged_adapter_is_refused(tmp_path):
    saved_run(tmp_path, steps=1, peft=True)
    path = damage(tmp_path / "checkpoint-1", "adapter_model.safetensors", "flip")
    with pytest.raises(CheckpointError, match=f"{path} does not match the sha256"):
        make_trainer(config(tmp_path), peft=True).train(resume_from_checkpoint=True)


# --- 5. changed settings on resume --------------------------------------------------------------------------------

def test_a_changed_learning_rate_and_kl_coef_apply_on_resume_and_are_reported(three_checkpoints, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    resumed = make_trainer(config(out, learning_rate=3e-4, kl_coef=0.02, cliprange=0.1))
    seen = {}

    class Look(StopAt):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.setdefault("lr", [g["lr"] for g in resumed.lr_scheduler.optimizer.param_groups])
            seen.setdefault("beta", resumed.kl_ctl.value)

    resumed.add_callback(Look(99))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    # the linear schedule at iteration 3 of 4, from the new learning rate; β the new kl_coef
    assert seen["lr"] == [pytest.approx(3e-4 * (4 - 3) / 4)] * len(seen["lr"]), seen
    assert seen["beta"] == 0.02
    said = capsys.readouterr().out
    assert "learning_rate: 0.001 -> 0.0003 (re-applied over the checkpoint's state)" in said
    assert "kl_coef: 0.05 -> 0.02 (re-applied over the checkpoint's state)" in said
    assert "cliprange: 0.2 -> 0.1" in said


def test_an_adaptive_controllers_changed_target_applies_on_resume(tmp_path):
    kw = dict(kl_controller="adaptive", kl_coef=0.1, kl_target=0.01, kl_horizon=8)
    saved_run(tmp_path, steps=2, **kw)
    resumed = make_trainer(config(tmp_path, **{**kw, "kl_target": 0.5}))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.kl_ctl.state_dict()["target"] == 0.5


def test_unchanged_settings_resume_bit_exact_and_print_nothing(three_checkpoints, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_checkpoints, out)
    resumed = make_trainer(config(out, save_strategy="steps", save_steps=1))
    resumed.train(resume_from_checkpoint=True)
    assert "changed settings" not in capsys.readouterr().out
    same_run(resumed, straight_run(tmp_path / "straight"))


# --- 6, 7. the run's timeline; replacing a checkpoint -------------------------------------------------------------

def test_resuming_from_an_older_checkpoint_abandons_the_later_ones(tmp_path):
    saved_run(tmp_path, steps=4)  # checkpoints 1-4: the run later found buggy
    rolled_back = make_trainer(config(tmp_path, save_strategy="steps", save_steps=1), callbacks=[StopAt(3)])
    rolled_back.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))  # preempted after checkpoint-3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert sorted(p.name.split("-2026")[0].split("-20")[0] for p in (tmp_path / "abandoned").iterdir()) == [
        "checkpoint-3", "checkpoint-4"]
    restarted = make_trainer(config(tmp_path))
    restarted.train(resume_from_checkpoint=True)  # continues the rolled-back run from its checkpoint-3
    assert restarted.state.global_step == 4 and len(step_logs(restarted)) == 4


def test_a_replaced_checkpoint_is_moved_aside_before_it_is_deleted(tmp_path, monkeypatch):
    from trl_ext.trainer.checkpoint import verify

    t = saved_run(tmp_path, steps=2)

    def killed(path, *args, **kwargs):  # the process dies as soon as a whole checkpoint is deleted
        if not str(path).endswith(".partial"):
            raise KeyboardInterrupt

    monkeypatch.setattr("trl_ext.trainer.checkpoint.shutil.rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        t._save_checkpoint(t.model, trial=None)  # checkpoint-2 again
    assert verify(str(tmp_path / "checkpoint-2")) is None  # the new copy, whole
    assert verify(str(tmp_path / "checkpoint-2.replaced")) is None  # the old, whole


def test_a_new_run_in_a_folder_of_older_checkpoints_moves_them_aside(tmp_path, capsys):
    """A new run (no resume) in the output_dir of an older run: the older run's checkpoints move into abandoned/, so
    a restart with resume_from_checkpoint=True continues the new run, not the older one."""
    saved_run(tmp_path, steps=4)  # the older run: checkpoint-1..4, finished
    new = make_trainer(config(tmp_path, seed=4, save_strategy="steps", save_steps=1), callbacks=[StopAt(2)])
    new.train()  # stopped after checkpoint-2 (preempted)
    said = capsys.readouterr().out
    assert f"[trl_ext] a new run in {tmp_path} (not resumed): the checkpoints there, of an earlier run, are moved " \
           f"aside, to {tmp_path / 'abandoned' / 'checkpoint-4-'}" in said
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name.split("-20")[0] for p in (tmp_path / "abandoned").iterdir()) == [
        f"checkpoint-{i}" for i in (1, 2, 3, 4)]
    restarted = make_trainer(config(tmp_path, seed=4))
    restarted.train(resume_from_checkpoint=True)
    same_run(restarted, straight_run(tmp_path / "straight", seed=4))


# --- 8. a full disk -----------------------------------------------------------------------------------------------

def test_a_full_disk_names_the_folder_the_free_space_and_the_checkpoint_kept(tmp_path, monkeypatch):
    t = saved_run(tmp_path, steps=1)
    original = torch.save

    def disk_full(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            with open(f, "wb") as handle:
                handle.write(b"\0" * 100)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    t.state.global_step = 2
    with pytest.raises(CheckpointError, match=r"checkpoint-2.partial failed \(RuntimeError: .*unexpected pos.*\). "
                                              r"The disk of .* has [0-9.]+ MiB free; the last checkpoint took "
                                              r"[0-9.]+ MiB\. .*checkpoint-1 is kept, intact"):
        t._save_checkpoint(t.model, trial=None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]  # no partial folder left


# --- 9. input checks at construction ------------------------------------------------------------------------------

def test_prompt_plus_response_beyond_the_position_limit_is_an_error_at_construction(tmp_path):
    # the tiny models have max_position_embeddings=128; the tiny prompts are up to 8 tokens
    with pytest.raises(ValueError, match=r"response_length=125: 13\d positions, beyond the policy's position limit "
                                         r"\(LlamaForCausalLM: 128\)\. Set max_prompt_length <= 3"):
        make_trainer(config(tmp_path, response_length=125))
    make_trainer(config(tmp_path, response_length=100))  # fits


def test_a_reward_function_needing_a_missing_column_is_an_error_at_construction(tmp_path):
    def needs_answer(prompts, completions, answer, **kw):
        return [float(a in c) for a, c in zip(answer, completions)]

    with pytest.raises(ValueError, match=r"reward function 'needs_answer' needs the argument\(s\) \['answer'\], but "
                                         r"the dataset's columns are"):
        make_trainer(config(tmp_path), reward_model=needs_answer)
    tok = tiny_tokenizer()
    data = tiny_prompt_dataset(tok, 8)
    data = data.add_column("answer", ["a"] * len(data))
    from trl_ext import PPOTrainer
    from trl_ext.testing import tiny_causal_lm, tiny_scalar_model
    PPOTrainer(args=config(tmp_path), processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
               reward_model=needs_answer, train_dataset=data, value_model=tiny_scalar_model(tok, seed=1))



def test_a_full_disk_at_the_first_write_is_a_checkpoint_error(tmp_path, monkeypatch):
    """The first and largest write, model.safetensors: safetensors reports a full disk as its own SafetensorError."""
    from safetensors import SafetensorError

    t = saved_run(tmp_path, steps=1)

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", disk_full)
    t.state.global_step = 2
    with pytest.raises(CheckpointError, match=r"checkpoint-2.partial failed \(SafetensorError: .*No space left on "
                                              r"device.*\)\. The disk of .* has [0-9.]+ MiB free; the last checkpoint "
                                              r"took [0-9.]+ MiB\. .*checkpoint-1 is kept, intact"):
        t._save_checkpoint(t.model, trial=None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
