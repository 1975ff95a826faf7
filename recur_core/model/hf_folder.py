"""What every Hugging Face-style folder shares (Huginn-0125's, Ouro's): config.json, the weights as
`model.safetensors` or shards listed in `model.safetensors.index.json`, a tokenizer.json. The format
modules (recur_core.model.huginn, recur_core.model.ouro) say how a config maps onto `ModelConfig` and
how each tensor is named; this module reads the folder:

  files       `weight_files`: the shards of the index (a missing shard refused), or the single file;
              pickled weights (.bin and friends) are refused, never unpickled.
  dtype       `stored_dtype`: read from a tensor's safetensors header (a config's dtype can be wrong).
  memory      `memory_estimate` (weights + one window's working memory) and `check_fits`, which
              refuses a folder before a byte of weights is read when the estimate exceeds what the
              device has free (or $RECUR_MEMORY_LIMIT).
  loading     `build_model` of a format's `TensorLayout` (its tensors' names, shapes and mapping onto
              ours): the model on the meta device, the weights read tensor by tensor (views
              of the memory-mapped files when no conversion is needed, else converted one at a time),
              shapes checked against the config, assigned without a second copy.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import CONFIG, TOKENIZER, CheckpointError, check_state_dict, refuse_pickle
from .config import ModelConfig
from .looped_lm import LoopedLM

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
WORKING_TOKENS = 2048  # token rows of one forward the working-memory estimate assumes (analyze: 16 x 128)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# {their tensor name: {our state-dict name: tensor}} for one tensor of a format
TensorMap = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorLayout:
    """How a format's tensors map onto our state dict, for one config: `shapes` names its tensors
    (names theirs) with their shapes, `to_ours` maps each to ours, `embed_name` is the tensor whose
    stored dtype is the folder's, `skipped` tensors are ignored; copied(name): True for tensors
    `to_ours` copies (read from a short-lived mapping, so the file's pages go once copied); `kind`
    names the format in messages."""

    kind: str
    shapes: dict[str, tuple]
    to_ours: TensorMap
    embed_name: str
    skipped: tuple[str, ...] = ()
    copied: Callable[[str], bool] | None = None


def model_type_of(path: Path) -> str | None:
    """The model_type a folder's config.json names (a transformers config), or None."""
    try:
        value = json.loads((Path(path) / CONFIG).read_text()).get("model_type")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def read_config(path: Path) -> dict:
    """config.json of a folder as a dict, or a CheckpointError that says why not."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        hf = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / CONFIG}: unreadable ({err})") from err
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path / CONFIG}: not a JSON object")
    return hf


# -- files ----------------------------------------------------------------------------------------
def weight_files(path: Path) -> dict[str, list[str]]:
    """{safetensors file name: [tensor names]} from the index (sharded) or the single file.

    Refuses pickled weights (.bin and friends), an index naming a missing shard, and a folder
    without safetensors weights."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: unreadable index ({err})") from err
        files: dict[str, list[str]] = {}
        for tensor, shard in items:
            files.setdefault(shard, []).append(tensor)
        for shard, names in files.items():
            if not (path / shard).is_file():
                raise CheckpointError(f"{path}: shard {shard} is missing ({len(names)} tensors of "
                                      f"{INDEX} are in it, e.g. {names[0]}); download it again")
        return files
    if (path / SINGLE).is_file():
        return {SINGLE: []}  # every tensor of the file
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{path}: the weights are pickle files ({', '.join(pickles)}), which are never "
                              "unpickled here (it can run code); convert them to safetensors first")
    raise CheckpointError(f"{path}: no {SINGLE} and no {INDEX}")


def open_safetensors(file: Path):
    """safe_open a safetensors file, refusing pickles and unreadable files with a clear message."""
    from safetensors import SafetensorError, safe_open
    refuse_pickle(file)
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}") from err


def stored_dtype(files: dict[str, list[str]], path: Path, tensor: str) -> torch.dtype:
    """The dtype `tensor` (the embedding) is stored in, from its safetensors header."""
    names = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    for file in files:
        with open_safetensors(path / file) as f:
            if tensor in f.keys():
                code = f.get_slice(tensor).get_dtype()
                if code not in names:
                    raise CheckpointError(f"{path / file}: {tensor} stored as {code}, not a float dtype")
                return names[code]
    raise CheckpointError(f"{path}: missing tensor {tensor}")


def weights_bytes(path: Path, files: dict[str, list[str]]) -> int:
    """The weight files' size on disk."""
    return sum((path / f).stat().st_size for f in files)


# -- memory ---------------------------------------------------------------------------------------
def available_bytes(device: torch.device) -> int:
    """Free memory on the device: MemAvailable for the CPU, free CUDA memory for a GPU; at most
    $RECUR_MEMORY_LIMIT bytes when that is set (to keep a shared machine's headroom)."""
    free = _free_bytes(device)
    limit = os.environ.get("RECUR_MEMORY_LIMIT")
    return min(free, int(float(limit))) if limit else free


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_estimate(cfg: ModelConfig, shapes: dict[str, tuple], dtype: torch.dtype) -> dict[str, int]:
    """Bytes to hold the weights (every tensor of `shapes`) in `dtype`, plus the working memory of
    one forward over WORKING_TOKENS token rows (an analysis batch: state, prelude output, a block's
    activations in float32, the initial noise, the readout's vocabulary chunk; attention runs in
    blocks, no T x T scores). Checked against the peak RSS of a load and a trace at full size
    (bench/bench_fullsize.py, docs/BENCHMARKS.md)."""
    n_params = sum(math.prod(s) for s in shapes.values())
    weights = n_params * torch.finfo(dtype).bits // 8
    d = cfg.d_model
    acts = 4 * WORKING_TOKENS * (8 * d + 3 * cfg.ffn_dim + 2 * 8192)
    return {"n_params": n_params, "weights": weights, "working": acts, "total": weights + acts}


def describe(path: Path, cfg: ModelConfig, shapes: dict[str, tuple], embed_name: str) -> dict:
    """What every format's describe_* reports, from the safetensors headers only (no weights read):
    n_params, dtype as stored (read from `embed_name`), the weights' bytes on disk and the memory
    estimate."""
    files = weight_files(path)
    dtype = stored_dtype(files, path, embed_name)
    est = memory_estimate(cfg, shapes, dtype)
    return {"n_params": est["n_params"], "dtype": str(dtype).removeprefix("torch."),
            "weights_bytes": weights_bytes(path, files), "memory_estimate": est}


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def check_fits(est: dict[str, int], dtype: torch.dtype, device: torch.device, path: Path,
               max_bytes: int | None = None) -> dict[str, int]:
    """Refuse (CheckpointError) before loading when the estimate exceeds the device's free memory."""
    limit = available_bytes(device) if max_bytes is None else int(max_bytes)
    if est["total"] > limit:
        raise CheckpointError(
            f"{path}: too large for this machine: {est['n_params'] / 1e9:.3g}B parameters need about "
            f"{human_bytes(est['total'])} on {device} ({human_bytes(est['weights'])} of {str(dtype).split('.')[-1]} "
            f"weights + {human_bytes(est['working'])} working memory), and {human_bytes(limit)} is free. "
            "Try --dtype bfloat16, another device, or a machine with more memory.")
    return est


# -- loading --------------------------------------------------------------------------------------
def build_model(path: Path, cfg: ModelConfig, layout: TensorLayout, *, dtype: torch.dtype | None,
                device: torch.device, max_bytes: int | None) -> tuple[LoopedLM, torch.dtype, dict[str, int]]:
    """(model, dtype, memory estimate) of a folder whose tensors are exactly the layout's. dtype None
    keeps the stored one (read from the layout's embed_name)."""
    if not (path / TOKENIZER).is_file():
        raise CheckpointError(f"{path}: {TOKENIZER} is missing (a {layout.kind} folder ships its tokenizer)")
    files = weight_files(path)
    dtype = dtype or stored_dtype(files, path, layout.embed_name)
    est = check_fits(memory_estimate(cfg, layout.shapes, dtype), dtype, device, path, max_bytes)
    with torch.device("meta"):
        model = LoopedLM(cfg)
    state = read_weights(path, files, layout, dtype, device)
    check_state_dict(model, state, str(path))
    model.load_state_dict(state, assign=True)
    model.reset_rope(device)
    model.eval().requires_grad_(False)
    return model, dtype, est


def read_weights(path: Path, files: dict[str, list[str]], layout: TensorLayout, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Our state dict, read tensor by tensor (views of each file's lazily mapped tensors when no
    conversion or copy is needed; otherwise one tensor at a time from its own mapping), shapes
    checked first."""
    shapes, kind, skipped, copied = layout.shapes, layout.kind, layout.skipped, layout.copied
    state, seen = {}, set()
    for file, listed in files.items():
        with open_safetensors(path / file) as f:
            names = set(f.keys())
            missing = [n for n in listed if n not in names]
            if missing:
                raise CheckpointError(f"{path / file}: lacks {len(missing)} tensors its index puts there, "
                                      f"e.g. {missing[0]}")
            for name in sorted(names):
                if name in skipped:
                    continue
                if name not in shapes:
                    raise CheckpointError(f"{path / file}: unexpected tensor {name} (not part of a {kind} "
                                          "model with this config.json)")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != shapes[name]:
                    raise CheckpointError(f"{path / file}: {name} has shape {shape} in the weights, "
                                          f"{shapes[name]} expected from config.json")
                as_stored = f.get_slice(name).get_dtype() == SAFETENSORS_DTYPES[dtype] and device.type == "cpu"
                if as_stored and not (copied and copied(name)):
                    t = f.get_tensor(name)  # a lazily mapped view of the file: no copy
                else:  # converted alone, from its own short-lived mapping, so the source pages go
                    with open_safetensors(path / file) as one:
                        t = one.get_tensor(name).to(device=device, dtype=dtype)
                state.update(layout.to_ours(name, t))
                seen.add(name)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise CheckpointError(f"{path}: missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return state
