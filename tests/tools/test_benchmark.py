"""benchmarks/bench_vs_trl.py: the arithmetic of its tables (medians, ratios, slopes, exclusive phase times) on
hand-made inputs, and that what it times still exists in both trainers (TRL's functions, trl_ext's phase hooks)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_vs_trl"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def make_run(trainer, seconds, phases=None, growth=100.0, T=8, B=4, mode="plain", model="tiny", warmup=1):
    phases = phases or {}
    return {
        "case": dict(model=model, trainer=trainer, mode=mode, response_length=T, batch_size=B,
                     iterations=len(seconds) - warmup, warmup=warmup, device="cpu", num_ppo_epochs=2),
        "iterations": [{"seconds": s, "cpu_seconds": 2 * s,
                        "phases": {p: phases.get(p, [0.0] * len(seconds))[i] for p in bench.PHASES}}
                       for i, s in enumerate(seconds)],
        "tokens_per_iteration": T * B, "peak_growth_mb": growth, "optimizer_state_mb": 1.5,
    }


def test_summary_drops_warmup_and_takes_medians():
    run = make_run("trl_ext", [10.0, 1.0, 3.0, 2.0], phases={"generation": [9.0, 0.5, 1.0, 0.7]}, T=8, B=4)
    s = bench.summarize(run)
    assert s["seconds_per_iteration"] == 2.0  # median of 1, 3, 2 (the 10 s warmup iteration dropped)
    assert s["cpu_seconds_per_iteration"] == 4.0
    assert s["phases"]["generation"] == 0.7
    assert s["tokens_per_second"] == 32 / 2.0
    with pytest.raises(ValueError, match="none after warmup=1"):
        bench.summarize(make_run("trl", [1.0]))


def test_ratios_are_ours_over_trls():
    ours = bench.summarize(make_run("trl_ext", [9.0, 2.0, 2.0], phases={"update": [0, 1.0, 1.0]}, growth=60.0))
    theirs = bench.summarize(make_run("trl", [9.0, 4.0, 4.0], phases={"update": [0, 4.0, 4.0]}, growth=200.0))
    unpaired = bench.summarize(make_run("trl", [1.0, 1.0], T=16))
    rows = bench.pair_up([ours, theirs, unpaired])
    assert len(rows) == 1  # the T=16 point has no trl_ext run
    row = rows[0]
    assert row["time_ratio"] == 0.5
    assert row["phases"]["update"]["ratio"] == 0.25
    assert row["phases"]["reward"]["ratio"] is None  # TRL's reward time is 0: no ratio
    assert row["memory_ratio"] == 0.3
    assert row["tokens_per_second"] == {"trl_ext": 16.0, "trl": 8.0}
    table = bench.markdown(rows, [])
    assert row["cpu_time_ratio"] == 0.5
    assert "| tiny | plain | 8 | 4 | 2.000 | 4.000 | **0.50** | 0.50 |" in table
    assert "| **0.30** |" in table and "(–)" in table


class _Toy(torch.nn.Module):
    """Embedding 10 × 4, one 4 × 4 matmul (its bias is not a matmul), head 4 → 10: body 16, head 40 parameters."""

    def __init__(self):
        super().__init__()
        self.embed, self.layer, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_iteration_flops_by_hand():
    """B = 2 prompts of 5 tokens, T = 3, 2 epochs, every model the toy: seq = 2·(5 + 3) = 16 tokens.
    generation 2·16·16 + 2·40·(2·3) = 992; rollout (reference, value, reward) 992 + 512 + 512 = 2016;
    update 2 · (6·16·16 + 6·40·6 + 6·16·16) = 9024."""
    toy = _Toy()
    assert bench.matmul_parameters(toy) == (16, 40)
    case = bench.Case("tiny", "trl_ext", "plain", response_length=3, batch_size=2, iterations=1)
    flops = bench.iteration_flops(case, 5.0, toy, toy, toy)
    assert flops == {"generation": 992, "rollout": 2016, "update": 9024, "total": 12032}
    assert bench.matmul_flops_per_second(seconds=0.05) > 1e8  # any CPU does 0.1 GFLOP/s


def test_the_limit_column_is_each_trainer_over_the_arithmetic():
    ours, theirs = make_run("trl_ext", [9.0, 2.0]), make_run("trl", [9.0, 4.0])
    for run in (ours, theirs):
        run["flops_per_iteration"], run["matmul_flops_per_second"] = {"total": 1e9}, 2e9  # 0.5 s
    rows = bench.pair_up([bench.summarize(ours), bench.summarize(theirs)])
    assert rows[0]["limit_seconds"] == 0.5
    assert "| 0.500 | 4.0 / 8.0 |" in bench.markdown(rows, [])


def test_fit_line_by_hand():
    exact = bench.fit_line([32, 64, 128], [3 * 32 + 5, 3 * 64 + 5, 3 * 128 + 5])
    assert exact["slope"] == pytest.approx(3.0) and exact["intercept"] == pytest.approx(5.0)
    assert exact["r2"] == pytest.approx(1.0)
    # y = 0, 2, 1 at x = 0, 1, 2: slope 0.5, intercept 0.5, residuals -0.5, 1, -0.5 -> R² = 1 - 1.5/2
    noisy = bench.fit_line([0, 1, 2], [0, 2, 1])
    assert (noisy["slope"], noisy["intercept"], noisy["r2"]) == pytest.approx((0.5, 0.5, 0.25))
    with pytest.raises(ValueError, match="at least 2 distinct x"):
        bench.fit_line([4, 4], [1, 2])


def test_memory_slopes_per_trainer_against_length_and_batch():
    runs = [make_run("trl", [1, 1], T=T, B=B, growth=g)
            for T, B, g in [(32, 8, 100), (64, 8, 164), (128, 8, 292), (64, 4, 100), (64, 16, 292)]]
    runs.append(make_run("trl", [1, 1], T=64, B=8, mode="extras", growth=999))  # extras mode: not in the fit
    slopes = bench.memory_slopes([bench.summarize(r) for r in runs])
    by_x = {s["x"]: s for s in slopes}
    assert by_x["response_length"]["at"] == {"batch_size": 8}
    assert by_x["response_length"]["slope"] == pytest.approx(2.0)  # (292 - 100) / (128 - 32)
    assert by_x["batch_size"]["at"] == {"response_length": 64}
    assert by_x["batch_size"]["slope"] == pytest.approx(16.0)  # (292 - 100) / (16 - 4)
    assert by_x["batch_size"]["points"] == [(4, 100), (8, 164), (16, 292)]


def test_phase_clock_times_are_exclusive(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    clock = bench.PhaseClock()
    clock.start("update")          # t=0
    now[0] = 2.0
    with clock.phase("reference"):  # t=2..5: reference, update paused
        now[0] = 5.0
    now[0] = 6.0
    clock.stop("update")
    assert dict(clock.totals) == {"update": 3.0, "reference": 3.0}
    assert not clock.is_open("update")


def test_plan_pairs_both_trainers_and_alternates_their_order():
    cases = bench.plan(["tiny"], "cpu")
    pairs = [cases[i : i + 2] for i in range(0, len(cases), 2)]
    assert all({a.trainer, b.trainer} == {"trl_ext", "trl"} and a.point == b.point for a, b in pairs)
    assert [p[0].trainer for p in pairs[:3]] == ["trl_ext", "trl", "trl_ext"]
    assert {(c.mode, c.response_length, c.batch_size) for c in cases} >= {("plain", 64, 8), ("extras", 64, 8),
                                                                          ("plain", 256, 8), ("plain", 64, 16)}


@pytest.mark.trl_ppo
def test_the_timed_functions_exist_in_trl():
    """If TRL's trainer lost a timed function, its time would silently move to `other`."""
    import trl.experimental.ppo.ppo_trainer as trl_ppo

    for name in ("batch_generation", "get_reward", "forward"):
        assert hasattr(trl_ppo, name), name


def test_a_trl_ext_iteration_announces_every_timed_phase(tmp_path):
    """trl_ext's phase hooks cover every column of the table but `other`, and one PPO iteration opens each of them,
    nested as the clock expects (each stop matches the innermost open phase)."""
    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.monitoring.phases import PHASE_NAMES
    from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

    assert set(bench.TRL_EXT_PHASES) <= set(PHASE_NAMES)
    assert set(bench.TRL_EXT_PHASES.values()) == set(bench.PHASES) - {"other"}
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=2, num_ppo_epochs=1,
                     response_length=4, report_to="none", save_strategy="no", num_sample_generations=0,
                     logging_steps=1, gradient_checkpointing=False, disable_tqdm=True)
    trainer = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                         reward_model=lambda p, c: [1.0] * len(c), train_dataset=tiny_prompt_dataset(tok, 2),
                         value_model=tiny_scalar_model(tok))
    clock = bench.PhaseClock()
    assert bench.instrument_trl_ext(trainer, clock) == ["trainer.phases"]
    trainer.train()
    assert set(clock.totals) == set(bench.PHASES) - {"other"} and not clock._stack
    assert all(clock.calls[name] >= 1 for name in clock.totals)


@pytest.mark.slow
def test_scale_out_benchmark_measures_the_sharding(tmp_path):
    """benchmarks/scale_out.py end to end on 2 CPU processes, DDP and ZeRO-2, one iteration: its table reads the
    engine each run really used, and ZeRO-2 holds half the optimizer state per process and all the weights."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_out.py"), "--engines", "ddp,zero2",
                           "--warmup", "1", "--iterations", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    ddp, zero2 = results["ddp"][0], results["zero2"][0]
    assert ddp["engine"] == "MULTI_CPU" and zero2["engine"] == "DEEPSPEED"
    assert zero2["optimizer_state_mb"] / ddp["optimizer_state_mb"] == pytest.approx(0.5, abs=0.01)
    assert zero2["trained_parameters_mb"] == pytest.approx(ddp["trained_parameters_mb"])
    assert ddp["seconds_per_iteration"] > 0 and "| zero2 (DEEPSPEED) |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_ppo_variants_benchmark_runs_and_reads_each_variants_diagnostic(tmp_path):
    """benchmarks/ppo_variants.py end to end on two variants, one seed, 3 iterations: its table holds both rows, and
    the dual-clip row reports its clip fraction while the defaults' row has none to report."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_variants.py"), "--seeds", "1", "--steps",
                           "3", "--only", "TRL 1.12 PPO (defaults)", "dual-clip (c = 3)", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(results) == {"TRL 1.12 PPO (defaults)", "dual-clip (c = 3)"}
    assert results["TRL 1.12 PPO (defaults)"]["policy/clipfrac_dual_avg"] is None
    assert results["dual-clip (c = 3)"]["policy/clipfrac_dual_avg"] is not None
    assert "| dual-clip (c = 3) |" in (tmp_path / "results.md").read_text()


def test_padding_free_benchmark_cuts_answers_the_same_way_for_every_trainer():
    """benchmarks/padding_free.py: the drawn lengths are in [T/4, T] and depend on the iteration only; the cut puts
    EOS at the last real position and padding after."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import padding_free

    lengths = padding_free.stop_lengths(0, 64, 32)
    assert torch.equal(lengths, padding_free.stop_lengths(0, 64, 32))
    assert not torch.equal(lengths, padding_free.stop_lengths(1, 64, 32))
    assert lengths.min() >= 8 and lengths.max() <= 32 and lengths.unique().numel() > 10
    responses, mask = padding_free.cut(torch.full((2, 4), 7), torch.tensor([1, 3]), eos=1, pad=0)
    assert responses.tolist() == [[1, 0, 0, 0], [7, 7, 1, 0]]
    assert mask.tolist() == [[True, False, False, False], [True, True, True, False]]


def test_packed_pass_benchmark_builds_its_two_shapes():
    """benchmarks/packed_pass.py's rows: left-padded prompts (chat-templated ones longer), answers cut in [T/4, T],
    so both shapes have padding for the packed pass to skip."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vs_trl
    import packed_pass

    tok = bench_vs_trl._smollm2_tokenizer()
    dataset = bench_vs_trl._opinion_dataset(tok, 64)
    widths = {}
    for name, (batch, T, chat) in packed_pass.SHAPES.items():
        inputs, responses, mask = packed_pass.rows(tok, dataset, batch, T, chat)
        lengths = mask.sum(1)
        assert inputs["input_ids"].shape[0] == batch and responses.shape == (batch, T)
        assert lengths.min() >= T // 4 and lengths.max() <= T and lengths.min() < lengths.max()
        assert 0.5 < inputs["attention_mask"].float().mean() < 0.95
        widths[name] = inputs["input_ids"].shape[1] - T
    assert widths["chat"] > 2 * widths["plain"]


@pytest.mark.slow
def test_padding_free_benchmark_runs_its_trainers(tmp_path):
    """End to end on the tiny model, one measured iteration: a row per trainer (TRL's says it needs trl 1.12 where
    that is not installed), and the padding-free run packs ragged rows (its peak memory is its own measurement)."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "padding_free.py"), "--model", "tiny",
                           "--response_length", "32", "--batch_size", "4", "--iterations", "1", "--repeats", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    for name in ("trl_ext", "trl_ext_padding_free"):
        assert rows[name]["summary"]["seconds_per_iteration"] > 0 and len(rows[name]["runs"]) == 2
    trl = importlib.util.find_spec("trl.experimental.ppo") is not None
    assert (rows["trl"] is not None) == trl
    table = (tmp_path / "results.md").read_text()
    assert "| trl_ext_padding_free |" in table and ("| trl | not run" in table) != trl
