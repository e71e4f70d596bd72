"""bAbI tasks of small fixed worlds: qa4 and qa15-qa20 (directions, deduction, induction, positions, sizes,
paths, motivations).

Facts per story follow the original stories: qa4 two facts (BABILong's Table 1), qa15 eight (four rules, four
memberships), qa16 nine (five memberships, four colours), qa17 two, qa18 2-12 size relations, qa19 five (six
rooms), qa20 1-12 (up to three facts for each of four people, asked after any of them).

Where the stories leave a choice open, the choices follow the public bAbI generator (facebookarchive/bAbI-tasks,
lua/babi/tasks/*.lua, a rewrite of the one that made the released data): each species has its own colour (qa16),
positions are asked along an axis where the shapes differ (qa17), sizes put the chocolate and the box of chocolates
below the containers and questions need two facts (qa18), and a route is laid before its decoys (qa19).
"""

from __future__ import annotations

import random

from data.babi.sample import Sample
from data.babi.vocab import DIRECTIONS, MOVES, OPPOSITE, PICKS, ROOMS

QA4_FACTS = (2, 2)
QA15_FACTS = (8, 8)
QA16_FACTS = (9, 9)
QA17_FACTS = (2, 2)
QA18_FACTS = (2, 12)
QA19_FACTS = (5, 5)
QA20_FACTS = (1, 12)

PLURALS = {"mouse": "mice", "sheep": "sheep", "wolf": "wolves", "cat": "cats"}  # qa15
FEARFUL = ("Gertrude", "Winona", "Jessica", "Emily")
SPECIES = ("swan", "lion", "frog", "rhino")  # qa16
COLORS = ("white", "gray", "yellow", "green")
ANIMAL_NAMES = ("Lily", "Bernhard", "Greg", "Julius", "Brian")
SHAPES = ("red square", "blue square", "red sphere", "pink rectangle", "triangle", "yellow square")  # qa17
SIDES = {"above": (0, 1), "below": (0, -1), "to the right of": (1, 0), "to the left of": (-1, 0)}
FLIPPED = {
    "above": "below",
    "below": "above",
    "to the right of": "to the left of",
    "to the left of": "to the right of",
}
SWEETS = ("chocolate", "box of chocolates")  # qa18: the two smallest things, smallest first
CONTAINERS = ("box", "chest", "container", "suitcase")  # qa18: bigger than the sweets, in a random order
MOTIVES = {  # qa20: feeling -> (where one goes, what one gets there)
    "hungry": ("kitchen", "apple"),
    "thirsty": ("kitchen", "milk"),
    "tired": ("bedroom", "pajamas"),
    "bored": ("garden", "football"),
}
AGENTS = ("Yann", "Jason", "Antoine", "Sumit")


def _shuffled(rng: random.Random, items: list) -> tuple[list, list[int]]:
    """`items` in a random order, and where each original item went."""
    order = list(range(len(items)))
    rng.shuffle(order)
    where = [0] * len(items)
    for new, old in enumerate(order):
        where[old] = new
    return [items[old] for old in order], where


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def qa4(rng: random.Random) -> Sample:
    """Two-argument relations: "The kitchen is north of the bathroom." / "What is north of the bathroom?"

    Rooms sit on a grid, one step apart; both facts touch one middle room.
    """
    middle, *outer = rng.sample(ROOMS, 3)
    relations = [
        (room, way, middle) for room, way in zip(outer, rng.sample(tuple(DIRECTIONS), 2), strict=True)
    ]
    relations = [r if rng.random() < 0.5 else (r[2], OPPOSITE[r[1]], r[0]) for r in relations]
    facts, where = _shuffled(rng, [f"The {a} is {way} of the {b}." for a, way, b in relations])
    k = rng.randrange(2)
    a, way, b = (
        relations[k] if rng.random() < 0.5 else (relations[k][2], OPPOSITE[relations[k][1]], relations[k][0])
    )
    if rng.random() < 0.5:
        return Sample(facts, f"What is {way} of the {b}?", a, [where[k]])
    return Sample(facts, f"What is the {a} {way} of?", b, [where[k]])


def qa15(rng: random.Random) -> Sample:
    """Basic deduction: "Sheep are afraid of wolves. Gertrude is a sheep." / "What is gertrude afraid of?"

    The question writes the name in lower case, as the released bAbI data (and so BABILong) do, and as qa20 does.
    """
    fears = {kind: rng.choice([k for k in PLURALS if k != kind]) for kind in PLURALS}
    kinds = {name: rng.choice(tuple(PLURALS)) for name in FEARFUL}
    rules = [f"{PLURALS[kind].capitalize()} are afraid of {PLURALS[fears[kind]]}." for kind in PLURALS]
    members = [f"{name} is a {kinds[name]}." for name in FEARFUL]
    facts, where = _shuffled(rng, rules + members)
    k = rng.randrange(len(FEARFUL))
    name, kind = FEARFUL[k], kinds[FEARFUL[k]]
    support = sorted((where[len(rules) + k], where[list(PLURALS).index(kind)]))
    return Sample(facts, f"What is {name.lower()} afraid of?", fears[kind], support)


def qa16(rng: random.Random) -> Sample:
    """Basic induction: "Lily is a swan. Lily is white. Greg is a swan." / "What color is Greg?"

    Each species has its own colour, shared by all its animals; the asked one's colour is not stated, and at least
    one other of its species has a stated colour. The support is the asked one's species and, for every other
    animal of that species, its species and colour.
    """
    color = dict(zip(SPECIES, rng.sample(COLORS, len(SPECIES)), strict=True))
    names = rng.sample(ANIMAL_NAMES, len(ANIMAL_NAMES))
    kind = {name: rng.choice(SPECIES) for name in names}
    asked, witness = names[0], names[1]
    kind[witness] = kind[asked]
    members = [f"{name} is a {kind[name]}." for name in names]
    colors = [f"{name} is {color[kind[name]]}." for name in names[1:]]
    facts, where = _shuffled(rng, members + colors)
    kin = [i for i in range(1, len(names)) if kind[names[i]] == kind[asked]]
    support = sorted([where[0]] + [where[i] for i in kin] + [where[len(members) + i - 1] for i in kin])
    return Sample(facts, f"What color is {asked}?", color[kind[asked]], support)


def qa17(rng: random.Random) -> Sample:
    """Positional reasoning: "The red square is below the blue square." / "Is the red square to the left of the
    triangle?" (yes/no).

    Shapes sit on a grid one step from a middle shape; "left of" means further west, "above" further north. The
    question compares the two outer shapes along an axis where they differ (the original asks only there), so it
    always needs both facts.
    """
    middle, *outer = rng.sample(SHAPES, 3)
    sides = rng.sample(tuple(SIDES), 2)
    position = {middle: (0, 0), outer[0]: SIDES[sides[0]], outer[1]: SIDES[sides[1]]}
    stated = [
        f"The {shape} is {side} the {middle}."
        if rng.random() < 0.5
        else f"The {middle} is {FLIPPED[side]} the {shape}."
        for shape, side in zip(outer, sides, strict=True)
    ]
    facts, _ = _shuffled(rng, stated)
    a, b = rng.sample(outer, 2)
    offset = (position[a][0] - position[b][0], position[a][1] - position[b][1])
    axis = rng.choice([k for k in (0, 1) if offset[k]])  # never along an axis where the two are level
    answer = rng.choice(("yes", "no"))
    side = next(
        s for s, step in SIDES.items() if step[axis] and (step[axis] * offset[axis] > 0) == (answer == "yes")
    )
    return Sample(facts, f"Is the {a} {side} the {b}?", answer, [0, 1])


def qa18(rng: random.Random) -> Sample:
    """Size reasoning: "The box is bigger than the chocolate." / "Does the chocolate fit in the box?" (yes/no).

    As in the original: the chocolate is the smallest thing and the box of chocolates the next, and the four
    containers follow in a random order. The story starts as a chain of two facts (small < middle < big, the pair
    small-big left unstated) and goes on with other relations in a shuffled order; the question asks a pair that no
    fact states but a chain of exactly two facts orders, which is its support.
    """
    order = [*SWEETS, *rng.sample(CONTAINERS, len(CONTAINERS))]  # smallest first
    small, middle, big = sorted(rng.sample(range(len(order)), 3))
    chain = [(small, middle), (middle, big)]
    kept = {*chain, (small, big)}  # the chain is stated already; the pair it orders stays unstated
    rest = [(i, j) for j in range(len(order)) for i in range(j) if (i, j) not in kept]
    relations = chain + rng.sample(rest, rng.randint(*QA18_FACTS) - len(chain))  # (smaller, bigger)
    stated = [
        f"The {order[i]} fits inside the {order[j]}."
        if rng.random() < 0.5
        else f"The {order[j]} is bigger than the {order[i]}."
        for i, j in relations
    ]
    facts, where = _shuffled(rng, stated)
    told = {pair: where[n] for n, pair in enumerate(relations)}  # (smaller, bigger) -> its fact
    bigger: dict[int, list[int]] = {i: [] for i in range(len(order))}
    for i, j in relations:
        bigger[i].append(j)
    chains = {  # (i, k) -> the facts of a chain i < j < k, for pairs that no fact states
        (i, k): (told[i, j], told[j, k])
        for i in bigger
        for j in bigger[i]
        for k in bigger[j]
        if (i, k) not in told
    }
    (i, k), support = rng.choice(list(chains.items()))
    a, b = (i, k) if rng.random() < 0.5 else (k, i)
    if rng.random() < 0.5:
        question, answer = f"Does the {order[a]} fit in the {order[b]}?", a == i
    else:
        question, answer = f"Is the {order[a]} bigger than the {order[b]}?", a == k
    return Sample(facts, question, "yes" if answer else "no", sorted(support))


def qa19(rng: random.Random) -> Sample:
    """Path finding: "The office is east of the hallway." / "How do you go from the kitchen to the garden?"
    answered with the two steps, "n,w".

    As in the original, the route is laid first (two steps, each in any direction that does not turn back, so all
    twelve answers are equally likely), then the three other rooms join as decoys. Each room borders only the room
    it was attached to, so the rooms form a tree and the route is unique.
    """
    rooms = rng.sample(ROOMS, len(ROOMS))
    first = rng.choice(tuple(DIRECTIONS))
    second = rng.choice([way for way in DIRECTIONS if way != OPPOSITE[first]])
    position = {rooms[0]: (0, 0), rooms[1]: DIRECTIONS[first]}
    position[rooms[2]] = _add(position[rooms[1]], DIRECTIONS[second])
    edges = [(rooms[1], first, rooms[0]), (rooms[2], second, rooms[1])]  # (room, direction, neighbour)
    for room in rooms[3:]:
        while True:
            anchor, way = rng.choice(list(position)), rng.choice(tuple(DIRECTIONS))
            cell = _add(position[anchor], DIRECTIONS[way])
            around = {_add(cell, step) for step in DIRECTIONS.values()}
            if cell not in position.values() and all(
                position[r] not in around for r in position if r != anchor
            ):
                break
        position[room] = cell
        edges.append((room, way, anchor))
    stated = [
        f"The {a} is {way} of the {b}." if rng.random() < 0.5 else f"The {b} is {OPPOSITE[way]} of the {a}."
        for a, way, b in edges
    ]
    facts, where = _shuffled(rng, stated)
    return Sample(
        facts,
        f"How do you go from the {rooms[0]} to the {rooms[2]}?",
        f"{first[0]},{second[0]}",
        sorted(where[:2]),
    )


def qa20(rng: random.Random) -> Sample:
    """Agents' motivations: "Sumit is tired." / "Where will sumit go?"; "Sumit went to the bedroom." / "Why did
    sumit go to the bedroom?"; "Sumit got the pajamas there." / "Why did sumit get the pajamas?"

    Each person has their own feeling (so only one of them gets "the apple"), goes, then gets, interleaved with
    the others; the question follows one of these facts.
    """
    feeling = dict(zip(AGENTS, rng.sample(tuple(MOTIVES), len(AGENTS)), strict=True))
    left = {agent: 3 for agent in AGENTS}
    steps: list[tuple[str, int]] = []  # (agent, 0 feel / 1 go / 2 get)
    while left:
        agent = rng.choice(list(left))
        steps.append((agent, 3 - left[agent]))
        left[agent] -= 1
        if not left[agent]:
            del left[agent]
    at = {step: i for i, step in enumerate(steps)}
    facts = []
    for agent, stage in steps:
        place, thing = MOTIVES[feeling[agent]]
        sentence = (
            f"is {feeling[agent]}",
            f"{rng.choice(MOVES)} the {place}",
            f"{rng.choice(PICKS)} the {thing} there",
        )
        facts.append(f"{agent} {sentence[stage]}.")
    i = rng.randrange(len(steps))
    agent, stage = steps[i]
    place, thing = MOTIVES[feeling[agent]]
    name = agent.lower()
    if stage == 0:
        n = rng.randint(i + 1, at[agent, 1])
        return Sample(facts[:n], f"Where will {name} go?", place, [i])
    n = rng.randint(i + 1, len(facts))
    question = f"Why did {name} go to the {place}?" if stage == 1 else f"Why did {name} get the {thing}?"
    return Sample(facts[:n], question, feeling[agent], [at[agent, 0], i])
