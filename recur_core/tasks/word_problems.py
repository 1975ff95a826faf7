"""The word-problem task: TinyStories-like text mixed with generated word problems in story form
(recur_core/tasks/stories.py), each answer word labelled with the composition steps it needs.

A checkpoint of this task reads pasted text as it was trained (`WordProblems.read`: after EOS, and a
word problem after a space too); its ground truth is the generated problems'. Each problem is drawn
from its own RNG seeded by (seed, index): a stream's state is one integer.
`WordProblems.parse("word_problems:max_steps=6")` reads the settings of a mixture string.
Held-out windows (`held_out_windows`) and probe windows (`probe_windows`) come from seeds the training
stream (training/word_problems.py) never reaches.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from tokenizers import Tokenizer

from recur_core.settings import seed_for

from .base import EOS, EOS_PIECE, Example, Tokens, parse_settings, text_pieces
from .prose import Prose
from .stories import (
    KINDS,
    MAKERS,
    NAMES,
    Problem,
    looks_like_problem,
    terse_where_problem,
    token_steps,
    with_extra_facts,
)

TERSE_EXAMPLES = ((2, 3), (3, 1), (4, 4))  # (facts read, seed): a terse mixture's example problems


@dataclass(frozen=True)
class WordProblems(Prose):
    """The generated half of a `stories-reasoning` mixture and its settings; an answer's depth is its
    composition steps. Pasted text is read as the mixture was trained (`read`)."""
    kind: ClassVar[str] = "word_problems"
    unit: ClassVar[str] = "step"
    noun: ClassVar[str] = "problem"
    about: ClassVar[str] = ("Word problems in story form: counts changed several times, children following each other "
                            "from place to place, toys swapped, ages told relative to each other. Each answer word "
                            "needs one **step** of composition per change, link or swap since the last value the "
                            "story states.")

    share: float = 0.5  # the share of each training batch's windows that are generated problems
    max_steps: int = 6  # answers need 1 .. max_steps steps in training
    extra_eval_steps: int = 2  # held-out problems go to max_steps + this (extrapolation)
    kinds: str = "count+where+swap+ages"
    running_share: float = 0.5  # the share of problems told "running": each intermediate value stated
    # count facts read (a direct recall of a stated fact is 1 step, each change, link or swap adds one)
    # rather than composition steps (the first link is 1 step): gives a curriculum its base case
    recall: bool = False
    # unasked facts told in each story ("Mia was at the zoo.", a child it does not name): longer stories
    # with more places to confuse, whose answers need no more steps (0: none)
    extra_facts: int = 0
    # the share of `where` problems told in two-word clauses ("Ben zoo. Amy Ben. Amy? zoo.", `hops`'
    # density; stories.terse_where_problem), plain and without extra facts (0: none)
    terse_share: float = 0.0
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
        kwargs = parse_settings(cls, settings, "word_problems")
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
        if not 0 <= task.extra_facts <= len(NAMES) // 4:
            raise ValueError(f"word_problems extra_facts must be within 0 .. {len(NAMES) // 4}, got {task.extra_facts}")
        if not 0.0 <= task.terse_share <= 1.0 or (task.terse_share and "where" not in task.kind_list):
            raise ValueError(f"word_problems terse_share must be within [0, 1], with where among the kinds, "
                             f"got {task.terse_share} for kinds {task.kinds!r}")
        if min(task.answer_weight, task.other_weight, task.text_weight) < 0 or task.answer_weight == 0:
            raise ValueError("word_problems loss weights must be >= 0, with answer_weight > 0")
        return task

    @property
    def kind_list(self) -> list[str]:
        return [k for k in self.kinds.split("+") if k]

    def problem(self, rng: random.Random, steps: int, kind: str | None = None,
                running: bool | None = None) -> Problem:
        kind = kind or rng.choice(self.kind_list)
        if self.terse_share and kind == "where" and rng.random() < self.terse_share:
            return terse_where_problem(rng, steps - self.recall, self.recall)
        running = rng.random() < self.running_share if running is None else running
        problem = MAKERS[kind](rng, steps - self.recall, running, self.recall)
        return with_extra_facts(problem, rng, self.extra_facts) if self.extra_facts else problem

    def read(self, tok: Tokenizer, text: str) -> Tokens:
        """A pasted text as the mixture was trained: after EOS (every story and problem of a training
        window follows one), and after a space too when it opens as a word problem does
        (`stories.looks_like_problem`; problems were told after EOS and a space, `spaced`, stories
        straight after EOS). Without them a problem's first name is another token than its later
        mentions (" Ben" against "Ben"). Its answers are not labelled: their words are the paster's."""
        unlabelled = [0] * len(text)
        return after_eos(tok, *(spaced(text, unlabelled) if looks_like_problem(text) else (text, unlabelled)))

    def labelled(self, tok: Tokenizer, example: Example) -> Tokens:
        """EOS + a word problem's tokens, as the mixture was trained (EOS and a space before every
        problem), and the steps each token's answer word needs (0 elsewhere)."""
        return after_eos(tok, *spaced(example.text, example.char_depths))

    def eval_examples(self, tok: Tokenizer, eval_windows: torch.Tensor | None, seed: int, n: int) -> list[Example]:
        """n word problems drawn with the held-out seeds, told plain, cycling through every step
        count the eval set has."""
        out = []
        for i in range(n):
            rng = random.Random(seed_for(seed, EVAL_SEED_OFFSET + i))
            problem = self.problem(rng, eval_steps(self, i)(rng, 0), running=False)
            out.append(Example(problem.text, tuple(problem.steps)))
        return out

    def text_examples(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> dict[str, str]:
        """Prose's examples; a mixture that tells its problems in two-word clauses opens with its own
        (a checkpoint trained on "Ben zoo. Amy Ben. Amy? zoo." has never read the sentence form)."""
        examples = super().text_examples(tok, eval_windows, n)
        if not self.terse_share:
            return examples
        own = {f"Word problem: {facts} facts": terse_where_problem(random.Random(seed), facts - 1, True).text
               for facts, seed in TERSE_EXAMPLES}
        stories = {name: text for name, text in examples.items() if not name.startswith("Word problem")}
        return dict(list({**own, **stories}.items())[:n])

    def random_example(self, seed: int, deepest: int) -> Example:
        problem = self.problem(random.Random(seed), deepest, running=False)
        return Example(problem.text, tuple(problem.steps))

    def ground_truth_windows(self, tok: Tokenizer, seed: int, n: int,
                             window_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out problem windows (the eval set's generated half)."""
        return held_out_windows(self, tok, seed, n, window_len, EVAL_SEED_OFFSET)


def after_eos(tok: Tokenizer, text: str, char_steps) -> Tokens:
    """EOS + the text's tokens, each labelled with the steps of the answer word it starts (per character:
    char_steps)."""
    enc = tok.encode(text, add_special_tokens=False)
    return Tokens((tok.token_to_id(EOS), *enc.ids), (EOS_PIECE, *text_pieces(text, enc.offsets)),
                  (0, *token_steps(enc.offsets, char_steps)))


def is_word_problems(spec: str) -> bool:
    return spec == "word_problems" or spec.startswith("word_problems:")


# -- windows --------------------------------------------------------------------------------------
EVAL_SEED_OFFSET, SELECT_SEED_OFFSET, PROBE_SEED_OFFSET = 1_000_000_007, 1_500_000_001, 2_000_000_011


def encode_problem(tok, problem: Problem) -> tuple[list[int], list[int]]:
    """(ids, steps) of one problem's tokens (no EOS), told after a space (`spaced`)."""
    text, steps = spaced(problem.text, problem.steps)
    enc = tok.encode(text, add_special_tokens=False)
    return list(enc.ids), token_steps(enc.offsets, steps)


def spaced(text: str, steps) -> tuple[str, list[int]]:
    """A problem's text after a space, and its per-character steps: so that its first word is the token
    its later mentions are (a byte-level BPE reads " Kate" and "Kate" as two tokens, and in "Kate hill.
    Emma Kate. Emma? hill." the lookup must match the first with the second)."""
    return " " + text, [0, *steps]


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
