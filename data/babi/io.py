"""The bAbI v1.2 text format: numbered story lines, and question lines "<n> <question>\\t<answer>\\t<ids>".

Numbering restarts at 1 with each story; supporting ids are 1-based line numbers of story lines. Official
files ask several questions per story; `read_babi` yields one `Sample` per question with the facts so far.
`write_babi` writes one story per sample.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from data.babi.sample import Sample


def write_babi(samples: Iterable[Sample], path: str | os.PathLike) -> None:
    """Write `samples` to `path`, one story per sample."""
    lines = []
    for sample in samples:
        texts = [*sample.facts, sample.question, sample.answer]
        if any("\t" in text or "\n" in text for text in texts):
            raise ValueError(
                f"bAbI text cannot hold tabs or newlines; fix the sample asking {sample.question!r}"
            )
        lines += [f"{i} {fact}" for i, fact in enumerate(sample.facts, 1)]
        ids = " ".join(str(i + 1) for i in sample.supporting)
        lines.append(f"{len(sample.facts) + 1} {sample.question}\t{sample.answer}\t{ids}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def read_babi(path: str | os.PathLike) -> list[Sample]:
    """One `Sample` per question line of the bAbI v1.2 file at `path`, supporting ids remapped to fact indices."""
    samples = []
    facts: list[str] = []
    fact_of_line: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            number, _, text = line.rstrip("\n").partition(" ")
            if not number.isdigit():
                raise ValueError(f"{where}: a bAbI line starts with its number, got {line.strip()!r}")
            if int(number) == 1:
                facts, fact_of_line = [], {}
            if "\t" not in text:
                fact_of_line[int(number)] = len(facts)
                facts.append(text.strip())
                continue
            question, answer, *ids = text.split("\t")
            try:
                supporting = [fact_of_line[int(i)] for i in " ".join(ids).split()]
            except (KeyError, ValueError):
                raise ValueError(
                    f"{where}: supporting ids {ids} must be numbers of story lines above"
                ) from None
            samples.append(Sample(list(facts), question.strip(), answer.strip(), supporting))
    return samples
