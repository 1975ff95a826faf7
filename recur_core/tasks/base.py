"""The `Task` interface: what a checkpoint was trained to read, and the known depth of its answers.

A task is parsed from the training spec (`recur_core.tasks.parse_task(dataset, mixture)`, or `task_of(meta)`
for a checkpoint's meta.json) and then asked, never forked on: how a pasted text is read (`read`), labelled
examples and how they are tokenized with each token's depth (`eval_examples`, `random_example`,
`labelled`), example texts for the text pages (`text_examples`), and held-out windows with their
ground truth (`ground_truth_windows`), and prompts for the Generate page (`prompts`). Three tasks implement it: multi-hop programs (`HopsTask`, an
answer's depth in hops), word problems in story form (`WordProblems`, in composition steps) and prose
(`Prose`, no depth). `interleaved_chains` is what both generators tell their chains of facts with.
"""
from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from tokenizers import Tokenizer

EOS = "<|endoftext|>"  # token 0 of every project tokenizer: a document's (or program's) start and end
EOS_PIECE = "␄"  # how a labelled example's leading EOS is drawn


@dataclass(frozen=True)
class Example:
    """A text with ground truth: per character, the depth of the answer that starts there, else 0."""
    text: str
    char_depths: tuple[int, ...]

    @property
    def deepest(self) -> int:
        return max(self.char_depths, default=0)


@dataclass(frozen=True)
class Tokens:
    """A text as a checkpoint reads it: token ids, the slice of the text each token covers, and each
    token's ground-truth depth (its answer's hops / steps, 0 elsewhere and for tasks without one)."""
    ids: tuple[int, ...]
    pieces: tuple[str, ...]
    depths: tuple[int, ...]


class Task(ABC):
    """One training task. Implementations are frozen dataclasses of the task's settings."""
    kind: ClassVar[str]  # the spec's name: "hops", "word_problems" or "prose"
    unit: ClassVar[str | None]  # what an answer's depth is counted in ("hop", "step"); None: no ground truth
    noun: ClassVar[str]  # what one example is called ("program", "problem", "text")
    about: ClassVar[str]  # one paragraph (Markdown): what the examples are and what an answer's depth counts
    padding: ClassVar[str | None] = None  # the token windows are padded with after their text, padding
    #                                       predicting padding at zero training weight (None: windows are full)

    @property
    def has_ground_truth(self) -> bool:
        return self.unit is not None

    @abstractmethod
    def read(self, tok: Tokenizer, text: str) -> Tokens:
        """A pasted text as this task's checkpoint reads it (the text pages)."""

    @abstractmethod
    def text_examples(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> dict[str, str]:
        """At most n example texts by name for the text pages (eval_windows: the checkpoint's, None for
        a folder that ships none)."""

    @abstractmethod
    def prompts(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> list[str]:
        """At most n prompts for generation, one line each."""

    def labelled(self, tok: Tokenizer, example: Example) -> Tokens:
        """EOS + a labelled example's tokens as the task was trained, with each token's depth."""
        raise self._no_ground_truth()

    def eval_examples(self, tok: Tokenizer, eval_windows: torch.Tensor, seed: int, n: int) -> list[Example]:
        """n held-out labelled examples (`seed`: the checkpoint's training seed)."""
        raise self._no_ground_truth()

    def random_example(self, seed: int, deepest: int) -> Example:
        """A new seeded example whose deepest answer needs `deepest` hops / steps."""
        raise self._no_ground_truth()

    def ground_truth_windows(self, tok: Tokenizer, seed: int, n: int,
                             window_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, depths), each n x window_len: held-out generated windows and every token's depth."""
        raise self._no_ground_truth()

    def _no_ground_truth(self) -> ValueError:
        return ValueError(f"the {self.kind} task has no ground truth: its answers have no known depth")


def parse_settings(cls, settings: str, what: str) -> dict:
    """The fields of dataclass `cls` from "key=value,..." (each value cast to its field's type: float,
    int, str, or bool written true/false/1/0); a ValueError naming `what` and the valid keys for any
    other item."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in filter(None, settings.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"{what} setting {item!r}: expected key=value with key in {', '.join(types)}")
        try:
            kwargs[key] = {"float": float, "int": int, "str": str, "bool": _boolean}[types[key]](value)
        except ValueError as e:
            raise ValueError(f"{what} setting {item!r}: {e}") from None
    return kwargs


def _boolean(value: str) -> bool:
    words = {"true": True, "1": True, "false": False, "0": False}
    if value.lower() not in words:
        raise ValueError(f"expected true or false, got {value!r}")
    return words[value.lower()]


def text_pieces(text: str, offsets) -> list[str]:
    """The slice of the text each token covers; byte-level BPE gives every token of a split
    character the same span: it is shown once ("" for the tokens that only continue it)."""
    pieces, covered = [], 0
    for start, end in offsets:
        start = max(start, covered)
        pieces.append(text[start:end] if end > start else "")
        covered = max(covered, end)
    return pieces


def interleaved_chains(rng: random.Random, names: list, lengths: list[int]) -> tuple[list[list], list[tuple[int, int]]]:
    """`names` cut into chains of `lengths`, and the order their links are told in: (chain, link)
    pairs, each chain in order, the chains interleaved at random (one rng.shuffle)."""
    chains, at = [], 0
    for n in lengths:
        chains.append(names[at:at + n])
        at += n
    order = [c for c, chain in enumerate(chains) for _ in chain]
    rng.shuffle(order)
    told = [0] * len(chains)
    links = []
    for c in order:
        links.append((c, told[c]))
        told[c] += 1
    return chains, links
