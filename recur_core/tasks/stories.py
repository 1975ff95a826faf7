"""Generated word problems in story form: English text whose answer tokens need composition.

Four kinds of short story, each ending in a question and its answer sentence:

    count     Grandma baked seven cookies. Sam ate two of them. Then Mia baked four more. How many
              cookies were there at the end? There were nine cookies.                (steps: 2 changes)
    where     Ben was at the farm. Anna was at the lake. Tom was with Ben. Lily was with Tom.
              Where was Lily? Lily was at the farm.                                  (steps: 3 links)
    swap      Tom had a kite, Mia had a ball and Sam had a book. Tom and Mia swapped their toys.
              Then Mia and Sam swapped their toys. What did Sam have? Sam had the kite. (steps: 2 swaps)
    ages      Ben was four years old. Mia was two years older than Ben. Tom was one year younger than
              Mia. How old was Tom? Tom was five years old.                          (steps: 2 links)
    inside    The bag was at the park. The jar was at the lake. The box was in the bag. The kite was
              in the box. Where was the kite? The kite was at the park.              (steps: 2 links)

With `terse_share` (word_problems.WordProblems) a where story may instead be told in two-word clauses at
`hops`' density, "Ben farm. Anna lake. Tom Ben. Lily Tom. Lily? farm." (`terse_where_problem`).

The word that answers the question (`seven`, `farm`, `kite`, `five`) is an **answer**, labelled with
its **steps**: the number of facts that must be chained to get it (changes applied to a count, links
followed to a place, swaps of a toy, age differences added). With `recall` a maker counts the facts
read instead (one more: the stated count, place, toy or age the chain starts from), and 0 steps is a
direct recall ("Ben was at the farm. ... Where was Ben? Ben was at the farm.", 1 fact). Its loss can be predicted only by
composing them, so a looped model should need more loops for it than for a function word. The label
sits on the answer word's first character, so `token_steps` can put it on the token that starts the
answer under any tokenizer (the ground truth of checkpoint analyses: recur_core.analysis.ground_truth,
which calls the label "hops").

Each maker draws one problem from the RNG it is given; the task, its settings and its windows are
`word_problems.WordProblems`.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from .base import interleaved_chains

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
MAX_COUNT = 20  # counts and ages stay within 0 .. 20 (number words), so every answer is one word
NAMES = ("Tom", "Sam", "Ben", "Lily", "Mia", "Anna", "Max", "Lucy", "Tim", "Sue", "Jack", "Amy", "Zoe", "Leo",
         "Emma", "Kate", "Bob", "Jane", "Dan", "Sara")
PLACES = ("park", "beach", "farm", "lake", "zoo", "school", "garden", "forest", "shop", "river", "hill", "pond")
TOYS = ("ball", "kite", "book", "doll", "car", "hat", "drum", "cup", "bear", "boat")
# what a toy is put in (and those in each other) in an "inside" story
CONTAINERS = ("box", "bag", "basket", "jar", "sack", "bucket", "chest", "pot", "tin", "drawer", "bowl", "tub",
              "crate", "case")
# (plural noun, verbs that take some away, verbs that add some): what a count story counts
THINGS = (("cookies", ("ate", "gave away"), ("baked", "made")),
          ("apples", ("ate", "gave away", "dropped"), ("picked", "found")),
          ("flowers", ("gave away", "lost"), ("picked", "found")),
          ("shells", ("lost", "gave away"), ("found", "picked up")),
          ("balloons", ("lost", "gave away"), ("got", "found")),
          ("candies", ("ate", "gave away"), ("got", "found")),
          ("stickers", ("lost", "gave away"), ("got", "found")),
          ("eggs", ("dropped", "ate"), ("found", "got")))
OPENINGS = ("", "", "", "One day, ", "One sunny day, ", "Once upon a time, ", "After school, ", "In the morning, ")
KINDS = ("count", "where", "swap", "ages", "inside")


@dataclass
class Problem:
    text: str
    kind: str
    steps: list[int]  # per character of text: the steps of the answer word starting there, else 0
    terse: bool = False  # told in two-word clauses (terse_where_problem)

    @property
    def answer_steps(self) -> list[int]:
        return [s for s in self.steps if s]


class _Writer:
    """Builds a problem's text sentence by sentence, remembering where each answer word starts.
    `recall`: label an answer with the facts it reads (its steps + 1), so that a direct recall of a
    stated fact (0 steps) is labelled 1."""

    def __init__(self, recall: bool = False):
        self.recall = recall
        self.parts: list[str] = []
        self.length = 0
        self.answers: list[tuple[int, int]] = []  # (character position, steps)

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def answer(self, word: str, steps: int) -> None:
        self.answers.append((self.length, steps + self.recall))
        self.add(word)

    def problem(self, kind: str, terse: bool = False) -> Problem:
        text = "".join(self.parts).strip()
        shift = len("".join(self.parts)) - len("".join(self.parts).lstrip())
        steps = [0] * len(text)
        for pos, s in self.answers:
            steps[pos - shift] = s
        return Problem(text, kind, steps, terse)


def _opening(rng: random.Random) -> str:
    return rng.choice(OPENINGS)


def _then(rng: random.Random, i: int) -> str:
    return "Then " if i and rng.random() < 0.4 else ""


def count_problem(rng: random.Random, steps: int, running: bool, recall: bool = False) -> Problem:
    """A count changed `steps` times (taken away or added to), asked at the end. Running: after every
    change but the last the story says the new count ("Now Sam had five apples.", 1 step: one change
    to a stated count), so the final answer is 1 step from the last stated count."""
    noun, take_verbs, add_verbs = rng.choice(THINGS)
    owner, *others = rng.sample(NAMES, 4)
    total = rng.randint(3, 12)
    w = _Writer(recall)
    w.add(f"{_opening(rng)}{owner} had {NUMBER_WORDS[total]} {noun}. ")
    for i in range(steps):
        if total > 0 and (total >= MAX_COUNT - 1 or rng.random() < 0.5):
            k = rng.randint(1, min(5, total))
            total -= k
            w.add(f"{_then(rng, i)}{owner} {rng.choice(take_verbs)} {NUMBER_WORDS[k]} of them. ")
        else:
            k = rng.randint(1, min(5, MAX_COUNT - total))
            total += k
            if rng.random() < 0.5:
                w.add(f"{_then(rng, i)}{owner} {rng.choice(add_verbs)} {NUMBER_WORDS[k]} more. ")
            else:
                w.add(f"{rng.choice(others)} gave {owner} {NUMBER_WORDS[k]} more. ")
        if running and i < steps - 1:
            w.add(f"Now {owner} had ")
            w.answer(NUMBER_WORDS[total], 1)
            w.add(f" {noun}. ")
    w.add(f"How many {noun} did {owner} have at the end? {owner} had ")
    w.answer(NUMBER_WORDS[total], min(1, steps) if running else steps)
    w.add(f" {noun}.")
    return w.problem("count")


def _where_chains(rng: random.Random, steps: int) -> tuple[list[list[str]], list[tuple[int, int]], list[str]]:
    """A where story's chains of children (the first `steps` links long, two or three in all), the
    order their links are told in, and each chain's place."""
    n_chains = rng.randint(2, 3)
    lengths = [steps + 1] + [rng.randint(2, min(max(steps, 1) + 1, 5)) for _ in range(n_chains - 1)]
    while sum(lengths) > len(NAMES):
        lengths[lengths.index(max(lengths[1:]), 1)] -= 1
    names = rng.sample(NAMES, sum(lengths))
    places = rng.sample(PLACES, n_chains)
    chains, links = interleaved_chains(rng, names, lengths)
    return chains, links, places


def where_problem(rng: random.Random, steps: int, running: bool, recall: bool = False) -> Problem:
    """Chains of "X was with Y" from a child at a place; the first chain's last child is `steps`
    links from the place, the others' at most that many. Two or three chains, interleaved, each in
    order; the last child of another chain is asked too. Running: every link but the asked children's says where that puts the child
    ("Tom was with Ben, so Tom was at the farm.", 1 step), so each answer is 1 step from a stated place."""
    chains, links, places = _where_chains(rng, steps)
    w = _Writer(recall)
    w.add(_opening(rng))
    for c, i in links:
        if i == 0:
            w.add(f"{chains[c][0]} was at the {places[c]}. ")
        elif running and i < len(chains[c]) - 1:
            w.add(f"{chains[c][i]} was with {chains[c][i - 1]}, so {chains[c][i]} was at the ")
            w.answer(places[c], 1)
            w.add(". ")
        else:
            w.add(f"{chains[c][i]} was with {chains[c][i - 1]}. ")
    for c in (0, rng.randrange(1, len(chains))):
        asked = chains[c][-1]
        w.add(f"Where was {asked}? {asked} was at the ")
        w.answer(places[c], min(1, len(chains[c]) - 1) if running else len(chains[c]) - 1)
        w.add(". ")
    return w.problem("where")


def terse_where_problem(rng: random.Random, steps: int, recall: bool = False) -> Problem:
    """The where story told in clauses of two words, at `hops`' density of one fact per three tokens:
    "Ben zoo. Amy Ben. Sue Amy. Sue? zoo." (Ben was at the zoo, Amy with Ben, Sue with Amy; where
    was Sue?). Why this form: a clause's second word names what its first word is with, and the
    question `Sue?` names the child asked in the same place, so the one lookup that answers a
    1-link question ("find the clause whose first word is the word before me") also moves every
    clause one link along its chain, as `hops`' layout does; in full sentences the asked name and a
    link's target sit at different distances from the words that read them. Draws the chains as
    where_problem does (the same for the same RNG); told plain (no running answers).

    One question, about the first chain: with a second question about another chain (as the
    sentence form asks), its answer is the place the first answer is not, which a model learns
    long before any lookup (pilot P9: 84% on second questions, 51% on first ones, 42% guessing)."""
    chains, links, places = _where_chains(rng, steps)
    w = _Writer(recall)
    for c, i in links:
        w.add(f"{chains[c][0]} {places[c]}. " if i == 0 else f"{chains[c][i]} {chains[c][i - 1]}. ")
    w.add(f"{chains[0][-1]}? ")
    w.answer(places[0], len(chains[0]) - 1)
    w.add(".")
    return w.problem("where", terse=True)


def inside_problem(rng: random.Random, steps: int, running: bool, recall: bool = False) -> Problem:
    """Where a toy is through containers: chains "the X was in the Y" from a container at a place,
    each ending in a toy; the first chain's toy is `steps` links from the place, the others' at most
    that many. Two or three chains, interleaved, each told from its place outwards; the toys of the first and of one other chain
    are asked. Running: every container but the outermost is said to be where that puts it ("The
    box was in the bag, so the box was at the park.", 1 step)."""
    n_chains = rng.randint(2, 3)
    lengths = [steps + 1] + [rng.randint(2, min(max(steps, 1) + 1, 5)) for _ in range(n_chains - 1)]
    while sum(lengths) - n_chains > len(CONTAINERS):
        lengths[lengths.index(max(lengths[1:]), 1)] -= 1
    containers = iter(rng.sample(CONTAINERS, sum(lengths) - n_chains))
    toys = rng.sample(TOYS, n_chains)
    items = [item for c, n in enumerate(lengths) for item in [*(next(containers) for _ in range(n - 1)), toys[c]]]
    places = rng.sample(PLACES, n_chains)
    chains, links = interleaved_chains(rng, items, lengths)
    w = _Writer(recall)
    opening = _opening(rng)
    w.add(opening)
    for n, (c, i) in enumerate(links):
        item = chains[c][i]
        the = "the" if opening and n == 0 else "The"
        if i == 0:
            w.add(f"{the} {item} was at the {places[c]}. ")
        elif running and i < len(chains[c]) - 1:
            w.add(f"{the} {item} was in the {chains[c][i - 1]}, so the {item} was at the ")
            w.answer(places[c], 1)
            w.add(". ")
        else:
            w.add(f"{the} {item} was in the {chains[c][i - 1]}. ")
    for c in (0, rng.randrange(1, n_chains)):
        toy = chains[c][-1]
        w.add(f"Where was the {toy}? The {toy} was at the ")
        w.answer(places[c], min(1, len(chains[c]) - 1) if running else len(chains[c]) - 1)
        w.add(". ")
    return w.problem("inside")


def swap_problem(rng: random.Random, steps: int, running: bool, recall: bool = False) -> Problem:
    """Three children with one toy each swap `steps` times; asked what two of them have. Running:
    after every swap but the last the story says what the two have now (1 step each), and the
    children asked are the last swap's, 1 step from what was said."""
    kids = rng.sample(NAMES, 3)
    toys = rng.sample(TOYS, 3)
    has = dict(zip(kids, toys, strict=True))
    w = _Writer(recall)
    w.add(f"{_opening(rng)}{kids[0]} had a {toys[0]}, {kids[1]} had a {toys[1]} and {kids[2]} had a {toys[2]}. ")
    for i in range(steps):
        a, b = rng.sample(kids, 2)
        has[a], has[b] = has[b], has[a]
        w.add(f"{'Then ' if i else ''}{a} and {b} swapped their toys. ")
        if running and i < steps - 1:
            w.add(f"Now {a} had the ")
            w.answer(has[a], 1)
            w.add(f" and {b} had the ")
            w.answer(has[b], 1)
            w.add(". ")
    asked = [a, b] if running and steps else rng.sample(kids, 2)
    for kid in asked:
        w.add(f"What did {kid} have? {kid} had the ")
        w.answer(has[kid], min(1, steps) if running else steps)
        w.add(". ")
    return w.problem("swap")


def ages_problem(rng: random.Random, steps: int, running: bool, recall: bool = False) -> Problem:
    """A chain of "X was k years older / younger than Y" from one stated age; asked the last one.
    Running: every link but the last says the age it gives ("..., so Mia was six.", 1 step)."""
    people = rng.sample(NAMES, steps + 1)
    age = rng.randint(3, 12)
    w = _Writer(recall)
    w.add(f"{_opening(rng)}{people[0]} was {NUMBER_WORDS[age]} years old. ")
    for i, (prev, person) in enumerate(zip(people[:-1], people[1:], strict=True)):
        older = age <= 2 or (age < MAX_COUNT - 1 and rng.random() < 0.5)
        k = rng.randint(1, min(4, MAX_COUNT - age if older else age - 1))
        age += k if older else -k
        unit = "year" if k == 1 else "years"
        w.add(f"{person} was {NUMBER_WORDS[k]} {unit} {'older' if older else 'younger'} than {prev}")
        if running and i < steps - 1:
            w.add(f", so {person} was ")
            w.answer(NUMBER_WORDS[age], 1)
        w.add(". ")
    asked = people[-1]
    w.add(f"How old was {asked}? {asked} was ")
    w.answer(NUMBER_WORDS[age], min(1, steps) if running else steps)
    w.add(" years old.")
    return w.problem("ages")


def with_extra_facts(problem: Problem, rng: random.Random, n: int) -> Problem:
    """The problem with n unasked facts told in its story ("Mia was at the zoo."), each about a child
    the story does not name (fewer where it names nearly all), at a random sentence boundary before
    its first question: a longer story with more places to confuse, whose answers need no more steps
    (their labels move with the text)."""
    text, steps = problem.text, list(problem.steps)
    named = set(re.findall(r"\b[A-Z][a-z]+\b", text))
    free = [name for name in NAMES if name not in named]
    children = rng.sample(free, min(n, len(free)))  # the longest where-stories name nearly every child
    question = text.rfind(". ", 0, text.index("?")) + 2
    boundaries = [m.end() for m in re.finditer(r"\. ", text[:question])]
    for child in children:
        at = rng.choice(boundaries)
        fact = f"{child} was at the {rng.choice(PLACES)}. "
        text, steps = text[:at] + fact + text[at:], steps[:at] + [0] * len(fact) + steps[at:]
        boundaries = [b + len(fact) if b >= at else b for b in boundaries] + [at + len(fact)]
    return Problem(text, problem.kind, steps)


MAKERS: dict[str, Callable[[random.Random, int, bool, bool], Problem]] = {
    "count": count_problem, "where": where_problem, "swap": swap_problem, "ages": ages_problem,
    "inside": inside_problem}


def guess_chance(problem: Problem) -> list[float]:
    """Per answer, in order: the accuracy of guessing among the words of its class (places, or toys)
    told before it, what a model that reads the story's places or toys but follows no link gets.
    Counts and ages (number words) have no such class: nan."""
    out = []
    for pos, _ in ((p, s) for p, s in enumerate(problem.steps) if s):
        word = problem.text[pos:].split()[0].strip(".,?")
        vocabulary = PLACES if word in PLACES else TOYS if word in TOYS else ()
        before = problem.text[:pos]  # terse stories have no openings; in sentences, not "After school"
        words = re.findall(r"\w+", before) if problem.terse else re.findall(r"\b(?:the|a) (\w+)", before)
        told = {w for w in words if w in vocabulary}
        out.append(1.0 / len(told) if told else float("nan"))
    return out


_PROBLEM_START = re.compile(
    "(?:" + "|".join(re.escape(o) for o in OPENINGS if o) + ")?"
    + "(?:" + "|".join(NAMES) + "|[Tt]he (?:" + "|".join(CONTAINERS) + "))\\b")


def looks_like_problem(text: str) -> bool:
    """Whether a text opens as this module's problems do: an optional opening, then a child's name or
    "the" and a container ("Ben zoo.", "One day, Mia had ...", "The box was ..."). A story that
    opens so ("Lily was happy.") passes too: the two are told apart by their first words only."""
    return _PROBLEM_START.match(text) is not None


def token_steps(offsets: list[tuple[int, int]], steps: list[int]) -> list[int]:
    """Per token (given its character span in the text): the steps of the answer word that starts in
    it, else 0. A byte-level BPE token usually carries the space before the word, so the label goes
    to the token whose span holds the answer's first character."""
    out = [0] * len(offsets)
    starts = {pos: s for pos, s in enumerate(steps) if s}
    for i, (start, end) in enumerate(offsets):
        for pos in range(start, end):
            if pos in starts:
                out[i] = starts.pop(pos)
                break
    if starts:
        raise ValueError(f"answers at characters {sorted(starts)} start inside no token")
    return out
