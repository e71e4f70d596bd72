"""One bAbI question with the story before it, and how long generated stories are."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """The facts of a story up to one question, the question, its answer and the facts it needs.

    `supporting` holds 0-based indices into `facts`, ascending. Answers follow bAbI v1.2: one word, a comma list
    ("apple,football", "nothing"), directions ("n,w"), yes/no/maybe or a count word ("none", "one", ...).
    """

    facts: list[str]
    question: str
    answer: str
    supporting: list[int]

    def __post_init__(self) -> None:
        if any(not 0 <= i < len(self.facts) for i in self.supporting):
            raise ValueError(
                f"supporting fact indices {self.supporting} must lie in [0, {len(self.facts)}) "
                f"for a story of {len(self.facts)} facts"
            )


def story_length(rng: random.Random, lo: int, hi: int) -> int:
    """Number of facts in a story, in [lo, hi]: uniform for short ranges, log-uniform for long ones.

    Log-uniform keeps most long-range stories short, as in the original bAbI, while the longest ones still occur.
    """
    if hi - lo <= 16:
        return rng.randint(lo, hi)
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
