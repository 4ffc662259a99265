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
    # and logged last, as transformers' Trainer (GRPOTrainer) does: `trainer.state.log_history[-1]["train_loss"]`
    for trainer, output in zip((grpo, ppo), outputs):
        assert trainer.state.log_history[-1] == {**output.metrics, "step": 2}
        assert [h for h in trainer.state.log_history if "train_loss" in h] == trainer.state.log_history[-1:]
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
    done = run_script([sys.executable, "-m", "trl_ext.scripts.cli", "ppo"] + flags, tmp_path)
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


# --- GRPO scripts from public projects (tests/scripts/user_scripts/grpo_*.py, each in a public script's shape) ------
USER_SCRIPTS = ROOT / "tests" / "scripts" / "user_scripts"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """TRL's tiny Qwen2 stand-in (a chat template; tests/trl/trl_standins.py) and the two scripts' datasets."""
    sys.path.insert(0, str(Path(__file__).parent))
    import trl_standins

    folder = tmp_path_factory.mktemp("grpo_standins")
    paths = trl_standins.build(folder)
    g = torch.Generator().manual_seed(0)
    numbers = torch.randint(1, 20, (40, 3), generator=g).tolist()
    countdown = Dataset.from_dict({"nums": numbers, "target": [a + b - c for a, b, c in numbers]})
    countdown.to_json(folder / "countdown" / "train.jsonl")
    questions = [f"What is {a} plus {b}?" for a, b, _ in numbers[:16]]
    gsm8k = Dataset.from_dict({"question": questions, "answer": [f"{a} + {b}\n#### {a + b}"
                                                                 for a, b, _ in numbers[:16]]})
    gsm8k.to_json(folder / "gsm8k" / "train.jsonl")
    paths.update(countdown=str(folder / "countdown"), gsm8k=str(folder / "gsm8k"),
                 policy=format_tuned_policy(paths["causal_lm"], folder / "policy"))
    return paths


def format_tuned_policy(source: str, folder: Path) -> str:
    """The stand-in policy after 60 SFT steps on answers in the two scripts' formats (after their prompts), so
    that their format rewards are earned by some completions and not others: the policy's advantages and the
    critic's returns are not all zero (a random tiny model earns no reward at all, and nothing would move)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(USER_SCRIPTS))
    from grpo_countdown import r1_messages
    from grpo_gsm8k import SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    rows = []
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 7)]:
        rows.append((tok.apply_chat_template(r1_messages([a, b, 1], a + b - 1), tokenize=False,
                                             continue_final_message=True),
                     f" add</think>\n<answer>{a} + {b} - 1</answer>"))
        gsm8k = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {a} plus {b}?"}]
        rows.append((tok.apply_chat_template(gsm8k, tokenize=False, add_generation_prompt=True),
                     f"<reasoning>\nadd\n</reasoning>\n<answer>\n{a + b}\n</answer>"))
    full = [tok(prompt + answer + tok.eos_token)["input_ids"] for prompt, answer in rows]
    width = max(map(len, full))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, ((prompt, _), row) in enumerate(zip(rows, full)):
        ids[i, :len(row)] = torch.tensor(row)
        start = len(tok(prompt)["input_ids"])
        labels[i, start:len(row)] = ids[i, start:len(row)]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        model(input_ids=ids, attention_mask=(labels != -100) | (ids != tok.pad_token_id), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def user_script(name: str, tmp_path, ppo: bool) -> Path:
    source = (USER_SCRIPTS / name).read_text()
    script = tmp_path / name
    script.write_text(grpo_to_ppo(source) if ppo else source)
    return script


def countdown_command(s, out):
    return ["--model_name_or_path", s["policy"], "--dataset_id_or_path", s["countdown"], "--output_dir", str(out),
            "--per_device_train_batch_size", "8", "--max_steps", "2", "--max_completion_length", "48",
            "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no", "--bf16", "false",
            "--logging_steps", "1", "--num_generations", "4"]


def check_user_run(out, names: list[str], iterations: int, rewards_differ: bool = True):
    """GRPO's reward keys at every step; the policy and the critic took steps (nonzero gradients) wherever a batch's
    rewards differ, and (`rewards_differ`) some did."""
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [log for log in logs if "objective/scores" in log]
    assert len(steps) == iterations
    assert any(log["reward_std"] > 0 for log in steps) or not rewards_differ  # some earned more than others
    for log in steps:
        assert {"reward", "reward_std", "completions/mean_length"} | {f"rewards/{n}/mean" for n in names} <= set(log)
        if log["reward_std"] > 0:
            assert log["policy/grad_norm"] > 0 and log["val/grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("ppo", [False, True], ids=["grpo", "ppo"])
def test_a_countdown_grpo_script_runs_with_only_the_class_names_changed(standins, tmp_path, ppo):
    """On TRL's GRPOTrainer as written (it is a valid GRPO script), then on PPO with the names changed: it resumes
    from output_dir's last checkpoint if any, logs and saves train_result.metrics, the state, the model and the card."""
    out = tmp_path / "out"
    done = run_script([sys.executable, str(user_script("grpo_countdown.py", tmp_path, ppo))]
                      + countdown_command(standins, out), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "train_results.json").read_text())["train_samples"] == 36
    assert (out / "trainer_state.json").is_file() and (out / "README.md").is_file()
    if ppo:  # (its exact-format reward is sparse: on the tiny stand-in a batch may earn all zeros under some
        # library versions, and then nothing moves; the GSM8K-shape test below checks that both models move)
        check_user_run(out, ["format_reward_func", "equation_reward_func"], 2, rewards_differ=False)
        assert "train_loss" in json.loads((out / "train_results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ppo", [False, True], ids=["grpo", "ppo"])
def test_a_gsm8k_format_grpo_script_runs_with_only_the_class_names_changed(standins, tmp_path, ppo):
    """Conversational prompts, rewards reading messages and the answer column, LoRA: on GRPOTrainer as written, then
    on PPO (8 completions = 2 prompts x num_generations 4 per step, the critic made from the policy)."""
    out = tmp_path / "out"
    done = run_script([sys.executable, str(user_script("grpo_gsm8k.py", tmp_path, ppo)), standins["policy"],
                       standins["gsm8k"], str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = load_file(out / "adapter_model.safetensors")
    assert any((tensor != 0).any() for name, tensor in adapter.items() if "lora_B" in name)  # LoRA's B starts at 0
    if ppo:
        check_user_run(out, ["xmlcount_reward_func", "soft_format_reward_func", "int_reward_func",
                             "correctness_reward_func"], 8)  # 16 prompts x 4 / 8 per batch


# --- bad GRPO-shaped input: refused at construction, by name ----------------------------------------------------------
def test_a_reward_path_that_is_not_a_sequence_classifier_is_refused(model_dir, tmp_path):
    """GRPOTrainer loads a causal LM's folder as a reward model with a new random head; trl_ext names it."""
    with pytest.raises(ValueError, match=r"is a LlamaForCausalLM checkpoint, not a sequence classifier"):
        PPOTrainer(model=str(model_dir), reward_funcs=str(model_dir), train_dataset=prompts(4),
                   args=PPOConfig(output_dir=str(tmp_path), report_to=[]))


def test_a_reward_model_of_another_tokenizer_needs_its_tokenizer(model_dir, tmp_path):
    """A reward model saved with another tokenizer, passed without reward_processing_classes: refused (it would read
    the policy's ids as other tokens); with its tokenizer it reads the decoded text."""
    from trl_ext.testing import tiny_chat_tokenizer, tiny_scalar_model

    other = tiny_chat_tokenizer()
    reward = tiny_scalar_model(other, seed=3)
    reward.save_pretrained(tmp_path / "rm")
    other.save_pretrained(tmp_path / "rm")
    reward = type(reward).from_pretrained(tmp_path / "rm")
    args = PPOConfig(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="was saved with a tokenizer whose vocabulary differs .* "
                                         "reward_processing_classes"):
        PPOTrainer(model=str(model_dir), reward_funcs=reward, train_dataset=prompts(4), args=args)
    t = PPOTrainer(model=str(model_dir), reward_funcs=reward, reward_processing_classes=[other],
                   train_dataset=prompts(4), args=args)
    assert t.reward_scorer.names == [str(tmp_path / "rm")]
    small = tiny_scalar_model(tiny_tokenizer(), seed=3, vocab_size=10)  # fewer embeddings than the policy's ids
    with pytest.raises(ValueError, match="has 10 token embeddings, fewer than the policy tokenizer's"):
        PPOTrainer(model=str(model_dir), reward_funcs=small, train_dataset=prompts(4), args=args)


def test_what_a_grpo_script_reads_back_means_the_policy(model_dir, tmp_path):
    """trainer.model as GRPOTrainer's: the policy's config, generate and save_pretrained; processing_class the
    tokenizer the trainer loaded; state.log_history the logged steps."""
    from transformers import AutoModelForCausalLM

    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=3,
                     report_to=[], save_strategy="no")
    trainer = PPOTrainer(model=str(model_dir), reward_funcs=accuracy_reward, args=args, train_dataset=prompts(4))
    trainer.train()
    policy = trainer.unwrapped.policy
    assert trainer.model.config is policy.config
    ids = trainer.processing_class(["w1 w2"], return_tensors="pt")
    out = trainer.model.generate(**ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(out, policy.generate(**ids, max_new_tokens=2, do_sample=False))
    trainer.model.save_pretrained(tmp_path / "saved")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), policy.state_dict().values()))
    assert [h["step"] for h in trainer.state.log_history if "reward" in h] == [1]


@pytest.mark.slow
def test_a_4bit_policy_with_a_peft_config_gets_a_shared_base_for_its_critic_and_reference(tmp_path, capsys):
    """GRPO's call with a 4-bit policy and a LoraConfig: one shared 4-bit base (the QLoRA recipes' layout) with the
    policy's adapter, a 'critic' adapter and a zeroed value head; the reference is the base with adapters disabled.
    Training moves both adapters and the head; without a peft_config the 4-bit policy is still refused by name."""
    from peft import LoraConfig

    from trl_ext.models import SharedBaseModels
    from trl_ext.testing import tiny_4bit_causal_lm

    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4,
                     total_episodes=8, response_length=4, learning_rate=1e-2, save_strategy="no",
                     gradient_checkpointing=False)
    t = PPOTrainer(model=tiny_4bit_causal_lm(tok, tmp_path / "base"), processing_class=tok,
                   reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                   train_dataset=prompts(8), args=args, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    out = capsys.readouterr().out
    assert isinstance(t.shared, SharedBaseModels) and t.ref_model is None
    assert out.count("trl_ext: critic: a 'critic' LoRA adapter") == 1
    assert "reference: the shared base with its adapters disabled" in out
    assert (t.shared.value_model.score.weight == 0).all()
    before = {n: [p.detach().clone() for p in ps] for n, ps in
              (("policy", t.shared.policy_parameters()), ("critic", t.shared.value_parameters()))}
    t.train()
    for name, ps in (("policy", t.shared.policy_parameters()), ("critic", t.shared.value_parameters())):
        assert any(not torch.equal(a, b) for a, b in zip(before[name], ps)), f"the {name} adapter did not move"
    with pytest.raises(ValueError, match="cannot copy a quantized policy's backbone: pass a peft_config"):
        PPOTrainer(model=tiny_4bit_causal_lm(tok, tmp_path / "base2"), processing_class=tok,
                   reward_funcs=accuracy_reward, train_dataset=prompts(4),
                   args=PPOConfig(output_dir=str(tmp_path / "out2"), report_to=[]))


def test_accelerate_config_runs_the_script_under_accelerate_launch(monkeypatch):
    """--accelerate_config NAME: `accelerate launch --config_file <TRL's NAME.yaml> trl_ext/scripts/ppo.py <the
    training flags>` (the launch itself is accelerate's)."""
    import accelerate.commands.launch as launch

    import trl_ext.scripts.ppo as ppo

    seen = []
    monkeypatch.setattr(launch, "launch_command", seen.append)
    flags = ["--model_name_or_path", "m", "--output_dir", "o", "--num_processes", "2"]
    assert ppo.run(["--accelerate_config", "multi_gpu"] + flags) == 0
    (args,) = seen
    assert args.config_file.endswith("multi_gpu.yaml") and args.num_processes == 2
    assert args.training_script == ppo.__file__
    assert args.training_script_args == ["--model_name_or_path", "m", "--output_dir", "o"]
    with pytest.raises(ValueError, match="--accelerate_config 'zero9' is neither a file nor one of TRL's configs"):
        ppo.run(["--accelerate_config", "zero9"] + flags)
