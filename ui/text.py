"""Pasted text -> token ids and the text each token covers (for display), within the model's context."""
from __future__ import annotations

from dataclasses import dataclass

from . import compute

EXAMPLES = {
    "Story opening": "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                     "park with her dog, Max. One day, Max found a big red ball under a tree.",
    "Numbers and dialogue": "Tom had 3 red balls and 12 blue ones. He gave 2 to Mia.\n"
                            "\"Thank you!\" said Mia, and they were happy.",
    "Repetition": "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "Lists and newlines": "Ben packed his bag:\n- 1 apple\n- 2 books\n- a toy car\nThen he ran to school.",
}


@dataclass(frozen=True)
class Encoded:
    ids: tuple[int, ...]  # what the model reads (at most max_seq_len tokens)
    pieces: tuple[str, ...]  # the slice of the text each token covers ("" for a token that only
    #                          continues the previous one's character, e.g. a split UTF-8 byte)
    n_total: int  # tokens in the whole text
    max_len: int

    @property
    def truncated(self) -> bool:
        return self.n_total > len(self.ids)

    def notice(self) -> str | None:
        if not self.truncated:
            return None
        return (f"The text is {self.n_total} tokens long but this model's context is {self.max_len} tokens: "
                f"it was **truncated**, and only the first {self.max_len} tokens are analysed.")


def encode(path: str, ckpt_id: str, text: str, max_len: int) -> Encoded:
    enc = compute.tokenizer(path, ckpt_id).encode(text)
    ids = list(enc.ids)
    pieces, covered = [], 0
    for start, end in enc.offsets:
        # byte-level BPE gives every token of a split character the same span: show it once
        start = max(start, covered)
        pieces.append(text[start:end] if end > start else "")
        covered = max(covered, end)
    return Encoded(tuple(ids[:max_len]), tuple(pieces[:max_len]), len(ids), max_len)
