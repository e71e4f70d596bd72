"""The bAbI world of tasks qa1-qa3 and qa5-qa8 (Weston et al. 2015): people move between rooms and pick up,
drop and give objects. Each action appends one fact, and the world remembers which facts tell what.

True places stay hidden until a fact states them: a person stands in an unstated room until their first move,
and an object lies unseen until its first pick-up (so it lay where that person stands). Every action is valid
in the true world, so facts never contradict each other. A person's room counts as told only through their
latest move; an object's room through its holder (the fact giving it to them and the holder's latest move) or,
on the floor, through the drop and the dropper's latest move before it.
"""

from __future__ import annotations

import random

from data.babi.vocab import DROPS, GIVES, MOVES, OBJECTS, PICKS, ROOMS

Told = tuple[str, list[int]]  # a room and the ascending indices of the facts that tell it


class World:
    """People, rooms and objects with true state plus the facts that tell it.

    `stay`: chance that the previous actor acts again (stories follow one person for a while, as bAbI's do);
    `follow`: chance that a move goes to a room where someone else stands (so people meet and can give).
    """

    def __init__(
        self, rng: random.Random, people: tuple[str, ...], *, stay: float = 0.3, follow: float = 0.0
    ) -> None:
        self.rng = rng
        self.people = people
        self.stay = stay
        self.follow = follow
        self.actor: str | None = None
        self.facts: list[str] = []
        self.place = {p: rng.choice(ROOMS) for p in people}
        self.moved_at: dict[str, int | None] = dict.fromkeys(people)  # each person's latest move
        self.carrying: dict[str, list[str]] = {p: [] for p in people}  # in the order they were got
        self.holder: dict[str, str | None] = dict.fromkeys(OBJECTS)
        self.lying_in: dict[str, str | None] = dict.fromkeys(OBJECTS)  # None: held, or not seen yet
        self.got_at: dict[str, int] = {}  # object -> fact by which its holder got it
        self.dropped: dict[str, Told | None] = dict.fromkeys(OBJECTS)  # told room of a dropped object
        self.came_from: dict[str, Told | None] = dict.fromkeys(OBJECTS)  # told room before its latest move
        self.dealings: dict[str, dict[str, tuple[int, int | None]]] = {p: {} for p in people}
        self.gives: list[dict[str, str | int]] = []  # {"at", "giver", "obj", "receiver"}

    # ----- what the facts tell -----
    def told_place(self, obj: str) -> Told | None:
        """The room the facts put `obj` in now, or None when they do not tell it."""
        holder = self.holder[obj]
        if holder is None:
            return self.dropped[obj]
        moved = self.moved_at[holder]
        return None if moved is None else (self.place[holder], sorted((moved, self.got_at[obj])))

    def object_place(self, obj: str) -> str | None:
        """True room of `obj`; None while it has not been seen."""
        holder = self.holder[obj]
        return self.lying_in[obj] if holder is None else self.place[holder]

    # ----- actions -----
    def move(self, person: str) -> None:
        here = there = self.place[person]
        if self.follow and self.rng.random() < self.follow:
            others = [self.place[q] for q in self.people if self.place[q] != here]
            if others:
                there = self.rng.choice(others)
        while there == here:
            there = self.rng.choice(ROOMS)
        at = len(self.facts)
        for obj in self.carrying[person]:
            told = self.told_place(obj)
            self.came_from[obj] = None if told is None else (told[0], told[1] + [at])
        self.facts.append(f"{person} {self.rng.choice(MOVES)} the {there}.")
        self.place[person] = there
        self.moved_at[person] = at
        self.actor = person

    def pick_up(self, person: str, obj: str) -> None:
        at = len(self.facts)
        self.facts.append(f"{person} {self.rng.choice(PICKS)} the {obj} there.")
        self.holder[obj] = person
        self.lying_in[obj] = None
        self.carrying[person].append(obj)
        self.got_at[obj] = at
        self.dealings[person][obj] = (at, None)
        self.actor = person

    def drop(self, person: str, obj: str) -> None:
        at = len(self.facts)
        self.facts.append(f"{person} {self.rng.choice(DROPS)} the {obj}.")
        self.holder[obj] = None
        self.lying_in[obj] = self.place[person]
        self.carrying[person].remove(obj)
        moved = self.moved_at[person]
        self.dropped[obj] = None if moved is None else (self.place[person], [moved, at])
        self.dealings[person][obj] = (self.dealings[person][obj][0], at)
        self.actor = person

    def give(self, giver: str, obj: str, receiver: str) -> None:
        at = len(self.facts)
        self.facts.append(f"{giver} {self.rng.choice(GIVES)} the {obj} to {receiver}.")
        self.holder[obj] = receiver
        self.carrying[giver].remove(obj)
        self.carrying[receiver].append(obj)
        self.got_at[obj] = at
        self.dealings[giver][obj] = (self.dealings[giver][obj][0], at)
        self.dealings[receiver][obj] = (at, None)
        self.gives.append({"at": at, "giver": giver, "obj": obj, "receiver": receiver})
        self.actor = giver

    def act(self, move: float, pick_up: float = 0.0, drop: float = 0.0, give: float = 0.0) -> None:
        """Append one random valid action; the weights set how often each kind is tried."""
        rng = self.rng
        while True:
            r = rng.random() * (move + pick_up + drop + give)
            if r < move:
                self.move(self._choose(self.people))
                return
            if r < move + pick_up:
                takers = [p for p in self.people if self._within_reach(p)]
                if takers:
                    person = self._choose(takers)
                    self.pick_up(person, rng.choice(self._within_reach(person)))
                    return
            elif r < move + pick_up + drop:
                carriers = [p for p in self.people if self.carrying[p]]
                if carriers:
                    person = self._choose(carriers)
                    self.drop(person, rng.choice(self.carrying[person]))
                    return
            else:
                givers = [p for p in self.people if self.carrying[p] and self._mates(p)]
                if givers:
                    person = self._choose(givers)
                    self.give(person, rng.choice(self.carrying[person]), rng.choice(self._mates(person)))
                    return

    def _choose(self, candidates: list[str] | tuple[str, ...]) -> str:
        if self.actor in candidates and self.rng.random() < self.stay:
            return self.actor
        return self.rng.choice(candidates)

    def _within_reach(self, person: str) -> list[str]:
        here = self.place[person]
        return [o for o in OBJECTS if self.holder[o] is None and self.lying_in[o] in (None, here)]

    def _mates(self, person: str) -> list[str]:
        here = self.place[person]
        return [q for q in self.people if q != person and self.place[q] == here]
