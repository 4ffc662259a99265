"""trl_ext's own bases for `PPOConfig` and `PPOTrainer`, used where the installed TRL has no PPOTrainer (trl >= 1.13,
which removed it in PR #7020; `trl_ext/_trl.py` picks the base).

- `PPOConfigBase`: `transformers.TrainingArguments` with exactly the fields and defaults of TRL 1.12's
  `trl.experimental.ppo.PPOConfig` (its base config's overrides included: `logging_steps=10`,
  `gradient_checkpointing=True`, `bf16` unset meaning "not fp16", `learning_rate=3e-6`), so a config built here gives
  the same `to_dict()` as TRL 1.12's, field for field (`tests/trl/test_trl_versions.py`).
- `PPOTrainerBase`: `transformers.Trainer` with what trl_ext takes from TRL's trainer classes: the model card
  (written with TRL's public `generate_model_card`), the tags and the PPO paper it cites, and the dataloader getters.
- `OnlineTrainerState`: `TrainerState` with TRL's `episode` counter.

trl_ext never calls TRL's `PPOTrainer.__init__` or `train()`, so the trainer is the same on either base.
"""

from __future__ import annotations

import os
import textwrap
import warnings
from dataclasses import dataclass, field

from transformers import Trainer, TrainerState, TrainingArguments

__all__ = ["OnlineTrainerState", "PPOConfigBase", "PPOTrainerBase"]


@dataclass
class OnlineTrainerState(TrainerState):
    """`TrainerState` with `episode`: the number of rollouts (prompts) sampled so far."""

    episode: int = 0


@dataclass
class PPOConfigBase(TrainingArguments):
    """TRL 1.12's PPOConfig fields and defaults on `TrainingArguments` (trl_ext's `PPOConfig` documents each one)."""

    # TrainingArguments fields whose defaults TRL's configs change
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps (a float in [0, 1): a "
                                                              "fraction of the training steps)."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Recompute activations in backward to "
                                                                        "save memory."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; unset: True unless fp16."})
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate (AdamW)."})
    # PPO's own fields
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preparation."})
    num_mini_batches: int = field(default=1, metadata={"help": "Minibatches each rollout batch is split into."})
    total_episodes: int | None = field(default=None, metadata={"help": "Rollouts to train on in all (unset: "
                                                                        "num_train_epochs x the dataset)."})
    local_rollout_forward_batch_size: int = field(default=64, metadata={"help": "Rows per no-grad forward (and "
                                                                                "generation chunk) in the rollout."})
    num_sample_generations: int = field(default=10, metadata={"help": "How many times to print sample completions "
                                                                      "during training."})
    response_length: int = field(default=53, metadata={"help": "Tokens sampled per response at most."})
    stop_token: str | None = field(default=None, metadata={"help": "Stop token for generation ('eos')."})
    stop_token_id: int | None = field(default=None, metadata={"help": "Id of the stop token for generation."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(default=None, metadata={"help": "Subtracted from the score of a "
                                                                              "response without the stop token."})
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path of the SFT model (for "
                                                                                    "scripts)."})
    world_size: int | None = field(default=None, metadata={"help": "Processes (set by the trainer)."})
    num_total_batches: int | None = field(default=None, metadata={"help": "Rollout batches in all (set by the "
                                                                          "trainer)."})
    micro_batch_size: int | None = field(default=None, metadata={"help": "per_device_train_batch_size x world_size "
                                                                         "(set by the trainer)."})
    local_batch_size: int | None = field(default=None, metadata={"help": "per_device_train_batch_size x "
                                                                         "gradient_accumulation_steps (set by the "
                                                                         "trainer)."})
    batch_size: int | None = field(default=None, metadata={"help": "local_batch_size x world_size (set by the "
                                                                   "trainer)."})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Minibatch per process (set by the "
                                                                              "trainer)."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Minibatch over all processes (set by the "
                                                                        "trainer)."})
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path of the reward model "
                                                                                       "(for scripts)."})
    model_adapter_name: str | None = field(default=None, metadata={"help": "PEFT adapter to train, with several "
                                                                           "adapters."})
    ref_adapter_name: str | None = field(default=None, metadata={"help": "PEFT adapter that is the reference, with "
                                                                         "several adapters."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "PPO epochs over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the per-token rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "β, the weight of the KL penalty."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator of the penalty."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value predictions."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE λ."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "DeepSpeed ZeRO-3: gather the policy's "
                                                                            "weights for generation."})

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16  # TRL's rule for an unset bf16
        super().__post_init__()


class PPOTrainerBase(Trainer):
    """`transformers.Trainer` with TRL's PPO model card, tags and paper; trl_ext's PPOTrainer does the rest (it never
    calls `Trainer.__init__`)."""

    _tag_names = ["trl", "ppo"]
    _name = "PPO"
    _template_file = None
    _paper = {
        "title": "Fine-Tuning Language Models from Human Preferences",
        "id": "1909.08593",
        "citation": textwrap.dedent("""\
            @article{mziegler2019fine-tuning,
                title        = {{Fine-Tuning Language Models from Human Preferences}},
                author       = {Daniel M. Ziegler and Nisan Stiennon and Jeffrey Wu and Tom B. Brown and Alec Radford
                                and Dario Amodei and Paul F. Christiano and Geoffrey Irving},
                year         = 2019,
                eprint       = {arXiv:1909.08593}
            }"""),
    }

    def get_train_dataloader(self):
        return self.dataloader

    def get_eval_dataloader(self, eval_dataset=None):
        return self.eval_dataloader

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """`output_dir/README.md`: the model card TRL's trainers write (base model, tags, how to cite PPO)."""
        from transformers import is_wandb_available

        try:  # TRL's model-card helpers are not public API: a TRL that moved them gets no card, not a failed save
            from trl.trainer.utils import generate_model_card, get_comet_experiment_url, get_trackio_space_url
        except ImportError as error:
            warnings.warn(f"No model card written: this trl has no trl.trainer.utils.generate_model_card ({error}).",
                          stacklevel=2)
            return
        if not self.is_world_process_zero():
            return
        name_or_path = getattr(self.model.config, "_name_or_path", None)
        base_model = name_or_path if name_or_path and not os.path.isdir(name_or_path) else None
        tags = {tags} if isinstance(tags, str) else set(tags or ())
        tags.update(self._tag_names)
        trackio_url = get_trackio_space_url()
        if trackio_url is not None:
            tags.add(f"trackio:{trackio_url}")
        wandb_url = None
        if is_wandb_available():
            import wandb

            wandb_url = wandb.run.url if wandb.run is not None else None
        card = generate_model_card(
            base_model=base_model, model_name=model_name, hub_model_id=self.hub_model_id, dataset_name=dataset_name,
            tags=sorted(tags), wandb_url=wandb_url, trackio_url=trackio_url, comet_url=get_comet_experiment_url(),
            trainer_name=self._name, trainer_citation=self._paper["citation"], template_file=self._template_file,
            paper_title=self._paper["title"], paper_id=self._paper["id"])
        card.save(os.path.join(self.args.output_dir, "README.md"))
