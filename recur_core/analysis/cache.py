"""The on-disk cache of traces and A2 probes.

Layout under the cache root (`$RECUR_CACHE_DIR`, else `~/.cache/recur_core`):

    <root>/<checkpoint_id>/traces/<key>.safetensors    one trace per key
    <root>/<checkpoint_id>/probes/<name>.safetensors   A2 router probes of that checkpoint

Every file is a safetensors file of numpy arrays whose header metadata holds one JSON document:
the file's `key`, a sha256 `digest` of all array names, dtypes, shapes and bytes, and the caller's
own metadata. Files are written to a temporary file in the same folder and moved into place with
os.replace, so a reader sees either no file or a complete one. A file that does not load, whose key
differs from the one asked for, whose digest does not match its arrays, or whose arrays have other
shapes than expected is deleted and reported as a miss: the caller recomputes, and a corrupt file is
never returned.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

META_KEY = "recur_core"


class CacheCorrupt(ValueError):
    """A cache file exists but cannot be trusted."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECUR_CACHE_DIR") or Path.home() / ".cache" / "recur_core")


def digest_arrays(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_arrays(path: Path, arrays: dict[str, np.ndarray], key: str, meta: dict) -> None:
    """Atomically write arrays plus {key, digest, meta} to a safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    header = {"key": key, "digest": digest_arrays(arrays), "meta": meta}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(arrays, tmp, metadata={META_KEY: json.dumps(header)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_arrays(path: Path, key: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of a file written by write_arrays; CacheCorrupt if it cannot be trusted."""
    try:
        with safe_open(str(path), framework="np") as f:
            header = json.loads((f.metadata() or {})[META_KEY])
        arrays = load_file(str(path))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as err:
        raise CacheCorrupt(f"unreadable: {err}") from err
    if key is not None and header.get("key") != key:
        raise CacheCorrupt(f"stored key {header.get('key')!r} is not {key!r}")
    if header.get("digest") != digest_arrays(arrays):
        raise CacheCorrupt("array digest mismatch")
    return arrays, header.get("meta", {})


def trace_key(checkpoint_id: str, ids: np.ndarray, max_loops: int, seed: int, topk: int,
              format_version: int, probe_ids: tuple[str, ...] = ()) -> str:
    """sha256 over everything a trace depends on (ids by dtype, shape and bytes)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    spec = {"checkpoint_id": checkpoint_id, "max_loops": max_loops, "seed": seed, "topk": topk,
            "format_version": format_version, "probe_ids": sorted(probe_ids), "ids_shape": list(ids.shape)}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(ids.tobytes())
    return h.hexdigest()


class TraceCache:
    """Traces and probes of checkpoints under one root folder."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def trace_path(self, checkpoint_id: str, key: str) -> Path:
        return self.root / checkpoint_id / "traces" / f"{key}.safetensors"

    def probe_path(self, checkpoint_id: str, name: str) -> Path:
        return self.root / checkpoint_id / "probes" / f"{name}.safetensors"

    def load(self, path: Path, key: str,
             expected_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, dict] | None:
        """(arrays, meta) on a hit; None on a miss. A corrupt file is deleted (with a warning)."""
        if not path.is_file():
            return None
        try:
            arrays, meta = read_arrays(path, key)
            _check_shapes(arrays, expected_shapes)
        except CacheCorrupt as err:
            warnings.warn(f"discarding corrupt cache file {path} ({err}); recomputing", stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        return arrays, meta

    def save(self, path: Path, key: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
        write_arrays(path, arrays, key, meta)


def _check_shapes(arrays: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]] | None) -> None:
    if expected is None:
        return
    if set(arrays) != set(expected):
        raise CacheCorrupt(f"arrays {sorted(arrays)} are not {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != tuple(shape):
            raise CacheCorrupt(f"{name} has shape {arrays[name].shape}, expected {shape}")
