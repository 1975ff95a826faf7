"""Pasted text -> token ids and the text each token covers (for display), within the model's context,
as the checkpoint's task reads it (recur_core.tasks): a hops checkpoint reads a program as it was
trained (EOS, then one token per statement, query, answer or `;`) and its examples are held-out
programs; a word-problem mixture's reads a problem after EOS and a space, as trained; any other reads prose.
"""
from __future__ import annotations

from dataclasses import dataclass

from recur_core.tasks import Task, Tokens, task_of

from .handle import Handle

N_EXAMPLES = 8  # example texts offered by the text pages


def task(model: Handle) -> Task:
    """The task the checkpoint was trained on (its meta.json)."""
    return task_of(model.meta)


def eval_windows(model: Handle):
    """The checkpoint's eval windows; None for a folder that ships none."""
    return model.checkpoint().windows("eval") if model.has_windows else None


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


def within_context(tokens: Tokens, max_len: int) -> tuple[Encoded, list[int]]:
    """(what the model reads of the tokens, at most max_len of them; each read token's depth)."""
    return Encoded(tokens.ids[:max_len], tokens.pieces[:max_len], len(tokens.ids), max_len), list(tokens.depths[:max_len])


def examples_for(model: Handle) -> dict[str, str]:
    """Example texts by name: held-out programs for a hops checkpoint, prose otherwise."""
    windows = eval_windows(model)
    return task(model).text_examples(model.tokenizer() if windows is not None else None, windows, N_EXAMPLES)


def prompt_ids(model: Handle, text: str) -> list[int]:
    """A prompt's token ids as the checkpoint's task reads it (a program or a word problem after EOS,
    as trained), not cut to the context: generation checks its own room."""
    return list(task(model).read(model.tokenizer(), text).ids)


def encode_for(model: Handle, text: str) -> Encoded:
    """The text as this checkpoint reads it: a program for a hops checkpoint, else plain tokens."""
    return within_context(task(model).read(model.tokenizer(), text), model.max_seq_len)[0]
