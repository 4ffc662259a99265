"""Steps 1-7 of a PPO iteration (`RolloutPhase`) and what they collect (`Rollout`, named tensors).

    1. generate       sample from softmax(logits / temperature), nothing else, in the loss's precision
    2. mask           the response mask from the stop position (the stop token is real; nothing after it is)
    3. reference      reference log-probs
    4. π_old, values  behaviour log-probs and values: the same forward pass (module, masks, precision) the loss uses
    5. scores         the rewards' scores of the response cut after its stop token, conditioned (normalised, clipped,
                      the missing-stop penalty)
    6. rewards        −β·KL on every real token, the score on the last real token (`core.shape_rewards`)
    7. advantages     GAE advantages and returns, the advantages whitened over real tokens

Shapes: B = rollouts in the batch, Q = query length (left-padded), T = response length (right-padded).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core import (
    compact,
    compaction,
    compute_gae,
    constant_groups,
    entropy_from_logits,
    expand,
    group_advantages,
    last_true_index,
    length_adaptive_lam,
    masked_whiten,
    place_turn_rewards,
    sampler_correction_weights,
    shape_rewards,
    top_entropy_mask,
)
from ..core.types import Rollout
from ..models import LOGPROB_CHUNK, row_layout, sequence_inputs
from .evaluation import dataset_columns
from .seeds import extra_draw_seed


def check_left_padded(query_mask: torch.Tensor) -> None:
    """Prompts must be left-padded: in each row, once a real token appears, every later one is real."""
    if (query_mask[:, 1:].long() < query_mask[:, :-1].long()).any():
        raise ValueError(
            "The prompts are right-padded (a padding position follows a real token). PPO generates after the last "
            "prompt position, so prompts must be left-padded: set `tokenizer.padding_side = 'left'` (or make your "
            "data_collator pad on the left)."
        )


@dataclass
class _Batch:
    """Steps 1-2 and the rewards' raw scores (step 5): the rows a rollout is made of."""
    queries: torch.Tensor
    query_mask: torch.Tensor
    extra_columns: dict
    responses: torch.Tensor
    input_mask: torch.Tensor  # (B, T) the response positions the models read (`Rollout.input_mask`)
    sampler_logprobs: torch.Tensor
    scores: torch.Tensor | None = None  # (B,) the combined score
    source_scores: torch.Tensor | None = None  # (B, S) each source's
    # multi-turn rollouts: input_mask is every real token of the conversation, model_mask the model's
    model_mask: torch.Tensor | None = None  # (B, T) bool
    turn_rewards: torch.Tensor | None = None  # (B, T) the environment's per-turn rewards, on their turns' last tokens
    messages: list | None = None  # TRL's conversational completions: one message list per row
    environments: list | None = None  # the rows' environments (reward functions get them)

    @property
    def response_mask(self) -> torch.Tensor:
        """The tokens PPO trains on, the model's (`Rollout.response_mask`)."""
        return self.input_mask if self.model_mask is None else self.input_mask & self.model_mask

    def select(self, rows: list[int]) -> _Batch:
        pick = torch.tensor(rows, dtype=torch.long, device=self.queries.device)
        columns = {k: v[pick.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in rows]
                   for k, v in self.extra_columns.items()}  # (lists, or tensors from a collator of the user's)
        def picked(x):
            return None if x is None else x[pick] if isinstance(x, torch.Tensor) else [x[i] for i in rows]

        return _Batch(self.queries[pick], self.query_mask[pick], columns,
                      self.responses[pick], self.input_mask[pick], self.sampler_logprobs[pick],
                      self.scores[pick], self.source_scores[pick], picked(self.model_mask),
                      picked(self.turn_rewards), picked(self.messages), picked(self.environments))

    @staticmethod
    def cat(parts: list[_Batch], pad_token_id: int) -> _Batch:
        """Rows of several draws in one batch: prompts left-padded, responses right-padded to the widest."""
        def padded(tensors, value, left):
            width = max(t.shape[1] for t in tensors)
            pads = [(width - t.shape[1], 0) if left else (0, width - t.shape[1]) for t in tensors]
            return torch.cat([torch.nn.functional.pad(t, pad, value=value) for t, pad in zip(tensors, pads)])

        return _Batch(padded([p.queries for p in parts], pad_token_id, True),
                      padded([p.query_mask for p in parts], False, True),
                      {k: torch.cat([p.extra_columns[k] for p in parts])
                       if isinstance(parts[0].extra_columns[k], torch.Tensor)
                       else [x for p in parts for x in p.extra_columns[k]] for k in parts[0].extra_columns},
                      padded([p.responses for p in parts], pad_token_id, False),
                      padded([p.input_mask for p in parts], False, False),
                      padded([p.sampler_logprobs for p in parts], 0.0, False),
                      torch.cat([p.scores for p in parts]), torch.cat([p.source_scores for p in parts]),
                      *((padded([p.model_mask for p in parts], False, False),
                         padded([p.turn_rewards for p in parts], 0.0, False),
                         [m for p in parts for m in p.messages],
                         None if parts[0].environments is None else [e for p in parts for e in p.environments])
                        if parts[0].model_mask is not None else ()))


@dataclass
class _Scored:
    """Steps 3-4 over every chunk of the batch."""
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    trunk_hidden: torch.Tensor | None
    entropy: torch.Tensor | None = None  # (B, T) π_old's entropy at each response position (top_entropy_quantile)


class MorePrompts:
    """Dynamic sampling's further draws of prompts: `draw(step, draw)` -> (queries, query_mask, extra_columns) of
    this process's share of a batch drawn by (seed, step, draw) alone (`PromptBatches.extra`), on `device`."""

    def __init__(self, prompt_batches, dataset, collator, seed: int, device):
        self.prompt_batches, self.dataset, self.collator = prompt_batches, dataset, collator
        self.seed, self.device = seed, device

    def draw(self, step: int, draw: int):
        indices = self.prompt_batches.extra(extra_draw_seed(self.seed, step, draw))
        batch = self.collator([self.dataset[i] for i in indices])
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device), dataset_columns(batch)


def prompt_tensors(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A collated prompt batch -> its (B, Q) ids and mask on `device` and its other dataset columns."""
    if "attention_mask" not in batch:
        raise ValueError("The data collator must return `attention_mask` with `input_ids` (PPO needs the "
                         "real prompt mask; pad ids are not used to guess it).")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device), dataset_columns(batch)


class SyncRollouts:
    """The rollout source of synchronous PPO (single-turn, tools, environments and rollout_func alike): iteration
    k's prompt batch is drawn and made into its Rollout on the trainer's thread when the iteration asks for it. The
    trainer opens one per train() (`builders.rollout_source` picks it or `AsyncRollouts`, which answers the same
    calls: start, next, publish, state, close)."""

    def __init__(self, phase: RolloutPhase, batches, device: torch.device):
        self.phase, self.batches, self.device = phase, batches, device

    def start(self, policy) -> None:
        """Nothing runs beside the trainer."""

    def next(self, step: int, kl_coef: float, trainer_state=None) -> Rollout:
        """Iteration `step`'s Rollout, rewards shaped with β = `kl_coef`."""
        queries, query_mask, columns = prompt_tensors(next(self.batches), self.device)
        return self.phase.run(queries, query_mask, columns, kl_coef=kl_coef, step=step, trainer_state=trainer_state)

    def publish(self, policy, version: int) -> None:
        """Each draw reads the policy as it is."""

    def state(self, step: int) -> None:
        """Nothing is drawn ahead: a checkpoint saves nothing of the source."""
        return None

    def close(self) -> None:
        """Nothing to stop."""


class RolloutPhase:
    """Steps 1-7 on a batch of left-padded prompts. Holds what they use: the config, the backend (the trained module
    and the processes), the sampler, the reference, the rewards and their normaliser, and the phase hooks.

    `trunk_from_reference`: the reference's layer whose output is the critic's frozen trunk output (a critic built
    from the policy's checkpoint), captured on the reference pass so the trunk never runs; None: the trunk runs."""

    def __init__(self, args, backend, sampler, reference, reward_scorer, reward_normalizer, stop_token_id,
                 phases, trunk_from_reference=None, more_prompts=None, multi_turn=None):
        self.args, self.backend, self.sampler, self.reference = args, backend, sampler, reference
        self.reward_scorer, self.reward_normalizer = reward_scorer, reward_normalizer
        self.stop_token_id, self.phases, self.trunk_from_reference = stop_token_id, phases, trunk_from_reference
        self.more_prompts = more_prompts  # dynamic_sampling's further prompts (`MorePrompts`)
        self.multi_turn = multi_turn  # a MultiTurn: conversations with tools and environments (multi_turn.py)
        self.rows = row_layout(args.padding_free)  # padded rows or their real tokens packed (models/packing.py)

    @torch.no_grad()
    def run(self, queries: torch.Tensor, query_mask: torch.Tensor, extra_columns: dict | None, kl_coef: float,
                 step: int, trainer_state=None, drawn: tuple | None = None) -> Rollout:
        """(B, Q) ids and (B, Q) mask of iteration `step`'s prompts -> their Rollout, rewards shaped with β =
        `kl_coef`. extra_columns: other dataset columns of these prompts (lists), passed to reward functions.
        `drawn`: steps 1-2 done already (async_rollouts: responses, response mask, sampler log-probs of an earlier
        policy version); steps 3-7 then run at the current one. With dynamic_sampling, groups whose completions all
        score the same are replaced by groups of further draws (`_fill`, `MorePrompts`)."""
        query_mask = query_mask.bool()
        check_left_padded(query_mask)
        extra_columns = extra_columns or {}
        self._turn_sums = {}  # multi-turn: this rollout's turns, tool calls... summed over its draws
        draw_metrics = {}  # dynamic sampling's, multi-turn's: the Rollout carries them (`Rollout.draw_metrics`)
        with self.backend.whole_weights():
            if drawn is not None:
                batch = _Batch(queries, query_mask, extra_columns, *drawn)
            else:
                batch = self._draw(queries, query_mask, extra_columns, step)  # 1-2
            batch.scores, batch.source_scores = self._rewards(batch, trainer_state)  # 5
            if self.args.dynamic_sampling:
                batch, draw_metrics = self._fill(batch, step, trainer_state)
            if self._turn_sums:
                draw_metrics.update(self._turn_metrics())
            scored = self._score(batch)  # 3-4
        scores = self._condition(batch.scores, batch.responses, batch.response_mask)  # 5
        return self._advantages(batch, scored, scores, kl_coef, draw_metrics)  # 6-7

    def _draw(self, queries, query_mask, extra_columns, step: int, draw: int = 0) -> _Batch:
        """Steps 1-2: the policy's responses to the prompts, drawn by (process, step, draw); with tools or
        environments, conversations (`multi_turn`)."""
        with self.phases("generation"):
            if self.multi_turn is None:
                drawn = self.sampler.rollout_responses(queries, query_mask, step, draw)
                return _Batch(queries, query_mask.bool(), extra_columns, *drawn)
            talk = self.multi_turn.run(queries, query_mask.bool(), extra_columns,
                                       self.sampler.turn_generator(step, draw), self.backend.any_process())
        for key, value in talk.metrics.items():
            self._turn_sums[key] = self._turn_sums.get(key, 0.0) + value
        return _Batch(talk.queries, talk.query_mask, extra_columns, talk.responses, talk.context_mask,
                      talk.sampler_logprobs, model_mask=talk.model_mask,
                      turn_rewards=place_turn_rewards(talk.turn_rewards, talk.model_mask),
                      messages=talk.messages, environments=talk.environments)

    @contextmanager
    def _reference_trunk(self):
        """Inside: the critic's trunk output as the reference pass computes it ([] unless `trunk_from_reference`)."""
        if self.trunk_from_reference is None:
            yield []
        else:
            with self.backend.unwrap().trunk.capture(self.trunk_from_reference) as captured:
                yield captured

    def _chunks(self, query_mask, input_mask) -> list[slice]:
        """The rows of each scoring chunk: `local_rollout_forward_batch_size` rows, or consecutive rows up to
        `max_tokens_per_micro_batch` real tokens (as many chunks on every process: their forwards meet under ZeRO-3
        and FSDP)."""
        args, B = self.args, query_mask.shape[0]
        if args.max_tokens_per_micro_batch is None:
            step = args.local_rollout_forward_batch_size
            return [slice(start, start + step) for start in range(0, B, step)]
        lengths = (query_mask.sum(1) + input_mask.sum(1)).tolist()
        return [slice(g[0], g[-1] + 1) for g in self.backend.token_groups(lengths, args.max_tokens_per_micro_batch)]

    def _rewards(self, batch: _Batch, trainer_state) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 5 before conditioning, in the scoring chunks: the (B,) combined score of the response cut after its
        stop token and the (B, S) score of each source."""
        scores, per_source = [], []
        with self.phases("reward"), self.backend.accelerator.autocast():
            for s in self._chunks(batch.query_mask, batch.input_mask):
                extra = {k: v[s] for k, v in batch.extra_columns.items()}
                if batch.environments is not None:  # TRL's: reward functions may read the episodes' environments
                    extra["environments"] = batch.environments[s]
                combined, sources = self.reward_scorer(batch.queries[s], batch.query_mask[s], batch.responses[s],
                                                       batch.input_mask[s], extra, trainer_state=trainer_state,
                                                       conversations=None if batch.messages is None
                                                       else batch.messages[s])
                scores.append(combined)
                per_source.append(torch.stack(list(sources.values()), 1))
        device = batch.queries.device
        return torch.cat(scores).to(device), torch.cat(per_source).to(device)

    def _fill(self, batch: _Batch, step: int, trainer_state) -> tuple[_Batch, dict[str, float]]:
        """Dynamic sampling (DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476, §3.2): groups whose completions
        all got the same score are dropped and further draws of prompts (`more_prompts`) generated and scored, until
        the batch's groups all differ or `max_num_gen_batches` draws are made; then constant groups of the first draw
        fill what is left. Every process makes as many draws (their forwards meet under ZeRO-3, FSDP and vLLM)."""
        G, B = self.args.num_generations, len(batch.queries)
        parts, kept, constants = [batch], [], []  # kept: rows (into the concatenated draws) of the groups that differ
        for draw in range(self.args.max_num_gen_batches):
            if draw:
                queries, query_mask, extra = self.more_prompts.draw(step, draw)
                part = self._draw(queries, query_mask, extra, step, draw)
                part.scores, part.source_scores = self._rewards(part, trainer_state)
                parts.append(part)
            offset = B * draw
            constants.append(constant_groups(parts[-1].scores, G))  # (B / G,) this draw's constant groups
            for g in (~constants[-1]).nonzero().flatten().tolist():
                kept.extend(range(offset + g * G, offset + (g + 1) * G))
            short = torch.tensor(float(len(kept) < B), device=batch.queries.device)
            if not self.backend.sum_over_processes(short).item():  # every process's batch is full
                break
        draws = len(parts)
        constant = [r for g in constants[0].nonzero().flatten().tolist() for r in range(g * G, (g + 1) * G)]
        rows = (kept + constant)[:B]
        dropped = sum(int(c.sum()) for c in constants)  # this process's constant groups
        dropped = self.backend.sum_over_processes(torch.tensor(float(dropped), device=batch.queries.device)).item()
        drawn = B * draws * self.backend.num_processes
        metrics = {"rollout/dynamic_draws": float(draws), "rollout/completions_drawn": float(drawn),
                   "rollout/dynamic_dropped_frac": dropped * G / drawn}
        return _Batch.cat(parts, self.sampler.pad_token_id).select(rows), metrics

    def _score(self, batch: _Batch) -> _Scored:
        """Steps 3-4 in chunks of rows (`_chunks`); padding-free, each chunk's real tokens run as one sequence."""
        args, accelerator, model = self.args, self.backend.accelerator, self.backend.model
        queries, query_mask, responses, input_mask = (batch.queries, batch.query_mask, batch.responses,
                                                      batch.input_mask)
        policy = self.backend.unwrap().policy
        trunk = getattr(self.backend.unwrap(), "trunk", None)  # the critic's frozen trunk, its output kept
        parts = {name: [] for name in ("logprobs", "ref_logprobs", "values", "trunk", "entropy")}
        entropy = args.top_entropy_quantile < 1  # π_old's entropy from the same logits
        for s in self._chunks(query_mask, input_mask):
            inputs = sequence_inputs(queries[s], query_mask[s], responses[s], input_mask[s])
            # padding-free: logits only where they predict a token PPO trains on (not a tool's)
            rows = self.rows(inputs, batch.response_mask[s])
            # 3. a reference holding the critic's frozen trunk computes its output on the way (trunk_from_reference)
            with self.phases("reference"), accelerator.autocast(), self._reference_trunk() as captured:
                parts["ref_logprobs"].append(self.reference.logprobs(policy, rows))
            # 4. only the positions that predict response tokens get logits; log-probs in chunks; the logits freed
            # at once. rollout_logprobs="sampler": π_old is the sampler's own log-probs, the values computed alone.
            with self.phases("policy_and_value"), accelerator.autocast():
                kept = {}
                if trunk is not None:
                    if not captured:
                        captured.append(trunk.hidden_states(rows.inputs))
                    kept = {"trunk_hidden": captured[0]}
                    parts["trunk"].append(rows.unpack(captured[0]))
                if args.rollout_logprobs == "sampler":
                    value = model(**rows.inputs, role="value", **kept)
                    parts["logprobs"].append(batch.sampler_logprobs[s].to(value.device) * input_mask[s])
                else:
                    logits, value = model(**rows.inputs, logits_to_keep=rows.keep, **kept)  # (B, T+1, V) / (1, R, V)
                    parts["logprobs"].append(rows.logprobs(logits, args.temperature))
                    if entropy:
                        parts["entropy"].append(rows.per_response(entropy_from_logits(
                            rows.response_logits(logits), args.temperature, LOGPROB_CHUNK)).float())
                    del logits
                parts["values"].append(rows.values(value).float())
        logprobs = torch.cat(parts["logprobs"])
        ref_logprobs = torch.cat(parts["ref_logprobs"])
        if batch.model_mask is not None:  # the tools' tokens are not the policy's: nothing of them is kept
            logprobs, ref_logprobs = logprobs * batch.model_mask, ref_logprobs * batch.model_mask
        return _Scored(logprobs=logprobs, ref_logprobs=ref_logprobs,
                       values=torch.cat(parts["values"]) * batch.response_mask,
                       trunk_hidden=torch.cat(parts["trunk"]) if trunk is not None else None,
                       entropy=torch.cat(parts["entropy"]) if entropy else None)

    def _condition(self, scores, responses, response_mask) -> torch.Tensor:
        """Score conditioning: normalise (running statistics over all processes) and clip, then the stop penalty."""
        args = self.args
        if args.reward_norm == "running":
            self.reward_normalizer.update(self.backend.gather(scores))
        scores = self.reward_normalizer.normalize(scores)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~self._stopped(responses, response_mask)).float()
        return scores

    def _stopped(self, responses, response_mask) -> torch.Tensor:
        """(B,) bool: the response (the conversation's last model turn) ends with the stop token."""
        last = responses.gather(1, last_true_index(response_mask)[:, None])[:, 0]
        return last == self.stop_token_id

    def _turn_metrics(self) -> dict[str, float]:
        """Multi-turn rollouts, over every process: model turns per episode, tool calls per episode and the
        fraction that failed (TRL's tools/ keys), episodes ended by a length cap, the tools' and environment's
        tokens per episode and the environment's per-turn rewards per episode."""
        keys = ("turns", "tool_calls", "tool_failures", "truncated", "env_tokens", "turn_reward", "episodes")
        totals = self.backend.sum_over_processes(torch.tensor([float(self._turn_sums[k]) for k in keys],
                                                              device=self.backend.device)).tolist()
        t = dict(zip(keys, totals))
        return {"multi_turn/turns_mean": t["turns"] / t["episodes"],
                "tools/call_frequency": t["tool_calls"] / t["episodes"],
                "tools/failure_frequency": t["tool_failures"] / max(t["tool_calls"], 1.0),
                "multi_turn/truncated_frac": t["truncated"] / t["episodes"],
                "multi_turn/env_tokens_mean": t["env_tokens"] / t["episodes"],
                "multi_turn/turn_reward_mean": t["turn_reward"] / t["episodes"]}

    def _advantages(self, batch: _Batch, scored: _Scored, scores, kl_coef, draw_metrics: dict) -> Rollout:
        """Steps 6-7, the group advantage mixed in, and the sampler correction's weights. In a multi-turn rollout the
        recursions run over the model's tokens only (core.turns: compacted to the front of each row and put back),
        so the score lands on the conversation's last model token, each environment reward on its turn's last
        token, and the GAE's discount skips the tools' tokens."""
        args, logprobs, mask = self.args, scored.logprobs, batch.response_mask
        if batch.model_mask is None:
            along, back, cmask = (lambda x: x), (lambda x: x), mask
        else:
            index, cmask = compaction(mask)
            along, back = (lambda x: compact(x, index)), (lambda x: expand(x, index, cmask))
        # 6. rewards: −β·KL on every real token, the score on the last real token (see core.shape_rewards)
        rewards, kl = shape_rewards(scores, along(logprobs), along(scored.ref_logprobs), cmask, kl_coef,
                                    args.kl_estimator)
        if batch.turn_rewards is not None:  # the environment's per-turn rewards, as given
            rewards = rewards + along(batch.turn_rewards.to(rewards))
        # whitening statistics over the real tokens of all processes: N processes act as one with the whole batch
        over_processes = self.backend.sum_over_processes if self.backend.num_processes > 1 else None
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, cmask, shift_mean=False, all_reduce_sum=over_processes) * cmask
        # 7. advantages and returns (GAE); the policy's λ and the value targets' λ may differ (lam_policy,
        # lam_value, length_adaptive_alpha: docs/ppo-variants.md)
        lam_policy = args.lam if args.lam_policy is None else args.lam_policy
        if args.length_adaptive_alpha is not None:
            lam_policy = length_adaptive_lam(cmask, args.length_adaptive_alpha)
        lam_value = args.lam if args.lam_value is None else args.lam_value
        values = along(scored.values)
        advantages, returns = compute_gae(rewards, values, cmask, args.gamma, lam_policy)
        if isinstance(lam_policy, torch.Tensor) or lam_value != lam_policy:
            returns = compute_gae(rewards, values, cmask, args.gamma, lam_value)[1]
        advantages = masked_whiten(advantages, cmask, all_reduce_sum=over_processes) * cmask
        if args.group_advantage_weight:  # the group baseline mixed in: GRPO's advantage on every token
            w = args.group_advantage_weight
            group = group_advantages(scores, args.num_generations, args.scale_rewards,
                                     args.multi_objective_aggregation, batch.source_scores,
                                     torch.tensor(self.reward_scorer.weights), self.backend.gather)
            advantages = ((1 - w) * advantages + w * group[:, None].to(advantages)) * cmask
        rewards, kl, advantages, returns = back(rewards), back(kl), back(advantages), back(returns)
        entropy_mask = None
        if scored.entropy is not None:  # the threshold over every process's real tokens
            padded = self.backend.accelerator.pad_across_processes(
                torch.where(mask, scored.entropy, -1.0), dim=1, pad_index=-1.0)
            population = self.backend.gather(padded)
            entropy_mask = top_entropy_mask(scored.entropy, mask, args.top_entropy_quantile,
                                            population[population >= 0])
        policy_mask = None
        if args.mask_truncated_completions:  # only completions that stopped train the policy (TRL's GRPO)
            policy_mask = mask & self._stopped(batch.responses, mask)[:, None]
        if args.num_generations > 1:
            zero_std = constant_groups(batch.scores, args.num_generations).float()
            draw_metrics["rollout/frac_reward_zero_std"] = self.backend.gather(zero_std).mean().item()
        # the sampler against the trainer: here over every token, or (π_old the sampler's) in the update, where the
        # first minibatch's forward is the trainer's at the rollout's weights (UpdateStats.sampler_rows)
        sampler_logprobs = (None if args.rollout_logprobs == "sampler"
                            else batch.sampler_logprobs.to(logprobs.device) * mask)
        sampler_weights = None
        if args.vllm_importance_sampling_correction:  # π_old / π_sampler, truncated or masked (core.losses)
            sampler_weights = sampler_correction_weights(
                logprobs, sampler_logprobs, mask, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
        multi_turn = batch.model_mask is not None
        return Rollout(queries=batch.queries, query_mask=batch.query_mask, responses=batch.responses,
                       response_mask=mask, logprobs=logprobs, ref_logprobs=scored.ref_logprobs,
                       values=scored.values, scores=scores, kl=kl, rewards=rewards, advantages=advantages,
                       returns=returns, source_scores=batch.source_scores, sampler_logprobs=sampler_logprobs,
                       sampler_weights=sampler_weights,
                       advantage_lam=lam_policy if isinstance(lam_policy, torch.Tensor) else None,
                       trunk_hidden=scored.trunk_hidden, policy_mask=policy_mask, entropy_mask=entropy_mask,
                       context_mask=batch.input_mask if multi_turn else None,
                       turn_rewards=batch.turn_rewards if multi_turn else None, draw_metrics=draw_metrics)
