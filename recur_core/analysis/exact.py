"""The exact path's results, cached: the masking harness (recur_core.analysis.harness) run on a list
of policies, stored in the trace cache under a key of the checkpoint, the windows, the policies,
the loop budget and the seed. Re-running a report or reopening the app replays the same harness
runs from disk."""
from __future__ import annotations

import hashlib
import json

import numpy as np

from ..exits.policies import Policy
from ..model.checkpoint import model_id
from .harness import ExactResult, SweepWork, run_exact_sweep
from .trace import resolve_cache

EXACT_FORMAT_VERSION = 2  # 2: the final readout's argmax is stored (ground truth scores answers exactly)
_FIELDS = ("ce", "exit_depth", "converged", "argmax")


def exact_results(ckpt_or_model, ids, policies: list[Policy], max_loops: int, seed: int, *, cache=False,
                  progress=None, work: SweepWork | None = None, cache_only: bool = False) -> list[ExactResult] | None:
    """run_exact_sweep through the on-disk cache. cache_only: return None instead of running the
    harness when the results are not cached."""
    ckpt_id = model_id(ckpt_or_model)
    store = resolve_cache(cache)
    ids_np = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids, dtype=np.int64)
    key = _exact_key(ckpt_id, ids_np, policies, max_loops, seed)
    path = None if store is None else store.trace_path(ckpt_id, f"exact-{key[:32]}")
    if store is not None:
        hit = store.load(path, key)
        if hit is not None and hit[0]["ce"].shape[0] == len(policies):
            a = hit[0]
            return [ExactResult(a["ce"][p], a["exit_depth"][p], a["converged"][p], a["targets"], a["argmax"][p])
                    for p in range(len(policies))]
    if cache_only:
        return None
    results = run_exact_sweep(ckpt_or_model, ids_np, policies, max_loops, seed, progress=progress, work=work)
    if store is not None:
        arrays = {f: np.stack([getattr(r, f) for r in results]) for f in _FIELDS}
        store.save(path, key, {**arrays, "targets": results[0].targets},
                   {"kind": "exact sweep", "policies": [repr(p) for p in policies]})
    return results


def _exact_key(ckpt_id: str, ids: np.ndarray, policies: list[Policy], max_loops: int, seed: int) -> str:
    spec = {"checkpoint_id": ckpt_id, "policies": [repr(p) for p in policies], "max_loops": max_loops,
            "seed": seed, "format_version": EXACT_FORMAT_VERSION}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(np.ascontiguousarray(ids).tobytes())
    return h.hexdigest()
