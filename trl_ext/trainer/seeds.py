"""Every seed trl_ext derives from `PPOConfig.seed`, in one place. The multipliers are distinct primes, so no two
processes, iterations or evaluation batches share a random stream, and a resumed run derives the same seeds as the
uninterrupted one (they depend on the iteration, never on how the run got there)."""

PROCESS = 100_003  # between processes
EVAL_STEP = 7_919  # between evaluations at different iterations
VLLM_REQUEST = 1_000_003  # from a stream's seed to vLLM's per-request seeds
VLLM_STEP = 10_007  # between the rollouts of different iterations
EXTRA_DRAW = 1_009  # between the prompt draws of one rollout (dynamic sampling)
DRAW = 1_000_000_007  # between the response draws of one rollout (dynamic sampling)
REGROWN_STEP = 104_729  # between the iterations a run resumed on another number of processes restarts at


def process_seed(seed: int, process_index: int) -> int:
    """The seed of one process's sampling (torch's global RNG in the rollouts)."""
    return seed + PROCESS * process_index


def regrown_process_seed(seed: int, process_index: int, step: int) -> int:
    """One process's global random streams in a run resumed at iteration `step` on another number of processes than
    saved the checkpoint (the saved streams belong to other processes)."""
    return process_seed(seed, process_index) + REGROWN_STEP * (step + 1)


def eval_seed(seed: int, process_index: int, step: int, batch_index: int) -> int:
    """The RNG stream of one evaluation batch, shared by the policy's and the reference's completions (paired)."""
    return seed + PROCESS * process_index + EVAL_STEP * step + batch_index


def rollout_seed(local_seed: int, step: int, draw: int = 0) -> int:
    """The seed of one process's rollout draw at iteration `step` (`local_seed` from `process_seed`): HF generate's
    generator, or the first vLLM request seed (row i adds i). `draw` >= 1: dynamic sampling's further draws."""
    return local_seed * VLLM_REQUEST + VLLM_STEP * step + DRAW * draw


def vllm_stream_seed(stream_seed: int) -> int:
    """The first vLLM request seed of an RNG stream (an evaluation batch's), row i adding i."""
    return stream_seed * VLLM_REQUEST


def request_seeds(first: int, rows: int) -> list[int]:
    """vLLM's per-request seeds of a draw whose first seed is `first`: row i gets first + i, in vLLM's int32 range."""
    return [(first + i) % 2**31 for i in range(rows)]


def extra_draw_seed(seed: int, step: int, draw: int) -> int:
    """Dynamic sampling's draw `draw` >= 1 at iteration `step`: the seed of its prompts' permutation (shared by all
    processes) and, added to `rollout_seed`, of its responses."""
    return seed + PROCESS * VLLM_STEP * draw + EXTRA_DRAW * step
