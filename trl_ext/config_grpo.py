"""GRPO's config names in `PPOConfig` (`GRPONames`): TRL 1.16 `GRPOConfig`'s fields that `PPOConfig` lacks, each
with GRPO's meaning where PPO has one, so a GRPOTrainer script switches by changing the class names.

- Aliases: where TRL 1.12's PPO and GRPO name one thing twice, both names are accepted; the GRPO name, when given,
  sets the PPO field (which must then be at its default or equal: two different values are an error naming both),
  and after `resolve` both read the same value. `max_completion_length` = `response_length`, `num_iterations` =
  `num_ppo_epochs`, `epsilon` = `cliprange`, `epsilon_high` = `clip_ratio_high`, `vllm_importance_sampling_cap` =
  `vllm_importance_sampling_clip_max`; `generation_batch_size` / `steps_per_generation` size the rollout batch as
  GRPO's generation batch (`use_steps_per_generation`).
- Honoured as GRPO does: `model_init_kwargs` (a model given by name), `chat_template_kwargs` (conversational
  prompts), `log_completions` (the iteration's samples written at every logging step).
- Refused: a GRPO-only option PPO cannot honour, set away from GRPO's default, is an error at construction naming
  the PPO alternative (`REFUSED`); at its default it changes nothing.

The defaults of the names both configs share stay TRL 1.12 PPO's (`temperature` 0.7, `num_generations` 1, PPO's
token-mean loss): README, "From GRPO to PPO".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# name -> (the PPO field it sets, PPO's default of that field)
ALIASES = {"max_completion_length": ("response_length", 53), "num_iterations": ("num_ppo_epochs", 4),
           "epsilon": ("cliprange", 0.2), "epsilon_high": ("clip_ratio_high", None),
           "vllm_importance_sampling_cap": ("vllm_importance_sampling_clip_max", 3.0)}

_SAMPLING = ("PPO samples from softmax(logits / temperature) and trains on the same distribution (its ratio and KL "
             "are of that policy): use temperature; ")
# name -> (GRPO's default, which PPO runs as is; why another value is refused and what to use)
REFUSED = {
    "top_p": (1.0, _SAMPLING + "a nucleus-truncated sampler would make every ratio off-policy."),
    "top_k": (0, _SAMPLING + "a top-k-truncated sampler would make every ratio off-policy."),
    "min_p": (None, _SAMPLING + "a min-p-truncated sampler would make every ratio off-policy."),
    "repetition_penalty": (1.0, _SAMPLING + "a penalised sampler would make every ratio off-policy."),
    "generation_kwargs": (None, "PPO samples with its own sampler (temperature, response_length, stop_token): set "
                                "those fields instead of generate() keyword arguments."),
    "cache_implementation": (None, "PPO's sampler keeps transformers' default KV cache; drop the setting."),
    "use_transformers_continuous_batching": (False, "PPO samples with HF generate or vLLM: use use_vllm=True for "
                                                    "faster rollouts."),
    "use_transformers_paged": (False, "PPO samples with HF generate or vLLM: use use_vllm=True for faster "
                                      "rollouts."),
    "transformers_continuous_batching_config": (None, "PPO samples with HF generate or vLLM: use use_vllm=True."),
    "vllm_model_impl": ("vllm", "trl_ext's vLLM engine runs vLLM's own model implementation: drop the setting."),
    "vllm_structured_outputs_regex": (None, "a regex-constrained sampler would make every ratio off-policy: score "
                                            "the format with a reward function instead."),
    "delta": (None, "GRPO's two-sided clipping of the ratio; PPO's counterpart for negative advantages is the dual "
                    "clip: clip_ratio_c (veRL: 3.0)."),
    "sync_ref_model": (False, "PPO keeps its reference frozen, and the KL to it is what keeps the policy close: "
                              "lower kl_coef (or kl_controller='adaptive') to let it move further."),
    "use_adaptive_entropy": (False, "use a fixed entropy bonus: entropy_coef (typical 1e-3)."),
    "disable_dropout": (True, "PPO runs every model without dropout, so the rollout's log-probs and values are the "
                              "ones the loss recomputes (ratio 1 on the first minibatch): drop the setting."),
    "shuffle_dataset": (True, "PPO draws the prompts in a seeded shuffled order, which a resumed run continues "
                              "exactly: drop the setting."),
    "num_generations_eval": (None, "evaluation samples one completion per prompt, paired with the reference's: drop "
                                   "the setting."),
    "pad_to_multiple_of": ("auto", "PPO pads rows to the batch's longest: drop the setting (padding_free=True packs "
                                   "them)."),
    "router_aux_loss_coef": (None, "PPO adds no MoE router loss: drop the setting."),
    "log_completions_hub_repo": (None, "completions are written to output_dir/samples.jsonl (log_completions=True): "
                                       "push that file with the checkpoint instead."),
    "num_completions_to_print": (None, "log_completions writes 4 rows per logging step to output_dir/samples.jsonl; "
                                       "drop the setting."),
    "log_unique_prompts": (False, "drop the setting (samples.jsonl holds each row's prompt)."),
    "log_multimodal": (True, "PPO trains on text prompts: drop the setting."),
}
# read only by GRPO losses, reference syncs or entropy control that trl_ext has not (each refused above by its
# switch): accepted at any value, inert
INERT = {"sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
         "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512,
         "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2}


def _grpo(default, help: str):
    return field(default=default, metadata={"help": "GRPO's name: " + help})


def _refused(name: str):
    default, why = REFUSED[name]
    return field(default=default, metadata={"help": f"GRPO's; PPO runs it at {default!r} only: {why}"})


def _inert(name: str):
    return field(default=INERT[name], metadata={"help": "GRPO's; read by nothing PPO has (its switch is refused)."})


@dataclass
class GRPONames:
    """TRL 1.16 GRPOConfig's fields that PPOConfig lacks (module docstring); `PPOConfig` inherits them."""

    # -- aliases of PPO fields (both accepted; two different values are an error)
    max_completion_length: int | None = _grpo(None, "response_length (the most tokens a completion has).")
    num_iterations: int | None = _grpo(None, "num_ppo_epochs (passes over each rollout batch, GRPO's μ).")
    epsilon: float | None = _grpo(None, "cliprange (the ratio's clip range).")
    epsilon_high: float | None = _grpo(None, "clip_ratio_high (DAPO's clip-higher: the upper bound 1 + it).")
    vllm_importance_sampling_cap: float | None = _grpo(None, "vllm_importance_sampling_clip_max (TRL's deprecated "
                                                             "name).")
    generation_batch_size: int | None = _grpo(
        None, "the rollout batch over all processes, completions: per_device_train_batch_size x processes x "
              "steps_per_generation. Sets gradient_accumulation_steps = steps_per_generation and num_mini_batches = "
              "steps_per_generation / the gradient_accumulation_steps given (one optimizer step per GRPO step).")
    steps_per_generation: int | None = _grpo(None, "micro-batches of per_device_train_batch_size per rollout batch "
                                                   "and process (see generation_batch_size). Unset: "
                                                   "gradient_accumulation_steps, PPO's own batch.")
    # -- honoured as GRPOTrainer does
    model_init_kwargs: dict | str | None = _grpo(None, "keyword arguments of AutoModelForCausalLM.from_pretrained "
                                                       "when `model` is given as a name or path (a JSON string on "
                                                       "the command line).")
    chat_template_kwargs: dict | str | None = _grpo(None, "keyword arguments of apply_chat_template for "
                                                          "conversational prompts (e.g. {\"enable_thinking\": false}).")
    log_completions: bool = _grpo(False, "write a few (prompt, completion, score) rows of the iteration's rollout "
                                         "to output_dir/samples.jsonl at every logging step.")
    # -- GRPO-only options: at GRPO's default they change nothing; another value is an error naming the alternative
    top_p: float = _refused("top_p")
    top_k: int = _refused("top_k")
    min_p: float | None = _refused("min_p")
    repetition_penalty: float = _refused("repetition_penalty")
    generation_kwargs: dict | str | None = _refused("generation_kwargs")
    cache_implementation: str | None = _refused("cache_implementation")
    use_transformers_continuous_batching: bool = _refused("use_transformers_continuous_batching")
    use_transformers_paged: bool = _refused("use_transformers_paged")
    transformers_continuous_batching_config: dict | str | None = _refused("transformers_continuous_batching_config")
    vllm_model_impl: str = _refused("vllm_model_impl")
    vllm_structured_outputs_regex: str | None = _refused("vllm_structured_outputs_regex")
    delta: float | None = _refused("delta")
    sync_ref_model: bool = _refused("sync_ref_model")
    use_adaptive_entropy: bool = _refused("use_adaptive_entropy")
    disable_dropout: bool = _refused("disable_dropout")
    shuffle_dataset: bool = _refused("shuffle_dataset")
    num_generations_eval: int | None = _refused("num_generations_eval")
    pad_to_multiple_of: int | str | None = _refused("pad_to_multiple_of")
    router_aux_loss_coef: float | None = _refused("router_aux_loss_coef")
    log_completions_hub_repo: str | None = _refused("log_completions_hub_repo")
    num_completions_to_print: int | None = _refused("num_completions_to_print")
    log_unique_prompts: bool = _refused("log_unique_prompts")
    log_multimodal: bool = _refused("log_multimodal")
    sapo_temperature_neg: float = _inert("sapo_temperature_neg")
    sapo_temperature_pos: float = _inert("sapo_temperature_pos")
    vespo_k_pos: float = _inert("vespo_k_pos")
    vespo_lambda_pos: float = _inert("vespo_lambda_pos")
    vespo_k_neg: float = _inert("vespo_k_neg")
    vespo_lambda_neg: float = _inert("vespo_lambda_neg")
    ref_model_mixup_alpha: float = _inert("ref_model_mixup_alpha")
    ref_model_sync_steps: int = _inert("ref_model_sync_steps")
    entropy_coef_min: float = _inert("entropy_coef_min")
    entropy_coef_max: float = _inert("entropy_coef_max")
    entropy_coef_delta: float = _inert("entropy_coef_delta")
    entropy_target: float = _inert("entropy_target")

    def resolve_grpo_names(self) -> None:
        """Before PPOConfig's checks: the aliases onto PPO's fields (and back), the generation batch, JSON strings
        from the command line, the refused options. Each error names the values and the fix."""
        for name in ("model_init_kwargs", "chat_template_kwargs", "generation_kwargs",
                     "transformers_continuous_batching_config"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, json.loads(value))
        if self.generation_kwargs == {}:
            self.generation_kwargs = None
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of.lower() in ("none", "null"):
            self.pad_to_multiple_of = None
        for name, (default, why) in REFUSED.items():
            value = getattr(self, name)
            if value != default and not (name == "pad_to_multiple_of" and value is None):
                raise ValueError(f"{name}={value!r} is GRPOTrainer's option; PPO runs it at {default!r} only: {why}")
        for name, (ppo_name, ppo_default) in ALIASES.items():
            value, ppo_value = getattr(self, name), getattr(self, ppo_name)
            if value is None:
                setattr(self, name, ppo_value)
            elif ppo_value in (ppo_default, value):
                setattr(self, ppo_name, value)
            else:
                raise ValueError(f"{name}={value!r} (GRPO's name) and {ppo_name}={ppo_value!r} (PPO's) set one "
                                 f"thing to two values: set one of them.")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(f"generation_batch_size={self.generation_batch_size} and steps_per_generation="
                             f"{self.steps_per_generation} are both set (as in GRPO, one decides the other): set one "
                             "of them.")
        if self.steps_per_generation is not None:
            self.use_steps_per_generation(self.steps_per_generation)

    def use_steps_per_generation(self, steps: int) -> None:
        """GRPO's generation batch as PPO's rollout batch: per process, `steps` micro-batches of
        per_device_train_batch_size, one optimizer step every gradient_accumulation_steps of them
        (`generation_batch_size` is turned into `steps` where the number of processes is known:
        `trainer.builders.batch_sizes`)."""
        accumulation = self.gradient_accumulation_steps
        if steps == accumulation:
            return
        if steps < 1 or steps % accumulation or self.num_mini_batches != 1:
            raise ValueError(
                f"steps_per_generation={steps} must be a multiple of gradient_accumulation_steps={accumulation} (one "
                f"optimizer step per gradient_accumulation_steps micro-batches), with num_mini_batches left at 1 (it "
                f"is {self.num_mini_batches}; GRPO's steps_per_generation sets it).")
        self.num_mini_batches = steps // accumulation
        self.gradient_accumulation_steps = self.steps_per_generation = steps
