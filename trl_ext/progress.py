"""A live progress bar for PPO: one tick per iteration, the phase in progress (generating, scoring, optimising) and
the latest score, KL and β. Shown on the main process unless `disable_tqdm`."""

from __future__ import annotations

from tqdm.auto import tqdm


class PPOProgress:
    def __init__(self, total: int, initial: int = 0, disable: bool = False):
        self.bar = tqdm(total=total, initial=initial, desc="PPO", disable=disable, dynamic_ncols=True, unit="it")
        self.postfix: dict[str, str] = {}

    def phase(self, name: str) -> None:
        """Show what the current iteration is doing."""
        self.bar.set_description(f"PPO [{name}]", refresh=True)

    def step(self, metrics: dict) -> None:
        """One iteration done: show its score, KL and β."""
        for key, label in (("objective/scores", "score"), ("objective/kl", "kl"), ("objective/kl_coef", "beta")):
            if key in metrics:
                self.postfix[label] = f"{metrics[key]:.3g}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
