"""GRPOTrainer scripts run on trl_ext's PPO with only the class and config names changed (README, "From GRPO to PPO"),
on offline stand-ins: a tiny model saved to a folder stands for the hub id, a local dataset for the hub dataset.

Each checks what a GRPO user relies on: the policy and the critic (made for the script) moved, the run logged what
a GRPO user reads, and what the trainer reads back (`processing_class`, `state.log_history`)."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).parents[2]

# TRL's GRPO docs quickstart (docs/source/quickstart.md, GRPO), word for word but for the class name and the two
# offline stand-ins: the hub id is MODEL, the dataset is DATASET
QUICKSTART = """
from trl_ext import PPOTrainer

dataset = DATASET
trainer = PPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=dataset)
trainer.train()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny causal LM and its tokenizer in a folder, as a hub id resolves to one."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny_tokenizer(padding_side="right")  # GRPOTrainer pads prompts on the left whatever it is saved with
    tiny_causal_lm(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(n: int = 16) -> Dataset:
    """GRPO's standard text form: a `prompt` column, and the `solution` column accuracy_reward reads."""
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"w{i}" for i in torch.randint(0, 60, (3,), generator=g).tolist()) for _ in range(n)]
    return Dataset.from_dict({"prompt": rows, "solution": [row.split()[0] for row in rows]})


def accuracy_reward(completions, solution, **kwargs):
    """Stands in for trl.rewards.accuracy_reward (math_verify is not installed here): TRL's reward-function
    signature, 1.0 where the completion contains the solution."""
    return [float(answer in completion) for completion, answer in zip(completions, solution)]


@pytest.mark.slow
def test_trls_grpo_quickstart_runs_with_only_the_class_name_changed(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = {"MODEL": str(model_dir), "DATASET": prompts(), "accuracy_reward": accuracy_reward}
    exec(textwrap.dedent(QUICKSTART), scope)
    trainer = scope["trainer"]
    # args=None: a default config named after the model, as GRPOTrainer's "<name>-GRPO"
    assert trainer.args.output_dir == f"{model_dir.name}-PPO" and (tmp_path / f"{model_dir.name}-PPO").is_dir()
    assert trainer.processing_class.padding_side == "left"
    start = load_file(model_dir / "model.safetensors")
    policy = trainer.unwrapped.policy.state_dict()
    assert any(not torch.equal(policy[name], start[name]) for name in start)  # the policy moved
    critic = trainer.unwrapped.value_model
    assert (critic.score.weight != 0).any()  # the critic made for the script learned (its head starts at zero)
    out = capsys.readouterr().out
    assert "trl_ext: critic: LlamaForSequenceClassification, the policy" in out
    steps = [log for log in trainer.state.log_history if "objective/scores" in log]
    assert len(steps) == trainer.args.num_total_batches == 6  # 3 epochs x 16 prompts / 8 per batch
    for log in steps:  # GRPO's keys beside TRL 1.12 PPO's
        assert log["reward"] == pytest.approx(log["objective/scores"])
        assert log["rewards/accuracy_reward/mean"] == pytest.approx(log["objective/scores"])
        assert log["reward_std"] == log["objective/scores_std"] and log["entropy"] == log["policy/entropy_avg"]
        assert log["completions/mean_length"] == log["rollout/response_length_mean"]


def test_ppos_own_call_and_grpos_call_build_the_same_trainer(model_dir, tmp_path):
    """TRL 1.12 PPO's call (objects) and GRPOTrainer's (a path, reward_funcs, no tokenizer, no value or reference
    model) give the same first-step weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def config(out):
        return PPOConfig(output_dir=str(out), per_device_train_batch_size=4, total_episodes=8, response_length=5,
                         num_ppo_epochs=1, report_to=[], save_strategy="no", seed=1, learning_rate=1e-3)

    grpo = PPOTrainer(model=str(model_dir), reward_funcs=accuracy_reward, args=config(tmp_path / "grpo"),
                      train_dataset=prompts(8))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ppo = PPOTrainer(args=config(tmp_path / "ppo"), processing_class=tokenizer, model=policy, ref_model=None,
                     reward_model=accuracy_reward, train_dataset=prompts(8), value_model=None)
    outputs = [trainer.train() for trainer in (grpo, ppo)]
    # what Trainer.train returns, as GRPO scripts log it: train_loss = the mean of policy + vf_coef x value loss
    logs = [h for h in grpo.state.log_history if "loss/policy_avg" in h]
    want = sum(h["loss/policy_avg"] + 0.1 * h["loss/value_avg"] for h in logs) / 2
    assert len(logs) == 2 and outputs[0].metrics["train_loss"] == pytest.approx(want, rel=1e-12)
    assert outputs[0].global_step == 2 and outputs[0].training_loss == outputs[1].training_loss
    for role in ("policy", "value_model"):
        a, b = getattr(grpo.unwrapped, role).state_dict(), getattr(ppo.unwrapped, role).state_dict()
        assert all(torch.equal(a[name], b[name]) for name in a), role


def test_grpo_positional_order_model_reward_funcs_args(model_dir, tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=3,
                     report_to=[], save_strategy="no")
    trainer = PPOTrainer(str(model_dir), accuracy_reward, args, train_dataset=prompts(4))
    assert trainer.args is args and trainer.reward_scorer.names == ["accuracy_reward"]


@pytest.mark.parametrize("call, message", [
    (dict(reward_funcs=accuracy_reward, reward_model=accuracy_reward), "reward_funcs (GRPO's name) and reward_model"),
    (dict(reward_funcs=accuracy_reward, model_init_kwargs=True), "model_init_kwargs / quantization_config load"),
])
def test_bad_grpo_calls_are_refused_by_name(model_dir, tmp_path, call, message):
    from transformers import AutoModelForCausalLM

    args = PPOConfig(output_dir=str(tmp_path), report_to=[],
                     model_init_kwargs={"dtype": "float32"} if call.pop("model_init_kwargs", False) else None)
    model = AutoModelForCausalLM.from_pretrained(model_dir) if args.model_init_kwargs else str(model_dir)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(model=model, args=args, train_dataset=prompts(4), **call)


# --- TRL's own `trl grpo` script, and trl-ext ppo with its flags ----------------------------------------------------
REWARD_MODULE = '''
def contains_first_word(completions, solution, **kwargs):
    return [float(answer in completion) for completion, answer in zip(completions, solution)]
'''


def grpo_to_ppo(source: str) -> str:
    """A GRPO script with only the class and config names changed: GRPOTrainer -> PPOTrainer, GRPOConfig ->
    PPOConfig, imported from trl_ext where the script imported them from trl."""
    out = []
    for line in source.replace("GRPOTrainer", "PPOTrainer").replace("GRPOConfig", "PPOConfig").splitlines():
        names = re.match(r"^(\s*)from trl import (.*)$", line)
        ours = [n for n in ("PPOConfig", "PPOTrainer") if names and re.search(rf"\b{n}\b", names.group(2))]
        if ours:
            rest = [n.strip() for n in names.group(2).split(",") if n.strip() not in ours]
            out += [f"{names.group(1)}from trl import {', '.join(rest)}"] * bool(rest)
            line = f"{names.group(1)}from trl_ext import {', '.join(ours)}"
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture
def grpo_run(model_dir, tmp_path):
    """A local dataset folder (train.jsonl, test.jsonl) for --dataset_name, a reward module importable from the
    working folder, and the checks a GRPO user's run must pass."""
    data = tmp_path / "data"
    data.mkdir()
    prompts(16).to_json(data / "train.jsonl")
    prompts(4).to_json(data / "test.jsonl")
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    flags = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--reward_funcs",
             "my_rewards.contains_first_word", "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size",
             "4", "--max_steps", "2", "--max_completion_length", "6", "--num_iterations", "2", "--report_to", "none",
             "--learning_rate", "1e-3", "--save_strategy", "steps", "--save_steps", "2", "--dtype", "float32"]
    return flags, tmp_path / "out"


def check_grpo_run(out, model_dir):
    """The policy saved in out and the critic in its checkpoint moved; the run logged GRPO's keys each step."""
    start = load_file(model_dir / "model.safetensors")
    policy = load_file(out / "model.safetensors")
    assert any(not torch.equal(policy[name], start[name]) for name in start)
    critic = load_file(out / "checkpoint-2" / "value_model" / "model.safetensors")
    assert (critic["score.weight"] != 0).any()  # made with a zero head, trained (saved in the checkpoint)
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [log for log in logs if "objective/scores" in log]
    assert len(steps) == 2 and all(log["rewards/contains_first_word/mean"] == log["reward"] for log in steps)


def run_script(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_trls_grpo_script_runs_with_only_the_class_names_changed(model_dir, grpo_run, tmp_path):
    import trl.scripts

    source = (Path(trl.scripts.__file__).parent / "grpo.py").read_text()
    script = tmp_path / "grpo.py"
    script.write_text(grpo_to_ppo(source))
    assert not re.search(r"GRPOTrainer|GRPOConfig", script.read_text())
    flags, out = grpo_run
    done = run_script([sys.executable, str(script)] + flags, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check_grpo_run(out, model_dir)


@pytest.mark.slow
def test_trl_ext_ppo_runs_from_its_command_line(model_dir, grpo_run, tmp_path):
    flags, out = grpo_run
    done = run_script([sys.executable, "-m", "trl_ext.tools.cli", "ppo"] + flags, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trl_ext: critic: LlamaForSequenceClassification" in done.stdout
    check_grpo_run(out, model_dir)


def flag_names(help_text: str) -> set[str]:
    return set(re.findall(r"^\s+(--[a-z_0-9]+)", help_text, re.M))


@pytest.mark.slow
def test_trl_ext_ppo_help_lists_every_flag_of_trl_grpo(tmp_path):
    from trl_ext.scripts.ppo import make_parser

    trl_cli = shutil.which("trl", path=os.path.dirname(sys.executable))
    grpo = run_script([trl_cli, "grpo", "--help"], tmp_path)
    assert grpo.returncode == 0, grpo.stderr[-2000:]
    ours = make_parser(prog="trl-ext ppo").format_help()
    assert len(flag_names(grpo.stdout)) > 200 and flag_names(grpo.stdout) - flag_names(ours) == set()


def test_a_reward_name_that_is_neither_trls_nor_a_path_is_refused():
    from trl_ext.scripts.ppo import PPOScriptArguments, reward_functions

    with pytest.raises(ValueError, match="'accuracy' is neither one of .*accuracy_reward.* nor a dotted import path"):
        reward_functions(PPOScriptArguments(reward_funcs=["accuracy"]))
