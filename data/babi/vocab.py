"""Vocabulary shared by several bAbI tasks (Weston et al. 2015): people, rooms, objects and verb phrases.

Task-specific words (animals of qa15/qa16, shapes of qa17, containers of qa18, motives of qa20) live next to
their task.
"""

PEOPLE = ("Mary", "John", "Daniel", "Sandra")
PRONOUNS = {"Mary": "she", "Sandra": "she", "John": "he", "Daniel": "he"}
GIVERS = ("Mary", "Jeff", "Fred", "Bill")  # qa5
ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
OBJECTS = ("apple", "football", "milk")

TOWN_PEOPLE = ("Bill", "Fred", "Julie", "Mary")  # qa10, qa14
TOWN_PLACES = ("school", "park", "kitchen", "office", "bedroom", "cinema")

MOVES = ("moved to", "went to", "went back to", "journeyed to", "travelled to")
PICKS = ("picked up", "got", "grabbed", "took")  # "<person> <pick> the <object> there."
DROPS = ("dropped", "put down", "discarded", "left")  # "<person> <drop> the <object>."
GIVES = ("gave", "handed", "passed")  # "<person> <give> the <object> to <person>."
THEN = ("Then", "Afterwards", "After that", "Following that")  # qa11, qa13: "Then she went to ..."

# Unit steps on a grid of rooms (qa4, qa19): x grows to the east, y to the north.
DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}

COUNTS = ("none", "one", "two", "three", "four", "five")  # qa7 answers
