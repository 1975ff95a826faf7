"""The `Trace` type: per-token, per-loop statistics of a uniform run, as arrays.

It lives below `recur_core.exits` because the policies' fast face (`Policy.exits(trace)`) reads
it; the tracer that fills it (`recur_core.analysis.trace`) sits above. The fields' meanings, the
loop-1 convention and the padding rule are documented there.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pandas as pd

LOOP_FIELDS = ("kl_prev", "state_change", "ce", "entropy", "argmax", "top1_prob", "kl_prev_reverse", "cosine_change",
               "state_step", "state_norm")
TOPK_FIELDS = ("topk_ids", "topk_probs")
GATE_FIELD = "exit_lambda"  # only for models with an exit gate
NO_TARGET = -1


@dataclass
class Trace:
    """Per-token, per-loop statistics of a uniform run; loop i is index i - 1 of the last axis.

    ids, targets (N, T) int64 (targets NO_TARGET where none); LOOP_FIELDS (N, T, L);
    topk_ids / topk_probs (N, T, L, k); router_chance maps a probe id to its (N, T, L) predicted
    chance that the output changes after each loop (see recur_core.analysis.probe).
    """

    ids: np.ndarray
    targets: np.ndarray
    kl_prev: np.ndarray
    state_change: np.ndarray
    ce: np.ndarray
    entropy: np.ndarray
    argmax: np.ndarray
    top1_prob: np.ndarray
    topk_ids: np.ndarray
    topk_probs: np.ndarray
    max_loops: int
    seed: int
    checkpoint_id: str
    router_chance: dict[str, np.ndarray] = field(default_factory=dict)
    kl_prev_reverse: np.ndarray | None = None  # always set by trace(); optional for hand-made traces
    cosine_change: np.ndarray | None = None
    state_step: np.ndarray | None = None  # always set by trace(), like state_norm
    state_norm: np.ndarray | None = None
    exit_lambda: np.ndarray | None = None  # the exit gate's lambda (N, T, L), models with a gate only
    zero_weight: np.ndarray | None = None  # (N, T) bool: padding, zero loss weight in training (module doc)

    @property
    def n_windows(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    @property
    def topk(self) -> int:
        return self.topk_ids.shape[-1]

    @property
    def has_target(self) -> np.ndarray:
        return self.targets != NO_TARGET

    @property
    def weighted(self) -> np.ndarray:
        """(N, T) bool: positions that carried loss weight in training (all but padding)."""
        return np.ones(self.ids.shape, dtype=bool) if self.zero_weight is None else ~self.zero_weight

    @property
    def scored(self) -> np.ndarray:
        """(N, T) bool: the positions every loss and exit statistic counts (a target, not padding)."""
        return self.has_target & self.weighted

    def subset(self, windows) -> Trace:
        """The trace of some windows (rows); scalars and probes' chances follow."""
        arrays = {f.name: getattr(self, f.name)[windows] for f in fields(self)
                  if isinstance(getattr(self, f.name), np.ndarray)}
        chance = {k: v[windows] for k, v in self.router_chance.items()}
        return Trace(**arrays, max_loops=self.max_loops, seed=self.seed, checkpoint_id=self.checkpoint_id,
                     router_chance=chance)

    def arrays(self) -> dict[str, np.ndarray]:
        """All arrays by name (router chances as 'router_chance/<probe id>'), for the cache."""
        out = {name: getattr(self, name) for name in ("ids", "targets", *LOOP_FIELDS, *TOPK_FIELDS)}
        if self.exit_lambda is not None:
            out[GATE_FIELD] = self.exit_lambda
        out.update({f"router_chance/{k}": v for k, v in self.router_chance.items()})
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per window x token x loop (loop 1-based), with the top-k as top{j}_id / top{j}_prob."""
        N, T, L = self.kl_prev.shape
        window, position, loop = np.meshgrid(np.arange(N), np.arange(T), np.arange(1, L + 1), indexing="ij")
        cols = {"window": window.ravel(), "position": position.ravel(), "loop": loop.ravel(),
                "token_id": np.repeat(self.ids.ravel(), L), "target": np.repeat(self.targets.ravel(), L)}
        cols["scored"] = np.repeat(self.scored.ravel(), L)
        cols.update({name: getattr(self, name).ravel() for name in (*LOOP_FIELDS, GATE_FIELD)
                     if getattr(self, name) is not None})
        for j in range(self.topk):
            cols[f"top{j + 1}_id"] = self.topk_ids[..., j].ravel()
            cols[f"top{j + 1}_prob"] = self.topk_probs[..., j].ravel()
        cols.update({f"router_chance_{k}": v.ravel() for k, v in self.router_chance.items()})
        return pd.DataFrame(cols)

    def to_parquet(self, path: str | Path) -> None:
        self.to_frame().to_parquet(path, index=False)

    def to_csv(self, path: str | Path) -> None:
        self.to_frame().to_csv(path, index=False)
