"""A2's router: a logistic-regression probe on the core state that predicts "the output still changes".

Features at loop i: the core state s_i (d values) and the loop index i. Two label kinds:
  "argmax"  argmax p_{i+1} != argmax p_i          (the paper's labels)
  "kl"      KL(p_{i+1} || p_i) >= label_eps       (the review's fairer labels: A1's own signal)
so a label exists for loops 1 .. max_loops - 1. Labels and states are harvested from uniform runs of
the checkpoint's training-side windows (`ckpt.windows("probe")`); a seeded sample of token positions
per window keeps memory bounded (every loop of a sampled token is kept). Windows are split into
train and held-out sets (disjoint), and the probe's accuracy and AUC are measured on the held-out
windows. The fit is an L2-regularised logistic regression on standardised features, full-batch LBFGS.

Probes are saved as safetensors beside the checkpoint's trace cache (<cache>/<ckpt id>/probes/).
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from .cache import CacheCorrupt, TraceCache, read_arrays, write_arrays
from .checkpoint import Checkpoint
from .trace import (progress_bar, resolve_cache, resolve_model, split_inputs, trace_batch,
                    window_noise)

LABEL_KINDS = ("argmax", "kl")
PROBE_FORMAT_VERSION = 1
DEFAULT_LABEL_EPS = 1e-3


@dataclass
class Probe:
    """Logistic regression: chance = sigmoid(((x - mean) / std) . weight + bias), x = [s_i, i]."""

    weight: torch.Tensor
    bias: float
    mean: torch.Tensor
    std: torch.Tensor
    label_kind: str
    label_eps: float
    metrics: dict = field(default_factory=dict)

    @property
    def probe_id(self) -> str:
        """Content hash of the parameters and label definition (keys traces that record it)."""
        h = hashlib.sha256(json.dumps([self.label_kind, self.label_eps, self.bias]).encode())
        for t in (self.weight, self.mean, self.std):
            h.update(t.detach().cpu().float().numpy().tobytes())
        return f"{self.label_kind}-{h.hexdigest()[:12]}"

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of standardised-then-weighted features (..., d + 1)."""
        x = (features.float() - self.mean.to(features.device)) / self.std.to(features.device)
        return x @ self.weight.to(features.device) + self.bias

    def chance(self, state: torch.Tensor, loop: int) -> torch.Tensor:
        """Predicted chance (B, T) that the output changes after loop `loop`, from states (B, T, d)."""
        loop_col = torch.full((*state.shape[:-1], 1), float(loop), device=state.device)
        return torch.sigmoid(self.logit(torch.cat([state.float(), loop_col], dim=-1)))

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Path, key: str = "") -> None:
        arrays = {"weight": self.weight.numpy(), "mean": self.mean.numpy(), "std": self.std.numpy(),
                  "bias": np.array([self.bias], dtype=np.float32)}
        write_arrays(path, arrays, key, {"label_kind": self.label_kind, "label_eps": self.label_eps,
                                         "metrics": self.metrics, "format_version": PROBE_FORMAT_VERSION})

    @classmethod
    def load(cls, path: Path, key: str | None = None) -> Probe:
        """Load a saved probe; CacheCorrupt if the file cannot be trusted."""
        arrays, meta = read_arrays(path, key)
        try:
            return cls(torch.from_numpy(arrays["weight"]), float(arrays["bias"][0]),
                       torch.from_numpy(arrays["mean"]), torch.from_numpy(arrays["std"]),
                       meta["label_kind"], float(meta["label_eps"]), meta.get("metrics", {}))
        except (KeyError, IndexError, TypeError) as err:
            raise CacheCorrupt(f"incomplete probe file: {err}") from err


@dataclass
class Harvest:
    """Probe training data: M samples of (state, loop) features with both label kinds.

    features (M, d + 1) float32; changed_argmax, changed_kl (M,) bool; window (M,) int (the
    sample's window, for the disjoint split); label_eps is the KL labels' threshold.
    """

    features: np.ndarray
    changed_argmax: np.ndarray
    changed_kl: np.ndarray
    window: np.ndarray
    label_eps: float

    def labels(self, kind: str) -> np.ndarray:
        if kind not in LABEL_KINDS:
            raise ValueError(f"label kind must be one of {LABEL_KINDS}, got {kind!r}")
        return self.changed_argmax if kind == "argmax" else self.changed_kl


@torch.inference_mode()
def harvest(ckpt_or_model, windows, max_loops: int, seed: int = 0, *, tokens_per_window: int = 64,
            label_eps: float = DEFAULT_LABEL_EPS, batch_size: int = 16, progress=None) -> Harvest:
    """Run windows (N, T + 1) to max_loops and keep features/labels of a seeded sample of positions."""
    if max_loops < 2:
        raise ValueError("labels look one loop ahead: harvest needs max_loops >= 2")
    model, _ = resolve_model(ckpt_or_model)
    device = next(model.parameters()).device
    inputs, targets = split_inputs(windows)
    N, T = inputs.shape
    positions = _sample_positions(N, T, tokens_per_window, seed)  # (N, P)
    update, close = progress_bar(progress, N, "probe harvest")
    parts = []
    try:
        for start in range(0, N, batch_size):
            rows = range(start, min(start + batch_size, N))
            parts.append(_harvest_batch(model, inputs[start:rows.stop].to(device), targets[start:rows.stop],
                                        window_noise(model, rows, T, seed), positions[start:rows.stop],
                                        max_loops, label_eps, rows))
            update(len(rows))
    finally:
        close()
    return Harvest(*(np.concatenate(arrays) for arrays in zip(*parts)), label_eps=label_eps)


def _sample_positions(n_windows: int, seq_len: int, per_window: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    k = min(per_window, seq_len)
    return torch.from_numpy(np.stack([np.sort(rng.choice(seq_len, k, replace=False)) for _ in range(n_windows)]))


def _harvest_batch(model, inputs, targets, noise, positions, max_loops, label_eps, rows):
    """(features, changed_argmax, changed_kl, window) of one batch, in (window, position, loop)
    order, for loops 1 .. max_loops - 1 (the last loop has no next loop to label it)."""
    states = []
    gather = positions.to(inputs.device)[..., None].expand(-1, -1, model.cfg.d_model)
    out = trace_batch(model, inputs, targets, noise, max_loops,
                      on_state=lambda loop, s: states.append(s.gather(1, gather).float().cpu()))
    at_positions = positions[..., None].expand(-1, -1, max_loops)
    argmax, kl_prev = out["argmax"].gather(1, at_positions), out["kl_prev"].gather(1, at_positions)
    state = torch.stack(states[:-1], dim=2)  # (B, P, L - 1, d)
    loop = torch.arange(1, max_loops, dtype=torch.float32).expand(*state.shape[:-1])[..., None]
    window = torch.tensor(list(rows))[:, None, None].expand(*state.shape[:-1])
    features = torch.cat([state, loop], dim=-1).flatten(0, 2)
    changed_argmax = argmax[..., 1:] != argmax[..., :-1]
    changed_kl = kl_prev[..., 1:] >= label_eps  # KL(p_{i+1} || p_i), labelled at loop i
    return (features.numpy(), changed_argmax.flatten().numpy(), changed_kl.flatten().numpy(),
            window.flatten().numpy())


# -- fitting ----------------------------------------------------------------------------------
def fit_logistic(features: np.ndarray, labels: np.ndarray, l2: float = 1e-3,
                 max_iter: int = 200) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """(weight, bias, mean, std) minimising mean BCE + l2/2 |w|^2 on standardised features."""
    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.float32)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z @ w + b, y) + 0.5 * l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), float(b.detach()), mean, std


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); NaN with a single class."""
    labels = np.asarray(labels, dtype=bool)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = pd.Series(np.asarray(scores)).rank(method="average").to_numpy()
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def split_windows(window: np.ndarray, heldout_fraction: float, seed: int) -> np.ndarray:
    """Bool mask of held-out samples: a seeded random subset of whole windows."""
    ids = np.unique(window)
    if len(ids) < 2:
        raise ValueError("a train / held-out split by window needs at least 2 windows")
    n_held = min(len(ids) - 1, max(1, round(heldout_fraction * len(ids))))
    held = np.random.default_rng(seed).permutation(ids)[:n_held]
    return np.isin(window, held)


def train_probe(data: Harvest, kind: str, *, l2: float = 1e-3, heldout_fraction: float = 0.25,
                seed: int = 0) -> Probe:
    """Fit on the training windows; metrics (accuracy, AUC, positive rate) on the held-out ones."""
    labels = data.labels(kind)
    held = split_windows(data.window, heldout_fraction, seed)
    weight, bias, mean, std = fit_logistic(data.features[~held], labels[~held], l2)
    probe = Probe(weight, bias, mean, std, kind, data.label_eps)
    probe.metrics = {"train": _metrics(probe, data.features[~held], labels[~held]),
                     "heldout": _metrics(probe, data.features[held], labels[held]),
                     "n_train_windows": int(len(np.unique(data.window[~held]))),
                     "n_heldout_windows": int(len(np.unique(data.window[held])))}
    return probe


def _metrics(probe: Probe, features: np.ndarray, labels: np.ndarray) -> dict:
    with torch.inference_mode():
        chance = torch.sigmoid(probe.logit(torch.as_tensor(features))).numpy()
    return {"n": int(len(labels)), "accuracy": float(((chance >= 0.5) == labels).mean()),
            "auc": auc(chance, labels), "positive_rate": float(labels.mean())}


# -- cached training for a checkpoint -----------------------------------------------------------
def load_or_train_probes(ckpt: Checkpoint, max_loops: int, seed: int = 0, *, kinds=LABEL_KINDS,
                         label_eps: float = DEFAULT_LABEL_EPS, n_windows: int = 32,
                         tokens_per_window: int = 64, l2: float = 1e-3, heldout_fraction: float = 0.25,
                         cache=True, progress=None) -> dict[str, Probe]:
    """Probes of each label kind for a checkpoint, from its first n_windows probe windows; loaded
    from <cache>/<ckpt id>/probes/ when saved with the same settings, else harvested and trained."""
    windows = ckpt.windows("probe")[:n_windows]
    settings = {"max_loops": max_loops, "seed": seed, "label_eps": label_eps, "l2": l2,
                "tokens_per_window": tokens_per_window, "heldout_fraction": heldout_fraction,
                "format_version": PROBE_FORMAT_VERSION}
    store = resolve_cache(cache)
    probes, missing = {}, []
    for kind in kinds:
        key = _probe_key(ckpt.checkpoint_id, windows.numpy(), {**settings, "kind": kind})
        path = None if store is None else store.probe_path(ckpt.checkpoint_id, f"{kind}-{key[:16]}")
        probes[kind] = _load_probe(store, path, key)
        if probes[kind] is None:
            missing.append((kind, path, key))
    if missing:
        data = harvest(ckpt, windows, max_loops, seed, tokens_per_window=tokens_per_window,
                       label_eps=label_eps, progress=progress)
        for kind, path, key in missing:
            probes[kind] = train_probe(data, kind, l2=l2, heldout_fraction=heldout_fraction, seed=seed)
            if path is not None:
                probes[kind].save(path, key)
    return probes


def _probe_key(ckpt_id: str, windows: np.ndarray, settings: dict) -> str:
    h = hashlib.sha256(json.dumps({"checkpoint_id": ckpt_id, **settings}, sort_keys=True).encode())
    h.update(np.ascontiguousarray(windows, dtype=np.int64).tobytes())
    return h.hexdigest()


def _load_probe(store: TraceCache | None, path: Path | None, key: str) -> Probe | None:
    if store is None or not path.is_file():
        return None
    try:
        return Probe.load(path, key)
    except CacheCorrupt as err:
        warnings.warn(f"discarding corrupt probe file {path} ({err}); retraining", stacklevel=3)
        path.unlink(missing_ok=True)
        return None
