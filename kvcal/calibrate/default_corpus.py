"""kvcal's built-in calibration text: generated from a seed, no network, no copied dataset.

K/V statistics depend on what the model reads, so the generator mixes the kinds of text a served model meets:
English prose (narrative, explanatory, dialogue), Python code, arithmetic and word problems, lists and tables.
Every document is built from templates and small word lists by a seeded `random.Random`, so the set is the same on
every machine (its token sha256 goes into the scale file's manifest like any dataset's). It is meant for demos
and smoke tests; real calibration should use text like the served traffic (e.g. the C4 slice, `--dataset`).
"""

from __future__ import annotations

import random

NAMES = [
    "Ada",
    "Bilal",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jonas",
    "Keiko",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tove",
    "Uma",
    "Viktor",
    "Wen",
    "Yusuf",
    "Zoe",
]
PLACES = [
    "the harbour",
    "a small village",
    "the old library",
    "the mountain pass",
    "the train station",
    "a crowded market",
    "the university",
    "the river bank",
    "a quiet office",
    "the hospital",
    "the farm",
]
OBJECTS = [
    "a letter",
    "the map",
    "an old radio",
    "a bicycle",
    "the notebook",
    "a box of tools",
    "the key",
    "a jar of honey",
    "the telescope",
    "a loaf of bread",
    "the lantern",
    "a set of keys",
    "the umbrella",
]
VERBS = [
    "found",
    "repaired",
    "carried",
    "painted",
    "sold",
    "borrowed",
    "lost",
    "opened",
    "measured",
    "studied",
]
ADJS = [
    "quiet",
    "bright",
    "heavy",
    "ancient",
    "careful",
    "narrow",
    "generous",
    "restless",
    "curious",
    "tired",
    "patient",
    "strange",
    "warm",
    "sudden",
    "distant",
    "practical",
]
TOPICS = [
    ("photosynthesis", "plants convert light, water and carbon dioxide into sugar and oxygen"),
    ("inflation", "the general level of prices rises and each unit of money buys less"),
    ("plate tectonics", "the outer shell of the Earth is split into plates that move slowly"),
    ("vaccination", "the immune system learns to recognise a pathogen before an infection"),
    ("compound interest", "interest is earned on both the principal and the interest already added"),
    ("the water cycle", "water evaporates, condenses into clouds and falls again as rain or snow"),
    (
        "a hash table",
        "keys are mapped by a hash function to buckets so lookups take constant time on average",
    ),
    ("supply and demand", "prices move until the quantity offered matches the quantity wanted"),
    ("natural selection", "traits that help survival and reproduction become more common over generations"),
    (
        "a transformer model",
        "attention lets every token weigh every earlier token when computing its representation",
    ),
]
CONNECTIVES = [
    "However,",
    "Meanwhile,",
    "As a result,",
    "In the end,",
    "At first,",
    "Later that day,",
    "For this reason,",
    "Surprisingly,",
    "Even so,",
    "Because of that,",
]
FUNCS = ["total", "average", "clean", "parse", "merge", "count", "scale", "filter", "window", "normalise"]
VARS = ["items", "values", "rows", "words", "prices", "scores", "tokens", "records", "samples", "lines"]


def _sentence(rng: random.Random) -> str:
    who, other = rng.sample(NAMES, 2)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{who} {rng.choice(VERBS)} {rng.choice(OBJECTS)} near {rng.choice(PLACES)}."
    if kind == 1:
        return (
            f"{rng.choice(CONNECTIVES)} the {rng.choice(ADJS)} {rng.choice(['morning', 'evening', 'winter', 'storm', 'meeting'])} "
            f"made {other} {rng.choice(['smile', 'hesitate', 'leave early', 'write a note', 'call home'])}."
        )
    if kind == 2:
        return f'"Did you see {rng.choice(OBJECTS)}?" asked {who}. "{rng.choice(["Yes", "No", "Not yet", "Maybe"])}," said {other}.'
    if kind == 3:
        n = rng.randint(2, 97)
        return (
            f"{who} walked {n} kilometres to {rng.choice(PLACES)} and arrived {rng.choice(ADJS)} but happy."
        )
    return f"The {rng.choice(ADJS)} light over {rng.choice(PLACES)} reminded {who} of {rng.choice(OBJECTS)}."


def _prose(rng: random.Random) -> str:
    paras = []
    for _ in range(rng.randint(2, 5)):
        paras.append(" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))))
    return "\n\n".join(paras)


def _explainer(rng: random.Random) -> str:
    topic, gist = rng.choice(TOPICS)
    lines = [f"What is {topic}?", "", f"In short, {gist}."]
    for i in range(rng.randint(2, 4)):
        lines.append(
            f"{i + 1}. {rng.choice(CONNECTIVES)} {rng.choice(NAMES)} noted that {gist.split(' and ')[0]}"
            f" in about {rng.randint(2, 90)} percent of the cases studied."
        )
    lines.append(f"A {rng.choice(ADJS)} way to remember it: {gist}.")
    return "\n".join(lines)


def _code(rng: random.Random) -> str:
    f, v = rng.choice(FUNCS), rng.choice(VARS)
    k = rng.randint(2, 9)
    body = rng.choice(
        [
            f"    result = 0\n    for i, x in enumerate({v}):\n        if i % {k} == 0:\n            result += x * {k}\n    return result\n",
            f"    seen = set()\n    out = []\n    for x in {v}:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out[:{k * 10}]\n",
            f'    if not {v}:\n        raise ValueError("{v} must not be empty")\n    return sum({v}) / len({v})\n',
            f"    return {{key: len(group) for key, group in itertools.groupby(sorted({v}))}}\n",
        ]
    )
    args = [rng.randint(0, 100) for _ in range(rng.randint(3, 8))]
    return (
        f'import itertools\n\n\ndef {f}_{v}({v}: list[int]) -> int:\n    """{f.capitalize()} the {v}; '
        f'see issue #{rng.randint(10, 9999)}."""\n{body}\n\nif __name__ == "__main__":\n'
        f"    print({f}_{v}({args}))\n"
    )


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 50)
    who = rng.choice(NAMES)
    kind = rng.randrange(3)
    if kind == 0:
        return (
            f"Question: {who} buys {b} boxes with {c} pencils each and gives away {a % (b * c) + 1} pencils. "
            f"How many are left?\nAnswer: {b} * {c} = {b * c}; {b * c} - {a % (b * c) + 1} = "
            f"{b * c - (a % (b * c) + 1)}. The answer is {b * c - (a % (b * c) + 1)}."
        )
    if kind == 1:
        return f"Compute ({a} + {b}) * {c} - {b}.\n({a} + {b}) = {a + b}; {a + b} * {c} = {(a + b) * c}; minus {b} gives {(a + b) * c - b}."
    rows = [
        f"| {rng.choice(NAMES)} | {rng.randint(1, 100)} | {rng.uniform(0, 10):.2f} |"
        for _ in range(rng.randint(3, 6))
    ]
    return "| name | count | score |\n|---|---|---|\n" + "\n".join(rows)


_KINDS = (_prose, _prose, _explainer, _code, _math)


def generate_corpus(num_docs: int = 512, seed: int = 0) -> list[str]:
    """`num_docs` generated documents (a few hundred to ~1500 characters each), identical for the same seed."""
    rng = random.Random(f"kvcal-default-corpus-{seed}")
    docs = []
    for _ in range(num_docs):
        parts = [rng.choice(_KINDS)(rng) for _ in range(rng.randint(1, 3))]
        docs.append("\n\n".join(parts))
    return docs
