"""Step 8 of a PPO iteration (`PPOUpdate`): `num_ppo_epochs` passes over the rollout in shuffled minibatches, each
minibatch one optimizer step over its micro-batches, and the loss terms (`policy_terms`, `value_terms`), which take a
micro-batch of the rollout and the config, no trainer.

Both losses are aggregated over the whole minibatch (`loss_agg_mode`; by default token means: Σ over its real tokens
on every process / the number of those tokens). Each micro-batch's backward carries its share (its weighted sum / the
minibatch's denominator), scaled up by the accumulation steps and the process count that accelerate and DDP divide
by, so the update is the same for any gradient_accumulation_steps and any number of processes.

Memory: the policy's logits are computed for the T + 1 positions that predict response tokens only; the log-probs
come from `token_logprobs` (no (b, T, V) fp32 tensor, forward or backward) and the entropy under no_grad in chunks,
and the logits are released before backward. Every forward of the trained module runs under the run's autocast
(`Backend.autocast`) and returns the compute dtype: accelerate's conversion of the outputs to fp32, which would add an
fp32 copy of the logits, is removed when the module is prepared. With a shared base, the policy and the critic each
run forward and backward with their own adapter active (one backward per role).
"""

from __future__ import annotations

import math

import torch

from ..core import (
    aggregate_loss,
    cispo_loss,
    clipped_policy_loss,
    entropy_from_logits,
    estimate_kl,
    loss_denominator,
    masked_mean,
    off_policy_sequence_mask,
    token_logprobs,
    value_loss,
)
from ..core.types import (
    DUAL_CLIP_STATS,
    KL_LOSS_STATS,
    OFF_POLICY_MASK_STATS,
    TOKEN_STATS,
    Rollout,
    UpdateStats,
    row_fields,
)
from ..data.batches import balanced_partition
from ..models import LOGPROB_CHUNK, Packing, Padded, model_input_ids, row_layout, sequence_inputs
from .backend import Backend


def _padded(micro: Rollout) -> Padded:
    """`micro`'s rows laid out padded, as `sequence_inputs` does (the losses read only the response ids)."""
    return Padded(None, model_input_ids(micro.responses, micro.input_mask))


def policy_terms(logits: torch.Tensor, micro: Rollout, args, denominator, rows: Padded | Packing | None = None):
    """(b, T+1 or L, V) policy logits, or (1, R, V) at a packing's response positions -> (policy loss, its stats,
    mean entropy); `rows`: how the forward laid the rows out (default: `micro`'s rows padded). The entropy is taken
    under no_grad in chunks, so nothing but autograd's own reference keeps the logits after this returns. With
    entropy_coef the loss has the entropy bonus −c·H, H aggregated as the policy loss is (loss_agg_mode, veRL's
    rule), and the entropy keeps its graph: each chunk's softmax until backward."""
    rows = _padded(micro) if rows is None else rows
    response_logits = rows.response_logits(logits)  # (b, T, V) or (1, R, V): the positions that predict responses
    mask = micro.response_mask if micro.policy_mask is None else micro.policy_mask  # the policy loss's tokens
    new_logprobs = token_logprobs(response_logits, rows.token_ids, args.temperature, LOGPROB_CHUNK)
    with torch.set_grad_enabled(torch.is_grad_enabled() and bool(args.entropy_coef)):
        token_entropy = entropy_from_logits(response_logits, args.temperature, LOGPROB_CHUNK)
    # (b, T), zeros after the stop token
    new_logprobs, token_entropy = rows.per_response(new_logprobs), rows.per_response(token_entropy)
    entropy = masked_mean(token_entropy.detach(), micro.response_mask, strict=False)
    low = args.cliprange if args.clip_ratio_low is None else args.clip_ratio_low
    high = args.cliprange if args.clip_ratio_high is None else args.clip_ratio_high
    weights, keep = micro.sampler_weights, None
    if micro.policy_mask is not None:  # rows out of the loss: weight 0 (the denominator leaves them out too)
        weights = mask.float() if weights is None else weights * mask
    if micro.entropy_mask is not None:  # top_entropy_quantile: only the forking tokens (the denominator unchanged)
        weights = micro.entropy_mask.float() if weights is None else weights * micro.entropy_mask
    if args.off_policy_mask_threshold is not None:  # against the policy that sampled (π_old when it is the sampler's)
        behaviour = micro.logprobs if micro.sampler_logprobs is None else micro.sampler_logprobs
        keep = off_policy_sequence_mask(micro.advantages, new_logprobs, behaviour, micro.response_mask,
                                        args.off_policy_mask_threshold)
        weights = keep if weights is None else weights * keep
    common = dict(denominator=denominator, weights=weights, loss_agg_mode=args.loss_agg_mode,
                  importance_sampling_level=args.importance_sampling_level)
    if args.loss_type == "cispo":
        pg_loss, pg_stats = cispo_loss(new_logprobs, micro.logprobs, micro.advantages, micro.response_mask, high,
                                       **common)
    else:
        pg_loss, pg_stats = clipped_policy_loss(new_logprobs, micro.logprobs, micro.advantages, micro.response_mask,
                                                low, cliprange_high=high, clip_ratio_c=args.clip_ratio_c, **common)
    if keep is not None:
        pg_stats["off_policy_masked"] = masked_mean(1.0 - keep, micro.response_mask, strict=False)
    if args.entropy_coef:  # the bonus: a higher entropy lowers the loss
        pg_loss = pg_loss - args.entropy_coef * aggregate_loss(token_entropy, mask, args.loss_agg_mode,
                                                               denominator)
    if args.beta:  # KL(π_θ ‖ π_ref) as a loss term (GRPO's), aggregated as the policy loss is
        kl = kl_loss_terms(new_logprobs, micro, args)
        pg_loss = pg_loss + args.beta * aggregate_loss(kl, mask, args.loss_agg_mode, denominator)
        pg_stats["kl_loss"] = masked_mean(kl.detach(), micro.response_mask, strict=False)
    pg_stats["logprobs"] = new_logprobs.detach()
    return pg_loss, pg_stats, entropy


def kl_loss_terms(logprobs: torch.Tensor, micro: Rollout, args) -> torch.Tensor:
    """(b, T) per-token estimates of KL(π_θ ‖ π_ref) (`kl_loss_estimator`) from tokens drawn by π_old; with
    use_bias_correction_kl multiplied by the importance ratio π_θ / π_old (per sequence with
    importance_sampling_level="sequence"), with its gradient, as TRL's GRPO does."""
    kl = estimate_kl(logprobs, micro.ref_logprobs, args.kl_loss_estimator)
    if args.use_bias_correction_kl:
        log_ratio = torch.where(micro.response_mask, logprobs - micro.logprobs, 0)
        if args.importance_sampling_level == "sequence":
            mask = micro.response_mask
            log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(kl)
        kl = kl * torch.exp(log_ratio)
    return kl


def value_terms(values: torch.Tensor, micro: Rollout, args, denominator, rows: Padded | Packing | None = None):
    """(b, L) value-head outputs, or (1, N) over a packing -> (value loss, its stats); `rows` as `policy_terms`'."""
    rows = _padded(micro) if rows is None else rows
    vpred = rows.values(values).float()
    return value_loss(vpred, micro.values, micro.returns, micro.response_mask, args.vf_loss_type,
                      args.cliprange_value, args.vf_huber_delta, denominator, args.loss_agg_mode)


def vf_coef_at(args, step: int) -> float:
    """The value loss's weight at iteration `step`: vf_coef, or linear from vf_coef to vf_coef_end over the run."""
    if args.vf_coef_end is None:
        return args.vf_coef
    progress = step / max(args.num_total_batches - 1, 1)
    return args.vf_coef + (args.vf_coef_end - args.vf_coef) * min(progress, 1.0)


class NonfiniteGuard:
    """Whether an optimizer step is taken: a non-finite loss (on any process) or gradient norm skips it
    (`on_nonfinite="skip"`: counted in `update/skipped_steps`; `max_skipped_steps` in a row stop the run) or stops the
    run (`"error"`), so no step writes NaN/inf into the weights or Adam's moments. Under fp16, a non-finite gradient
    norm with finite losses is the GradScaler's overflow: the scaler skips that step and lowers its scale, as it
    should, and it is not counted."""

    def __init__(self, args, backend: Backend):
        self.args, self.backend = args, backend
        self.in_a_row = 0  # skipped steps in a row, across iterations

    def skip_step(self, nonfinite_losses: torch.Tensor, norms: dict[str, float], rollout: Rollout,
                 stats: UpdateStats, step: int) -> bool:
        """True: skip this step. `nonfinite_losses`: this process's micro-batches with a non-finite loss; `step`: the
        iterations done before this one."""
        bad_losses = float(self.backend.sum_over_processes(nonfinite_losses.float()))  # the same on every process
        bad_norms = [key for key, norm in norms.items() if not math.isfinite(norm)]
        if not bad_losses and (not bad_norms or self.backend.accelerator.scaler is not None):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        stats.skipped_steps += 1
        what = ", ".join(([f"the loss of {bad_losses:.0f} micro-batch(es)"] if bad_losses else [])
                         + [f"{key}={norms[key]}" for key in bad_norms])
        if self.args.on_nonfinite == "error" or self.in_a_row >= self.args.max_skipped_steps:
            raw = rollout.source_scores if rollout.source_scores is not None else rollout.scores
            scores = self.backend.gather(raw.abs().max()[None]).max().item()
            why = ("on_nonfinite='error'" if self.args.on_nonfinite == "error" else
                   f"{self.in_a_row} optimizer steps in a row were skipped (max_skipped_steps="
                   f"{self.args.max_skipped_steps})")
            raise FloatingPointError(
                f"Non-finite update ({what}) at iteration {step + 1}; {why}. Likely causes: learning_rate="
                f"{self.args.learning_rate:g} too high (the weights overflowed), or rewards out of range (this "
                f"rollout's largest |score| is {scores:.4g}: clip or normalize them, reward_clip / reward_norm). No "
                "non-finite step was taken and none is saved.")
        return True


class PPOUpdate:
    """The PPO epochs of one iteration on the backend's trained module. `micro_batch_losses` runs one micro-batch's
    forward passes and backward: one of the wrapper (separate policy and value models) or one per adapter (a shared
    base)."""

    def __init__(self, args, backend: Backend):
        self.args, self.backend = args, backend
        self.micro_batch_losses = self._shared_losses if backend.shared is not None else self._losses
        self.rows = row_layout(args.padding_free)  # padded rows or their real tokens packed (models/packing.py)
        self.guard = NonfiniteGuard(args, backend)
        # balance_batch (None: on with padding_free): the minibatches' rows dealt out again by tokens
        self.balance = backend.num_processes > 1 and args.padding_free and args.balance_batch is not False

    def run(self, rollout: Rollout, critic_only: bool = False, vf_coef: float = 1.0, step: int = 0) -> UpdateStats:
        """critic_only (critic warmup): the policy's gradients are dropped before each optimizer step, so neither its
        weights nor its optimizer state change; only the value model learns."""
        args, accelerator, backend = self.args, self.backend.accelerator, self.backend
        stats = UpdateStats(TOKEN_STATS + (DUAL_CLIP_STATS if args.clip_ratio_c is not None else ())
                            + (OFF_POLICY_MASK_STATS if args.off_policy_mask_threshold is not None else ())
                            + (KL_LOSS_STATS if args.beta else ()))
        B, mini_size = args.local_batch_size, args.local_mini_batch_size
        # accelerate divides each backward by its accumulation steps, DDP averages gradients over processes
        loss_scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
        rows_of = gather_rollout(rollout, backend) if self.balance else rollout  # every process's rows, or its own
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(B, device=rollout.queries.device)
            starts = range(0, B, mini_size)
            denominators = self._denominators(rollout, order, starts)
            if self.balance:  # (processes, B): each process's order, as rows of the gathered rollout
                offsets = B * torch.arange(backend.num_processes, device=backend.device)[:, None]
                orders = backend.gather(order[None]) + offsets
            for k, mini_start in enumerate(starts):
                minibatch = order[mini_start : mini_start + mini_size]
                if self.balance:
                    minibatch = self._balanced_share(rows_of, orders[:, mini_start : mini_start + mini_size])
                nonfinite_losses = torch.zeros((), device=rollout.queries.device)  # this minibatch's, on device
                micro_batches = self._micro_batches(rows_of, minibatch)
                stats.step_tokens.append(rows_of.query_mask[minibatch].sum() + rows_of.input_mask[minibatch].sum())
                for i, rows in enumerate(micro_batches):
                    micro = rows_of[rows]
                    with self._accumulate(last=i == len(micro_batches) - 1):
                        inputs = sequence_inputs(micro.queries, micro.query_mask, micro.responses, micro.input_mask)
                        # padding-free: logits only where they predict the model's tokens (not a tool's)
                        rows = self.rows(inputs, micro.response_mask)
                        pg_stats, vf_stats, entropy = self.micro_batch_losses(
                            rows, micro, critic_only, denominators[k], loss_scale, vf_coef)
                        nonfinite_losses += ~torch.isfinite(pg_stats["loss"] + vf_stats["loss"])
                        if accelerator.sync_gradients:
                            norms = backend.clip_gradients(critic_only)
                            for key, norm in norms.items():
                                stats.add_step(key, norm)
                            skip = self.guard.skip_step(nonfinite_losses, norms, rollout, stats, step)
                            backend.optimizer_step(critic_only, skip=skip)
                    self._record(stats, micro, pg_stats, vf_stats, entropy, epoch == 0 and mini_start == 0)
        return stats

    def _balanced_share(self, rows_of: Rollout, minibatch: torch.Tensor) -> torch.Tensor:
        """This process's rows of a minibatch (`minibatch`: (processes, n) rows of every process, indices into the
        gathered rollout): as many rows as before, dealt out so each process gets about as many real tokens."""
        rows = minibatch.flatten()
        lengths = (rows_of.query_mask[rows].sum(1) + rows_of.input_mask[rows].sum(1)).tolist()
        share = balanced_partition(lengths, self.backend.num_processes)[self.backend.accelerator.process_index]
        return rows[share]

    def _micro_batches(self, rollout: Rollout, minibatch: torch.Tensor) -> list[torch.Tensor]:
        """The rows of each micro-batch: per_device_train_batch_size rows, or consecutive rows up to
        `max_tokens_per_micro_batch` real tokens (as many micro-batches on every process)."""
        args = self.args
        if args.max_tokens_per_micro_batch is None:
            size = args.per_device_train_batch_size
            return [minibatch[start : start + size] for start in range(0, len(minibatch), size)]
        lengths = (rollout.query_mask[minibatch].sum(1) + rollout.input_mask[minibatch].sum(1)).tolist()
        return [minibatch[group] for group in self.backend.token_groups(lengths, args.max_tokens_per_micro_batch)]

    def _accumulate(self, last: bool):
        """accelerate's accumulation over a fixed count of micro-batches, or ours over a token budget's."""
        if self.args.max_tokens_per_micro_batch is None:
            return self.backend.accelerator.accumulate(self.backend.model)
        return self.backend.accumulate(last)

    def _denominators(self, rollout: Rollout, order: torch.Tensor, starts: range) -> torch.Tensor:
        """(minibatches, 2): each minibatch's denominators of the loss aggregation (loss_agg_mode; token-mean: its
        real tokens), summed over processes, of the policy loss (over `policy_mask`, at least 1: a minibatch of
        masked rows adds 0) and of the value loss; token-sum's are 1 for any batch."""
        args, mini_size = self.args, self.args.local_mini_batch_size
        policy_mask = rollout.response_mask if rollout.policy_mask is None else rollout.policy_mask
        denominators = torch.stack([torch.stack([
            loss_denominator(mask[order[s : s + mini_size]], args.loss_agg_mode, args.response_length)
            for mask in (policy_mask, rollout.response_mask)]) for s in starts])
        if args.loss_agg_mode != "token-sum":
            denominators = self.backend.sum_over_processes(denominators)
        return torch.stack([denominators[:, 0].clamp(min=1), denominators[:, 1]], 1)

    def _record(self, stats: UpdateStats, micro: Rollout, pg_stats, vf_stats, entropy, first_minibatch: bool):
        """Before any optimizer step of this iteration (the first minibatch) the ratio must be 1.0; with π_old the
        sampler's, its forward is where the sampler meets the trainer at the same weights."""
        if first_minibatch and self.args.rollout_logprobs == "sampler":
            stats.add_sampler_rows(micro.logprobs, pg_stats["logprobs"], micro.response_mask)
        stats.add(micro.response_mask.sum(), first_minibatch=first_minibatch, **{
            "policy/approxkl_avg": pg_stats["approxkl"], "policy/clipfrac_avg": pg_stats["clipfrac"],
            "loss/policy_avg": pg_stats["loss"], "loss/value_avg": vf_stats["loss"],
            "val/clipfrac_avg": vf_stats["clipfrac"], "policy/entropy_avg": entropy,
            "val/ratio": pg_stats["ratio_mean"], "policy/clipfrac_low_avg": pg_stats["clipfrac_low"],
            "policy/clipfrac_high_avg": pg_stats["clipfrac_high"],
            "policy/clipfrac_dual_avg": pg_stats["clipfrac_dual"],
            "policy/off_policy_masked_frac": pg_stats.get("off_policy_masked"),
            "policy/kl_loss_avg": pg_stats.get("kl_loss")})

    def _losses(self, rows: Padded | Packing, micro: Rollout, critic_only: bool, denominator, loss_scale: float,
                vf_coef: float):
        """Separate policy and value models: one forward of the wrapper, one backward of the summed loss (this
        micro-batch's share of the minibatch's losses). With a `Packing`, the forwards are padding-free."""
        args, model = self.args, self.backend.model
        policy_denominator, value_denominator = (None, None) if denominator is None else denominator
        forward, keep = rows.inputs, rows.keep
        # the critic's frozen trunk output kept by the rollout, laid out as the rows are
        trunk_hidden = None if micro.trunk_hidden is None else rows.pack(micro.trunk_hidden)
        if critic_only and self.backend.plain:
            # warmup on one plain process: the policy's forward (for its stats) without a graph, the critic's alone;
            # its gradients would be dropped before the optimizer step anyway
            with torch.no_grad():
                with self.backend.autocast():
                    logits = model(**forward, logits_to_keep=keep, role="policy")
                pg_loss, pg_stats, entropy = policy_terms(logits, micro, args, policy_denominator, rows)
            del logits
            with self.backend.autocast():
                values = model(**forward, role="value", trunk_hidden=trunk_hidden)
            vf_loss, vf_stats = value_terms(values, micro, args, value_denominator, rows)
            self.backend.backward(vf_coef * vf_loss * loss_scale)
            return pg_stats, vf_stats, entropy
        # the critic runs its trainable top layers only, over its frozen trunk's output kept by the rollout
        with self.backend.autocast():
            logits, values = model(**forward, logits_to_keep=keep, trunk_hidden=trunk_hidden)
        pg_loss, pg_stats, entropy = policy_terms(logits, micro, args, policy_denominator, rows)
        del logits
        vf_loss, vf_stats = value_terms(values, micro, args, value_denominator, rows)
        # in warmup under DDP/DeepSpeed/FSDP the policy term is kept at weight 0 so every parameter still gets a
        # gradient (DDP needs that); those zeros are dropped before the optimizer step
        loss = (0.0 if critic_only else 1.0) * pg_loss + vf_coef * vf_loss
        self.backend.backward(loss * loss_scale)
        return pg_stats, vf_stats, entropy

    def _shared_losses(self, rows: Padded | Packing, micro: Rollout, critic_only: bool, denominator,
                       loss_scale: float, vf_coef: float):
        """Shared base: the policy pass (adapter "policy") and the critic pass (adapter "critic"), each with its
        backward inside its adapter context, since gradient checkpointing recomputes layers with the adapter
        active at backward time. The gradients are the same as one backward of the summed loss (the two losses
        share no trainable parameter). In critic warmup the policy pass runs without grad."""
        args, model, shared = self.args, self.backend.model, self.backend.shared
        policy_denominator, value_denominator = (None, None) if denominator is None else denominator
        forward, keep = rows.inputs, rows.keep
        with shared.adapter("policy"), torch.set_grad_enabled(not critic_only):
            with self.backend.autocast():
                logits = model(**forward, logits_to_keep=keep, role="policy")
            pg_loss, pg_stats, entropy = policy_terms(logits, micro, args, policy_denominator, rows)
            del logits
            if not critic_only:
                self.backend.backward(pg_loss * loss_scale)
        with shared.adapter("critic"):
            with self.backend.autocast():
                values = model(**forward, role="value")
            vf_loss, vf_stats = value_terms(values, micro, args, value_denominator, rows)
            self.backend.backward(vf_coef * vf_loss * loss_scale)
        return pg_stats, vf_stats, entropy


def gather_rollout(rollout: Rollout, backend: Backend) -> Rollout:
    """Every process's rollout rows on every process (balance_batch): process p's B rows at p·B, prompts (and the
    critic's trunk output) left-padded to the longest process's width."""
    def gathered(name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        dtype = tensor.dtype
        tensor = tensor.to(torch.uint8) if dtype == torch.bool else tensor  # gloo gathers no bool
        if name in ("queries", "query_mask", "trunk_hidden"):  # (B, Q, ...): each process pads to its own Q
            # (accelerate's padding adds pad_index to new zeros: a type promotion, undone here)
            tensor = backend.accelerator.pad_across_processes(tensor, dim=1, pad_index=0, pad_first=True)
        return backend.gather(tensor.to(torch.uint8 if dtype == torch.bool else dtype)).to(dtype)

    return Rollout(**{f.name: gathered(f.name, getattr(rollout, f.name)) for f in row_fields(rollout)})
