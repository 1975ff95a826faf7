"""Finding checkpoint folders and describing them without loading their weights.

Sources, in order: the shipped `checkpoints/<name>/` folders next to app.py (`$RECUR_SHIPPED` names
another folder for them, e.g. an empty one in tests), every folder named in
`$RECUR_CHECKPOINTS` (os.pathsep-separated; each is a checkpoint or a folder of checkpoints),
`$RECUR_CHECKPOINT` (also the default selection) and paths typed in the sidebar. A folder that is
missing or whose meta.json cannot be read is still listed, with the reason, so the app can say
what is wrong with it while the others keep working. A Huginn-0125-format folder (a transformers
config.json, no meta.json) is described from its config and safetensors headers
(recur_core.describe_folder): size, dtype and memory estimate, without reading weights.

A folder is described once per stamp (the size and modification time of its meta.json, config.json
and weights): a rerun re-lists the folders but re-reads none that did not change, and the
description keeps meta.json as read, so loading the checkpoint does not read it again.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from recur_core import CheckpointError, describe_folder
from recur_core.model.checkpoint import CONFIG, EVAL_WINDOWS, META, TOKENIZER, WEIGHTS, read_meta
from recur_core.model.hf_folder import INDEX
from recur_core.model.recipe import Recipe

APP_ROOT = Path(__file__).resolve().parents[1]
MARKERS = (META, WEIGHTS, CONFIG)


def shipped_root() -> Path:
    return Path(os.environ.get("RECUR_SHIPPED") or APP_ROOT / "checkpoints")


@dataclass(frozen=True)
class Entry:
    """One checkpoint folder as the picker shows it (meta.json only; weights are not read)."""

    path: str  # absolute
    name: str
    meta: dict | None = None  # what describe_folder says (for a native folder: meta.json, its dtype filled in)
    error: str | None = None
    stamp: tuple = ()  # folder_stamp when it was described
    meta_json: dict | None = None  # a native folder's meta.json as read (None for a transformers folder)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def checkpoint_id(self) -> str:
        return str((self.meta or {}).get("checkpoint_id", ""))

    @property
    def task(self) -> str:
        return data_key(self.meta, self.path)

    @property
    def recipe(self) -> Recipe | None:
        """The recipe (recur_core.model.recipe's fallback rule for missing fields); None if meta.json's is unusable."""
        try:
            return Recipe.from_meta(self.meta)
        except (ValueError, TypeError, AttributeError):
            return None

    def label(self) -> str:
        if not self.ok:
            return f"⚠ {self.name} (unusable)"
        m = self.meta or {}
        parts = [self.name, str(m.get("preset", "?"))]
        if m.get("n_params"):
            parts.append(f"{human_count(m['n_params'])} params · {m.get('dtype', '?')}")
        if self.recipe is not None and "r_bar" not in self.recipe.defaulted:
            parts.append(f"r̄ {self.recipe.r_bar:g}")
        if m.get("tokens_seen") is not None:
            parts.append(f"{human_count(m['tokens_seen'])} tok")
        parts.append(self.checkpoint_id[:8] or "no id")
        return " · ".join(parts)


    def size_line(self, device: str) -> str:
        """Model size, dtype and the memory it needs on `device` against what is free there."""
        import torch

        from recur_core.model.hf_folder import available_bytes, human_bytes
        m = self.meta or {}
        need = m["memory_estimate"]["total"]
        try:
            free = available_bytes(torch.device(device))
        except (RuntimeError, ValueError):
            free = None
        fits = "" if free is None else (f", {human_bytes(free)} free" + (" — too large" if need > free else ""))
        return (f"{human_count(m['n_params'])} params · {m.get('dtype', '?')} · {human_bytes(m['weights_bytes'])} "
                f"on disk · needs ≈ {human_bytes(need)} on {device}{fits}")


def data_key(meta: dict | None, path: str) -> str:
    """What a checkpoint reads, for keeping texts and comparing curves: its training data and its
    tokenizer; a folder that says neither is a task of its own."""
    m = meta or {}
    dataset = (m.get("train_config") or {}).get("dataset") or m.get("data")
    tokenizer = m.get("tokenizer")
    return f"{dataset}|{tokenizer}" if dataset and tokenizer else f"folder:{path}"


def eval_set(path: str) -> str | None:
    """What a checkpoint is evaluated on, as an id: the hash of its eval windows and its tokenizer
    (None when it ships no eval windows). Two checkpoints with the same id are scored on the very same
    tokens, so their losses compare and pair window by window; a data-source string in meta.json
    cannot promise that (stories-reasoning's names TinyStories, as demo's does, but its windows mix in
    word problems)."""
    files = [Path(path) / EVAL_WINDOWS, Path(path) / TOKENIZER]
    try:
        stamps = tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    except OSError:
        return None
    return _eval_set(path, stamps)


@lru_cache(maxsize=64)
def _eval_set(path: str, stamps: tuple) -> str:
    digest = hashlib.sha256()
    for name in (EVAL_WINDOWS, TOKENIZER):
        digest.update((Path(path) / name).read_bytes())
    return digest.hexdigest()[:16]


def human_count(n) -> str:
    n = float(n)
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def looks_like_checkpoint(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in MARKERS)


def display_name(path: Path) -> str:
    """Folder name; `run/latest` style for the trainer's latest/ and best/ folders."""
    if path.name in ("latest", "best") and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name


def folder_stamp(path: str | Path) -> tuple:
    """(size, modification time) of each file a description and a load read, None where missing:
    a folder whose stamp did not change is not read again."""
    out = []
    for name in (META, CONFIG, WEIGHTS, INDEX):
        try:
            s = (Path(path) / name).stat()
            out.append((s.st_size, s.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def describe(path: str | Path) -> Entry:
    """An Entry from recur_core.describe_folder (any format), cached on the folder's stamp; the
    error says what is missing or unreadable."""
    resolved = Path(path).expanduser().resolve()
    return _describe(str(resolved), folder_stamp(resolved))


@lru_cache(maxsize=256)
def _describe(path: str, stamp: tuple) -> Entry:
    name = display_name(Path(path))
    try:
        meta_json = read_meta(path) if (Path(path) / META).is_file() else None
        return Entry(path, name, meta=describe_folder(path, meta=meta_json), stamp=stamp, meta_json=meta_json)
    except CheckpointError as err:
        return Entry(path, name, error=str(err), stamp=stamp)


def expand(root: Path, explicit: bool) -> list[Path]:
    """A checkpoint folder itself, or the checkpoint folders directly inside it (and inside their
    latest/ and best/ folders, the trainer's layout). An explicit root that holds nothing usable is
    returned as is, so its problem gets reported."""
    root = root.expanduser()
    if looks_like_checkpoint(root) or not root.is_dir():
        return [root] if explicit or root.is_dir() else []
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if looks_like_checkpoint(child):
            found.append(child)
        else:
            found += [child / sub for sub in ("latest", "best") if looks_like_checkpoint(child / sub)]
    return found or ([root] if explicit else [])


def env_paths(name: str) -> list[Path]:
    return [Path(p) for p in os.environ.get(name, "").split(os.pathsep) if p.strip()]


def discover(typed: list[str] = ()) -> list[Entry]:
    """Every known checkpoint folder, deduplicated by resolved path, default first."""
    candidates: list[Path] = []
    default = env_paths("RECUR_CHECKPOINT")
    candidates += [p for d in default for p in expand(d, explicit=True)]
    candidates += expand(shipped_root(), explicit=False)
    for root in env_paths("RECUR_CHECKPOINTS"):
        candidates += expand(root, explicit=True)
    for t in typed:
        candidates += expand(Path(t), explicit=True)
    seen, entries = set(), []
    for path in candidates:
        key = str(path.expanduser().resolve())
        if key not in seen:
            seen.add(key)
            entries.append(describe(path))
    return entries


SHIPPED_DEFAULT = "specimen"  # the shipped specimen the app opens on (docs/benchmarks/specimen.md)


def default_path(entries: list[Entry]) -> str | None:
    """$RECUR_CHECKPOINT when it is listed, else the shipped SHIPPED_DEFAULT when it is usable, else
    the first usable entry, else the first."""
    explicit = {str(p.expanduser().resolve()) for p in env_paths("RECUR_CHECKPOINT")}
    specimen = str((shipped_root() / SHIPPED_DEFAULT).resolve())
    usable = [e for e in entries if e.ok] or entries
    for wanted, among in ((explicit, entries), ({specimen}, [e for e in entries if e.ok])):
        for e in among:
            if e.path in wanted:
                return e.path
    return usable[0].path if usable else None
