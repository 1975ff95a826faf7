"""Training on text mixed with generated word problems (the task, its generators and ground truth:
recur_core/tasks/word_problems.py and stories.py): the problem stream and its `Curriculum`, the mixed
batches and their per-token loss weights, the saved windows of a mixture, and what a BPE is trained on.

Held-out problems use other seeds than training's (recur_core.tasks.word_problems), so resume is exact
and no saved window is ever trained on."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from recur_core.analysis.ground_truth import GROUND_TRUTH
from recur_core.settings import seed_for
from recur_core.tasks.stories import CONTAINERS, NAMES, NUMBER_WORDS, PLACES, TOYS
from recur_core.tasks.word_problems import (
    EVAL_SEED_OFFSET,
    SELECT_SEED_OFFSET,
    WordProblems,
    held_out_windows,
    probe_windows,
    problem_window,
    train_steps,
)


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
