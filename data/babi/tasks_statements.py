"""bAbI tasks of statements about where people are: qa9-qa14 (negation, indefinite knowledge, coreference,
conjunction, compound coreference, time).

Ranges of facts per story: qa9 and qa10 follow BABILong's Table 1 (2-10); qa11-qa13 match the original stories
(ten facts, asked every two), so 2-10 too; qa14 tells of two to four people at two to four times of day
each, so 2-16 facts.
"""

from __future__ import annotations

import random

from data.babi.sample import Sample
from data.babi.vocab import MOVES, PEOPLE, PRONOUNS, ROOMS, THEN, TOWN_PEOPLE, TOWN_PLACES

QA9_FACTS = (2, 10)
QA10_FACTS = (2, 10)
QA11_FACTS = (2, 10)
QA12_FACTS = (2, 10)
QA13_FACTS = (2, 10)
QA14_FACTS = (2, 16)

TIMES = ("yesterday", "this morning", "this afternoon", "this evening")  # qa14, in order


def _other(rng: random.Random, places: tuple[str, ...], *avoid: str) -> str:
    place = avoid[0] if avoid else rng.choice(places)
    while place in avoid:
        place = rng.choice(places)
    return place


def qa9(rng: random.Random) -> Sample:
    """Simple negation: "John is not in the hallway." / "Is John in the hallway?" (yes/no)."""
    place = {p: rng.choice(ROOMS) for p in PEOPLE}  # true rooms
    last: dict[str, tuple[int, str, bool]] = {}  # person -> (fact, room, whether it says they are there)
    facts = []
    for at in range(rng.randint(*QA9_FACTS)):
        person = rng.choice(PEOPLE)
        kind = rng.random()
        if kind < 0.5:
            room = place[person] = _other(rng, ROOMS, place[person])
            verb = "is in" if rng.random() < 0.5 else rng.choice(MOVES)
            facts.append(f"{person} {verb} the {room}.")
        elif kind < 0.75:
            room = _other(rng, ROOMS, place[person])
            facts.append(f"{person} is not in the {room}.")
        else:  # leaves their room for an unstated one
            room = place[person]
            place[person] = _other(rng, ROOMS, room)
            facts.append(f"{person} is no longer in the {room}.")
        last[person] = (at, room, kind < 0.5)
    there = [p for p in last if last[p][2]]
    if there and rng.random() < 0.5:
        person = rng.choice(there)
        at, room, _ = last[person]
        return Sample(facts, f"Is {person} in the {room}?", "yes", [at])
    person = rng.choice(list(last))
    at, room, is_there = last[person]
    if is_there:
        room = _other(rng, ROOMS, room)
    return Sample(facts, f"Is {person} in the {room}?", "no", [at])


def qa10(rng: random.Random) -> Sample:
    """Indefinite knowledge: "Fred is either in the school or the park." / "Is Fred in the park?" (yes/no/maybe)."""
    place = {p: rng.choice(TOWN_PLACES) for p in TOWN_PEOPLE}
    last: dict[str, tuple[int, tuple[str, ...]]] = {}  # person -> (fact, the places it allows)
    facts = []
    for at in range(rng.randint(*QA10_FACTS)):
        person = rng.choice(TOWN_PEOPLE)
        here = place[person] = _other(rng, TOWN_PLACES, place[person])
        if rng.random() < 0.5:
            verb = "is in" if rng.random() < 0.5 else rng.choice(MOVES)
            facts.append(f"{person} {verb} the {here}.")
            last[person] = (at, (here,))
        else:
            pair = (here, _other(rng, TOWN_PLACES, here))
            if rng.random() < 0.5:
                pair = pair[::-1]
            facts.append(f"{person} is either in the {pair[0]} or the {pair[1]}.")
            last[person] = (at, pair)
    answer = rng.choice(("yes", "no", "maybe"))
    wanted = {"yes": 1, "maybe": 2}.get(answer)  # how many places the last fact must allow
    people = [p for p in last if wanted is None or len(last[p][1]) == wanted]
    if not people:
        answer, people = "no", list(last)
    person = rng.choice(people)
    at, allowed = last[person]
    where = _other(rng, TOWN_PLACES, *allowed) if answer == "no" else rng.choice(allowed)
    return Sample(facts, f"Is {person} in the {where}?", answer, [at])


def qa11(rng: random.Random) -> Sample:
    """Basic coreference: "Daniel went to the hallway. Afterwards he went to the bedroom." / "Where is Daniel?"

    A pronoun names the subject of the fact just before it (never another pronoun fact). People whose room
    needs the pronoun are asked about when there are any.
    """
    told: dict[str, tuple[str, list[int]]] = {}  # person -> (room, facts telling it)
    facts: list[str] = []
    named = None  # subject of the previous fact when that fact named them
    for at in range(rng.randint(*QA11_FACTS)):
        if named is not None and rng.random() < 0.5:
            room = _other(rng, ROOMS, told[named][0])
            facts.append(f"{rng.choice(THEN)} {PRONOUNS[named]} {rng.choice(MOVES)} the {room}.")
            told[named] = (room, [at - 1, at])
            named = None
        else:
            named = rng.choice(PEOPLE)
            room = _other(rng, ROOMS, told[named][0]) if named in told else rng.choice(ROOMS)
            facts.append(f"{named} {rng.choice(MOVES)} the {room}.")
            told[named] = (room, [at])
    return _ask_where(rng, facts, told)


def qa12(rng: random.Random) -> Sample:
    """Conjunction: "Daniel and Sandra journeyed to the office." / "Where is Sandra?" """
    told: dict[str, tuple[str, list[int]]] = {}
    facts = []
    for at in range(rng.randint(*QA12_FACTS)):
        pair = rng.sample(PEOPLE, 2)
        room = _other(rng, ROOMS, *(told[p][0] for p in pair if p in told))
        facts.append(f"{pair[0]} and {pair[1]} {rng.choice(MOVES)} the {room}.")
        for person in pair:
            told[person] = (room, [at])
    return _ask_where(rng, facts, told)


def qa13(rng: random.Random) -> Sample:
    """Compound coreference: "Daniel and Sandra went to the office. Then they went back to the garden."

    "They" names the pair of the fact just before it (never another "they" fact). People whose room needs the
    pronoun are asked about when there are any.
    """
    told: dict[str, tuple[str, list[int]]] = {}
    facts: list[str] = []
    pair = None  # people of the previous fact when that fact named them
    for at in range(rng.randint(*QA13_FACTS)):
        if pair is not None and rng.random() < 0.5:
            room = _other(rng, ROOMS, told[pair[0]][0])
            facts.append(f"{rng.choice(THEN)} they {rng.choice(MOVES)} the {room}.")
            for person in pair:
                told[person] = (room, [at - 1, at])
            pair = None
        else:
            pair = rng.sample(PEOPLE, 2)
            room = _other(rng, ROOMS, *(told[p][0] for p in pair if p in told))
            facts.append(f"{pair[0]} and {pair[1]} {rng.choice(MOVES)} the {room}.")
            for person in pair:
                told[person] = (room, [at])
    return _ask_where(rng, facts, told)


def _ask_where(rng: random.Random, facts: list[str], told: dict[str, tuple[str, list[int]]]) -> Sample:
    """ "Where is X?", preferring people whose room needs two facts (a pronoun and the fact it points to)."""
    people = [p for p in told if len(told[p][1]) == 2] or list(told)
    person = rng.choice(people)
    room, support = told[person]
    return Sample(facts, f"Where is {person}?", room, support)


def qa14(rng: random.Random) -> Sample:
    """Time reasoning: "Yesterday Julie went to the school." / "Where was Julie before the school?"

    Each person goes to distinct places at consecutive times of day starting yesterday; the facts come in a
    shuffled order. The question needs the place at some time and at the time before, and the story runs on
    for a random number of facts after the later of the two.
    """
    events = []  # (person, time index, place)
    for person in rng.sample(TOWN_PEOPLE, rng.randint(2, len(TOWN_PEOPLE))):
        places = rng.sample(TOWN_PLACES, rng.randint(2, len(TIMES)))
        events += [(person, t, place) for t, place in enumerate(places)]
    rng.shuffle(events)
    at = {(person, t): i for i, (person, t, _) in enumerate(events)}
    pairs = [(at[p, t - 1], i) for i, (p, t, _) in enumerate(events) if t > 0]
    support = sorted(rng.choice(pairs))
    n = rng.randint(support[1] + 1, len(events))
    facts = []
    for person, t, place in events[:n]:
        time, verb = TIMES[t], rng.choice(MOVES)
        if rng.random() < 0.5:
            facts.append(f"{time[0].upper()}{time[1:]} {person} {verb} the {place}.")
        else:
            facts.append(f"{person} {verb} the {place} {time}.")
    person, _, before = events[min(support, key=lambda i: events[i][1])]
    _, _, after = events[max(support, key=lambda i: events[i][1])]
    return Sample(facts, f"Where was {person} before the {after}?", before, support)
