"""Tokenizers: train a byte-level BPE on the corpus (demo), or load one: a shipped name ("smollm2",
training/tokenizers/), a tokenizer.json path, or a hub id."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recur_core.tasks import EOS
from recur_core.tasks.hops import build_tokenizer

from .data import require_hub

SHIPPED = {"smollm2": Path(__file__).resolve().parent / "tokenizers" / "smollm2.json"}


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with `<|endoftext|>` as token 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_tokenizer(spec: str, docs_for_training: Iterable[str] | None = None) -> Tokenizer:
    """spec: "hops" (the word vocabulary of recur_core/tasks/hops.py); "bpe:<vocab>" trains on
    docs_for_training; a shipped name (SHIPPED); a tokenizer.json path; or a hub id."""
    if spec == "hops":
        return build_tokenizer()
    if spec.startswith("bpe:"):
        if docs_for_training is None:
            raise ValueError("training a BPE needs documents")
        return train_bpe(docs_for_training, int(spec.split(":", 1)[1]))
    path = SHIPPED.get(spec, Path(spec))
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    require_hub(f"the tokenizer {spec!r} (not a file here, nor one of the shipped {sorted(SHIPPED)})")
    return Tokenizer.from_pretrained(spec)


def eos_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOS)
    if i is None:
        raise ValueError(f"the tokenizer has no {EOS} token, which separates documents")
    return i
