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

The word that answers the question (`seven`, `farm`, `kite`, `five`) is an **answer**, labelled with
its **steps**: the number of facts that must be chained to get it (changes applied to a count, links
followed to a place, swaps of a toy, age differences added). Its loss can be predicted only by
composing them, so a looped model should need more loops for it than for a function word. The label
sits on the answer word's first character, so `token_steps` can put it on the token that starts the
answer under any tokenizer (the ground truth of checkpoint analyses: recur_core.analysis.ground_truth,
which calls the label "hops").

Each problem is drawn from its own RNG seeded by (seed, index): the stream's state is one integer.
`WordProblems.parse("word_problems:max_steps=6")` reads the settings of a dataset string.
"""
from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Callable

import torch

from recur_core.settings import seed_for

from .hops import interleaved_chains

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

    @property
    def answer_steps(self) -> list[int]:
        return [s for s in self.steps if s]


class _Writer:
    """Builds a problem's text sentence by sentence, remembering where each answer word starts."""

    def __init__(self):
        self.parts: list[str] = []
        self.length = 0
        self.answers: list[tuple[int, int]] = []  # (character position, steps)

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def answer(self, word: str, steps: int) -> None:
        self.answers.append((self.length, steps))
        self.add(word)

    def problem(self, kind: str) -> Problem:
        text = "".join(self.parts).strip()
        shift = len("".join(self.parts)) - len("".join(self.parts).lstrip())
        steps = [0] * len(text)
        for pos, s in self.answers:
            steps[pos - shift] = s
        return Problem(text, kind, steps)


def _opening(rng: random.Random) -> str:
    return rng.choice(OPENINGS)


def _then(rng: random.Random, i: int) -> str:
    return "Then " if i and rng.random() < 0.4 else ""


def count_problem(rng: random.Random, steps: int, running: bool) -> Problem:
    """A count changed `steps` times (taken away or added to), asked at the end. Running: after every
    change but the last the story says the new count ("Now Sam had five apples.", 1 step: one change
    to a stated count), so the final answer is 1 step from the last stated count."""
    noun, take_verbs, add_verbs = rng.choice(THINGS)
    owner, *others = rng.sample(NAMES, 4)
    total = rng.randint(3, 12)
    w = _Writer()
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
    w.answer(NUMBER_WORDS[total], 1 if running else steps)
    w.add(f" {noun}.")
    return w.problem("count")


def where_problem(rng: random.Random, steps: int, running: bool) -> Problem:
    """Chains of "X was with Y" from a child at a place; the first chain's last child is `steps`
    links from the place, the others' at most that many. Two or three chains, interleaved, each in
    order; the last child of another chain is asked too. Running: every link but the asked children's says where that puts the child
    ("Tom was with Ben, so Tom was at the farm.", 1 step), so each answer is 1 step from a stated place."""
    n_chains = rng.randint(2, 3)
    lengths = [steps + 1] + [rng.randint(2, min(steps + 1, 5)) for _ in range(n_chains - 1)]
    while sum(lengths) > len(NAMES):
        lengths[lengths.index(max(lengths[1:]), 1)] -= 1
    names = rng.sample(NAMES, sum(lengths))
    places = rng.sample(PLACES, n_chains)
    chains, links = interleaved_chains(rng, names, lengths)
    w = _Writer()
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
    for c in (0, rng.randrange(1, n_chains)):
        asked = chains[c][-1]
        w.add(f"Where was {asked}? {asked} was at the ")
        w.answer(places[c], 1 if running else len(chains[c]) - 1)
        w.add(". ")
    return w.problem("where")


def inside_problem(rng: random.Random, steps: int, running: bool) -> Problem:
    """Where a toy is through containers: chains "the X was in the Y" from a container at a place,
    each ending in a toy; the first chain's toy is `steps` links from the place, the others' at most
    that many. Two or three chains, interleaved, each told from its place outwards; the toys of the first and of one other chain
    are asked. Running: every container but the outermost is said to be where that puts it ("The
    box was in the bag, so the box was at the park.", 1 step)."""
    n_chains = rng.randint(2, 3)
    lengths = [steps + 1] + [rng.randint(2, min(steps + 1, 5)) for _ in range(n_chains - 1)]
    while sum(lengths) - n_chains > len(CONTAINERS):
        lengths[lengths.index(max(lengths[1:]), 1)] -= 1
    containers = iter(rng.sample(CONTAINERS, sum(lengths) - n_chains))
    toys = rng.sample(TOYS, n_chains)
    items = [item for c, n in enumerate(lengths) for item in [*(next(containers) for _ in range(n - 1)), toys[c]]]
    places = rng.sample(PLACES, n_chains)
    chains, links = interleaved_chains(rng, items, lengths)
    w = _Writer()
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
        w.answer(places[c], 1 if running else len(chains[c]) - 1)
        w.add(". ")
    return w.problem("inside")


def swap_problem(rng: random.Random, steps: int, running: bool) -> Problem:
    """Three children with one toy each swap `steps` times; asked what two of them have. Running:
    after every swap but the last the story says what the two have now (1 step each), and the
    children asked are the last swap's, 1 step from what was said."""
    kids = rng.sample(NAMES, 3)
    toys = rng.sample(TOYS, 3)
    has = dict(zip(kids, toys, strict=True))
    w = _Writer()
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
    asked = [a, b] if running else rng.sample(kids, 2)
    for kid in asked:
        w.add(f"What did {kid} have? {kid} had the ")
        w.answer(has[kid], 1 if running else steps)
        w.add(". ")
    return w.problem("swap")


def ages_problem(rng: random.Random, steps: int, running: bool) -> Problem:
    """A chain of "X was k years older / younger than Y" from one stated age; asked the last one.
    Running: every link but the last says the age it gives ("..., so Mia was six.", 1 step)."""
    people = rng.sample(NAMES, steps + 1)
    age = rng.randint(3, 12)
    w = _Writer()
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
    w.answer(NUMBER_WORDS[age], 1 if running else steps)
    w.add(" years old.")
    return w.problem("ages")


MAKERS: dict[str, Callable[[random.Random, int, bool], Problem]] = {
    "count": count_problem, "where": where_problem, "swap": swap_problem, "ages": ages_problem,
    "inside": inside_problem}


@dataclass(frozen=True)
class WordProblems:
    """The generated half of a `stories-reasoning` mixture."""
    share: float = 0.5  # the share of each training batch's windows that are generated problems
    max_steps: int = 6  # answers need 1 .. max_steps steps in training
    extra_eval_steps: int = 2  # held-out problems go to max_steps + this (extrapolation)
    kinds: str = "count+where+swap+ages"
    running_share: float = 0.5  # the share of problems told "running": each intermediate value stated
    # loss weights per target token (1, 1, 1: the plain mean); hops weights answers 1 and the rest 0.1
    answer_weight: float = 1.0  # answer words
    other_weight: float = 1.0  # the problems' other tokens
    text_weight: float = 1.0  # the text windows' tokens
    # curriculum (start_steps 0: none, steps drawn from 1 .. max_steps throughout); see Curriculum
    start_steps: int = 0  # the largest step count starts here ...
    advance_at: float = 0.8  # ... and grows by one once this share of a block of its answers is right
    advance_answers: int = 512  # answers at the top step count per block

    @classmethod
    def parse(cls, spec: str) -> "WordProblems":
        """`word_problems` or `word_problems:key=value,...` with WordProblems' fields."""
        name, _, settings = spec.partition(":")
        if name != "word_problems":
            raise ValueError(f"not a word-problem mixture: {spec!r} (expected word_problems[:key=value,...])")
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for item in filter(None, settings.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in types:
                raise ValueError(f"word_problems setting {item!r}: expected key=value with key in {', '.join(types)}")
            kwargs[key] = {"float": float, "int": int, "str": str}[types[key]](value)
        task = cls(**kwargs)
        unknown = set(task.kind_list) - set(KINDS)
        if unknown or not task.kind_list:
            raise ValueError(f"word_problems kinds {task.kinds!r}: choose from {', '.join(KINDS)} (joined by +)")
        if not 0.0 < task.share < 1.0:
            raise ValueError(f"word_problems share must be within (0, 1), got {task.share}")
        if task.max_steps < 1 or task.max_steps + task.extra_eval_steps > len(NAMES) - 1:
            raise ValueError(f"word_problems max_steps must be within 1 .. {len(NAMES) - 1 - task.extra_eval_steps}")
        if not 0 <= task.start_steps <= task.max_steps:
            raise ValueError(f"word_problems start_steps must be within 0 (no curriculum) .. max_steps, "
                             f"got {task.start_steps}")
        if not 0.0 < task.advance_at <= 1.0 or task.advance_answers < 1:
            raise ValueError("word_problems advance_at must be within (0, 1] and advance_answers at least 1")
        if min(task.answer_weight, task.other_weight, task.text_weight) < 0 or task.answer_weight == 0:
            raise ValueError("word_problems loss weights must be >= 0, with answer_weight > 0")
        return task

    @property
    def kind_list(self) -> list[str]:
        return [k for k in self.kinds.split("+") if k]

    def problem(self, rng: random.Random, steps: int, kind: str | None = None,
                running: bool | None = None) -> Problem:
        kind = kind or rng.choice(self.kind_list)
        running = rng.random() < self.running_share if running is None else running
        return MAKERS[kind](rng, steps, running)


def guess_chance(problem: Problem) -> list[float]:
    """Per answer, in order: the accuracy of guessing among the words of its class (places, or toys)
    told before it, what a model that reads the story's places or toys but follows no link gets.
    Counts and ages (number words) have no such class: nan."""
    out = []
    for pos, _ in ((p, s) for p, s in enumerate(problem.steps) if s):
        word = problem.text[pos:].split()[0].strip(".,?")
        vocabulary = PLACES if word in PLACES else TOYS if word in TOYS else ()
        told = {w for w in re.findall(r"\b(?:the|a) (\w+)", problem.text[:pos]) if w in vocabulary}  # not "After school"
        out.append(1.0 / len(told) if told else float("nan"))
    return out


def is_word_problems(spec: str) -> bool:
    return spec == "word_problems" or spec.startswith("word_problems:")


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


# -- windows --------------------------------------------------------------------------------------
EVAL_SEED_OFFSET, SELECT_SEED_OFFSET, PROBE_SEED_OFFSET = 1_000_000_007, 1_500_000_001, 2_000_000_011


def encode_problem(tok, problem: Problem) -> tuple[list[int], list[int]]:
    """(ids, steps) of one problem's tokens (no EOS)."""
    enc = tok.encode(problem.text, add_special_tokens=False)
    return list(enc.ids), token_steps(enc.offsets, problem.steps)


def problem_window(task: WordProblems, tok, seed: int, window_len: int,
                   steps_of: Callable[[random.Random, int], int]) -> tuple[list[int], list[int]]:
    """(ids, steps) of one window: EOS, problem, EOS, problem, ... cut at window_len tokens. The
    window's problems come from one RNG seeded `seed`; steps_of(rng, i) gives problem i's steps."""
    rng = random.Random(seed)
    eos = tok.token_to_id("<|endoftext|>")
    ids, steps = [eos], [0]
    i = 0
    while len(ids) < window_len:
        p_ids, p_steps = encode_problem(tok, task.problem(rng, steps_of(rng, i)))
        ids += p_ids + [eos]
        steps += p_steps + [0]
        i += 1
    return ids[:window_len], steps[:window_len]


def train_steps(top: int) -> Callable[[random.Random, int], int]:
    """Training problems' steps: uniform on 1 .. top."""
    return lambda rng, i: rng.randint(1, top)


def eval_steps(task: WordProblems, window: int) -> Callable[[random.Random, int], int]:
    """Held-out windows cycle through 1 .. max_steps + extra_eval_steps, so every count is present."""
    top = task.max_steps + task.extra_eval_steps
    return lambda rng, i: 1 + (window * 3 + i) % top


@dataclass
class Curriculum:
    """Holds each stage until it is learned. Training problems need 1 .. `top` steps; the answers
    labelled `top` steps are scored on each training batch before its update (argmax at that step's
    sampled depth), in blocks of `block` answers; a block with at least `advance_at` of them right
    raises `top` by one, up to `max_steps`, and every block starts counting afresh. Its fields are
    its whole state (saved with the data stream, so --resume continues it exactly)."""
    top: int
    max_steps: int
    advance_at: float
    block: int
    correct: int = 0
    seen: int = 0

    @classmethod
    def of(cls, task: WordProblems) -> "Curriculum | None":
        if not task.start_steps:
            return None
        return cls(task.start_steps, task.max_steps, task.advance_at, task.advance_answers)

    def record(self, correct: int, seen: int) -> None:
        if self.top >= self.max_steps:
            return
        self.correct += correct
        self.seen += seen
        if self.seen >= self.block:
            if self.correct >= self.advance_at * self.seen:
                self.top += 1
            self.correct = self.seen = 0

    def state(self) -> dict:
        return {"top": self.top, "correct": self.correct, "seen": self.seen}

    def load_state(self, state: dict) -> None:
        self.top, self.correct, self.seen = int(state["top"]), int(state["correct"]), int(state["seen"])


class ProblemStream:
    """The infinite stream of training windows of generated problems; its state is `position` and,
    with a curriculum, the curriculum's (which sets the steps of the windows drawn next)."""

    def __init__(self, task: WordProblems, tok, seed: int, window_len: int):
        self.task, self.tok, self.seed, self.window_len = task, tok, seed, window_len
        self.position = 0
        self.curriculum = Curriculum.of(task)

    @property
    def top(self) -> int:
        """The largest step count of the windows drawn now."""
        return self.curriculum.top if self.curriculum else self.task.max_steps

    def window(self, index: int) -> tuple[list[int], list[int]]:
        return problem_window(self.task, self.tok, seed_for(self.seed, index), self.window_len, train_steps(self.top))

    def next_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, steps), each n x window_len."""
        rows = [self.window(self.position + i) for i in range(n)]
        self.position += n
        return (torch.tensor([r[0] for r in rows], dtype=torch.int64),
                torch.tensor([r[1] for r in rows], dtype=torch.int64))

    def state(self) -> dict:
        return {"position": self.position, **({"curriculum": self.curriculum.state()} if self.curriculum else {})}

    def load_state(self, state: dict | int) -> None:
        """A state of `state()`, or a bare position (runs saved before the curriculum existed)."""
        state = state if isinstance(state, dict) else {"position": state}
        self.position = int(state["position"])
        if self.curriculum:
            self.curriculum.load_state(state["curriculum"])


TEXT_LABEL = -1  # the steps label of a text window's tokens in a training batch (problems: 0 or an answer's steps)


class MixedWindows:
    """Training batches of text windows (TinyStories) and generated problem windows: of every batch
    of n, round(n * share) are problems, the rest text, alternating so that every DDP rank's slice
    holds both. The state is both sources' (exact resume). The last batch's per-token labels
    (`labels`: an answer's steps, 0 on other problem tokens, TEXT_LABEL on text) give each target
    its loss weight and the curriculum its answers."""

    def __init__(self, text, problems: ProblemStream, task: WordProblems):
        self.text, self.problems, self.task = text, problems, task
        self.labels: torch.Tensor | None = None

    def next_batch(self, n: int) -> torch.Tensor:
        n_problems = round(n * self.task.share)
        text = self.text.next_batch(n - n_problems)
        gen_ids, gen_steps = self.problems.next_batch(n_problems)
        self.labels = interleave(torch.full_like(text, TEXT_LABEL), gen_steps)
        return interleave(text, gen_ids)

    def target_labels(self, rows: slice) -> torch.Tensor:
        """The labels of the last batch's targets (positions 1 ..), of the rows this rank trains on."""
        return self.labels[rows, 1:]

    def loss_weights(self, inputs: torch.Tensor, targets: torch.Tensor, rows: slice) -> torch.Tensor:
        """Per target of the last batch's `rows` (inputs and targets: those rows' tokens):
        answer_weight on answers, other_weight on the problems' other tokens, text_weight on text."""
        labels = self.target_labels(rows)
        if labels.shape != targets.shape:
            raise ValueError(f"targets {tuple(targets.shape)} are not the last batch's rows {tuple(labels.shape)}")
        weights = torch.full(labels.shape, self.task.other_weight)
        weights[labels > 0] = self.task.answer_weight
        weights[labels == TEXT_LABEL] = self.task.text_weight
        return weights

    def curriculum_counts(self, logits: torch.Tensor, targets: torch.Tensor, rows: slice) -> torch.Tensor:
        """[right, seen] over the answers at the curriculum's top step count in the last batch's
        `rows` (the model's argmax against the target)."""
        at_top = self.target_labels(rows).to(targets.device) == self.problems.top
        right = (logits.argmax(-1) == targets) & at_top
        return torch.stack([right.sum(), at_top.sum()])

    def record(self, counts: torch.Tensor) -> None:
        """Counts of curriculum_counts (summed over ranks) move the curriculum."""
        if self.problems.curriculum:
            self.problems.curriculum.record(int(counts[0]), int(counts[1]))

    @property
    def has_curriculum(self) -> bool:
        return self.problems.curriculum is not None

    @property
    def trained_hops(self) -> int:
        """The largest step count trained so far (the ground truth's max_train_hops)."""
        return self.problems.top

    @property
    def epoch(self):
        return self.text.epoch

    def state(self) -> dict:
        return {"text": self.text.state(), "problems": self.problems.state(), "kind": "word_problems"}

    def load_state(self, state: dict) -> None:
        self.text.load_state(state["text"])
        self.problems.load_state(state["problems"])


def interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of a and b alternating (a first), the longer one's rest at the end."""
    rows, k = [], min(len(a), len(b))
    for i in range(k):
        rows += [a[i], b[i]]
    rows += list(a[k:]) + list(b[k:])
    return torch.stack(rows)


def held_out_windows(task: WordProblems, tok, seed: int, n: int, window_len: int,
                     offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, steps), each n x window_len: held-out problem windows (another seed than training's)."""
    rows = [problem_window(task, tok, seed_for(seed, offset + i), window_len, eval_steps(task, i)) for i in range(n)]
    return (torch.tensor([r[0] for r in rows], dtype=torch.int64),
            torch.tensor([r[1] for r in rows], dtype=torch.int64))


def probe_windows(task: WordProblems, tok, seed: int, n: int, window_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, steps): training-distribution windows from indices the stream never reaches (A2's probes)."""
    rows = [problem_window(task, tok, seed_for(seed, PROBE_SEED_OFFSET + i), window_len, train_steps(task.max_steps))
            for i in range(n)]
    return (torch.tensor([r[0] for r in rows], dtype=torch.int64),
            torch.tensor([r[1] for r in rows], dtype=torch.int64))


def tokenizer_sample(task: WordProblems, seed: int, n: int = 16_000) -> list[str]:
    """Generated problems for training a BPE beside the text, about as much as a TinyStories slice
    of 3.5 MB, so that every name, place, toy and number word is one token of a 2,048-token BPE."""
    rng = random.Random(seed_for(seed, SELECT_SEED_OFFSET - 1))
    return [task.problem(rng, rng.randint(1, task.max_steps + task.extra_eval_steps)).text for _ in range(n)]


def split_answer_words(tok, task: WordProblems) -> list[str]:
    """The task's answer words, names and containers (after a space) that `tok` splits into several
    tokens: an answer is then scored on its first piece only, and a lookup needs more than one."""
    numbers = NUMBER_WORDS if {"count", "ages"} & set(task.kind_list) else ()
    words = (*numbers, *PLACES, *TOYS, *NAMES, *CONTAINERS)
    return [w for w in words if len(tok.encode(" " + w, add_special_tokens=False).ids) != 1]


GROUND_TRUTH = "ground_truth.safetensors"  # the format of training/hops.py's: "hops" = steps here


def mixture_data(task: WordProblems, tok, seed: int, window_len: int, text_eval: torch.Tensor,
                 text_select: torch.Tensor, text_probe: torch.Tensor, text_train):
    """(eval, selection, probe windows, training batches, extra checkpoint tensors) of a mixture.

    Each saved set keeps the text set's size: its first (1 - share) part is text windows and the
    rest held-out problem windows (eval and selection from their own seeds, probes from training's
    distribution at indices the stream never reaches), alternating. The ground truth holds every
    token's steps (0 on text and on non-answers), aligned with the windows like a hops checkpoint's."""
    def mixed(text: torch.Tensor, make) -> tuple[torch.Tensor, torch.Tensor]:
        n_problems = round(len(text) * task.share)
        gen_ids, gen_steps = make(n_problems)
        text = text[:len(text) - n_problems]
        return interleave(text, gen_ids), interleave(torch.zeros_like(text), gen_steps)

    eval_ids, eval_steps_ = mixed(text_eval, lambda n: held_out_windows(task, tok, seed, n, window_len,
                                                                         EVAL_SEED_OFFSET))
    select_ids, _ = mixed(text_select, lambda n: held_out_windows(task, tok, seed, n, window_len, SELECT_SEED_OFFSET))
    probe_ids, probe_steps = mixed(text_probe, lambda n: probe_windows(task, tok, seed, n, window_len))
    ground_truth = {GROUND_TRUTH: {"hops": eval_steps_, "probe_hops": probe_steps,
                                   "max_train_hops": torch.tensor([task.max_steps])}}
    batches = MixedWindows(text_train, ProblemStream(task, tok, seed, window_len), task)
    return eval_ids, select_ids, probe_ids, batches, ground_truth
