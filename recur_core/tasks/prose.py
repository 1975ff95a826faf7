"""The prose task: plain text (TinyStories, FineWeb-Edu, any pasted text), read token by token, with no
known depth per token. Its example texts open with word problems told plain (the stories-reasoning
mixture's, recur_core/tasks/stories.py), then stories and other prose."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import torch
from tokenizers import Tokenizer

from .base import Task, Tokens, text_pieces
from .stories import MAKERS

# (name, kind, steps, seed): word problems told plain, each answer 3 steps from what the story states
WORD_PROBLEMS = (("counting", "count", 3, 1), ("who is where", "where", 3, 2), ("swapped toys", "swap", 2, 1),
                 ("ages", "ages", 3, 0))
EXAMPLES = {
    **{f"Word problem: {name}": MAKERS[kind](random.Random(seed), steps, False).text
       for name, kind, steps, seed in WORD_PROBLEMS},
    "Story opening": "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                     "park with her dog, Max. One day, Max found a big red ball under a tree.",
    "Numbers and dialogue": "Tom had 3 red balls and 12 blue ones. He gave 2 to Mia.\n"
                            "\"Thank you!\" said Mia, and they were happy.",
    "Repetition": "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "Lists and newlines": "Ben packed his bag:\n- 1 apple\n- 2 books\n- a toy car\nThen he ran to school.",
}
PROMPTS = ("Once upon a time, there was a little girl named Lily.", "Tom had a red ball.",
           "The sun was hot and the dog was tired.", "Mia found a box in the park.")


@dataclass(frozen=True)
class Prose(Task):
    """Plain text: no settings, no ground truth."""
    kind: ClassVar[str] = "prose"
    unit: ClassVar[str | None] = None
    noun: ClassVar[str] = "text"
    about: ClassVar[str] = "Plain text: no token has a known depth."

    def read(self, tok: Tokenizer, text: str) -> Tokens:
        enc = tok.encode(text)
        return Tokens(tuple(enc.ids), tuple(text_pieces(text, enc.offsets)), (0,) * len(enc.ids))

    def text_examples(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> dict[str, str]:
        return dict(list(EXAMPLES.items())[:n])

    def prompts(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> list[str]:
        return list(PROMPTS[:n])
