"""bAbI tasks asked about the `World` of people, rooms and objects: qa1-qa3 and qa5-qa8.

Each story gets a drawn number of facts (`story_length` over the ranges below, those of BABILong's Table 1); a
story that offers no question is played again with the same length, which keeps the length distribution.
The question is about the end of the story; earlier questions of the original stories are not facts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

from data.babi.sample import Sample, story_length
from data.babi.vocab import COUNTS, GIVERS, OBJECTS, PEOPLE, ROOMS
from data.babi.world import World

QA1_FACTS = (2, 10)
QA2_FACTS = (2, 68)
QA3_FACTS = (4, 320)
QA5_FACTS = (2, 126)
QA6_FACTS = (2, 26)
QA7_FACTS = (2, 52)
QA8_FACTS = (2, 50)

_TRIES = 1000


def _play(
    rng: random.Random,
    facts: tuple[int, int],
    ask: Callable[[World], Sample | None],
    people: tuple[str, ...] = PEOPLE,
    *,
    stay: float = 0.3,
    follow: float = 0.0,
    **weights: float,
) -> Sample:
    n = story_length(rng, *facts)
    for _ in range(_TRIES):
        world = World(rng, people, stay=stay, follow=follow)
        for _ in range(n):
            world.act(**weights)
        sample = ask(world)
        if sample is not None:
            return sample
    raise RuntimeError(
        f"no story of {n} facts offered a question in {_TRIES} tries; raise the action weights"
    )


def qa1(rng: random.Random) -> Sample:
    """Single supporting fact: "Mary moved to the bathroom." / "Where is Mary?" """
    return _play(rng, QA1_FACTS, _where_is_person, move=1.0)


def qa2(rng: random.Random) -> Sample:
    """Two supporting facts: "John picked up the apple there. John went to the office." / "Where is the apple?" """
    return _play(rng, QA2_FACTS, _where_is_object, move=4.0, pick_up=1.0, drop=0.6)


def qa3(rng: random.Random) -> Sample:
    """Three supporting facts: "Where was the football before the kitchen?", the kitchen being where it is now."""
    return _play(rng, QA3_FACTS, _where_was_object, stay=0.5, move=4.0, pick_up=1.0, drop=0.5)


def qa5(rng: random.Random) -> Sample:
    """Three-argument relations: "Fred gave the football to Bill." / "Who gave the football to Bill?" """
    asked = partial(_who_gave, after=rng.randint(0, GIVE_ASKED_WITHIN))
    return _play(rng, QA5_FACTS, asked, GIVERS, follow=0.5, move=1.0, pick_up=1.0, drop=0.3, give=1.5)


def qa6(rng: random.Random) -> Sample:
    """Yes/no questions: "Is Daniel in the hallway?" among moves, pick-ups and drops."""
    return _play(rng, QA6_FACTS, _is_person_in, move=3.0, pick_up=0.5, drop=0.3)


def qa7(rng: random.Random) -> Sample:
    """Counting: "How many objects is Daniel carrying?", answered "none", "one", "two" ..."""
    return _play(rng, QA7_FACTS, _how_many, move=2.0, pick_up=1.0, drop=0.6, give=0.4)


def qa8(rng: random.Random) -> Sample:
    """Lists/sets: "What is Daniel carrying?", answered "apple,milk" in the order got, or "nothing"."""
    return _play(rng, QA8_FACTS, _what_carried, move=2.0, pick_up=1.0, drop=0.6, give=0.4)


def _where_is_person(world: World) -> Sample | None:
    moved = [p for p in world.people if world.moved_at[p] is not None]
    if not moved:
        return None
    person = world.rng.choice(moved)
    return Sample(world.facts, f"Where is {person}?", world.place[person], [world.moved_at[person]])


def _is_person_in(world: World) -> Sample | None:
    moved = [p for p in world.people if world.moved_at[p] is not None]
    if not moved:
        return None
    person = world.rng.choice(moved)
    room = world.place[person]
    if world.rng.random() < 0.5:
        while room == world.place[person]:
            room = world.rng.choice(ROOMS)
    answer = "yes" if room == world.place[person] else "no"
    return Sample(world.facts, f"Is {person} in the {room}?", answer, [world.moved_at[person]])


def _where_is_object(world: World) -> Sample | None:
    told = [(o, t) for o in OBJECTS if (t := world.told_place(o)) is not None]
    if not told:
        return None
    obj, (room, support) = world.rng.choice(told)
    return Sample(world.facts, f"Where is the {obj}?", room, support)


def _where_was_object(world: World) -> Sample | None:
    moved = [o for o in OBJECTS if world.came_from[o] is not None]
    if not moved:
        return None
    obj = world.rng.choice(moved)
    room, support = world.came_from[obj]
    return Sample(world.facts, f"Where was the {obj} before the {world.object_place(obj)}?", room, support)


_GIVE_QUESTIONS = (  # the question about a give, the slot it asks
    ("Who gave the {obj}?", "giver"),
    ("Who received the {obj}?", "receiver"),
    ("Who gave the {obj} to {receiver}?", "giver"),
    ("Who did {giver} give the {obj} to?", "receiver"),
    ("What did {giver} give to {receiver}?", "obj"),
)
GIVE_ASKED_WITHIN = 5  # facts after the asked give at most (bAbI's WhoWhatGave: 0-5, drawn uniformly)


def _who_gave(world: World, after: int) -> Sample | None:
    """About the give `after` facts before the story's end (fewer in a short story), as bAbI's WhoWhatGave asks:
    right after a give or after up to 5 more facts, none of them naming its object or another give from the same
    giver to the same receiver (so each question shape has one answer and no later fact matches the give in part)."""
    at = len(world.facts) - 1 - min(after, len(world.facts) - 2)
    give = next((g for g in world.gives if g["at"] == at), None)
    if give is None or not _last_word_on(world, give):
        return None
    template, asked = world.rng.choice(_GIVE_QUESTIONS)
    return Sample(world.facts, template.format(**give), give[asked], [give["at"]])


def _last_word_on(world: World, give: dict[str, str | int]) -> bool:
    """No fact after `give` names its object, and no later give goes from its giver to its receiver."""
    later = world.facts[int(give["at"]) + 1 :]
    pair = (give["giver"], give["receiver"])
    return all(give["obj"] not in fact.rstrip(".").split() for fact in later) and not any(
        (g["giver"], g["receiver"]) == pair for g in world.gives if g["at"] > give["at"]
    )


def _dealt_with(world: World) -> tuple[str, list[int]] | None:
    """A person who got something at some point, and the latest getting and letting go of each object."""
    dealt = [p for p in world.people if world.dealings[p]]
    if not dealt:
        return None
    person = world.rng.choice(dealt)
    support = sorted(at for span in world.dealings[person].values() for at in span if at is not None)
    return person, support


def _how_many(world: World) -> Sample | None:
    dealt = _dealt_with(world)
    if dealt is None:
        return None
    person, support = dealt
    count = COUNTS[len(world.carrying[person])]
    return Sample(world.facts, f"How many objects is {person} carrying?", count, support)


def _what_carried(world: World) -> Sample | None:
    dealt = _dealt_with(world)
    if dealt is None:
        return None
    person, support = dealt
    answer = ",".join(world.carrying[person]) or "nothing"
    return Sample(world.facts, f"What is {person} carrying?", answer, support)
