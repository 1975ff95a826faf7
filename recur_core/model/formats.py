"""Every checkpoint format in one place: open a folder as a Checkpoint, or describe it without
reading its weights (the app's picker).

  native        this project's folders (meta.json, config.json, model.safetensors, tokenizer.json):
                recur_core.model.checkpoint
  huginn_raven  Huginn-0125's transformers folders (config.json names the model_type):
                recur_core.model.huginn
  ouro          Ouro's (ByteDance Seed) transformers folders: recur_core.model.ouro
A config.json that names another model_type is refused with the list of those opened.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import huginn, ouro
from .checkpoint import CONFIG, META, Checkpoint, CheckpointError, load_native, read_meta, stored_dtype_name
from .hf_folder import model_type_of

LOADERS = {huginn.MODEL_TYPE: huginn.load_huginn, ouro.MODEL_TYPE: ouro.load_ouro}
DESCRIBERS = {huginn.MODEL_TYPE: huginn.describe_huginn, ouro.MODEL_TYPE: ouro.describe_ouro}


def hf_model_type(path: Path) -> str | None:
    """The model_type of a transformers folder (config.json names one, no meta.json), else None;
    refuses a model_type no loader opens."""
    if (path / META).is_file():
        return None
    model_type = model_type_of(path)
    if model_type is not None and model_type not in LOADERS:
        raise CheckpointError(f"{path / CONFIG}: model_type {model_type!r} is not supported: this project opens "
                              f"its own checkpoints and the model types {', '.join(map(repr, LOADERS))} "
                              "(Huginn-0125, Ouro)")
    return model_type


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype=None,
                    max_bytes: int | None = None, meta: dict | None = None) -> Checkpoint:
    """Load and validate a checkpoint folder of any format (weights from safetensors only).
    dtype: None keeps the stored dtype; "float32" / "bfloat16" / "float16" converts. max_bytes: the
    memory budget a transformers folder's estimate is checked against (default: what the device
    has free). meta: a native folder's meta.json as the caller already read it (the app reads it
    once per change of the folder), else it is read here."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    model_type = hf_model_type(path)
    if model_type is not None:
        return LOADERS[model_type](path, device, dtype, max_bytes)
    return load_native(path, device, dtype, meta)


def describe_folder(path: str | Path, meta: dict | None = None) -> dict:
    """What a checkpoint folder holds, without reading its weights: meta.json for a native folder
    (with the stored dtype from the safetensors header where meta.json does not say), a Huginn or
    Ouro folder's config and headers (format, name, recipe, n_params, dtype, weights_bytes,
    memory_estimate). meta: a native folder's meta.json as the caller already read it (left
    unchanged). CheckpointError says why a folder is unusable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    model_type = hf_model_type(path)
    if model_type is not None:
        return DESCRIBERS[model_type](path)
    meta = dict(read_meta(path) if meta is None else meta)
    if "dtype" not in meta and (dtype := stored_dtype_name(path)):
        meta["dtype"] = dtype
    return meta
