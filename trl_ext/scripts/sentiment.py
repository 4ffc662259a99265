"""The shipped opinion prompts and the VADER sentiment scorer, shared by the sentiment recipes and notebooks.

- `load_prompts(split)`: the prompts of `trl_ext/scripts/assets/opinion_prompts.jsonl`, written for this project: 80
  requests for a review or an opinion ("Write a short review of a bakery.", "What do you think of rainy days?"), 64
  in the "train" split and 16 held out in "test" (chosen at random once, seed 0, and stored in the file).
- `vader_reward(prompts, completions)`: the VADER compound sentiment of each completion, in [-1, 1] (Hutto & Gilbert
  2014, the `vaderSentiment` package: a lexicon and rules nobody here wrote). The prompt is not scored.
- `prompt_dataset(split)`: a `datasets.Dataset` with a conversational `prompt` column, the form `PPOTrainer` renders
  with the tokenizer's chat template.
"""

from __future__ import annotations

import json
import pathlib

PROMPTS_FILE = pathlib.Path(__file__).resolve().parent / "assets" / "opinion_prompts.jsonl"
SPLITS = ("train", "test")

_analyzer = None


def load_prompts(split: str = "train") -> list[str]:
    """The prompts of one split of the shipped prompt set, in file order."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}.")
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return [row["prompt"] for row in rows if row["split"] == split]


def prompt_dataset(split: str = "train", instruction: str = "", repeats: int = 1):
    """The split as a conversational prompt dataset: one user message per row, the prompt with `instruction`
    appended, each prompt `repeats` times in a row."""
    from datasets import Dataset

    texts = [p + instruction for p in load_prompts(split) for _ in range(repeats)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts]})


def vader_scores(texts: list[str]) -> list[float]:
    """VADER compound sentiment of each text: -1 (most negative) .. +1 (most positive), 0 for neutral or empty."""
    global _analyzer
    if _analyzer is None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as err:
            raise ImportError("The sentiment recipes score with VADER: pip install vaderSentiment "
                              "(or pip install -e '.[recipes]').") from err
        _analyzer = SentimentIntensityAnalyzer()
    return [float(_analyzer.polarity_scores(text)["compound"]) for text in texts]


def vader_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Reward function for PPOTrainer (and the gold scorer of the three-stage recipe): the completion's sentiment."""
    return vader_scores(completions)
