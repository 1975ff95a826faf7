"""Every checkpoint format in one place: open a folder as a Checkpoint, or describe it without
reading its weights (the app's picker).

  native        this project's folders (meta.json, config.json, model.safetensors, tokenizer.json):
                recur_core.model.checkpoint
  huginn_raven  Huginn-0125's transformers folders (config.json names the model_type):
                recur_core.model.huginn
"""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import META, Checkpoint, CheckpointError, load_native, read_meta, stored_dtype_name
from .huginn import describe_huginn, is_huginn_dir, load_huginn


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype=None,
                    max_bytes: int | None = None) -> Checkpoint:
    """Load and validate a checkpoint folder of any format (weights from safetensors only).
    dtype: None keeps the stored dtype; "float32" / "bfloat16" / "float16" converts. max_bytes: the
    memory budget a Huginn folder's estimate is checked against (default: what the device has free)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if is_huginn_dir(path):
        return load_huginn(path, device, dtype, max_bytes)
    return load_native(path, device, dtype)


def describe_folder(path: str | Path) -> dict:
    """What a checkpoint folder holds, without reading its weights: meta.json for a native folder
    (with the stored dtype from the safetensors header where meta.json does not say), a Huginn
    folder's config and headers (format, name, recipe, n_params, dtype, weights_bytes,
    memory_estimate). CheckpointError says why a folder is unusable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    if not (path / META).is_file() and is_huginn_dir(path):
        return describe_huginn(path)
    meta = read_meta(path)
    if "dtype" not in meta and (dtype := stored_dtype_name(path)):
        meta["dtype"] = dtype
    return meta
