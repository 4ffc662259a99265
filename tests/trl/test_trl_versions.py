"""trl_ext on trl 1.12 through the newest release (issue 13): TRL's own classes as bases where TRL has PPO (1.12), and
trl_ext's (trl_ext/ppo_base.py) where it does not, with the same config fields and defaults.

The tests marked trl_ppo need TRL 1.12's PPOTrainer; CI runs them in its trl 1.12 environment (.ci/run), and the
rest of the suite runs under both."""

import dataclasses
import json
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from trl_ext import PPOConfig, PPOTrainer
from trl_ext._trl import PPO_BASE, TRL_HAS_PPO, PPOConfigBase, PPOTrainerBase
from trl_ext.ppo_base import PPOConfigBase as OwnConfigBase
from trl_ext.ppo_base import PPOTrainerBase as OwnTrainerBase
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

SNAPSHOT = json.loads((Path(__file__).parents[1] / "data" / "trl_1_12_ppo_config_defaults.json").read_text())[
    "defaults"]


def defaults(config_class) -> dict:
    out = {}
    for f in dataclasses.fields(config_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_the_base_follows_the_installed_trl():
    assert TRL_HAS_PPO == (Version(version("trl")) < Version("1.13"))
    if TRL_HAS_PPO:
        assert PPOTrainerBase.__module__ == "trl.experimental.ppo.ppo_trainer" and "TRL's own" in PPO_BASE
    else:
        assert PPOTrainerBase is OwnTrainerBase and PPOConfigBase is OwnConfigBase and "trl_ext's own" in PPO_BASE
    assert issubclass(PPOTrainer, PPOTrainerBase) and issubclass(PPOConfig, PPOConfigBase)


def test_trl_exts_own_config_base_has_trl_1_12s_defaults():
    """Every field TRL 1.12's PPOConfig adds to TrainingArguments or defaults differently, with TRL's default
    (`tests/data/trl_1_12_ppo_config_defaults.json`, read from TRL 1.12 and checked against it below)."""
    ours = defaults(OwnConfigBase)
    assert {k: ours[k] for k in SNAPSHOT} == SNAPSHOT
    from transformers import TrainingArguments

    extra = set(ours) - set(defaults(TrainingArguments)) - set(SNAPSHOT)
    assert extra == set(), f"fields TRL 1.12's PPOConfig does not have: {extra}"


def test_trl_exts_config_keeps_trls_defaults_except_where_documented(tmp_path):
    """trl_ext.PPOConfig on either base: TRL 1.12's defaults, except bf16 (resolved per device; README) and the
    stop token (unset means EOS; README)."""
    ours = defaults(PPOConfig)
    changed = {k for k in SNAPSHOT if ours[k] != SNAPSHOT[k]}
    assert changed == set()  # the defaults are the same values; bf16/stop_token differ in how None is resolved
    cfg = PPOConfig(output_dir=str(tmp_path), report_to=[])
    assert cfg.bf16 is False  # no CUDA here; TRL 1.12's unset bf16 becomes True and raises on a CPU-only machine


@pytest.mark.trl_ppo
def test_the_snapshot_is_trl_1_12s():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.ppo import PPOConfig as TRLPPOConfig
    trl = defaults(TRLPPOConfig)
    assert {k: trl[k] for k in SNAPSHOT} == SNAPSHOT
    assert set(trl) == set(defaults(OwnConfigBase))  # the same fields, none missing, none added


@pytest.mark.trl_ppo
def test_trl_exts_own_config_base_gives_trl_1_12s_to_dict_field_for_field(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.ppo import PPOConfig as TRLPPOConfig
    kwargs = dict(output_dir=str(tmp_path), bf16=False, report_to=[])
    theirs, ours = TRLPPOConfig(**kwargs).to_dict(), OwnConfigBase(**kwargs).to_dict()
    assert ours.keys() == theirs.keys()
    assert {k: ours[k] for k in ours if ours[k] != theirs[k]} == {}


@pytest.mark.trl_ppo
def test_on_trl_1_12_trl_exts_classes_are_trls(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import trl.experimental.ppo as trl_ppo
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, report_to=[],
                     save_strategy="no", num_sample_generations=0)
    trainer = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                         reward_model=tiny_scalar_model(tok, seed=2), value_model=tiny_scalar_model(tok),
                         train_dataset=tiny_prompt_dataset(tok, 4))
    assert isinstance(trainer, trl_ppo.PPOTrainer) and isinstance(args, trl_ppo.PPOConfig)


def test_the_model_card_of_trl_exts_own_base(tmp_path):
    """The base used on trl >= 1.13 writes TRL's model card too (TRL's public generate_model_card)."""

    class Card(OwnTrainerBase):
        def __init__(self, args, model):  # what create_model_card reads, without a Trainer.__init__
            self.args, self.model, self.hub_model_id = args, model, None

        def is_world_process_zero(self):
            return True

    tok = tiny_tokenizer()
    Card(PPOConfig(output_dir=str(tmp_path), report_to=[]), tiny_causal_lm(tok)).create_model_card(model_name="run")
    card = (tmp_path / "README.md").read_text()
    assert "model_name: run" in card and "- ppo" in card and "1909.08593" in card


def _requirement(name: str) -> str:
    import tomllib

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.split(">")[0].split("<")[0].split("=")[0].strip() == name]
    return spec


def test_trl_has_no_upper_bound_so_a_newer_trl_is_never_downgraded():
    from packaging.requirements import Requirement

    spec = Requirement(_requirement("trl")).specifier
    assert Version("1.12.0") in spec and Version("1.11.0") not in spec
    assert all(Version(v) in spec for v in ("1.16.0", "1.17.0", "1.18.0", "2.0.0")), spec


@pytest.mark.parametrize("installed, warns", [("1.12.0", False), ("1.16.0", False), ("1.16.3", False),
                                              ("1.17.0", True), ("1.18.1", True), ("2.0.0", True)])
def test_a_trl_newer_than_the_newest_tested_warns_naming_it(installed, warns):
    from trl_ext._trl import NEWEST_TESTED_TRL, warn_if_untested

    if warns:
        with pytest.warns(UserWarning, match=rf"trl {installed} is newer than {NEWEST_TESTED_TRL}.*trl<1\.17"):
            assert warn_if_untested(Version(installed))
    else:
        assert not warn_if_untested(Version(installed))


def test_the_torch_floor_is_one_transformers_enables():
    # transformers 5's is_torch_available() is False below torch 2.6 (transformers/utils/import_utils.py), so a
    # floor under it would let pip keep a torch on which nothing imports
    from packaging.requirements import Requirement

    spec = Requirement(_requirement("torch")).specifier
    assert Version("2.5.1") not in spec and Version("2.6.0") in spec, spec


def test_trl_ext_imports_only_trls_public_names_outside_its_trl_1_12_base():
    # trl.experimental and module-internal paths move between releases; the base for trl 1.12 is the one exception
    import ast

    # TRL's top-level names that are its documented API (create_reference_model there is deprecated: it moved to
    # trl.experimental)
    public = {"ModelConfig", "TrlParser", "ScriptArguments", "get_peft_config", "get_quantization_config",
              "RewardConfig", "RewardTrainer",
              "get_dataset", "DatasetMixtureConfig"}  # TRL's "Script Utilities" page (1.12 and 1.16), for trl-ext ppo
    # modules TRL documents by their path: trl.models; trl.generation.vllm_client, whose VLLMClient TRL's docs import
    # from there (the same path and API in trl 1.12 and 1.16), for vllm_mode="server"'s full-weight sync;
    # trl.rewards, its reward functions' page (get_soft_overlong_punishment, in 1.12 and 1.16); trl.chat_template_utils,
    # its "Chat template utilities" page (add_response_schema; parse_response and the bundled templates such as
    # qwen2_5_chat_template beside it, the same names in 1.12 and 1.16), for multi-turn rollouts' tool calls
    documented_modules = {"trl.models", "trl.generation.vllm_client", "trl.rewards", "trl.chat_template_utils"}
    root = Path(__file__).parents[2] / "trl_ext"
    private = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or path.name == "_trl.py":
                continue
            if node.module == "trl":
                private += [f"{path.relative_to(root)}: from trl import {a.name}" for a in node.names
                            if a.name not in public]
            elif (node.module or "").startswith("trl.") and node.module not in documented_modules and not (
                    path.name == "ppo_base.py" and node.module == "trl.trainer.utils"):
                private.append(f"{path.relative_to(root)}: from {node.module}")
    assert private == [], private
