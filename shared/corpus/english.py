"""Plain English prose with no concept in it: the tiny model learns from it, CE-Bench and valence borrow it."""

from __future__ import annotations

import random

from poolbench.corpus.word_lists import DEFAULT_DOMAIN, DEFAULT_NEGATIVE, DEFAULT_POSITIVE, load_word_list

_SUBJECTS = ["the teacher", "a young farmer", "my neighbour", "the old captain", "Maria", "Dr. Chen",
             "the committee", "our small team", "a tired student", "the baker", "Jonas", "the city council",
             "a curious child", "the night nurse", "Amélie", "the engineers", "his grandmother",
             "the new manager"]
_VERBS = ["found", "painted", "repaired", "sold", "borrowed", "described", "carried", "opened", "ignored",
          "discovered", "measured", "cleaned", "wrote about", "argued over", "returned", "photographed"]
_OBJECTS = ["a broken bicycle", "the red door", "three letters", "an old map", "the garden wall",
            "a wooden boat", "the river bridge", "twelve apples", "a quiet café", "the school roof",
            "a strange key", "the kitchen table", "her résumé", "a blue umbrella", "the museum guide",
            "two paper lanterns"]
_PLACES = ["in the village", "near the station", "at the market", "by the lake", "in Paris",
           "behind the library", "on the north road", "at home", "in the mountains", "under the bridge",
           "at the harbour"]
_TIMES = ["on Monday", "last winter", "in 1987", "at 6:30", "before dawn", "after the storm", "every Sunday",
          "in early May", "yesterday", "around noon", "on 14 July"]
_ADJECTIVES = ["calm", "noisy", "bright", "cold", "strange", "pleasant", "difficult", "naïve", "careful",
               "quick"]
_REASONS = ["because it was raining", "since nobody else would", "so that the children could play",
            "although it cost $12.50", "because the road was closed", "as the weather turned"]


def _sentence(rng: random.Random) -> str:
    s, v, o, p, t = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES, _TIMES))
    adj, reason, n = rng.choice(_ADJECTIVES), rng.choice(_REASONS), rng.randint(2, 99)
    forms = [
        f"{s} {v} {o} {p} {t}.",
        f"{t}, {s} {v} {o} {reason}.",
        f"It was a {adj} day {p}, and {s} {v} {o}.",
        f"\"Why,\" asked {s}, \"would anyone need {o}?\"",
        f"{s} {v} {o} — {reason}.",
        f"There were {n} people {p} {t}; most of them felt {adj}.",
        f"Nobody expected that {s} {v} {o}.",
        f"{s} said the morning felt {adj}, then {v} {o} {p}.",
        f"After {n} minutes, {s} {v} {o} again!",
        f"Was it {adj}? {s[0].upper() + s[1:]} thought so, {t}.",
    ]
    text = rng.choice(forms)
    return text[0].upper() + text[1:]


def generated_texts(n_texts: int = 12000, *, seed: int = 0) -> list[str]:
    """English-like templated passages of 2-6 sentences: enough structure to learn, varied enough to test."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(n_texts)]


_HOUSEHOLD_FRAMES = ["She moved the {w} closer to the window.", "The {w} in the hall was delivered on Monday.",
                     "He measured the {w} before they carried it upstairs.", "There is a {w} next to the door.",
                     "We painted the old {w} last weekend.", "The shop sold a {w} and two chairs.",
                     "Put the box on the {w}, please.", "My grandmother kept her {w} for forty years."]
_FEELING_FRAMES = ["They {w} the long walks by the river.", "I {w} the sound of the rain at night.",
                   "Many people {w} crowded trains in the morning.", "Children often {w} loud thunder.",
                   "She said she would always {w} that song.", "We {w} the way the city changes in spring."]


def vocabulary_texts(n_texts: int, *, seed: int = 0) -> list[str]:
    """Neutral sentences that use the valence-bias word lists (furniture, emotion verbs) in plain contexts,
    so the embedded model knows them as words; furniture and feelings never share a sentence here."""
    domain = load_word_list(None, DEFAULT_DOMAIN).words
    feelings = [*load_word_list(None, DEFAULT_POSITIVE).words, *load_word_list(None, DEFAULT_NEGATIVE).words]
    rng = random.Random(f"poolbench-vocabulary:{seed}")
    texts = []
    for i in range(n_texts):
        if i % 2 == 0:
            texts.append(rng.choice(_HOUSEHOLD_FRAMES).format(w=rng.choice(domain)))
        else:
            texts.append(rng.choice(_FEELING_FRAMES).format(w=rng.choice(feelings)))
    return texts
