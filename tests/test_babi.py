"""bAbI generators: every answer re-derived by an independent reader of the fact sentences (from the whole story
and from the supporting facts alone), fact ranges, determinism, the v1.2 format and the command line.

The reader below parses sentences back into world state with its own grammar and rules; it shares no code with
`data.babi` beyond the sample it checks.
"""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict

import pytest

from data.babi import FACT_RANGES, TASKS, Sample, generate_task, read_babi, write_babi
from data.babi.__main__ import main
from data.babi.sample import story_length

N_CHECKED = 200

# ----- the reader's grammar -----
_GO = r"(?:moved|went|went back|journeyed|travelled) to"
MOVE = re.compile(rf"^(\w+) {_GO} the (\w+)\.$")
PICK = re.compile(r"^(\w+) (?:picked up|got|grabbed|took) the (\w+) there\.$")
DROP = re.compile(r"^(\w+) (?:dropped|put down|discarded|left) the (\w+)\.$")
GIVE = re.compile(r"^(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\.$")
IS_IN = re.compile(r"^(\w+) is in the (\w+)\.$")
NOT_IN = re.compile(r"^(\w+) is not in the (\w+)\.$")
NO_LONGER = re.compile(r"^(\w+) is no longer in the (\w+)\.$")
EITHER = re.compile(r"^(\w+) is either in the (\w+) or the (\w+)\.$")
AND = re.compile(rf"^(\w+) and (\w+) {_GO} the (\w+)\.$")
PRONOUN = re.compile(rf"^(?:Then|Afterwards|After that|Following that) (he|she|they) {_GO} the (\w+)\.$")
GENDER = {"Mary": "she", "Sandra": "she", "John": "he", "Daniel": "he"}
COUNT_WORDS = ["none", "one", "two", "three", "four"]


class Undetermined(AssertionError):
    """The facts read do not tell the answer."""


def need(condition: bool, message: str) -> None:
    if not condition:
        raise Undetermined(message)


def ask(pattern: str, question: str) -> tuple[str, ...] | None:
    match = re.fullmatch(pattern, question)
    return None if match is None else match.groups()


class Objects:
    """qa1-qa3, qa5-qa8: who is where, who holds what, where objects lie, who gave what to whom."""

    def __init__(self, facts: list[str], strict: bool) -> None:
        self.strict = strict
        self.room: dict[str, str] = {}
        self.holder: dict[str, str] = {}
        self.floor: dict[str, str] = {}
        self.carried: dict[str, list[str]] = defaultdict(list)
        self.before: dict[str, str | None] = {}
        self.gives: list[tuple[str, str, str]] = []
        for fact in facts:
            self.read(fact)

    def where(self, obj: str) -> str | None:
        return self.room.get(self.holder[obj]) if obj in self.holder else self.floor.get(obj)

    def read(self, fact: str) -> None:
        if m := MOVE.match(fact):
            person, room = m.groups()
            assert not self.strict or self.room.get(person) != room, f"{fact!r}: already there"
            for obj in self.carried[person]:
                self.before[obj] = self.where(obj)
            self.room[person] = room
        elif m := PICK.match(fact):
            person, obj = m.groups()
            assert not self.strict or obj not in self.holder, f"{fact!r}: {self.holder.get(obj)} holds it"
            self.same_room(person, self.floor.pop(obj, None), fact)
            self.take(person, obj)
        elif m := DROP.match(fact):
            person, obj = m.groups()
            assert not self.strict or self.holder.get(obj) == person, f"{fact!r}: not holding it"
            self.release(obj)
            if person in self.room:
                self.floor[obj] = self.room[person]
        elif m := GIVE.match(fact):
            giver, obj, receiver = m.groups()
            assert not self.strict or self.holder.get(obj) == giver, f"{fact!r}: not holding it"
            self.same_room(receiver, self.room.get(giver), fact)
            self.same_room(giver, self.room.get(receiver), fact)
            self.release(obj)
            self.take(receiver, obj)
            self.gives.append((giver, obj, receiver))
        else:
            raise AssertionError(f"unreadable fact {fact!r}")

    def same_room(self, person: str, room: str | None, fact: str) -> None:
        """`person` stands in `room` (when known): check it, or learn it."""
        if room is not None:
            assert self.room.get(person, room) == room, f"{fact!r}: {person} is in the {self.room[person]}"
            self.room[person] = room

    def take(self, person: str, obj: str) -> None:
        self.holder[obj] = person
        self.carried[person].append(obj)

    def release(self, obj: str) -> None:
        if obj in self.holder:
            self.carried[self.holder.pop(obj)].remove(obj)

    def answer(self, question: str) -> str:
        if q := ask(r"Where is ([A-Z]\w+)\?", question):
            need(q[0] in self.room, "where the person is")
            return self.room[q[0]]
        if q := ask(r"Where is the (\w+)\?", question):
            need(self.where(q[0]) is not None, "where the object is")
            return self.where(q[0])
        if q := ask(r"Where was the (\w+) before the (\w+)\?", question):
            obj, room = q
            need(self.where(obj) == room, f"the {obj} is in the {room} now")
            need(self.before.get(obj) is not None, "where it was before its latest move")
            return self.before[obj]
        if q := ask(r"Is (\w+) in the (\w+)\?", question):
            need(q[0] in self.room, "where the person is")
            return "yes" if self.room[q[0]] == q[1] else "no"
        if q := ask(r"How many objects is (\w+) carrying\?", question):
            return COUNT_WORDS[len(self.carried[q[0]])]
        if q := ask(r"What is (\w+) carrying\?", question):
            return ",".join(self.carried[q[0]]) or "nothing"
        return self.answer_give(question)

    def answer_give(self, question: str) -> str:
        shapes = [  # question, the slots it names, the slot it asks (0 giver, 1 object, 2 receiver)
            (r"Who gave the (\w+)\?", (1,), 0),
            (r"Who received the (\w+)\?", (1,), 2),
            (r"Who gave the (\w+) to (\w+)\?", (1, 2), 0),
            (r"Who did (\w+) give the (\w+) to\?", (0, 1), 2),
            (r"What did (\w+) give to (\w+)\?", (0, 2), 1),
        ]
        for pattern, named, asked in shapes:
            if q := ask(pattern, question):
                matching = [g for g in self.gives if tuple(g[i] for i in named) == q]
                need(bool(matching), "a matching give")
                return matching[-1][asked]
        raise AssertionError(f"unreadable question {question!r}")


class Beliefs:
    """qa9-qa13: where people may be, after plain, negated, either-or, conjoined and pronoun statements."""

    def __init__(self, facts: list[str], strict: bool) -> None:
        self.strict = strict
        self.possible: dict[str, set[str]] = {}
        self.excluded: dict[str, set[str]] = defaultdict(set)
        self.subjects: list[str] | None = None  # people the previous fact named
        for fact in facts:
            self.read(fact)

    def read(self, fact: str) -> None:
        if m := MOVE.match(fact) or IS_IN.match(fact):
            self.at([m[1]], {m[2]})
        elif m := EITHER.match(fact):
            self.at([m[1]], {m[2], m[3]})
        elif m := AND.match(fact):
            self.at([m[1], m[2]], {m[3]})
        elif m := PRONOUN.match(fact):
            need(self.subjects is not None, f"{fact!r}: whom the pronoun names")
            expected = "they" if len(self.subjects) == 2 else GENDER[self.subjects[0]]
            assert m[1] == expected, f"{fact!r}: {m[1]} cannot name {self.subjects}"
            self.at(self.subjects, {m[2]}, named=False)
        elif m := NOT_IN.match(fact):
            person, room = m.groups()
            assert not self.strict or self.possible.get(person) != {room}, (
                f"{fact!r}: contradicts a fact above"
            )
            self.excluded[person].add(room)
            if person in self.possible:
                self.possible[person].discard(room)
            self.subjects = [person]
        elif m := NO_LONGER.match(fact):
            person, room = m.groups()
            assert not self.strict or room in self.possible.get(person, {room}), f"{fact!r}: was not there"
            self.possible.pop(person, None)
            self.excluded[person] = {room}
            self.subjects = [person]
        else:
            raise AssertionError(f"unreadable fact {fact!r}")

    def at(self, people: list[str], rooms: set[str], named: bool = True) -> None:
        for person in people:
            self.possible[person] = set(rooms)
            self.excluded[person] = set()
        if named:
            self.subjects = people

    def answer(self, question: str) -> str:
        if q := ask(r"Where is (\w+)\?", question):
            rooms = self.possible.get(q[0], set())
            need(len(rooms) == 1, "one room")
            return next(iter(rooms))
        person, room = ask(r"Is (\w+) in the (\w+)\?", question)
        rooms = self.possible.get(person)
        if room in self.excluded[person] or (rooms is not None and room not in rooms):
            return "no"
        need(rooms is not None, "where the person may be")
        return "yes" if rooms == {room} else "maybe"


TIMES = {"yesterday": 0, "this morning": 1, "this afternoon": 2, "this evening": 3}
_WHEN = "|".join(TIMES)
TIMED = re.compile(rf"^(?:({_WHEN}) )?(\w+) {_GO} the (\w+)(?: ({_WHEN}))?\.$", re.IGNORECASE)


def answer_time(facts: list[str], question: str, strict: bool) -> str:
    place: dict[tuple[str, int], str] = {}
    for fact in facts:
        m = TIMED.match(fact)
        assert m and bool(m[1]) != bool(m[4]), f"unreadable fact {fact!r}"
        person, room, when = m[2], m[3], TIMES[(m[1] or m[4]).lower()]
        assert (person, when) not in place, f"{fact!r}: two places at one time"
        place[person, when] = room
    person, room = ask(r"Where was (\w+) before the (\w+)\?", question)
    times = [t for (p, t), r in place.items() if p == person and r == room]
    assert len(times) <= 1, f"{person} was in the {room} twice"
    need(len(times) == 1 and (person, times[0] - 1) in place, "the place at the time before")
    return place[person, times[0] - 1]


OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
STEP = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
RELATION = re.compile(r"^The (\w+) is (north|south|east|west) of the (\w+)\.$")


def relations(facts: list[str]) -> set[tuple[str, str, str]]:
    """(a, direction, b) for "a is direction of b", both ways round."""
    out = set()
    for fact in facts:
        m = RELATION.match(fact)
        assert m, f"unreadable fact {fact!r}"
        out |= {(m[1], m[2], m[3]), (m[3], OPPOSITE[m[2]], m[1])}
    return out


def answer_directions(facts: list[str], question: str, strict: bool) -> str:
    known = relations(facts)
    if q := ask(r"What is (\w+) of the (\w+)\?", question):
        found = {a for a, way, b in known if (way, b) == q}
    else:
        room, way = ask(r"What is the (\w+) (\w+) of\?", question)
        found = {b for a, w, b in known if (a, w) == (room, way)}
    need(len(found) == 1, "one room")
    return found.pop()


def answer_path(facts: list[str], question: str, strict: bool) -> str:
    start, goal = ask(r"How do you go from the (\w+) to the (\w+)\?", question)
    walks = {(b, way): a for a, way, b in relations(facts)}  # from b, walking `way`, one reaches a
    routes = [[start]]
    paths: list[list[str]] = [[]]
    while routes and goal not in [r[-1] for r in routes]:
        routes, paths = (
            [r + [walks[r[-1], w]] for r in routes for w in STEP if (r[-1], w) in walks],
            [p + [w] for r, p in zip(routes, paths, strict=True) for w in STEP if (r[-1], w) in walks],
        )
    found = [",".join(w[0] for w in p) for r, p in zip(routes, paths, strict=True) if r[-1] == goal]
    need(len(set(found)) == 1, "one shortest route")
    return found[0]


SINGULAR = {"mice": "mouse", "sheep": "sheep", "wolves": "wolf", "cats": "cat"}


def answer_deduction(facts: list[str], question: str, strict: bool) -> str:
    fears, kind = {}, {}
    for fact in facts:
        if m := re.match(r"^(\w+) are afraid of (\w+)\.$", fact):
            fears[SINGULAR[m[1].lower()]] = SINGULAR[m[2]]
        elif m := re.match(r"^(\w+) is an? (\w+)\.$", fact):
            kind[m[1].lower()] = m[2]
        else:
            raise AssertionError(f"unreadable fact {fact!r}")
    (name,) = ask(r"What is ([a-z]+) afraid of\?", question)
    need(name in kind and kind[name] in fears, "the kind and what it fears")
    return fears[kind[name]]


def answer_induction(facts: list[str], question: str, strict: bool) -> str:
    kind, color = {}, {}
    for fact in facts:
        if m := re.match(r"^(\w+) is a (\w+)\.$", fact):
            kind[m[1]] = m[2]
        elif m := re.match(r"^(\w+) is (\w+)\.$", fact):
            color[m[1]] = m[2]
        else:
            raise AssertionError(f"unreadable fact {fact!r}")
    by_kind = defaultdict(set)
    for name, c in color.items():
        if name in kind:
            by_kind[kind[name]].add(c)
    assert not strict or all(len(c) == 1 for c in by_kind.values()), f"one species, two colours: {by_kind}"
    (name,) = ask(r"What color is (\w+)\?", question)
    need(name not in color, "the colour is not stated outright")
    need(len(by_kind.get(kind.get(name), ())) == 1, "one colour among the same species")
    return next(iter(by_kind[kind[name]]))


SIDE = {"above": (0, 1), "below": (0, -1), "to the right of": (1, 0), "to the left of": (-1, 0)}
_SIDES = "|".join(SIDE)


def answer_positions(facts: list[str], question: str, strict: bool) -> str:
    offsets = {}  # (a, b) -> position of a minus position of b
    for fact in facts:
        m = re.match(rf"^The (.+) is ({_SIDES}) the (.+)\.$", fact)
        assert m, f"unreadable fact {fact!r}"
        dx, dy = SIDE[m[2]]
        offsets[m[1], m[3]], offsets[m[3], m[1]] = (dx, dy), (-dx, -dy)
    a, side, b = ask(rf"Is the (.+) ({_SIDES}) the (.+)\?", question)
    paths = [(x, y, z) for (x, y) in offsets for (y2, z) in offsets if y2 == y and (x, z) == (a, b)]
    need(bool(paths), "a chain of two facts between the shapes")
    x, y, z = paths[0]
    dx = offsets[x, y][0] + offsets[y, z][0]
    dy = offsets[x, y][1] + offsets[y, z][1]
    holds = {"above": dy > 0, "below": dy < 0, "to the right of": dx > 0, "to the left of": dx < 0}[side]
    return "yes" if holds else "no"


def answer_sizes(facts: list[str], question: str, strict: bool) -> str:
    smaller = set()  # (a, b): a is smaller than b
    for fact in facts:
        if m := re.match(r"^The (.+) fits inside the (.+)\.$", fact):
            smaller.add((m[1], m[2]))
        elif m := re.match(r"^The (.+) is bigger than the (.+)\.$", fact):
            smaller.add((m[2], m[1]))
        else:
            raise AssertionError(f"unreadable fact {fact!r}")
    while True:  # transitive closure
        more = {(a, d) for a, b in smaller for c, d in smaller if b == c} - smaller
        if not more:
            break
        smaller |= more
    assert not strict or all((b, a) not in smaller for a, b in smaller), "sizes contradict each other"
    if q := ask(r"Does the (.+) fit in the (.+)\?", question):
        a, b = q
    else:
        b, a = ask(r"Is the (.+) bigger than the (.+)\?", question)
    need((a, b) in smaller or (b, a) in smaller, "the order of the two")
    return "yes" if (a, b) in smaller else "no"


NEEDS = {"hungry": "kitchen", "thirsty": "kitchen", "tired": "bedroom", "bored": "garden"}
THINGS = {"hungry": "apple", "thirsty": "milk", "tired": "pajamas", "bored": "football"}


def answer_motives(facts: list[str], question: str, strict: bool) -> str:
    feels, went, got = {}, {}, {}
    for fact in facts:
        if m := re.match(rf"^(\w+) is ({'|'.join(NEEDS)})\.$", fact):
            feels[m[1].lower()] = m[2]
        elif m := MOVE.match(fact):
            went[m[1].lower()] = m[2]
        elif m := PICK.match(fact):
            got[m[1].lower()] = m[2]
        else:
            raise AssertionError(f"unreadable fact {fact!r}")
    for person, room in went.items():
        assert not strict or NEEDS[feels[person]] == room, (
            f"{person} went to the {room} feeling {feels[person]}"
        )
    for person, thing in got.items():
        assert not strict or THINGS[feels[person]] == thing, (
            f"{person} got the {thing} feeling {feels[person]}"
        )
    assert len(set(got.values())) == len(got), f"two people got the same thing: {got}"
    if q := ask(r"Where will (\w+) go\?", question):
        need(q[0] in feels, "how the person feels")
        return NEEDS[feels[q[0]]]
    if q := ask(r"Why did (\w+) go to the (\w+)\?", question):
        need(went.get(q[0]) == q[1] and q[0] in feels, "where the person went, and how they feel")
    else:
        q = ask(r"Why did (\w+) get the (\w+)\?", question)
        need(got.get(q[0]) == q[1] and q[0] in feels, "what the person got, and how they feel")
    return feels[q[0]]


def answer(task: str, facts: list[str], question: str, strict: bool) -> str:
    """The answer the facts give, checking that they agree with each other when `strict`."""
    number = int(task[2:])
    if number in (1, 2, 3, 5, 6, 7, 8):
        return Objects(facts, strict).answer(question)
    if 9 <= number <= 13:
        return Beliefs(facts, strict).answer(question)
    reader = {
        4: answer_directions,
        14: answer_time,
        15: answer_deduction,
        16: answer_induction,
        17: answer_positions,
        18: answer_sizes,
        19: answer_path,
        20: answer_motives,
    }[number]
    return reader(facts, question, strict)


# ----- tests -----
@pytest.fixture(scope="module")
def samples() -> dict[str, list[Sample]]:
    return {task: generate_task(task, N_CHECKED, seed=11) for task in TASKS}


@pytest.mark.parametrize("task", list(TASKS))
def test_answer_follows_from_the_story_and_from_the_supporting_facts_alone(task, samples):
    for sample in samples[task]:
        assert answer(task, sample.facts, sample.question, strict=True) == sample.answer, sample
        support = [sample.facts[i] for i in sample.supporting]
        assert answer(task, support, sample.question, strict=False) == sample.answer, sample


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_well_formed_and_within_the_fact_range(task, samples):
    lo, hi = FACT_RANGES[task]
    for sample in samples[task]:
        assert lo <= len(sample.facts) <= hi
        assert sample.supporting == sorted(set(sample.supporting)) and sample.supporting
        assert re.fullmatch(r"[A-Za-z]+(,[a-z]+)*", sample.answer), sample.answer
        assert sample.question.endswith("?")
    assert len({s.answer for s in samples[task]}) > 1
    assert len({tuple(s.facts) for s in samples[task]}) > N_CHECKED // 2


def test_fact_ranges_span_babilong_table_1():
    table_1 = {"qa1": 10, "qa2": 68, "qa3": 320, "qa4": 2, "qa5": 126, "qa6": 26, "qa7": 52, "qa8": 50}
    table_1 |= {"qa9": 10, "qa10": 10}  # most facts per sample; the fewest is 2, and 4 for qa3
    assert {task: FACT_RANGES[task] for task in table_1} == {
        task: (4 if task == "qa3" else 2, most) for task, most in table_1.items()
    }
    rng = random.Random(0)
    draws = [story_length(rng, 4, 320) for _ in range(20000)]
    assert min(draws) == 4 and max(draws) == 320
    assert sorted(draws)[len(draws) // 2] < 60  # most stories stay short, as in bAbI


@pytest.mark.parametrize("task", ["qa6", "qa9", "qa10", "qa17", "qa18"])
def test_yes_no_answers_are_balanced(task, samples):
    counts = Counter(s.answer for s in samples[task])
    share = 1 / len(counts)
    assert all(abs(c / N_CHECKED - share) < 0.2 for c in counts.values()), counts


QUESTION_SHAPES = {
    "qa4": [r"What is \w+ of the \w+\?", r"What is the \w+ \w+ of\?"],
    "qa5": [
        r"Who gave the \w+\?",
        r"Who received the \w+\?",
        r"Who gave the \w+ to \w+\?",
        r"Who did \w+ give the \w+ to\?",
        r"What did \w+ give to \w+\?",
    ],
    "qa15": [r"What is [a-z]+ afraid of\?"],  # lower case, as in the released data
    "qa18": [r"Does the .+ fit in the .+\?", r"Is the .+ bigger than the .+\?"],
    "qa20": [r"Where will [a-z]+ go\?", r"Why did [a-z]+ go to the \w+\?", r"Why did [a-z]+ get the \w+\?"],
}


@pytest.mark.parametrize("task", list(QUESTION_SHAPES))
def test_every_question_shape_occurs(task, samples):
    shapes = QUESTION_SHAPES[task]
    seen = Counter(
        next(i for i, shape in enumerate(shapes) if re.fullmatch(shape, s.question)) for s in samples[task]
    )
    assert len(seen) == len(shapes), seen


# ----- the original generator's design (facebookarchive/bAbI-tasks, lua/babi/tasks/*.lua) -----
N_DESIGN = 2000


def read_sizes(facts: list[str]) -> list[tuple[str, str]]:
    """(smaller, bigger) for each qa18 fact, in story order."""
    out = []
    for fact in facts:
        if m := re.match(r"^The (.+) fits inside the (.+)\.$", fact):
            out.append((m[1], m[2]))
        else:
            m = re.match(r"^The (.+) is bigger than the (.+)\.$", fact)
            out.append((m[2], m[1]))
    return out


def test_size_questions_need_a_chain_of_two_facts_and_sizes_follow_the_original_order():
    """qa18 (Size.lua, worlds/world_sizes.txt): the chocolate is the smallest, the box of chocolates the next, the
    containers above them in a random order; the asked pair is stated by no fact but ordered by a chain of two."""
    rank = {"chocolate": 0, "box of chocolates": 1}  # the containers come after, in any order: 2
    seen = set()
    for sample in generate_task("qa18", N_DESIGN, seed=21):
        relations = read_sizes(sample.facts)
        seen |= set(relations)
        for small, big in relations:
            in_order = rank.get(small, 2) < rank.get(big, 2) or small not in rank and big not in rank
            assert in_order, f"the {small} is said to be smaller than the {big}"
        if q := ask(r"Does the (.+) fit in the (.+)\?", sample.question):
            pair = set(q)
        else:
            pair = set(ask(r"Is the (.+) bigger than the (.+)\?", sample.question))
        assert all(set(r) != pair for r in relations), f"one fact answers {sample.question!r}"
        first, second = (relations[i] for i in sample.supporting)
        if first[1] != second[0]:
            first, second = second, first
        assert first[1] == second[0] and {first[0], second[1]} == pair, f"no chain of two: {sample}"
    containers = ["box", "chest", "container", "suitcase"]
    assert {(a, b) for a in containers for b in containers if a != b} <= seen  # each order occurs


def test_positions_are_asked_only_along_an_axis_where_the_shapes_differ():
    """qa17 (PositionalReasoning.lua): the question's axis is one where the two shapes are not level."""
    axes = Counter()
    for sample in generate_task("qa17", N_DESIGN, seed=22):
        a, side, b = ask(rf"Is the (.+) ({_SIDES}) the (.+)\?", sample.question)
        offsets = {}
        for fact in sample.facts:
            m = re.match(rf"^The (.+) is ({_SIDES}) the (.+)\.$", fact)
            offsets[m[1], m[3]] = SIDE[m[2]]
            offsets[m[3], m[1]] = tuple(-x for x in SIDE[m[2]])
        (middle,) = {x for pair in offsets for x in pair} - {a, b}
        offset = [p + q for p, q in zip(offsets[a, middle], offsets[middle, b], strict=True)]
        axis = 0 if SIDE[side][0] else 1
        assert offset[axis] != 0, f"{sample.question!r}: the two are level along it ({sample.facts})"
        axes[axis, sample.answer] += 1
    assert all(abs(n / N_DESIGN - 1 / 4) < 0.05 for n in axes.values()) and len(axes) == 4, axes


def test_each_species_has_its_own_colour_and_all_of_its_kin_support_the_answer():
    """qa16 (Induction.lua): species -> colour is one-to-one in a story; the support is the asked one's species
    and the species and colour of every other animal of that species."""
    for sample in generate_task("qa16", N_DESIGN, seed=23):
        kind = {m[1]: m[2] for f in sample.facts if (m := re.match(r"^(\w+) is a (\w+)\.$", f))}
        color = {m[1]: m[2] for f in sample.facts if (m := re.match(r"^(\w+) is (\w+)\.$", f))}
        species_color = {(kind[name], c) for name, c in color.items()}
        assert len({s for s, _ in species_color}) == len(species_color), species_color  # a function
        assert len({c for _, c in species_color}) == len(species_color), species_color  # one-to-one
        (asked,) = ask(r"What color is (\w+)\?", sample.question)
        kin = [name for name in color if kind[name] == kind[asked]]
        wanted = {f"{asked} is a {kind[asked]}."}
        wanted |= {f"{name} is a {kind[name]}." for name in kin}
        wanted |= {f"{name} is {color[name]}." for name in kin}
        assert {sample.facts[i] for i in sample.supporting} == wanted


def test_gives_are_asked_within_five_facts_and_no_later_fact_touches_them():
    """qa5 (WhoWhatGave.lua): the question follows the asked give after 0-5 facts, drawn uniformly (fewer only in
    short stories), none of which names its object or is another give from its giver to its receiver."""
    after = Counter()
    for sample in generate_task("qa5", N_DESIGN, seed=25):
        (at,) = sample.supporting
        giver, obj, receiver = GIVE.match(sample.facts[at]).groups()
        for fact in sample.facts[at + 1 :]:
            assert obj not in fact.rstrip(".").split(), (fact, sample)
            m = GIVE.match(fact)
            assert not (m and (m[1], m[3]) == (giver, receiver)), (fact, sample)
        after[len(sample.facts) - 1 - at] += 1
    assert set(after) == set(range(6)), after
    assert all(0.1 < after[k] / N_DESIGN < 0.3 for k in range(1, 6)), after


def test_route_answers_are_uniform_over_the_twelve_two_step_paths():
    """qa19 (PathFinding.lua): the route is laid first, two steps that never turn back, so each of the 12 answers
    has chance 1/12 (straight routes were 40% when the route was picked among a random tree's)."""
    answers = Counter(s.answer for s in generate_task("qa19", N_DESIGN, seed=24))
    assert len(answers) == 12 and all(abs(n / N_DESIGN - 1 / 12) < 0.025 for n in answers.values()), answers
    straight = sum(n for answer, n in answers.items() if answer[0] == answer[2])
    assert abs(straight / N_DESIGN - 1 / 3) < 0.03


def test_same_seed_same_samples_other_seed_other_samples():
    for task in TASKS:
        assert generate_task(task, 20, seed=5) == generate_task(task, 20, seed=5)
        assert generate_task(task, 20, seed=5) != generate_task(task, 20, seed=6)


def test_long_names_and_unknown_tasks():
    assert generate_task("qa3_three-supporting-facts", 3, seed=1) == generate_task("qa3", 3, seed=1)
    with pytest.raises(ValueError, match="qa1, qa2, .*qa20"):
        generate_task("qa21", 3)


def test_sample_rejects_supporting_ids_outside_the_story():
    with pytest.raises(ValueError, match="must lie in"):
        Sample(["Mary moved to the office."], "Where is Mary?", "office", [1])


def test_v12_round_trip(tmp_path):
    path = tmp_path / "all.txt"
    written = [s for task in TASKS for s in generate_task(task, 10, seed=3)]
    write_babi(written, path)
    assert read_babi(path) == written


def test_read_official_layout_with_several_questions_per_story(tmp_path):
    path = tmp_path / "qa1_single-supporting-fact_test.txt"
    path.write_text(
        "1 Mary moved to the bathroom.\n2 John went to the hallway.\n3 Where is Mary? \tbathroom\t1\n"
        "4 Daniel went back to the hallway.\n5 Sandra moved to the garden.\n6 Where is Daniel? \thallway\t4\n"
        "1 John moved to the office.\n2 Where is John? \toffice\t1\n"
    )
    first, second, third = read_babi(path)
    assert second.facts[2:] == ["Daniel went back to the hallway.", "Sandra moved to the garden."]
    assert (second.question, second.answer, second.supporting) == ("Where is Daniel?", "hallway", [2])
    assert (third.facts, third.supporting) == (["John moved to the office."], [0])
    assert first.facts == second.facts[:2]
    path.write_text("1 Mary moved to the bathroom.\n2 Where is Mary?\tbathroom\t2\n")
    with pytest.raises(ValueError, match=":2: supporting ids"):
        read_babi(path)


def test_command_line_writes_a_readable_file(tmp_path, capsys):
    (path,) = main(["--task", "qa2", "--n", "30", "--seed", "4", "--out", str(tmp_path)])
    assert path == tmp_path / "qa2_two-supporting-facts_train.txt"
    assert read_babi(path) == generate_task("qa2", 30, seed=4)
    with pytest.raises(SystemExit):
        main(["--task", "qa0", "--n", "1", "--out", str(tmp_path)])
    assert "qa1, qa2" in capsys.readouterr().err
