"""`PPOTrainer` and its phases, one file each:

    ppo_trainer.py   PPOTrainer: TRL's API, train() (rollout -> update -> metrics), evaluation calls
    builders.py      the set-up: each builder returns one collaborator (rewards, models, accelerator, samplers...)
    rollout.py       steps 1-7 (generate, score, rewards, advantages): a `Rollout` (`core/types.py`); the
                     synchronous rollout source (`SyncRollouts`)
    update.py        step 8: PPO epochs over minibatches of micro-batches, the loss terms
    sampling.py      every draw of responses: the rollout's, evaluation's and the samples', seeded
    generators.py    what draws, chosen once: HF generate, or vLLM colocated or as a server (`sync`, `generate`)
    async_rollouts.py  async_rollouts' rollout source: the sampler's thread, the version schedule, the hand-over
    backend.py       the engine (one process, DDP, DeepSpeed ZeRO-1/2/3, FSDP2) and the model layout, decided once
    checkpoint.py    checkpoint-N: what it holds, writing it atomically, resuming from it (`Checkpoints`)
    multi_turn.py    tools, environments and rollout_func: the conversation loop, run_episodes' episodes
    evaluation.py    held-out paired evaluation against the reference, sample completions
    seeds.py         every random seed derived from PPOConfig.seed
    allocator.py     glibc malloc settings that keep a CPU run's freed memory for reuse
    preemption.py    SIGTERM / Ctrl-C: save at the next safe boundary, exit 0

Imported on first use, so `trl_ext.trainer.seeds` (say) loads without trl.
"""

_LAZY = {"PPOTrainer": ".ppo_trainer", "Rollout": "..core.types"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'trl_ext.trainer' has no attribute {name!r}")
