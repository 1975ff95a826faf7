"""Pasted text -> token ids and the text each token covers (for display), within the model's context.

A checkpoint trained on hops programs (training/hops.py) reads a program as it was trained: EOS, then
one token per statement, query, answer or `;`; its examples are held-out programs, not prose.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from training.hops import EOS, hop_counts, is_hops, token_hops
from training.word_problems import WordProblems, token_steps

from .handle import Handle

# (name, kind, steps, seed): word problems told plain, each answer 3 steps from what the story states
WORD_PROBLEMS = (("counting", "count", 3, 1), ("who is where", "where", 3, 2), ("swapped toys", "swap", 2, 1),
                 ("ages", "ages", 3, 0))


def word_problem_examples() -> dict[str, str]:
    """Word problems as the stories-reasoning specimen was trained on them (training/word_problems.py)."""
    task = WordProblems()
    return {f"Word problem: {name}": task.problem(random.Random(seed), steps, kind, running=False).text
            for name, kind, steps, seed in WORD_PROBLEMS}


EXAMPLES = {
    **word_problem_examples(),
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


def encode(model: Handle, text: str) -> Encoded:
    """The text's plain tokens, up to the model's context."""
    enc = model.tokenizer().encode(text)
    ids, n = list(enc.ids), model.max_seq_len
    pieces = _pieces(text, enc.offsets)
    return Encoded(tuple(ids[:n]), tuple(pieces[:n]), len(ids), n)


def _pieces(text: str, offsets) -> list[str]:
    """The slice of the text each token covers; byte-level BPE gives every token of a split
    character the same span: it is shown once."""
    pieces, covered = [], 0
    for start, end in offsets:
        start = max(start, covered)
        pieces.append(text[start:end] if end > start else "")
        covered = max(covered, end)
    return pieces


def encode_word_problem(model: Handle, text: str, char_steps) -> tuple[Encoded, list[int]]:
    """EOS + a word problem's tokens, as the stories-reasoning mixture was trained (EOS before every
    problem), and the steps each token's answer word needs (training/word_problems.py; 0 elsewhere)."""
    tok = model.tokenizer()
    enc = tok.encode(text, add_special_tokens=False)
    ids = [tok.token_to_id(EOS), *enc.ids]
    pieces = [EOS_PIECE, *_pieces(text, enc.offsets)]
    steps = [0, *token_steps(enc.offsets, list(char_steps))]
    n = model.max_seq_len
    return Encoded(tuple(ids[:n]), tuple(pieces[:n]), len(ids), n), steps[:n]


# -- hops programs --------------------------------------------------------------------------------------
EOS_PIECE = "␄"  # how a program's leading <|endoftext|> is drawn
N_PROGRAM_EXAMPLES = 8


def reads_programs(model: Handle) -> bool:
    """Whether the checkpoint was trained on hops programs (its text is a program, not prose)."""
    return is_hops(str((model.meta.get("train_config") or {}).get("dataset", "")))


def eval_programs(model: Handle, n: int = 32) -> list[str]:
    """The first n held-out programs as text (EOS and padding removed)."""
    ckpt = model.checkpoint()
    tok = model.tokenizer()
    eos = tok.token_to_id(EOS)
    return [tok.decode([i for i in w.tolist() if i != eos]) for w in ckpt.windows("eval")[:n]]


def program_label(program: str, i: int) -> str:
    deepest = max(hop_counts(program) or [0])
    return f"#{i} · deepest answer {deepest} hop{'s' if deepest != 1 else ''} · {program[:40]}…"


def examples_for(model: Handle) -> dict[str, str]:
    """Example texts by name: held-out programs for a hops checkpoint, prose otherwise."""
    if reads_programs(model) and model.has_windows:
        programs = eval_programs(model, N_PROGRAM_EXAMPLES)
        return {program_label(p, i): p for i, p in enumerate(programs)}
    return EXAMPLES


def encode_program(model: Handle, text: str) -> tuple[Encoded, list[int]]:
    """EOS + the program's tokens, as the model was trained, and the hop count each token carries
    (answers only; 0 elsewhere)."""
    tok = model.tokenizer()
    ids, hops = token_hops(tok, text)
    pieces = [EOS_PIECE] + [tok.id_to_token(i) for i in ids[1:]]
    n = model.max_seq_len
    return Encoded(tuple(ids[:n]), tuple(pieces[:n]), len(ids), n), hops[:n]


def encode_for(model: Handle, text: str) -> Encoded:
    """The text as this checkpoint reads it: a program for a hops checkpoint, else plain tokens."""
    if reads_programs(model):
        return encode_program(model, text)[0]
    return encode(model, text)
