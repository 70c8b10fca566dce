"""A verifier plug-in for multiple-choice rows (GPQA / MMLU style, ``"answer": "C"``): the
response's last ``Answer: X`` against the row's letter.

List it in a config's ``trainer.callbacks`` in place of `MathReward`, or add it:

    vapo fit -c my_config.yaml --trainer.callbacks+=examples.rewards.multiple_choice.MultipleChoice

It shows the two parts of the plug-in API a verifier uses: `correct_threshold` (a score above
it counts as correct in `rollout/accuracy`, `val/accuracy` and the positive-example NLL), and
`SampleError` for a row it cannot score (counted in `reward/errors`, never a silent zero).
"""

import re
from collections.abc import Sequence

from vapo_lightning.rewards import RewardCallback, Sample, SampleError

ANSWER = re.compile(r"(?i)\banswer\s*:\s*\(?([a-z])\)?(?![a-z])")


class MultipleChoice(RewardCallback):
    """`correct` when the last ``Answer: X`` (or ``Answer: (X)``) names the row's letter,
    else `wrong` (another letter, or no answer).

    Args:
        letters: the choices a row's answer may be.
        correct, wrong: the two reward values.
    """

    def __init__(self, letters: str = "ABCD", correct: float = 1.0, wrong: float = -1.0, **kwargs):
        super().__init__(**kwargs)
        self.letters = letters.upper()
        self.correct, self.wrong = float(correct), float(wrong)
        self.correct_threshold = (self.correct + self.wrong) / 2

    def score_one(self, sample: Sample) -> float | SampleError:
        gold = str(sample.ground_truth or "").strip().strip("()").upper()
        if len(gold) != 1 or gold not in self.letters:
            return SampleError(f"answer {sample.ground_truth!r} is not one of {self.letters}", kind="bad answer")
        found = ANSWER.findall(sample.response)
        return self.correct if found and found[-1].upper() == gold else self.wrong

    def score(self, samples: Sequence[Sample]) -> list[float | SampleError]:
        return [self.score_one(s) for s in samples]
