"""Tests for trl_ext/monitoring/report.py and the `trl-ext report` command line (trl_ext/tools/cli.py).

Synthetic metrics.jsonl files in tmp folders; no model, no torch. The command-line tests run `python -m
trl_ext.tools.cli` and the `trl-ext` console script (installed by `pip install -e .`) as subprocesses, started together.
"""

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from matplotlib.figure import Figure

from trl_ext.monitoring.report import PANEL_TITLES, load_metrics, make_dashboard, report, summarize
from trl_ext.tools.cli import main

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_STEPS = 30
ALARMS = {12: "kl_blowup", 22: "reward_hacking"}
NULL_KL_STEP = 9  # objective/kl is null (NaN) on this step
STEP_PANELS = PANEL_TITLES[1:]  # every panel but the frontier is plotted against steps


def _record(step: int) -> dict:
    t = step / N_STEPS
    record = {
        "step": step,
        "objective/scores": -0.5 + 1.2 * t + 0.05 * math.sin(step),
        "objective/scores_std": 0.3,
        "objective/scores_min": -1.0,
        "objective/scores_max": 1.0 + t,
        "objective/kl": 0.02 * step + 0.01 * math.cos(step),
        "objective/kl_k1": 0.02 * step,
        "objective/kl_k3": 0.021 * step,
        "objective/kl_coef": 0.05 * (1 + 0.5 * t),
        "objective/entropy": 60.0 - 20 * t,
        "objective/rlhf_reward": -0.5 + t,
        "policy/approxkl_avg": 0.01 + 0.005 * math.sin(step),
        "policy/clipfrac_avg": 0.1 + 0.05 * math.cos(step),
        "policy/entropy_avg": 2.5 - t,
        "policy/ratio_first_minibatch": 1.0,
        "policy/grad_norm": 0.5,
        "val/grad_norm": 0.4,
        "val/explained_variance": -0.5 + 1.3 * t,
        "val/value_error": 0.2 - 0.1 * t,
        "val/clipfrac_avg": 0.05,
        "val/warmup": 1.0 if step <= 3 else 0.0,
        "loss/policy_avg": -0.03,
        "loss/value_avg": 0.1,
        "rollout/response_length_mean": 20.0 + 10 * t,
        "rollout/truncation_rate": 0.1 * t,
        "lr": 1e-4,
        "episode": 8 * step,
        "eps": 0.5,
    }
    if step == NULL_KL_STEP:
        record["objective/kl"] = None
    if step in ALARMS:
        record[f"alarm/{ALARMS[step]}"] = 1.0
    return record


RECORDS = [_record(s) for s in range(1, N_STEPS + 1)]


def _write(folder: pathlib.Path, records, extra_lines=()) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _axes_by_title(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def _plot_axes(fig):
    """Every axes of the figure but colorbars (twin axes included)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def _twins(fig, ax):
    """The other axes at the same position as `ax` (its twinx)."""
    return [o for o in _plot_axes(fig) if o is not ax and o.get_position().bounds == ax.get_position().bounds]


def _texts(fig, ax) -> str:
    return " ".join(t.get_text() for a in [ax, *_twins(fig, ax)] for t in a.texts)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("run"), RECORDS)


@pytest.fixture(scope="module")
def fig(tmp_path_factory):
    return make_dashboard(RECORDS, tmp_path_factory.mktemp("fig") / "dash.png", title="synthetic")


# ------------------------------------------------------------------------------------------------ report / PNG


def test_report_writes_a_png_dashboard_and_returns_the_summary(run_dir):
    summary = report(run_dir)
    png = run_dir / "dashboard.png"
    assert png.is_file()
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000
    assert summary.splitlines()[-1].endswith(str(png.resolve()))
    assert "alarms raised:" in summary


def test_dashboard_has_the_six_titled_and_labelled_panels(fig):
    assert isinstance(fig, Figure)
    titles = _axes_by_title(fig)
    for title in PANEL_TITLES:
        assert title in titles, f"missing panel {title!r}; have {sorted(titles)}"
    plot_axes = _plot_axes(fig)
    assert len(plot_axes) == 6 + 3  # six panels; KL/β, clip/approx-KL and length/truncation have a twin right axis
    for ax in plot_axes:
        name = ax.get_title() or f"twin of {[t.get_title() for t in _twins(fig, ax)]}"
        assert ax.get_xlabel().strip(), f"{name}: no x label"
        assert ax.get_ylabel().strip(), f"{name}: no y label"
    for title in ("KL and β over steps", "Clip fraction and approx KL", "Response length and truncation rate"):
        (twin,) = _twins(fig, titles[title])
        assert twin.get_ylabel() != titles[title].get_ylabel()
    assert "β" in _twins(fig, titles["KL and β over steps"])[0].get_ylabel()
    colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert [cb.get_ylabel() for cb in colorbars] == ["step"]
    assert fig.get_suptitle() == "trl_ext run: synthetic"


def test_frontier_is_score_against_kl_not_steps(fig):
    ax = _axes_by_title(fig)["Reward vs KL (frontier)"]
    (line,) = [ln for ln in ax.lines if ln.get_gid() == "frontier"]
    kept = [r for r in RECORDS if r["objective/kl"] is not None]  # the null-KL step has no point
    assert list(line.get_xdata()) == pytest.approx([r["objective/kl"] for r in kept])
    assert list(line.get_ydata()) == pytest.approx([r["objective/scores"] for r in kept])
    assert len(kept) == N_STEPS - 1
    (scatter,) = ax.collections
    assert list(scatter.get_array()) == [r["step"] for r in kept]  # coloured by step


def test_step_panels_plot_against_steps_and_mark_the_alarms(fig):
    titles = _axes_by_title(fig)
    kl_line = [ln for ln in titles["KL and β over steps"].lines if ln.get_gid() == "objective/kl"][0]
    assert list(kl_line.get_xdata()) == list(range(1, N_STEPS + 1))
    assert math.isnan(kl_line.get_ydata()[NULL_KL_STEP - 1])  # null drawn as a gap
    for title in STEP_PANELS:
        alarm_lines = [ln for ln in titles[title].lines if (ln.get_gid() or "").startswith("alarm/")]
        marked = {(ln.get_xdata()[0], ln.get_gid()) for ln in alarm_lines}
        assert marked == {(step, f"alarm/{name}") for step, name in ALARMS.items()}, title
        assert all(ln.get_linestyle() == ":" for ln in alarm_lines)
    legend_texts = " ".join(t.get_text() for legend in fig.legends for t in legend.get_texts())
    assert "kl_blowup (step 12)" in legend_texts and "reward_hacking (step 22)" in legend_texts
    ev = titles["Value explained variance"]
    assert any(ln.get_linestyle() == "--" and list(ln.get_ydata()) == [0, 0] for ln in ev.lines)  # y = 0 dashed


def test_the_win_rate_panel_says_which_reward_judged_each_line(tmp_path):
    """Its two lines are win rates, each judged by one reward: the labels say so (a line labelled "training reward"
    on a win-rate axis reads as the reward itself)."""
    from trl_ext.monitoring.report import EVAL_PANEL_TITLES

    evals = [{**_record(s), "eval/kl": 0.1 * s, "eval/score": 0.1, "eval/score_ref": 0.0,
              "eval/win_rate_vs_ref": 0.5 + 0.05 * s, "eval/gold_score": 0.0, "eval/gold_score_ref": 0.0,
              "eval/gold_win_rate_vs_ref": 0.5} for s in (1, 2, 3)]
    fig = make_dashboard(evals, tmp_path / "dash.png")
    win = _axes_by_title(fig)[EVAL_PANEL_TITLES[0]]
    labels = {line.get_label(): list(line.get_ydata()) for line in win.get_lines()}
    assert labels["win rate judged by the training reward"] == pytest.approx([0.55, 0.6, 0.65])
    assert labels["win rate judged by the gold reward (eval_reward)"] == pytest.approx([0.5] * 3)


def test_missing_keys_give_no_data_panels_without_crashing(tmp_path):
    records = [{"step": s, "objective/scores": 0.1 * s} for s in range(1, 6)]  # no KL, β, entropy, ...
    fig = make_dashboard(records, tmp_path / "d.png")
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG_MAGIC
    titles = _axes_by_title(fig)
    assert set(PANEL_TITLES) <= set(titles)
    for title in PANEL_TITLES:
        assert "no data" in _texts(fig, titles[title]), title
    for ax in _plot_axes(fig):
        assert ax.get_xlabel() and ax.get_ylabel()
    # One series of a twin panel missing: the other is drawn, the missing one is named.
    records = [{"step": s, "rollout/response_length_mean": 10.0 + s} for s in range(1, 6)]
    fig = make_dashboard(records, tmp_path / "e.png")
    ax = _axes_by_title(fig)["Response length and truncation rate"]
    assert [ln.get_gid() for ln in ax.lines] == ["rollout/response_length_mean"]
    assert "rollout/truncation_rate" in _texts(fig, ax)
    summary = summarize(records)
    assert "no data" in summary and "alarms raised: none" in summary


def test_empty_file_reports_without_crashing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    summary = report(tmp_path)
    assert "no PPO steps" in summary
    assert (tmp_path / "dashboard.png").is_file()


# ------------------------------------------------------------------------------------------------------ summary


def test_summary_gives_start_and_end_numbers_and_the_alarms():
    summary = summarize(RECORDS)
    k = 3  # 10% of 30 steps
    assert "first 10% of steps (1-3)" in summary and "last 10% of steps (28-30)" in summary
    lines = {line.split("  ")[1].strip(): line for line in summary.splitlines() if line.startswith("  ")}

    def mean(key, rows):
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) / len(values)

    for label, key in (("score", "objective/scores"), ("KL (nats)", "objective/kl")):
        start, end = mean(key, RECORDS[:k]), mean(key, RECORDS[-k:])
        assert f"{start:.4g}" in lines[label] and f"{end:.4g}" in lines[label], lines[label]
    for label in ("β (kl_coef)", "clip fraction", "approx KL", "explained variance", "entropy (nats/token)",
                  "response length", "truncation rate"):
        assert label in lines and "no data" not in lines[label]
    alarms = summary[summary.index("alarms raised:"):]
    assert "step 12: kl_blowup" in alarms and "step 22: reward_hacking" in alarms


def test_summary_says_none_without_alarms_and_first_last_step_for_short_runs():
    records = [{k: v for k, v in _record(s).items() if not k.startswith("alarm/")} for s in range(1, 6)]
    summary = summarize(records)
    assert "alarms raised: none" in summary
    assert "start = first step (1), end = last step (5)" in summary


def test_repeated_steps_use_the_later_line():
    records = [{"step": 1, "objective/scores": 5.0}, {"step": 2, "objective/scores": 6.0},
               {"step": 1, "objective/scores": 1.0}]  # a rerun appended to the file
    summary = summarize(records)
    assert "1 line(s) repeat an earlier step" in summary
    score_line = next(line for line in summary.splitlines() if line.strip().startswith("score"))
    assert score_line.split()[1:3] == ["1", "6"]


def test_report_shows_best_and_worst_sample(tmp_path):
    _write(tmp_path, RECORDS[:5])
    samples = [{"step": 5, "prompt": "p", "completion": "good answer", "score": 0.9},
               {"step": 5, "prompt": "p", "completion": "bad answer", "score": -0.9},
               {"step": 1, "prompt": "p", "completion": "early", "score": 2.0}]
    (tmp_path / "samples.jsonl").write_text("\n".join(map(json.dumps, samples)) + "\n")
    summary = report(tmp_path)
    assert "best (score 0.9): 'good answer'" in summary and "worst (score -0.9): 'bad answer'" in summary


# ---------------------------------------------------------------------------------------------- loading errors


def test_load_metrics_reads_nulls_as_none(run_dir):
    records = load_metrics(run_dir)
    assert len(records) == N_STEPS
    assert records[NULL_KL_STEP - 1]["objective/kl"] is None
    assert load_metrics(run_dir / "metrics.jsonl") == records  # the file's own path works too


def test_malformed_line_is_a_value_error_with_its_line_number(tmp_path):
    _write(tmp_path, RECORDS[:2], extra_lines=['{"step": 3, "objective/kl": 0.1'])
    with pytest.raises(ValueError, match=r"line 3\b"):
        load_metrics(tmp_path)
    _write(tmp_path, RECORDS[:3], extra_lines=["", "[1, 2]"])  # blank line skipped; a list is not a record
    with pytest.raises(ValueError, match=r"line 5 is a JSON list"):
        load_metrics(tmp_path)


def test_missing_file_or_folder_is_a_file_not_found_error_that_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl.*output_dir"):
        load_metrics(tmp_path)  # folder exists, file does not
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_metrics(tmp_path / "nope")


# ------------------------------------------------------------------------------------------------- command line


def test_main_exit_codes(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(str((run_dir / "dashboard.png").resolve()))
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2  # folder without metrics.jsonl
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert main(["report", str(tmp_path)]) == 1
    assert "line 1" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit) as e:
        main(["report"])  # RUN_DIR missing: argparse's usage error
    assert e.value.code == 2


def _console_script() -> str | None:
    # Prefer the script next to this interpreter (a venv's bin/); fall back to PATH.
    return shutil.which("trl-ext", path=os.path.dirname(sys.executable)) or shutil.which("trl-ext")


class _CliRuns:
    """The command-line runs, as subprocesses started together when this module's tests begin: each pays the
    `import trl_ext` start-up (seconds: trl, torch), which then overlaps the in-process tests."""

    def __init__(self, base: pathlib.Path):
        self.commands = {
            "module": [sys.executable, "-m", "trl_ext.tools.cli", "report", str(_write(base / "a", RECORDS))],
            "module_missing": [sys.executable, "-m", "trl_ext.tools.cli", "report", str(base / "missing")],
            "script": [_console_script(), "report", str(_write(base / "b", RECORDS))],
        }
        self.procs = {name: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for name, cmd in self.commands.items() if cmd[0] is not None}
        self.results = {}

    def __getitem__(self, name):
        """(exit code, stdout, stderr, the RUN_DIR argument) of run `name`, waiting for it."""
        assert name in self.procs, f"{name}: {self.commands[name][0]} not found (pip install -e . installs trl-ext)"
        if name not in self.results:
            out, err = self.procs[name].communicate(timeout=300)
            self.results[name] = (self.procs[name].returncode, out, err, pathlib.Path(self.commands[name][-1]))
        return self.results[name]

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:  # a test selection that did not wait for it
                proc.kill()
            proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory):
    runs = _CliRuns(tmp_path_factory.mktemp("cli"))
    yield runs
    runs.close()


@pytest.mark.slow
def test_python_m_cli_report_prints_the_png_path(cli_runs):
    rc, out, err, folder = cli_runs["module"]
    assert rc == 0, err
    png = folder / "dashboard.png"
    assert out.rstrip().endswith(str(png.resolve()))
    assert "step 12: kl_blowup" in out
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_python_m_cli_report_missing_folder_exits_2(cli_runs):
    rc, out, err, folder = cli_runs["module_missing"]
    assert rc == 2
    assert str(folder) in err and "does not exist" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_trl_ext_console_script_report(cli_runs):
    rc, out, err, folder = cli_runs["script"]
    assert rc == 0, err
    png = folder / "dashboard.png"
    assert out.rstrip().endswith(str(png.resolve()))
    assert png.stat().st_size > 10_000
