"""trl_ext.trainer.seeds: the seeds derived from PPOConfig.seed, by hand, and distinct where streams must differ."""

from trl_ext.trainer.seeds import eval_seed, process_seed, request_seeds, rollout_seed, vllm_stream_seed


def test_derived_seeds_by_hand():
    assert process_seed(42, 0) == 42 and process_seed(42, 1) == 42 + 100_003
    assert eval_seed(42, 1, 3, 2) == 42 + 100_003 + 3 * 7_919 + 2
    assert rollout_seed(42, 3) == 42 * 1_000_003 + 3 * 10_007
    assert vllm_stream_seed(5) == 5_000_015
    assert request_seeds(7, 3) == [7, 8, 9] and request_seeds(2**31 - 1, 2) == [2**31 - 1, 0]


def test_no_two_processes_steps_or_batches_share_an_evaluation_stream():
    seeds = [eval_seed(0, p, step, b) for p in range(8) for step in range(200) for b in range(4)]
    assert len(set(seeds)) == len(seeds)
    rollouts = [rollout_seed(process_seed(0, p), step) for p in range(8) for step in range(1000)]
    assert len(set(rollouts)) == len(rollouts)
