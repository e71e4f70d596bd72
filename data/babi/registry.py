"""The twenty bAbI tasks by name, their fact ranges, and `generate_task`."""

from __future__ import annotations

import random
from collections.abc import Callable

from data.babi import tasks_reasoning as reasoning
from data.babi import tasks_statements as statements
from data.babi import tasks_world as world
from data.babi.sample import Sample
from models.config_errors import ConfigError

Generator = Callable[[random.Random], Sample]

# short name -> (long name as in the bAbI v1.2 files, generator, (min, max) facts per sample)
_SPECS: dict[str, tuple[str, Generator, tuple[int, int]]] = {
    "qa1": ("single-supporting-fact", world.qa1, world.QA1_FACTS),
    "qa2": ("two-supporting-facts", world.qa2, world.QA2_FACTS),
    "qa3": ("three-supporting-facts", world.qa3, world.QA3_FACTS),
    "qa4": ("two-arg-relations", reasoning.qa4, reasoning.QA4_FACTS),
    "qa5": ("three-arg-relations", world.qa5, world.QA5_FACTS),
    "qa6": ("yes-no-questions", world.qa6, world.QA6_FACTS),
    "qa7": ("counting", world.qa7, world.QA7_FACTS),
    "qa8": ("lists-sets", world.qa8, world.QA8_FACTS),
    "qa9": ("simple-negation", statements.qa9, statements.QA9_FACTS),
    "qa10": ("indefinite-knowledge", statements.qa10, statements.QA10_FACTS),
    "qa11": ("basic-coreference", statements.qa11, statements.QA11_FACTS),
    "qa12": ("conjunction", statements.qa12, statements.QA12_FACTS),
    "qa13": ("compound-coreference", statements.qa13, statements.QA13_FACTS),
    "qa14": ("time-reasoning", statements.qa14, statements.QA14_FACTS),
    "qa15": ("basic-deduction", reasoning.qa15, reasoning.QA15_FACTS),
    "qa16": ("basic-induction", reasoning.qa16, reasoning.QA16_FACTS),
    "qa17": ("positional-reasoning", reasoning.qa17, reasoning.QA17_FACTS),
    "qa18": ("size-reasoning", reasoning.qa18, reasoning.QA18_FACTS),
    "qa19": ("path-finding", reasoning.qa19, reasoning.QA19_FACTS),
    "qa20": ("agents-motivations", reasoning.qa20, reasoning.QA20_FACTS),
}

# Bumped when a task's stories change: caches built from its samples (warm starts) key on it, so none is reused.
# qa5 1: questions about a give within its story's last 6 facts (WhoWhatGave.lua), not about any give.
REVISIONS: dict[str, int] = {"qa5": 1}

TASKS: dict[str, Generator] = {name: spec[1] for name, spec in _SPECS.items()}
LONG_NAMES: dict[str, str] = {name: f"{name}_{spec[0]}" for name, spec in _SPECS.items()}
FACT_RANGES: dict[str, tuple[int, int]] = {name: spec[2] for name, spec in _SPECS.items()}
_ALIASES = {**{name: name for name in TASKS}, **{long: name for name, long in LONG_NAMES.items()}}


def task_name(task: str) -> str:
    """The short name ("qa1") of a short or long ("qa1_single-supporting-fact") task name."""
    if task not in _ALIASES:
        raise ConfigError(
            f"unknown bAbI task {task!r}; choose one of {', '.join(TASKS)} (or their long names)"
        )
    return _ALIASES[task]


def generate_task(task: str, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `task`, the same for the same seed (one `random.Random(seed)`, no global state)."""
    generator = TASKS[task_name(task)]
    if n < 0:
        raise ConfigError(f"n={n} samples: pass a count >= 0")
    rng = random.Random(seed)
    return [generator(rng) for _ in range(n)]
