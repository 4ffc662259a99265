"""A live progress bar for PPO: one tick per iteration, the phase in progress (generating, scoring, optimising) and
the latest score, KL and β. Shown on the main process unless `disable_tqdm`."""

from __future__ import annotations

from tqdm.auto import tqdm

# what the bar shows for each outermost phase (trl_ext.monitoring.phases)
LABELS = {"generation": "generating", "reference": "scoring", "policy_and_value": "scoring", "reward": "scoring",
          "update": "optimising", "critic_warmup": "optimising critic", "evaluation": "evaluating"}


class PPOProgress:
    """A listener of `Phases`: the label follows the outermost phase."""

    def __init__(self, total: int, initial: int = 0, disable: bool = False):
        self.bar = tqdm(total=total, initial=initial, desc="PPO", disable=disable, dynamic_ncols=True, unit="it")
        self.postfix: dict[str, str] = {}
        self.depth = 0
        self.label = None

    def start(self, phase: str) -> None:
        if self.depth == 0 and LABELS[phase] != self.label:
            self.label = LABELS[phase]
            self.bar.set_description(f"PPO [{self.label}]", refresh=True)
        self.depth += 1

    def stop(self, phase: str) -> None:
        self.depth -= 1

    def step(self, metrics: dict) -> None:
        """One iteration done: show its score, KL and β."""
        for key, label in (("objective/scores", "score"), ("objective/kl", "kl"), ("objective/kl_coef", "beta")):
            if key in metrics:
                self.postfix[label] = f"{metrics[key]:.3g}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
