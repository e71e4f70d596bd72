"""Clean-room generators for the twenty bAbI tasks (Weston et al. 2015, "Towards AI-complete question
answering"), written from the task descriptions, and readers/writers for the bAbI v1.2 text format.

    from data.babi import generate_task, Sample, TASKS, read_babi, write_babi
    samples = generate_task("qa1", n=1000, seed=0)   # list[Sample]: facts, question, answer, supporting

Each task is a small world simulation; a sample is one question with the story before it. Facts per sample
span BABILong's Table 1 for qa1-qa10 and the original stories for qa11-qa20 (`FACT_RANGES`).
Command line: `python -m data.babi --help`.
"""

from data.babi.io import read_babi, write_babi
from data.babi.registry import FACT_RANGES, LONG_NAMES, REVISIONS, TASKS, generate_task, task_name
from data.babi.sample import Sample

__all__ = [
    "FACT_RANGES",
    "LONG_NAMES",
    "REVISIONS",
    "TASKS",
    "Sample",
    "generate_task",
    "read_babi",
    "task_name",
    "write_babi",
]
