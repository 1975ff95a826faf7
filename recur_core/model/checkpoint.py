"""Checkpoint directories: atomic writes, validated safetensors loads, a stable checkpoint id.

A checkpoint is a directory holding
    model.safetensors   weights (never a pickle)
    config.json         ModelConfig
    tokenizer.json      a `tokenizers` tokenizer
    meta.json           preset, overrides, step, tokens seen, recipe (r_bar, r_max, k, sigma, sampler_mean),
                        data source, code revision, last eval, checkpoint_id
    metrics.jsonl       the trainer's log up to this step
    eval_windows.safetensors / probe_windows.safetensors   token-id windows (validation / training side)

`load_checkpoint` also opens Huginn-0125-format folders (a transformers config.json with a
model_type): see recur_core.huginn.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .looped_lm import LoopedLM
from .recipe import Recipe

WEIGHTS, CONFIG, TOKENIZER, META = "model.safetensors", "config.json", "tokenizer.json", "meta.json"
EVAL_WINDOWS, PROBE_WINDOWS, METRICS = "eval_windows.safetensors", "probe_windows.safetensors", "metrics.jsonl"
# What a shipped checkpoint holds (no trainer state): `recur_core.report.export` copies these.
SHIPPED_FILES = (WEIGHTS, CONFIG, TOKENIZER, META, METRICS, EVAL_WINDOWS, PROBE_WINDOWS)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt, or does not match its config."""


def resolve_dtype(dtype) -> torch.dtype | None:
    """None, a torch dtype, or a name ("bfloat16", "bf16", "float16", "fp16", "float32", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    model: LoopedLM
    meta: dict
    tokenizer_path: Path
    checkpoint_id: str = field(default="")
    text_windows: dict[str, torch.Tensor] = field(default_factory=dict)  # set by use_text

    @property
    def recipe(self) -> Recipe:
        """The training recipe from meta.json (missing fields: recur_core.model.recipe's one fallback rule)."""
        return Recipe.from_meta(self.meta)

    def tokenizer(self):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(self.tokenizer_path))

    def windows(self, kind: str = "eval") -> torch.Tensor:
        """Token-id windows (N, seq_len + 1): 'eval' (validation side) or 'probe' (training side);
        those of `use_text` if it was called, else the checkpoint's saved ones."""
        if kind in self.text_windows:
            return self.text_windows[kind]
        name = {"eval": EVAL_WINDOWS, "probe": PROBE_WINDOWS}[kind]
        if not (self.path / name).is_file():
            raise CheckpointError(f"{self.path}: ships no {name}; give a text to take windows from "
                                  "(Checkpoint.use_text, or --text FILE on the command line)")
        return read_safetensors(self.path / name)["ids"]

    def use_text(self, text: str, seq_len: int) -> None:
        """Take the windows from a text: its tokens cut into consecutive windows of seq_len + 1
        tokens; even-numbered windows are the 'eval' side, odd-numbered ones the 'probe' side
        (disjoint, both spread over the text)."""
        seq_len = min(seq_len, self.config.max_seq_len)
        ids = torch.tensor(self.tokenizer().encode(text).ids, dtype=torch.long)
        n = len(ids) // (seq_len + 1)
        if n < 2:
            raise CheckpointError(f"the text has {len(ids)} tokens; at least 2 windows of {seq_len + 1} tokens "
                                  f"({2 * (seq_len + 1)} tokens) are needed (or a shorter --seq-len)")
        windows = ids[:n * (seq_len + 1)].view(n, seq_len + 1)
        self.text_windows = {"eval": windows[0::2].clone(), "probe": windows[1::2].clone()}


_HEADER_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype_name(path: str | Path) -> str | None:
    """The dtype a checkpoint's embedding is stored in ("float32", ...), read from the safetensors
    header only (no weights); None when the file is missing or unreadable."""
    from safetensors import safe_open
    try:
        with safe_open(str(Path(path) / WEIGHTS), framework="pt") as f:
            return _HEADER_DTYPES.get(f.get_slice("embed.weight").get_dtype())
    except (SafetensorError, OSError, ValueError):
        return None


def checkpoint_id(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical config JSON and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(config.to_json().encode())
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # the bytes, hashed in place (no copy)
    return h.hexdigest()[:16]


def refuse_pickle(path: Path) -> None:
    """Raise CheckpointError if the file starts like a pickle / torch.save zip: never unpickle."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise CheckpointError(f"{path}: this is a pickle / torch.save file, not safetensors; "
                              "refusing to unpickle it (convert it to safetensors first)")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file, with a clear error for pickles, truncation and missing files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    refuse_pickle(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {err}") from err


def atomic_write_dir(final: Path, write_fn) -> None:
    """Call write_fn(tmp_dir), then swap tmp_dir into place: `final` is never half-written.

    The old directory is moved aside before the new one is renamed in and deleted after, so a kill
    at any moment leaves either the old complete checkpoint, the new one, or (between the two
    renames) the old one under `<final>.old`, which `recover_interrupted` puts back.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_fn(tmp)
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover_interrupted(final: Path) -> None:
    """Clean up after a save that was killed: drop its temp dir, put the previous checkpoint back
    if the kill came between the two renames."""
    final = Path(final)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():
        os.replace(old, final)


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_checkpoint(path: Path, model: LoopedLM, meta: dict, tokenizer_json: str,
                    extra_files: dict[str, bytes | Path] | None = None, extra_tensors: dict | None = None,
                    after_write: Callable[[Path], None] | None = None) -> str:
    """Write a complete checkpoint directory atomically; returns its checkpoint id.

    extra_files: name -> bytes or a file to copy; extra_tensors: name -> {key: tensor} safetensors;
    after_write(tmp_dir) may add more files before the directory is swapped into place.
    """
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    ckpt_id = checkpoint_id(model.cfg, state)

    def write(tmp: Path):
        save_file(state, str(tmp / WEIGHTS))
        (tmp / CONFIG).write_text(model.cfg.to_json() + "\n")
        (tmp / TOKENIZER).write_text(tokenizer_json)
        write_json(tmp / META, {**meta, "checkpoint_id": ckpt_id})
        for name, tensors in (extra_tensors or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / name))
        for name, content in (extra_files or {}).items():
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / name)
            else:
                (tmp / name).write_bytes(content)
        if after_write is not None:
            after_write(tmp)

    atomic_write_dir(Path(path), write)
    return ckpt_id


def check_state_dict(model: LoopedLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing tensor {k} {s}" for k, s in expected.items() if k not in state]
    problems += [f"unexpected tensor {k}" for k in state if k not in expected]
    problems += [f"{k}: shape {tuple(state[k].shape)} in weights, {s} in config"
                 for k, s in expected.items() if k in state and tuple(state[k].shape) != s]
    if problems:
        raise CheckpointError(f"{where}: weights do not match config.json: " + "; ".join(problems))


def read_meta(path: str | Path) -> dict:
    """A checkpoint folder's meta.json (the one reader); CheckpointError says what is missing or unreadable."""
    meta_file = Path(path) / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint ({META} is missing)")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file}: unreadable ({err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file}: unreadable (not a JSON object)")
    return meta


def load_native(path: Path, device: str | torch.device = "cpu", dtype=None, meta: dict | None = None) -> Checkpoint:
    """Load and validate a folder of this project's format (weights from safetensors only).
    dtype: None keeps the stored dtype; "float32" / "bfloat16" / "float16" converts. meta: meta.json
    as the caller already read it (copied), else read here."""
    for name in (WEIGHTS, CONFIG, TOKENIZER, META):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: incomplete checkpoint, {name} is missing")
    try:
        config = ModelConfig.from_json((path / CONFIG).read_text())
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable config.json: {err}") from err
    meta = dict(read_meta(path) if meta is None else meta)
    state = read_safetensors(path / WEIGHTS)
    model = LoopedLM(config)
    check_state_dict(model, state, str(path))
    model.load_state_dict(state)
    model.to(device).eval()
    ckpt_id = checkpoint_id(config, state)
    if resolve_dtype(dtype) not in (None, torch.float32):
        model.to(resolve_dtype(dtype))
        ckpt_id = checkpoint_id(config, model.state_dict())  # other weights, other traces
    return Checkpoint(path, config, model, meta, path / TOKENIZER, ckpt_id)


def resolve_model(ckpt_or_model: Checkpoint | LoopedLM) -> tuple[LoopedLM, Checkpoint | None]:
    """(model, its Checkpoint or None): every API that takes a checkpoint also takes a bare model."""
    if isinstance(ckpt_or_model, Checkpoint):
        return ckpt_or_model.model, ckpt_or_model
    return ckpt_or_model, None


def model_id(ckpt_or_model: Checkpoint | LoopedLM) -> str:
    """The checkpoint id that keys cached results; a bare model's is hashed from its config and weights."""
    model, ckpt = resolve_model(ckpt_or_model)
    return ckpt.checkpoint_id if ckpt is not None else checkpoint_id(model.cfg, model.state_dict())
