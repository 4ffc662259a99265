"""Reward functions (`FunctionReward`): how trl_ext calls one, read from its signature, what it must return, and
async functions awaited together.

- TRL's convention (GRPOTrainer's): the first parameter is `completions` or `completion_ids`, or the function takes
  keywords only; everything goes by keyword.
- trl_ext's `(prompts, completions, **columns)`: any other function with two positional parameters.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from .batch import RewardBatch

RewardFunction = Callable[..., list[float]]
TRL_FIRST_PARAMETERS = ("completions", "completion_ids")  # how TRL's reward functions start (trl.rewards, GRPO docs)


def is_reward_function(reward) -> bool:
    """A plain callable, not a torch module."""
    return callable(reward) and not isinstance(reward, nn.Module)


def check_reward_function_output(values, n: int, name: str = "reward function",
                                 allow_none: bool = False) -> torch.Tensor:
    """Validate what a reward function returned: a list of n finite numbers -> (n,) float32 tensor. allow_none: a
    None means "not applicable to this completion" (TRL's convention) and becomes NaN."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    if isinstance(values, (str, bytes, Mapping)):
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.")
    try:
        values = list(values)
    except TypeError as e:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.") from e
    if allow_none:
        none = {i for i, v in enumerate(values) if v is None}
        values = [math.nan if v is None else v for v in values]
    bad_type = [(i, v) for i, v in enumerate(values)
                if isinstance(v, (str, bytes)) or v is None
                or not isinstance(v, (numbers.Real, torch.Tensor)) and not hasattr(v, "__float__")]
    if bad_type:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got non-numbers "
                         f"{bad_type[:5]} (index, value).")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.") from e
    if len(values) != n:
        raise ValueError(f"The {name} returned {len(values)} scores for {n} completions; return exactly one score "
                         "per completion, in order.")
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v) and not (allow_none and i in none)]
    if bad:
        raise ValueError(f"The {name} returned non-finite scores {bad[:5]} (index, value); return finite floats "
                         "(e.g. clip or replace NaN/inf before returning).")
    return torch.tensor(values, dtype=torch.float32)

class GRPORewardFunction:
    """A reward function given as GRPOTrainer's `reward_funcs`: called as GRPOTrainer calls it, every argument by
    keyword (conversational prompts give conversational completions) whatever its first parameters are named; a
    function given as `reward_model` with (prompts, completions) first gets them as text (`FunctionReward`)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", None) or type(fn).__name__
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


class FunctionReward:
    """A reward function, called with its convention: `score(batch)` returns its scores (a coroutine if async)."""

    kind = "function"

    def __init__(self, fn, name: str):
        self.obj, self.name, self.tokenizer = fn, name, None
        # how it is called ("positional": trl_ext's (prompts, completions, **columns) with text; "keyword": TRL's
        # GRPO convention) and which keyword arguments it takes
        self.convention = "positional"
        self.is_async = False
        self.accepts_var_kwargs = False
        self.keyword_params: set[str] = set()
        self.required_keywords: set[str] = set()
        self.positional_names: tuple[str, ...] = ()
        self._inspect()

    def _inspect(self) -> None:
        """Read a reward function's signature and choose how to call it.

        - TRL's convention (GRPOTrainer's): a function given as `reward_funcs` (`GRPORewardFunction`), or one whose
          first parameter is `completions` or `completion_ids`, or that takes keywords only. Everything goes by
          keyword: prompts, completions, completion_ids, trainer_state and the dataset's columns; only those it
          names, or all of them with **kwargs. Conversational prompts give conversational completions
          ([{"role": "assistant", "content": ...}]).
        - trl_ext's (prompts, completions, **columns): any other function with two positional parameters. prompts and
          completions go positionally, as text; the other arguments by keyword, as above.
        """
        grpo = isinstance(self.obj, GRPORewardFunction)
        fn = self.obj.fn if grpo else self.obj
        call = type(fn).__call__ if callable(fn) else None  # an object with an async __call__
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: prompts and completions only
            return
        params = list(sig.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if grpo or not positional or positional[0].name in TRL_FIRST_PARAMETERS:
            self.convention = "keyword"
            if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params):
                raise TypeError(f"reward function {self.name!r} follows TRL's convention (first parameter "
                                f"{positional[0].name if positional else None!r}) but takes positional-only arguments; "
                                f"TRL calls reward functions by keyword. Its signature is {sig}.")
        else:
            try:
                sig.bind_partial(None, None)
            except TypeError as e:
                raise TypeError(f"reward function {self.name!r} must take (prompts, completions, ...) as its first two "
                                f"positional arguments, or follow TRL's convention (keyword arguments, starting with "
                                f"`completions`); its signature is {sig}.") from e
            self.positional_names = tuple(p.name for p in positional[:2])
        bound_positionally = set(self.positional_names)
        for p in params:
            if p.kind == p.VAR_KEYWORD:
                self.accepts_var_kwargs = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in bound_positionally:
                self.keyword_params.add(p.name)
                if p.default is p.empty:
                    self.required_keywords.add(p.name)

    def score(self, batch: RewardBatch):
        """Call the function with its convention (see `_inspect`); returns what it returned (a coroutine for an
        async function)."""
        prompts, completions = batch.texts()
        completion_ids = [list(ids) for ids in batch.token_ids()[1]]  # the function's own copy
        columns = dict(batch.extra_columns)
        offered = {"completion_ids": completion_ids, "trainer_state": batch.trainer_state}
        if self.convention == "keyword":  # TRL's: the dataset's own prompts, conversational completions for them
            original = columns.pop("prompt", None)
            if original is not None:
                prompts = list(original)
                if _is_conversation(prompts[0]):
                    completions = ([[{"role": "assistant", "content": c}] for c in completions]
                                   if batch.conversations is None else [list(m) for m in batch.conversations])
            offered.update(prompts=list(prompts), completions=list(completions))
        clash = sorted(set(columns) & (set(offered) | {"prompts", "completions"}))
        if clash:
            raise ValueError(f"dataset columns {clash} have the names of reward function arguments (prompts, "
                             "completions, completion_ids, trainer_state); rename the columns.")
        offered.update(columns)
        if self.accepts_var_kwargs:
            kwargs = offered
        else:
            kwargs = {k: v for k, v in offered.items() if k in self.keyword_params}
        missing = sorted(self.required_keywords - set(kwargs))
        if missing:
            raise ValueError(f"reward function {self.name!r} needs the column(s) {missing}, but extra_columns has "
                             f"{sorted(batch.extra_columns)}; keep those columns in the dataset.")
        try:
            if self.convention == "keyword":
                return self.obj(**kwargs)
            return self.obj(list(prompts), list(completions), **kwargs)
        except Exception as e:  # noqa: BLE001 — re-raised with the function's name, never scored as zero
            raise RuntimeError(f"reward function {self.name!r} failed: {e}") from e


def _await_all(coroutines: dict[str, Any]) -> dict[str, Any]:
    """Await the async reward functions' coroutines together (asyncio.gather); in a thread of its own if an event
    loop already runs in this one (a notebook). An exception is re-raised naming its function."""
    if not coroutines:
        return {}
    import asyncio

    async def gather():
        return await asyncio.gather(*coroutines.values(), return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    for name, result in zip(coroutines, results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"reward function {name!r} failed: {result}") from result
    return dict(zip(coroutines, results))
