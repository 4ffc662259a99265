"""cpu_reuse_freed_memory: glibc's malloc keeps freed memory, so a CPU training step stops page-faulting its
gradients in again (trl_ext/trainer/allocator.py), and the trainer sets it only where it should."""

import json
import subprocess
import sys

import pytest

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer
from trl_ext.trainer.allocator import ALLOCATOR_ENVIRONMENT

# A training step of a small model, gradients set to None after each optimizer step: an 8192-row embedding tied to
# the output head (19 MB of gradient) and 16 linear layers (3.5 MB each), all blocks under glibc's 32 MiB mmap
# threshold. Prints the minor page faults of each of 12 steps.
STEPS = """
import json, resource, sys, torch
from trl_ext.trainer.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(8192, 576), *[torch.nn.Linear(576, 1536) for _ in range(16)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
x = torch.randint(0, 8192, (4, 40))
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = model[0](x)
    loss = sum(layer(h).mean() for layer in model[1:]) + (h @ model[0].weight.T).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def step_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kept_memory_stops_the_page_faults_of_each_step():
    default, kept = step_faults("default"), step_faults("keep")
    steps_default, steps_kept = sorted(default[2:]), sorted(kept[2:])  # after the first two steps grow the heap
    # glibc's defaults: the heap's free top goes back to the OS after most steps and is faulted in again at the next
    # (measured idle: 0-21,000 faults per step, the median step 4,000-18,000)
    assert steps_default[len(steps_default) // 2] > 1000, default
    # kept: the median step reuses the heap (measured idle: 0-1 faults; a loaded machine's memory pressure adds a
    # few hundred), so it is compared with its own control, the default run: under a tenth of its median
    assert steps_kept[len(steps_kept) // 2] < 0.1 * steps_default[len(steps_default) // 2], (kept, default)
    assert sum(steps_kept) < 0.5 * sum(steps_default), (kept, default)


def tiny_trainer(tmp_path, **kw):
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=2, response_length=4,
                     report_to=[], save_strategy="no", num_sample_generations=0, bf16=False, disable_tqdm=True, **kw)
    return PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, seed=0), ref_model=None,
                      reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 4),
                      value_model=tiny_scalar_model(tok, seed=1))


def test_the_trainer_keeps_freed_memory_on_cpu_unless_told_or_the_environment_chose(tmp_path, monkeypatch):
    for name in ALLOCATOR_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr("trl_ext.trainer.allocator.keep_freed_memory", lambda largest: calls.append(largest) or 2**25)
    assert tiny_trainer(tmp_path / "a").reuses_freed_memory and len(calls) == 1  # default on CPU: on
    assert not tiny_trainer(tmp_path / "b", cpu_reuse_freed_memory=False).reuses_freed_memory and len(calls) == 1
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")  # the user chose: left alone, unless asked explicitly
    assert not tiny_trainer(tmp_path / "c").reuses_freed_memory and len(calls) == 1
    trainer = tiny_trainer(tmp_path / "d", cpu_reuse_freed_memory=True)
    assert trainer.reuses_freed_memory and len(calls) == 2
    # the largest trained parameter's size: here the policy's and the value model's embeddings (73 x 32 fp32)
    largest = max(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert calls == [largest, largest] and largest == 73 * 32 * 4


# One step of a model whose embedding gradient (16384 x 1024 fp32: 64 MiB) is above glibc's own 32 MiB ceiling.
LARGE_STEPS = """
import json, resource, sys, torch
from trl_ext.trainer.allocator import keep_freed_memory
print(json.dumps(keep_freed_memory(int(sys.argv[1]))))
torch.manual_seed(0)
emb = torch.nn.Embedding(16384, 1024)
opt = torch.optim.AdamW(emb.parameters(), lr=1e-5)
x = torch.randint(0, 16384, (4, 40))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    emb(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


@pytest.mark.slow
def test_blocks_up_to_the_largest_parameter_are_kept():
    def run(largest):
        out = subprocess.run([sys.executable, "-c", LARGE_STEPS, str(largest)], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()
        return json.loads(out[-2]), sorted(json.loads(out[-1])[2:])

    grad_bytes = 16384 * 1024 * 4
    threshold, control = run(0)
    assert threshold == 32 * 2**20
    # the 64 MiB gradient (and the embedding backward's output of that size) is mapped afresh every step: 16,384
    # pages each
    assert control[len(control) // 2] > 16384, control
    threshold, faults = run(grad_bytes)
    if threshold == 32 * 2**20:  # a glibc that refuses a threshold above 32 MiB: the fallback, still mapped afresh
        assert faults[len(faults) // 2] > 16384, faults
    else:  # glibc 2.36 (this project's machines) takes it: served from the heap
        assert threshold == grad_bytes + 2**20  # the block and its allocation overhead
        # nothing faulted in when the machine is idle (measured: 0-16 per step); a loaded machine's memory pressure
        # adds some hundreds (measured: up to 480), so against the control run: under a tenth of its median
        assert faults[len(faults) // 2] < 0.1 * control[len(control) // 2], (faults, control)


def test_asking_for_it_without_glibc_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("trl_ext.trainer.allocator.glibc", lambda: None)
    with pytest.raises(ValueError, match="cpu_reuse_freed_memory=True.*not glibc"):
        tiny_trainer(tmp_path / "a", cpu_reuse_freed_memory=True)
    assert not tiny_trainer(tmp_path / "b").reuses_freed_memory  # unset: no error, the trainer leaves malloc alone
