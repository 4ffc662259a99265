"""Held-out evaluation and samples: the policy against the reference on `eval_dataset`, with paired random numbers.

- `evaluate`: eval/score, eval/score_ref, eval/win_rate_vs_ref, eval/kl (and eval/gold_* with `eval_reward`).
- `paired_completions`: one completion of the reference and one of the policy per prompt of any prompt dataset.
- `print_completions`: a few `eval_dataset` completions with their scores, printed.

Every draw comes from an RNG stream of its own (`ResponseSampler.stream_responses`), so evaluating never changes
the training run, and identical models give identical completions.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from ..data.prompts import LeftPaddingCollator, prepare_prompts
from ..models import Padded, sequence_inputs
from ..monitoring.diagnostics import evaluation_metrics
from .seeds import eval_seed


def dataset_columns(batch: dict) -> dict:
    """The dataset columns of a collated batch other than the prompt tensors: {column: list}, for the rewards."""
    return {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}


class Evaluator:
    """Holds what evaluation uses: the config, the backend, the sampler, the reference, the training reward and the
    optional gold scorer (`eval_reward`, never trained on), the tokenizer and this process's share of eval_dataset."""

    def __init__(self, args, backend, sampler, reference, reward_scorer, eval_scorer, tokenizer, eval_dataloader):
        self.args, self.backend, self.sampler, self.reference = args, backend, sampler, reference
        self.reward_scorer, self.eval_scorer, self.tokenizer = reward_scorer, eval_scorer, tokenizer
        self.dataloader = eval_dataloader

    def _batches(self):
        """(index, batch) of this process's share of `eval_dataset`, the prompt tensors on the training device."""
        device = self.backend.device
        for i, batch in enumerate(self.dataloader):
            yield i, {**batch, "input_ids": batch["input_ids"].to(device),
                      "attention_mask": batch["attention_mask"].to(device).bool()}

    def _seed(self, step: int, batch_index: int) -> int:
        return eval_seed(self.args.seed, self.backend.accelerator.process_index, step, batch_index)

    @torch.no_grad()
    def evaluate(self, step: int, trainer_state=None) -> dict[str, float]:
        """Completions of the policy and of the reference for each prompt, scored by the training reward and, if
        given, by `eval_reward`. eval/kl: mean per-sequence KL(π‖π_ref) (k1) of the policy's completions."""
        accelerator, device = self.backend.accelerator, self.backend.device
        rows = []
        with self.backend.whole_weights():
            for i, batch in self._batches():
                queries, query_mask = batch["input_ids"], batch["attention_mask"]
                seed = self._seed(step, i)
                responses, response_mask = self.sampler.stream_responses(queries, query_mask, seed, False, step)
                ref_responses, ref_mask = self.sampler.stream_responses(queries, query_mask, seed, True, step)
                inputs = sequence_inputs(queries, query_mask, responses, response_mask)
                policy = self.backend.unwrap().policy
                with accelerator.autocast():
                    padded = Padded.of(inputs, response_mask)
                    logprobs = padded.model_logprobs(policy, self.args.temperature)
                    ref_logprobs = self.reference.logprobs(policy, padded)
                    columns = [((logprobs - ref_logprobs) * response_mask).sum(1)]
                    extra = dataset_columns(batch)
                    for scorer in filter(None, (self.reward_scorer, self.eval_scorer)):
                        columns.append(scorer(queries, query_mask, responses, response_mask, extra, trainer_state)[0])
                        columns.append(scorer(queries, query_mask, ref_responses, ref_mask, extra, trainer_state)[0])
                rows.append(torch.stack([c.float().to(device) for c in columns], 1))
        # (prompts, 3 or 5); gather_object, as the processes' shares of the prompts may differ by one
        table = torch.tensor(gather_object(torch.cat(rows).tolist()), dtype=torch.float32)
        return evaluation_metrics(table)

    @torch.no_grad()
    def paired_completions(self, dataset, seed: int, batch_size: int, step: int) -> list[dict]:
        """For each prompt of `dataset`, one completion of the reference and one of the policy, drawn with the same
        random numbers (`seed`), on this process, in dataset order: {"query", "reference", "policy"}."""
        tok, args = self.tokenizer, self.args
        prepared = prepare_prompts(dataset, tok, args.max_prompt_length, args.prompt_truncation).dataset
        loader = DataLoader(prepared, batch_size=batch_size, collate_fn=LeftPaddingCollator(tok))
        device, records = self.backend.device, []
        with self.backend.whole_weights():
            for b, batch in enumerate(loader):
                queries, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
                texts = {}
                for name in ("reference", "policy"):
                    responses, mask = self.sampler.stream_responses(queries, query_mask, seed + b,
                                                                    name == "reference", step)
                    texts[name] = [tok.decode(r[m], skip_special_tokens=True) for r, m in zip(responses, mask)]
                records += [{"query": tok.decode(q[m], skip_special_tokens=True), "reference": ref, "policy": pol}
                            for q, m, ref, pol in zip(queries, query_mask, texts["reference"], texts["policy"])]
        return records

    @torch.no_grad()
    def print_completions(self, step: int, trainer_state=None, first_batch_only: bool = False) -> None:
        """Print a few completions of `eval_dataset` prompts with their scores (main process)."""
        tok, rows = self.tokenizer, []
        with self.backend.whole_weights():
            for i, batch in self._batches():
                queries, query_mask = batch["input_ids"], batch["attention_mask"]
                with self.backend.generation_model(self.args.ds3_gather_for_generation) as model, \
                        self.sampler.own_rng(self._seed(step, i)):
                    responses, response_mask, _ = self.sampler.generate(model.policy, queries, query_mask)
                with self.backend.accelerator.autocast():
                    scores = self.reward_scorer(queries, query_mask, responses, response_mask, dataset_columns(batch),
                                                trainer_state)[0]
                for q, qm, r, rm, s in zip(queries, query_mask, responses, response_mask, scores):
                    rows.append((tok.decode(q[qm], skip_special_tokens=True), tok.decode(r[rm]), float(s)))
                if first_batch_only:
                    break
        if self.backend.accelerator.is_main_process:
            for query, response, score in rows[:5]:
                print(f"[sample] score={score:+.3f} | {query!r} -> {response!r}")
