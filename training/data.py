"""Documents -> tokens -> fixed windows, with a deterministic validation hold-out.

Sources (all read through `datasets`):
  * a hub dataset id (streamed), e.g. roneneldan/TinyStories or HuggingFaceFW/fineweb-edu;
  * local files: .txt, .jsonl/.json (field "text"), .parquet (column "text"), given as paths, globs or
    folders. A .txt file is split into documents at lines reading `<|endoftext|>`; a file without
    such lines is split at blank lines.
Windows hold seq_len + 1 tokens (inputs and shifted targets); documents are joined with EOS.
Without a validation source, about 0.5% of the documents (by SHA-1) are held out for validation; on
text too small for that to fill the trainer's validation windows, the trainer holds out more documents
in the same hash order (enlarged_holdout_below), up to a tenth of the text.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import torch

from recur_core.report.sources import VAL_PER_MILLE
from recur_core.settings import seed_for

LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# A document's hold-out rank puts its hash's per-mille bucket first, so the usual hold-out (buckets
# below VAL_PER_MILLE) is exactly the ranks below USUAL_HOLDOUT_BELOW, and an enlarged hold-out
# (enlarged_holdout_below) extends it in rank order.
USUAL_HOLDOUT_BELOW = VAL_PER_MILLE << 32
MAX_HOLDOUT_SHARE = 0.10  # an enlarged hold-out takes at most this share of the text's tokens: the
#                           usual validation share of small corpora, so training keeps nine tenths


LOCAL_FORMATS = ("local files via --data (paths, globs or folders): .txt (documents split at `<|endoftext|>` "
                 "lines, else at blank lines), .jsonl / .json (one document per row, field \"text\"), "
                 ".parquet (column \"text\")")
HUB_CHECK_TIMEOUT_S = 3.0


class DataError(ValueError):
    pass


class HubUnreachable(DataError):
    """The Hugging Face hub cannot be reached (offline machine, HF_HUB_OFFLINE, or no network)."""


@functools.lru_cache(maxsize=None)
def hub_reachable() -> str | None:
    """None when the hub answers within a few seconds, else why not. One quick request instead of
    the hub clients' own retries (about 30 s before a raw ConnectionError)."""
    if any(os.environ.get(flag, "0") not in ("", "0") for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    import requests
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        requests.head(endpoint, timeout=HUB_CHECK_TIMEOUT_S)
    except requests.RequestException as err:
        return f"{endpoint} did not answer ({type(err).__name__})"
    return None


def require_hub(what: str) -> None:
    """Raise HubUnreachable, naming the local alternatives, unless the hub answers."""
    why = hub_reachable()
    if why is not None:
        raise HubUnreachable(f"{what} is on the Hugging Face hub, which this machine cannot reach: {why}. "
                             f"Train on {LOCAL_FORMATS}.")


def local_files(spec: str) -> list[Path] | None:
    """Expand a path, glob or folder to supported files; None when spec names no local path."""
    matches = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
    if not matches:
        return None
    files = []
    for m in matches:
        files += sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m]
    files = [f for f in files if f.suffix in LOCAL_SUFFIXES]
    if not files:
        raise DataError(f"{spec}: no .txt / .jsonl / .json / .parquet files there")
    return files


def looks_local(spec: str) -> bool:
    """A path or glob rather than a hub id (which has no file suffix and no wildcard)."""
    return Path(spec).suffix in LOCAL_SUFFIXES or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~"))


def split_txt(text: str) -> list[str]:
    """Split a text file into documents at `<|endoftext|>` lines, else at blank lines."""
    parts = re.split(r"^\s*<\|endoftext\|>\s*$", text, flags=re.M)
    if len(parts) == 1:
        parts = re.split(r"\n\s*\n", text)
    return [p.strip() for p in parts if p.strip()]


def iter_local_documents(files: list[Path]) -> Iterator[str]:
    import datasets
    for f in files:
        builder = LOCAL_SUFFIXES[f.suffix]
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=[str(f)], split="train", streaming=True, **kwargs)
        for row in ds:
            if "text" not in row:
                raise DataError(f"{f}: rows have no 'text' field (fields: {sorted(row)})")
            if builder == "text":
                yield from split_txt(row["text"])
            elif row["text"] and row["text"].strip():
                yield row["text"]


def iter_hub_documents(name: str, config: str, split: str) -> Iterator[str]:
    require_hub(f"the dataset {name!r}")
    import datasets
    ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
    for row in ds:
        if row["text"] and row["text"].strip():
            yield row["text"]


def holdout_rank(doc: str) -> int:
    """The document's place in hold-out order: (per-mille bucket of its SHA-1, then the hash itself)."""
    h = int.from_bytes(hashlib.sha1(doc.encode()).digest()[:4], "little")
    return (h % 1000) << 32 | h


def is_heldout(doc: str, below: int = USUAL_HOLDOUT_BELOW) -> bool:
    """Deterministic hold-out by content hash: by default about VAL_PER_MILLE / 1000 of documents."""
    return holdout_rank(doc) < below


def enlarged_holdout_below(rank_and_tokens: list[tuple[int, int]], need_tokens: int,
                           max_share: float = MAX_HOLDOUT_SHARE) -> int:
    """The hold-out limit for text whose usual hold-out is too small: whole documents in rank order
    (the usual hold-out first) until they hold need_tokens, but no more than max_share of all tokens
    (the usual hold-out itself stays held out, whatever its share).

    rank_and_tokens: (holdout_rank, tokens including the EOS that follows it) per document.
    """
    cap = max_share * sum(n for _, n in rank_and_tokens)
    below, held = USUAL_HOLDOUT_BELOW, 0
    for rank, n in sorted(rank_and_tokens):
        if rank >= below:
            if held >= need_tokens or held + n > cap:
                break
            below = rank + 1
        held += n
    return below


@dataclass
class DataSpec:
    """Where training and validation documents come from."""
    train: str  # local path/glob/folder or hub dataset id
    val: str = ""  # optional separate validation source; else hold out by hash
    hub_config: str = ""
    holdout_below: int = USUAL_HOLDOUT_BELOW  # the hashed hold-out: documents of holdout_rank below this

    def describe(self) -> str:
        return self.train + (f" (validation: {self.val})" if self.val else " (validation: hashed hold-out)")

    def _docs(self, source: str, split: str) -> Iterator[str]:
        files = local_files(source)
        if files is not None:
            return iter_local_documents(files)
        if looks_local(source):
            raise DataError(f"{source}: no such file (accepted: {LOCAL_FORMATS}; or a hub dataset id)")
        return iter_hub_documents(source, self.hub_config, split)

    def all_train_docs(self) -> Iterator[str]:
        """Every document of the training source, the hashed hold-out included."""
        return self._docs(self.train, "train")

    def train_docs(self) -> Iterator[str]:
        docs = self.all_train_docs()
        if not self.holds_out_by_hash():
            return docs
        return (d for d in docs if not is_heldout(d, self.holdout_below))

    def val_docs(self) -> Iterator[str]:
        if self.val:
            return self._docs(self.val, "validation")
        if self._hub_has_validation():
            return self._docs(self.train, "validation")
        return (d for d in self.all_train_docs() if is_heldout(d, self.holdout_below))

    def holds_out_by_hash(self) -> bool:
        """Validation is the hashed hold-out of the training documents (no other source is given)."""
        return not self.val and not self._hub_has_validation()

    def can_enlarge_holdout(self) -> bool:
        """A hashed hold-out of local files (finite, so its documents can be ranked and counted)."""
        return self.holds_out_by_hash() and local_files(self.train) is not None

    def _hub_has_validation(self) -> bool:
        if local_files(self.train) is not None or looks_local(self.train):
            return False
        require_hub(f"the dataset {self.train!r}")
        import datasets
        return "validation" in datasets.get_dataset_split_names(self.train, self.hub_config or None)


def pack_windows(docs: Iterator[str], tokenizer, window_len: int, eos_id: int,
                 batch_docs: int = 256) -> Iterator[list[int]]:
    """Join tokenized documents with EOS and cut the stream into windows of window_len tokens."""
    buf: list[int] = []
    batch: list[str] = []

    def flush():
        nonlocal buf
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            buf.extend(enc.ids)
            buf.append(eos_id)
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) == batch_docs:
            flush()
            while len(buf) >= window_len:
                yield buf[:window_len]
                buf = buf[window_len:]
    flush()
    while len(buf) >= window_len:
        yield buf[:window_len]
        buf = buf[window_len:]


def token_counts(tokenizer, docs: list[str]) -> list[int]:
    """The tokens each document adds to the packed stream: its own and the EOS after it."""
    return [len(enc.ids) + 1 for enc in tokenizer.encode_batch(docs, add_special_tokens=False)]


def take_windows(windows: Iterator[list[int]], n: int) -> torch.Tensor:
    rows = list(islice(windows, n))
    if not rows:
        raise DataError("no complete window: the data is shorter than one window")
    return torch.tensor(rows, dtype=torch.int64)


class ShuffledWindows:
    """All training windows in memory; epoch e visits them in a permutation seeded by (seed, e).

    The data position is just the number of windows consumed, so resuming is exact.
    """

    def __init__(self, windows: torch.Tensor, seed: int):
        self.windows, self.seed, self.position = windows, seed, 0
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(seed_for(self.seed, epoch))
            self._perm, self._perm_epoch = torch.randperm(len(self.windows), generator=g), epoch
        return self._perm

    def next_batch(self, n: int) -> torch.Tensor:
        idx = []
        for pos in range(self.position, self.position + n):
            epoch, i = divmod(pos, len(self.windows))
            idx.append(self._order(epoch)[i])
        self.position += n
        return self.windows[torch.stack(idx)]

    @property
    def epoch(self) -> float:
        return self.position / len(self.windows)

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self.position = int(state["position"])


class StreamedWindows:
    """Windows read in order from a (possibly endless) stream; resuming skips the windows consumed."""

    def __init__(self, make_windows):
        self.make_windows, self.position = make_windows, 0
        self._it = make_windows()

    def _next(self) -> list[int]:
        for _ in range(2):
            try:
                return next(self._it)
            except StopIteration:  # end of the stream: start another pass
                self._it = self.make_windows()
        raise DataError("the training stream holds no complete window")

    def next_batch(self, n: int) -> torch.Tensor:
        rows = [self._next() for _ in range(n)]
        self.position += n
        return torch.tensor(rows, dtype=torch.int64)

    @property
    def epoch(self) -> None:
        return None  # a stream has no epochs (meta.json stores null: NaN is not JSON)

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self._it, self.position = self.make_windows(), int(state["position"])
        for _ in range(self.position):
            self._next()
