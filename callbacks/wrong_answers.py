"""qa1's answers by what they name: `evaluate.py eval=[wrong_answers]`.

A qa1 story moves a few people between six locations and asks where one of them is now. A wrong answer that names
another person's current location means the model kept the story's state but not who is where (binding); one that
names an earlier location of the story, that it kept a stale state; one that names no location of the story, that
it kept nothing of it. Counted with the memory carried and reset every segment (models without memory: carried only).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from callbacks.fact_distance import test_batches
from models.config_errors import ConfigError
from models.lit_module import scored_positions

KINDS = {  # key: label
    "right": "right",
    "other_person": "another person's current location",
    "earlier": "an earlier location of the story",
    "not_in_story": "not in the story",
}


def moves(facts: list[str]) -> list[tuple[str, str]]:
    """(person, location) of each fact of a qa1 story ("Mary moved to the garden.")."""
    return [(w[0], w[-1]) for w in (f.rstrip(". ").split() for f in facts)]


def current_locations(facts: list[str]) -> dict[str, str]:
    """Each person's latest location in a qa1 story (later facts overwrite earlier ones)."""
    return dict(moves(facts))


def answer_kind(facts: list[str], supporting: int, answer: str, predicted: str) -> str:
    """The KINDS key of a qa1 sample: its story `facts` ("Mary moved to the garden."), the index of its supporting
    fact, the right answer and the predicted one."""
    if predicted == answer:
        return "right"
    story = moves(facts)
    asked = story[supporting][0]
    if predicted in {loc for person, loc in dict(story).items() if person != asked}:
        return "other_person"
    if predicted in {loc for _, loc in story}:
        return "earlier"
    return "not_in_story"


def predicted_answers(logits: torch.Tensor, batch: dict, tokenizer) -> list[str]:
    """Each row's teacher-forced argmax over its answer positions, decoded (the answer greedy decoding gives when it
    is right; its first word otherwise)."""
    scored = scored_positions(batch["labels"])
    rows, is_answer = scored.nonzero()[:, 0], batch["answer_mask"][scored]
    pred = logits.argmax(-1)
    out = []
    for r in range(len(batch["input_ids"])):
        ids = pred[(rows == r) & is_answer].tolist()
        text = tokenizer.decode([i for i in ids if i != tokenizer.eos_id]).strip()
        out.append(text.split()[0] if text else "")
    return out


@torch.no_grad()
def wrong_answers(
    model: nn.Module,
    tokenizer,
    corpus,
    out_dir: Path,
    lengths: tuple[int, ...] = (4096, 16384),
    n: int = 100,
    batch_size: int = 8,
    seed: int = 0,
    answer_prompt: str = "Answer:",
) -> dict[str, float]:
    """Share of each answer kind among `n` qa1 test samples (the BABILong evaluator's, same seed) per length, memory
    carried and reset, and `random_person`: the accuracy of answering with a random person's current location (what
    a model that kept the story's state but not who is where would score). Writes wrong_answers.json and
    wrong_answers.png (random_person as a black line); returns `wrong_answers/<length>/<memory>/<kind>` (KINDS
    keys) and `wrong_answers/<length>/random_person`."""
    from data.babilong import length_name

    if not lengths:
        raise ConfigError("eval.wrong_answers.lengths is empty; give context lengths in tokens, e.g. [4096].")
    device = next(model.parameters()).device
    memories = ("carried", "reset") if hasattr(model, "segment_bounds") else ("carried",)
    table: dict[str, dict[str, Counter]] = {}
    random_person: dict[str, list[float]] = {}
    for length in lengths:
        dataset, batches = test_batches(
            tokenizer, corpus, "qa1", length, n, batch_size, seed, answer_prompt, device, "wrong answers"
        )
        tasks, samples = dataset.tasks, iter(dataset.indices)
        cells = table[length_name(length)] = {m: Counter() for m in memories}
        chance = random_person[length_name(length)] = []
        for batch in batches:
            predicted = {}
            for memory in memories:
                kwargs = {"recurrent": memory == "carried"} if len(memories) == 2 else {}
                predicted[memory] = predicted_answers(model(batch, **kwargs).logits, batch, tokenizer)
            for row in range(len(batch["input_ids"])):
                k = int(next(samples))
                facts = [tokenizer.decode(f.tolist()) for f in tasks.facts[k]]
                answer = tokenizer.decode(tasks.answer[k].tolist()).strip()
                chance.append(float(np.mean([loc == answer for loc in current_locations(facts).values()])))
                for memory, words in predicted.items():
                    cells[memory][answer_kind(facts, tasks.supporting[k][0], answer, words[row])] += 1
    summary = {
        size: {
            m: {kind: c[kind] / sum(c.values()) for kind in KINDS} | {"n": sum(c.values())}
            for m, c in row.items()
        }
        for size, row in table.items()
    }
    chance = {size: float(np.mean(v)) for size, v in random_person.items()}
    (Path(out_dir) / "wrong_answers.json").write_text(
        json.dumps({"seed": seed, "share": summary, "random_person": chance}, indent=1)
    )
    plot_wrong_answers(summary, chance, Path(out_dir) / "wrong_answers.png")
    metrics = {f"wrong_answers/{size}/random_person": c for size, c in chance.items()}
    for size, row in summary.items():
        for m, share in row.items():
            metrics |= {f"wrong_answers/{size}/{m}/{kind}": share[kind] for kind in KINDS}
    return metrics


def plot_wrong_answers(summary: dict, random_person: dict, path: Path) -> None:
    """One stacked bar per length and memory setting: the share of each answer kind; a black line at the accuracy
    of a random person's current location."""
    bars = [(f"{size}\n{m}", share) for size, row in summary.items() for m, share in row.items()]
    chance = [random_person[size] for size, row in summary.items() for _ in row]
    fig = Figure(figsize=(3.8 + 0.8 * len(bars), 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bottom = np.zeros(len(bars))
    for (kind, label), color in zip(
        KINDS.items(), ("tab:green", "tab:orange", "tab:purple", "tab:gray"), strict=True
    ):
        heights = np.array([share[kind] for _, share in bars])
        ax.bar(range(len(bars)), heights, bottom=bottom, color=color, label=label)
        bottom += heights
    ax.hlines(
        chance,
        np.arange(len(bars)) - 0.4,
        np.arange(len(bars)) + 0.4,
        color="k",
        label="random person's location",
    )
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set(ylabel="share of answers", ylim=(0, 1), title="BABILong qa1: what the answers name")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.savefig(path, dpi=120)
