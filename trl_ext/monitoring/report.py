"""Post-hoc report of a trl_ext PPO run: a text summary and a one-page PNG dashboard.

The trainer's output_dir holds ``metrics.jsonl`` (one JSON object per PPO step, written by
`trl_ext.monitoring.callbacks.MetricsFileCallback`) and may hold ``samples.jsonl``. From the command line::

    trl-ext report RUN_DIR            # or: python -m trl_ext.tools.cli report RUN_DIR

From Python::

    from trl_ext.monitoring.report import load_metrics, summarize, make_dashboard, report
    print(report("runs/quickstart"))  # writes runs/quickstart/dashboard.png

This module needs only the standard library and matplotlib (Agg backend, no window is ever opened); it does not
import torch, transformers or trl.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"  # as trl_ext.monitoring.callbacks.METRICS_FILE (not imported: it pulls transformers)
SAMPLES_FILE = "samples.jsonl"
DASHBOARD_FILE = "dashboard.png"

EVAL_PANEL_TITLES = ("Win rate vs reference against KL (eval)", "Evaluation scores")
PANEL_TITLES = (
    "Reward vs KL (frontier)",
    "KL and β over steps",
    "Clip fraction and approx KL",
    "Value explained variance",
    "Entropy",
    "Response length and truncation rate",
)

# (label, key) rows of the summary table, in order.
SUMMARY_ROWS = (
    ("score", "objective/scores"),
    ("KL (nats)", "objective/kl"),
    ("β (kl_coef)", "objective/kl_coef"),
    ("clip fraction", "policy/clipfrac_avg"),
    ("approx KL", "policy/approxkl_avg"),
    ("explained variance", "val/explained_variance"),
    ("entropy (nats/token)", "policy/entropy_avg"),
    ("response length", "rollout/response_length_mean"),
    ("truncation rate", "rollout/truncation_rate"),
)

ALARM_PREFIX = "alarm/"
_ALARM_COLORS = {
    "kl_blowup": "tab:red",
    "generator_mismatch": "tab:purple",
    "value_lag": "tab:brown",
    "entropy_collapse": "tab:pink",
    "length_exploitation": "tab:olive",
    "reward_hacking": "tab:cyan",
}
_EXTRA_ALARM_COLORS = ("black", "tab:gray", "darkgoldenrod", "darkslateblue")
_LEFT, _RIGHT = "tab:blue", "tab:orange"  # colours of the left and right (twin) axis series


# ------------------------------------------------------------------------------------------------------- loading


def _metrics_path(run_dir) -> Path:
    path = Path(run_dir)
    if path.is_file():  # a path to metrics.jsonl itself is accepted too
        return path
    if not path.exists():
        raise FileNotFoundError(
            f"run folder {str(path)!r} does not exist. Pass the output_dir of a trl_ext training run: "
            f"trl_ext's PPOTrainer (with trl_ext.monitoring.callbacks.MetricsFileCallback) writes {METRICS_FILE} there."
        )
    file = path / METRICS_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(file)!r} not found: {str(path)!r} has no {METRICS_FILE}. It is written during training by "
            f"trl_ext's PPOTrainer to its output_dir (trl_ext.monitoring.callbacks.MetricsFileCallback, one JSON "
            f"line per PPO step): train with trl_ext, then run `trl-ext report <output_dir>`."
        )
    return file


def load_metrics(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` (one dict per non-blank line, in file order).

    `run_dir` may also be the path of the file itself. JSON ``null`` (how the callback writes NaN) stays ``None``.

    Raises:
        FileNotFoundError: the folder or the file does not exist (the message says how the file is produced).
        ValueError: a line is not a JSON object; the message names the file and the line number.
    """
    file = _metrics_path(run_dir)
    records = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}: line {lineno} is not valid JSON ({e.msg}): {line.strip()[:120]!r}") from e
            if not isinstance(record, dict):
                raise ValueError(
                    f"{file}: line {lineno} is a JSON {type(record).__name__}, expected an object "
                    f"like {{\"step\": 1, \"objective/kl\": 0.1, ...}}"
                )
            records.append(record)
    return records


def _load_samples(run_dir) -> list[dict]:
    """``samples.jsonl`` records; lines that are not JSON objects are skipped (samples are only a garnish)."""
    file = Path(run_dir) / SAMPLES_FILE
    if not file.is_file():
        return []
    samples = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                samples.append(record)
    return samples


# ------------------------------------------------------------------------------------------------------- series


def _num(value) -> float:
    """A float, NaN for null / missing / non-numeric values."""
    if isinstance(value, bool) or value is None:
        return math.nan if value is None else float(value)
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)  # numbers written as strings
    except (TypeError, ValueError):
        return math.nan


class _Run:
    """Records reduced to one per step, sorted by step. A file appended to by a rerun or a resume can hold a step
    twice; the later line wins."""

    def __init__(self, records: list[dict]):
        by_step: dict[int, dict] = {}
        self.repeated = 0
        self.without_step = 0
        for record in records:
            step = _num(record.get("step"))
            if not math.isfinite(step):
                self.without_step += 1
                continue
            step = int(step)
            if step in by_step:
                self.repeated += 1
            by_step[step] = record
        self.steps = sorted(by_step)
        self.records = [by_step[s] for s in self.steps]

    def __len__(self):
        return len(self.steps)

    def has(self, key: str) -> bool:
        return any(math.isfinite(_num(r.get(key))) for r in self.records)

    def series(self, key: str) -> list[float]:
        return [_num(r.get(key)) for r in self.records]

    def alarms(self) -> list[tuple[int, str]]:
        """(step, name) for every ``alarm/<name>`` that is set (non-zero) on a step, in step order."""
        raised = []
        for step, record in zip(self.steps, self.records):
            for key in sorted(record):
                if key.startswith(ALARM_PREFIX):
                    value = _num(record[key])
                    if math.isfinite(value) and value != 0:
                        raised.append((step, key[len(ALARM_PREFIX):]))
        return raised


def _window(n: int) -> int:
    """Steps averaged for 'start' and 'end': 10% of the steps rounded up (one step for runs of up to 10 steps)."""
    return max(1, math.ceil(n / 10))


def _mean(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _fmt(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.4g}"


# ------------------------------------------------------------------------------------------------------- summary


def summarize(records: list[dict]) -> str:
    """A compact text table: each key metric at the start and at the end of the run, then the alarms raised.

    'start' and 'end' are the means over the first and the last 10% of the steps, rounded up (so for runs of up to 10
    steps: the first and the last step); the header line says which steps. Null values are left out of the
    means; a metric absent from the file shows "no data".
    """
    run = _Run(records)
    lines = []
    if not len(run):
        lines.append("no PPO steps in metrics.jsonl (no record has a \"step\")")
    else:
        n, k = len(run), _window(len(run))
        first, last = run.steps[:k], run.steps[-k:]
        episodes = _num(run.records[-1].get("episode"))
        lines.append(
            f"{n} steps (step {run.steps[0]} to {run.steps[-1]})"
            + (f", {int(episodes)} episodes" if math.isfinite(episodes) else "")
        )
        if k == 1:
            lines.append(f"start = first step ({first[0]}), end = last step ({last[0]})")
        else:
            lines.append(
                f"start = mean of first 10% of steps ({first[0]}-{first[-1]}), "
                f"end = mean of last 10% of steps ({last[0]}-{last[-1]})"
            )
        name_w = max(len(label) for label, _ in SUMMARY_ROWS)
        lines.append(f"  {'metric':<{name_w}}  {'start':>10}  {'end':>10}  {'change':>10}")
        for label, key in SUMMARY_ROWS:
            if not run.has(key):
                lines.append(f"  {label:<{name_w}}  {'no data':>10}  {'':>10}  {'':>10}   (no values logged for {key})")
                continue
            values = run.series(key)
            start, end = _mean(values[:k]), _mean(values[-k:])
            change = end - start
            change_s = f"{change:+.3g}" if math.isfinite(change) else "n/a"
            lines.append(f"  {label:<{name_w}}  {_fmt(start):>10}  {_fmt(end):>10}  {change_s:>10}")
    if run.repeated:
        lines.append(
            f"note: {run.repeated} line(s) repeat an earlier step (file appended by a rerun or a resume); "
            "the later line is used"
        )
    if run.without_step:
        lines.append(f"note: {run.without_step} line(s) without a \"step\" were left out")
    alarms = run.alarms()
    if alarms:
        lines.append("alarms raised:")
        lines.extend(f"  step {step}: {name}" for step, name in alarms)
    else:
        lines.append("alarms raised: none")
    return "\n".join(lines)


def run_summary(records: list[dict]) -> dict:
    """The numbers a recipe prints at the end, from the trainer's `state.log_history` or the records of metrics.jsonl.

    Training: `first_score`/`last_score` are `objective/scores` of the first and last PPO step; the quarter means
    average the first and last quarter of the steps (at least one step each); `last_kl` and `max_kl` are
    `objective/kl` (per-sequence KL to the reference, nats); `last_truncation_rate` is the share of the last quarter's
    responses that ran into `response_length` without a stop token. Held out: the eval/* numbers of the last
    evaluation (`eval_score`, `eval_score_ref`, `eval_win_rate`, `eval_kl`). Missing numbers (and nulls) are NaN.
    """
    steps = [r for r in records if r.get("objective/scores") is not None]
    scores = [_num(r["objective/scores"]) for r in steps]
    kls = [v for v in (_num(r.get("objective/kl")) for r in steps) if math.isfinite(v)]
    truncation = [_num(r.get("rollout/truncation_rate")) for r in steps]
    k = max(1, len(scores) // 4)
    evals = [r for r in records if r.get("eval/win_rate_vs_ref") is not None]
    last_eval = evals[-1] if evals else {}
    return {
        "steps": len(steps),
        "first_score": scores[0] if scores else math.nan,
        "last_score": scores[-1] if scores else math.nan,
        "first_quarter_score": _mean(scores[:k]),
        "last_quarter_score": _mean(scores[-k:]),
        "last_kl": kls[-1] if kls else math.nan,
        "max_kl": max(kls) if kls else math.nan,
        "last_truncation_rate": _mean(truncation[-k:]),
        "eval_score": _num(last_eval.get("eval/score")),
        "eval_score_ref": _num(last_eval.get("eval/score_ref")),
        "eval_win_rate": _num(last_eval.get("eval/win_rate_vs_ref")),
        "eval_kl": _num(last_eval.get("eval/kl")),
    }


def _summarize_samples(samples: list[dict], width: int = 100) -> list[str]:
    """Best and worst completion at the last sampled step."""
    steps = [_num(s.get("step")) for s in samples]
    finite = [s for s in steps if math.isfinite(s)]
    if not finite:
        return [f"samples.jsonl: {len(samples)} samples"]
    last_step = max(finite)
    at_last = [s for s, st in zip(samples, steps) if st == last_step and math.isfinite(_num(s.get("score")))]
    lines = [f"samples.jsonl: {len(samples)} samples; at step {int(last_step)}:"]
    if at_last:
        ranked = sorted(at_last, key=lambda s: _num(s["score"]))
        for tag, s in (("best", ranked[-1]), ("worst", ranked[0])):
            text = " ".join(str(s.get("completion", "")).split())
            text = text if len(text) <= width else text[: width - 1] + "…"
            lines.append(f"  {tag} (score {_fmt(_num(s['score']))}): {text!r}")
    return lines


# ------------------------------------------------------------------------------------------------------ dashboard


def _no_data(ax, keys, where=(0.5, 0.5), ha="center"):
    ax.text(*where, "no data\n(no values logged for " + ", ".join(keys) + ")", transform=ax.transAxes, ha=ha,
            va="center", fontsize=10, color="0.4", style="italic",
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.8))


def _alarm_colors(names) -> dict:
    colors, extra = {}, iter(_EXTRA_ALARM_COLORS * 10)
    for name in names:
        colors[name] = _ALARM_COLORS.get(name) or next(extra)
    return colors


def _mark_alarms(ax, alarms, colors):
    for step, name in alarms:
        line = ax.axvline(step, color=colors[name], linestyle=":", linewidth=1.6, alpha=0.9, zorder=0,
                          label=f"_alarm {name}")
        line.set_gid(f"alarm/{name}")


def _step_panel(ax, run, key, label, color=_LEFT, marker="o"):
    """Plot `key` vs step on `ax`; return the line, or None (and write "no data") when the key is absent."""
    if not run.has(key):
        return None
    (line,) = ax.plot(run.steps, run.series(key), color=color, marker=marker, markersize=3, linewidth=1.5,
                      label=label)
    line.set_gid(key)
    return line


def _twin_panel(ax, run, title, left, right):
    """Two series vs step: `left` = (key, label) on ax, `right` = (key, label) on a twin right axis."""
    ax.set_title(title)
    twin = ax.twinx()
    handles = []
    for axis, (key, label), color, side in ((ax, left, _LEFT, "left"), (twin, right, _RIGHT, "right")):
        axis.set_xlabel("step")
        axis.set_ylabel(label, color=color)
        axis.tick_params(axis="y", colors=color)
        values = [v for v in run.series(key) if math.isfinite(v)]
        if values and min(values) == max(values):  # e.g. a fixed β: say so rather than leave a flat line to decode
            label = f"{label} = {values[0]:.4g} (constant)"
        line = _step_panel(axis, run, key, label, color=color, marker="o" if side == "left" else "s")
        if line is not None:
            handles.append(line)
    missing = [key for key, _ in (left, right) if not run.has(key)]
    if len(missing) == 2:
        _no_data(ax, missing)
    elif missing:
        _no_data(ax, missing, where=(0.5, 0.12))
    if handles:
        for axis in (ax, twin):  # headroom above the data for the legend
            if axis.lines:
                lo, hi = axis.get_ylim()
                axis.set_ylim(lo, hi + 0.25 * (hi - lo))
        twin.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)  # on the twin: drawn on top
    return twin


def make_dashboard(records: list[dict], path, title: str | None = None):
    """Draw the run's dashboard, save it as a PNG at `path`, and return the `matplotlib.figure.Figure`.

    Six panels: reward vs KL (the frontier, coloured by step); KL and β; clip fraction and approx KL; value explained
    variance; entropy; response length and truncation rate. Alarm steps are dotted vertical lines on the step-based
    panels, named in the figure legend. A panel whose metrics are not in `records` says "no data". `title` (default:
    the name of the folder `path` is in) is the figure's title. Uses the Agg backend directly: no window, no pyplot
    state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    run = _Run(records)
    alarms = run.alarms()
    colors = _alarm_colors(dict.fromkeys(name for _, name in alarms))

    has_eval = run.has("eval/win_rate_vs_ref")
    fig = Figure(figsize=(15, 18.5 if has_eval else 14), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4 if has_eval else 3, 2)
    ax_front, ax_kl, ax_clip, ax_ev, ax_ent, ax_len = axes.flat[:6]
    if has_eval:  # (7) and (8): held-out evaluation against the reference (PPOTrainer.evaluate_policy)
        _eval_panels(run, *axes.flat[6:])

    _frontier_panel(fig, ax_front, run)

    # (2) KL (left) and β (right).
    _twin_panel(ax_kl, run, PANEL_TITLES[1], ("objective/kl", "KL, nats (objective/kl)"),
                ("objective/kl_coef", "β (objective/kl_coef)"))

    # (3) clip fraction (left) and approx KL (right).
    _twin_panel(ax_clip, run, PANEL_TITLES[2], ("policy/clipfrac_avg", "clip fraction (policy/clipfrac_avg)"),
                ("policy/approxkl_avg", "approx KL (policy/approxkl_avg)"))

    _explained_variance_panel(ax_ev, run)

    # (5) per-token policy entropy.
    ax_ent.set_title(PANEL_TITLES[4])
    ax_ent.set_xlabel("step")
    ax_ent.set_ylabel("entropy, nats/token (policy/entropy_avg)")
    if _step_panel(ax_ent, run, "policy/entropy_avg", "entropy") is None:
        _no_data(ax_ent, ["policy/entropy_avg"])

    # (6) response length (left) and truncation rate (right).
    _twin_panel(ax_len, run, PANEL_TITLES[5], ("rollout/response_length_mean", "mean response length, tokens"),
                ("rollout/truncation_rate", "truncation rate"))

    for ax in (ax_kl, ax_clip, ax_ev, ax_ent, ax_len):
        _mark_alarms(ax, alarms, colors)
        ax.grid(True, alpha=0.3)
        if len(run):  # the run's steps, also on panels with no data
            pad = max(0.5, 0.03 * (run.steps[-1] - run.steps[0]))
            ax.set_xlim(run.steps[0] - pad, run.steps[-1] + pad)
    ax_front.grid(True, alpha=0.3)

    if alarms:
        _alarm_legend(fig, alarms, colors)

    name = title if title is not None else path.resolve().parent.name
    fig.suptitle(f"trl_ext run: {name}" + ("" if alarms else "   (no alarms raised)"), fontsize=15)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return fig


def _frontier_panel(fig, ax_front, run) -> None:
    """(1) reward vs KL: one point per step, coloured by step, joined in step order."""
    ax_front.set_title(PANEL_TITLES[0])
    ax_front.set_xlabel("KL to reference, nats (objective/kl)")
    ax_front.set_ylabel("score (objective/scores)")
    kl, score = run.series("objective/kl"), run.series("objective/scores")
    points = [(s, x, y) for s, x, y in zip(run.steps, kl, score) if math.isfinite(x) and math.isfinite(y)]
    if points:
        steps, xs, ys = map(list, zip(*points))
        (line,) = ax_front.plot(xs, ys, color="0.6", linewidth=1, zorder=1)
        line.set_gid("frontier")
        sc = ax_front.scatter(xs, ys, c=steps, cmap="viridis", s=30, zorder=2, edgecolors="none")
        cbar = fig.colorbar(sc, ax=ax_front)
        cbar.set_label("step")
        ax_front.margins(0.08)  # room for the start/end labels
        for i, text in ((0, "start"), (-1, "end")):
            ax_front.annotate(f"{text} (step {steps[i]})", (xs[i], ys[i]), textcoords="offset points", xytext=(8, -14),
                              fontsize=9, zorder=3,
                              bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="0.7", alpha=0.85))
    else:
        _no_data(ax_front, [k for k in ("objective/kl", "objective/scores") if not run.has(k)] or
                 ["objective/kl with objective/scores"])


def _explained_variance_panel(ax_ev, run) -> None:
    """(4) value explained variance, with y = 0 (a critic no better than a constant) dashed; critic warmup shaded."""
    ax_ev.set_title(PANEL_TITLES[3])
    ax_ev.set_xlabel("step")
    ax_ev.set_ylabel("explained variance (val/explained_variance)")
    ax_ev.axhline(0.0, color="0.3", linestyle="--", linewidth=1, label="0 (constant predictor)")
    if _step_panel(ax_ev, run, "val/explained_variance", "explained variance") is None:
        _no_data(ax_ev, ["val/explained_variance"])
    else:
        ev = [v for v in run.series("val/explained_variance") if math.isfinite(v)]
        if min(ev) < -2:  # a cold critic can sit at -50: keep the interesting range [-2, 1] readable
            ax_ev.set_ylim(bottom=-2, top=max(1.05, max(ev) + 0.05))
            ax_ev.text(0.01, 0.02, f"clipped at -2 (min {min(ev):.3g})", transform=ax_ev.transAxes, fontsize=8,
                       color="0.4")
        warm = [s for s, w in zip(run.steps, run.series("val/warmup")) if math.isfinite(w) and w != 0]
        if warm:
            ax_ev.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="0.85", zorder=0, label="critic warmup")
        ax_ev.legend(loc="lower right", fontsize=8, framealpha=0.8)


def _alarm_legend(fig, alarms, colors) -> None:
    """The figure legend: one dotted line per alarm, with the steps it fired at."""
    from matplotlib.lines import Line2D

    by_name: dict[str, list[int]] = {}
    for step, name in alarms:
        by_name.setdefault(name, []).append(step)
    handles = [Line2D([], [], color=colors[name], linestyle=":", linewidth=2,
                      label=f"alarm {name} (step{'s' if len(st) > 1 else ''} {', '.join(map(str, st))})")
               for name, st in by_name.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)), fontsize=10,
               title="alarms (dotted lines on the step panels)", title_fontsize=10)


def _eval_panels(run, ax_win, ax_scores) -> None:
    """Win rate against the reference plotted against KL (over-optimisation shows as a gold win rate that stalls
    or falls while KL grows), and the evaluation scores over steps."""
    ax_win.set_title(EVAL_PANEL_TITLES[0])
    ax_win.set_xlabel("KL to reference on held-out prompts, nats (eval/kl)")
    ax_win.set_ylabel("win rate vs reference")
    ax_win.axhline(0.5, color="0.3", linestyle="--", linewidth=1, label="0.5 (no better than the reference)")
    kl = run.series("eval/kl")
    for key, label, color in (("eval/win_rate_vs_ref", "win rate judged by the training reward", _LEFT),
                              ("eval/gold_win_rate_vs_ref", "win rate judged by the gold reward (eval_reward)",
                               _RIGHT)):
        points = [(x, y) for x, y in zip(kl, run.series(key)) if math.isfinite(x) and math.isfinite(y)]
        if points:
            xs, ys = zip(*points)
            ax_win.plot(xs, ys, marker="o", color=color, label=label)
    ax_win.set_ylim(-0.02, 1.02)
    ax_win.legend(loc="lower right", fontsize=8, framealpha=0.8)
    ax_win.grid(True, alpha=0.3)

    ax_scores.set_title(EVAL_PANEL_TITLES[1])
    ax_scores.set_xlabel("step")
    ax_scores.set_ylabel("mean score on held-out prompts")
    for key, label in (("eval/score", "policy"), ("eval/score_ref", "reference"),
                       ("eval/gold_score", "policy, gold"), ("eval/gold_score_ref", "reference, gold")):
        points = [(st, v) for st, v in zip(run.steps, run.series(key)) if math.isfinite(v)]
        if points:
            xs, ys = zip(*points)
            ax_scores.plot(xs, ys, marker="o", linestyle="--" if "ref" in key else "-", label=label)
    ax_scores.legend(fontsize=8, framealpha=0.8)
    ax_scores.grid(True, alpha=0.3)


# -------------------------------------------------------------------------------------------------------- report


def report(run_dir) -> str:
    """Read ``<run_dir>/metrics.jsonl``, write ``<run_dir>/dashboard.png``, and return the text summary (ready to
    print; its last line is the PNG path). Raises as `load_metrics` does."""
    records = load_metrics(run_dir)
    run_dir = Path(run_dir)
    if run_dir.is_file():  # the path of metrics.jsonl itself
        run_dir = run_dir.parent
    png = run_dir / DASHBOARD_FILE
    make_dashboard(records, png, title=run_dir.resolve().name)
    parts = [f"run: {os.fspath(run_dir)}", summarize(records)]
    samples = _load_samples(run_dir)
    if samples:
        parts.append("\n".join(_summarize_samples(samples)))
    parts.append(f"dashboard: {png.resolve()}")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------- proxy vs gold


def proxy_gold_table(log_history: list[dict], before: dict | None = None) -> list[dict]:
    """The evaluations of a run with a gold scorer (`PPOTrainer(eval_reward=...)`), one row each: step, kl,
    proxy/gold scores of policy and reference, their gains (policy minus reference, same prompts and random numbers)
    and win rates. `before`: an evaluation at step 0."""
    entries = ([{**before, "step": 0}] if before else []) + [e for e in log_history if "eval/gold_score" in e]
    table = []
    for e in entries:
        table.append({
            "step": int(e["step"]),
            "kl": float(e["eval/kl"]),
            "proxy": float(e["eval/score"]),
            "proxy_ref": float(e["eval/score_ref"]),
            "proxy_gain": float(e["eval/score"]) - float(e["eval/score_ref"]),
            "gold": float(e["eval/gold_score"]),
            "gold_ref": float(e["eval/gold_score_ref"]),
            "gold_gain": float(e["eval/gold_score"]) - float(e["eval/gold_score_ref"]),
            "proxy_win_rate": float(e["eval/win_rate_vs_ref"]),
            "gold_win_rate": float(e["eval/gold_win_rate_vs_ref"]),
        })
    return table


def format_proxy_gold_table(table: list[dict]) -> str:
    lines = [f"{'step':>5} {'KL':>7} {'proxy':>8} {'Δproxy':>8} {'gold':>7} {'Δgold':>7} {'win(proxy)':>10} "
             f"{'win(gold)':>9}"]
    for r in table:
        lines.append(f"{r['step']:>5} {r['kl']:>7.2f} {r['proxy']:>+8.3f} {r['proxy_gain']:>+8.3f} {r['gold']:>+7.3f} "
                     f"{r['gold_gain']:>+7.3f} {r['proxy_win_rate']:>10.3f} {r['gold_win_rate']:>9.3f}")
    return "\n".join(lines)


def plot_proxy_vs_gold(table: list[dict], path, title: str = "") -> None:
    """Left: proxy (RM) and gold (VADER) gains over the reference against KL, on their own axes (the RM's scale is
    arbitrary). Right: the raw held-out scores of policy and reference over PPO steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_steps) = plt.subplots(1, 2, figsize=(12, 4.5))
    kl = [r["kl"] for r in table]
    ax.plot(kl, [r["proxy_gain"] for r in table], "o-", color="tab:blue", label="proxy (learned RM)")
    ax.set_xlabel("KL(policy ‖ reference), nats per completion (held out)")
    ax.set_ylabel("proxy reward gain over reference", color="tab:blue")
    ax.axhline(0.0, color="gray", lw=0.8)
    for r in table:
        ax.annotate(str(r["step"]), (r["kl"], r["proxy_gain"]), textcoords="offset points", xytext=(3, 3),
                    fontsize=7, color="tab:blue")
    gold_ax = ax.twinx()
    gold_ax.plot(kl, [r["gold_gain"] for r in table], "s--", color="tab:red", label="gold (VADER)")
    gold_ax.set_ylabel("gold reward gain over reference", color="tab:red")
    handles = ax.get_legend_handles_labels()[0] + gold_ax.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    ax.set_title("Proxy vs gold reward as KL grows (labels: PPO step)")
    ax.grid(True, alpha=0.3)

    steps = [r["step"] for r in table]
    ax_steps.plot(steps, [r["proxy"] for r in table], "o-", color="tab:blue", label="proxy, policy")
    ax_steps.plot(steps, [r["proxy_ref"] for r in table], "o:", color="tab:blue", alpha=0.5, label="proxy, reference")
    ax_steps.set_xlabel("PPO step")
    ax_steps.set_ylabel("proxy (RM) score", color="tab:blue")
    gold_steps = ax_steps.twinx()
    gold_steps.plot(steps, [r["gold"] for r in table], "s--", color="tab:red", label="gold, policy")
    gold_steps.plot(steps, [r["gold_ref"] for r in table], "s:", color="tab:red", alpha=0.5, label="gold, reference")
    gold_steps.set_ylabel("gold (VADER) score", color="tab:red")
    handles = ax_steps.get_legend_handles_labels()[0] + gold_steps.get_legend_handles_labels()[0]
    ax_steps.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    ax_steps.set_title("Held-out scores over steps")
    ax_steps.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
