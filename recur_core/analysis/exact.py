"""The exact path's results, cached under a key of the checkpoint, the windows, the policies, the loop
budget and the seed; re-running a report or reopening the app replays them from disk.

  ExactPath        where and how exact results are computed (model, windows, cache, progress, cache_only,
                   work counter): what the allocation curves and the ground truth take to go exact.
  ExactPath.results  the masking harness (recur_core.analysis.harness): every token's state loop by loop
                   in lockstep, many policies in one batched pass; cached per policy.
  ExactPath.decoded  teacher-forced decoding under the "recompute" KV rule, one policy at a time: what
                   real decoding gets, token by token in lockstep or as the fixed point of parallel passes
                   (recur_core.decoding.fixed_point), whichever is cheaper for the model and the batch
                   (teacher_forced.exact_mode). For a rule that reads only the state
                   it equals the harness; for a readout rule (A1, Huginn's KL / entropy / argmax) it
                   differs, because decoding reads token t's per-loop output with the earlier tokens'
                   coda at their exit states, the harness at their current loop (docs/DECODING.md).
  ExactPath.decoded_text  the same decoding of one text, every token's exit and its output there (the
                   app's pasted-text pages).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..decoding.decode import default_max_loops
from ..decoding.fixed_point import STEP_ROWS
from ..decoding.teacher_forced import exact_mode, teacher_forced
from ..exits.policies import Policy
from ..exits.trace_type import Trace
from ..model.checkpoint import model_id, resolve_model
from .harness import ExactResult, SweepWork, run_exact_sweep, uniform_run_result
from .parallel import map_batches
from .trace import progress_bar, resolve_cache, split_inputs

EXACT_FORMAT_VERSION = 3  # 2: the final readout's argmax is stored; 3: one file per policy
DECODE_BATCH = 32  # windows decoded in lockstep (on 2 CPU cores 32 programs of hops took 0.55x the time of 128)


@dataclass
class ExactPath:
    """The exact path of one set of windows: `model` a Checkpoint or LoopedLM, `ids` the traced windows
    (N, T + 1) or one text (T,); `cache` as trace's; `progress` as trace's; `cache_only`: a result that
    is not in the disk cache is None instead of computed; `work`: filled with what the harness ran."""

    model: Any
    ids: Any
    cache: Any = False
    progress: Any = None
    cache_only: bool = False
    work: SweepWork | None = None

    def results(self, policies: list[Policy], max_loops: int, seed: int,
                uniform: Trace | None = None) -> list[ExactResult] | None:
        """Every policy's exact result, through the disk cache, which keeps each policy's on its own (a
        policy that two plans share, the allocation's and the ground truth's, runs once); the policies
        not found run in the masking harness together (run_exact_sweep). `uniform`: the uniform trace
        of these windows, off which a policy that halts no token before its cap is read instead
        (uniform_run_result: nothing freezes early, so its harness run is the uniform run). None on a
        miss with cache_only."""
        out = [None if uniform is None else uniform_run_result(uniform, p) for p in policies]
        ckpt_id, store = model_id(self.model), resolve_cache(self.cache)
        ids_np = np.asarray(self.ids.cpu() if hasattr(self.ids, "cpu") else self.ids, dtype=np.int64)
        shape = (ids_np.shape[0], ids_np.shape[1] - 1) if ids_np.ndim == 2 else (1, ids_np.shape[0])
        entries = {}
        for i in (i for i, r in enumerate(out) if r is None and store is not None):
            key = _exact_key(ckpt_id, ids_np, [policies[i]], max_loops, seed)
            entries[i] = store.trace_path(ckpt_id, f"exact-{key[:32]}"), key
            hit = store.load(*entries[i], {f: shape for f in ExactResult.FIELDS})
            out[i] = None if hit is None else ExactResult(**hit[0])
        missing = [i for i, r in enumerate(out) if r is None]
        if missing and self.cache_only:
            return None
        computed = run_exact_sweep(self.model, ids_np, [policies[i] for i in missing], max_loops, seed,
                                   progress=self.progress, work=self.work) if missing else []
        for i, result in zip(missing, computed, strict=True):
            out[i] = result
            if i in entries:
                store.save(*entries[i], {f: getattr(result, f) for f in ExactResult.FIELDS},
                           {"kind": "exact (masking harness)", "policies": [repr(policies[i])]})
        return out

    def decoded(self, policy: Policy, max_loops: int, seed: int, guess: np.ndarray | None = None,
                lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """(exit_loop (N, T), argmax (N, T)) of `policy` in teacher-forced decoding of the windows
        (N, T + 1) under the "recompute" KV rule (exact, in the cheaper mode), window n with the
        trace's noise row n, through the disk cache; None on a miss with cache_only. guess: exits
        (N, T) to seed the fixed point with (the fast path's): fewer passes, the same result; lockstep
        decoding, where it is the cheaper mode (`exact_mode`), needs none.
        lengths: (N,) the leading positions of each window that matter (e.g. a program before its
        padding); decoding is causal, so the later ones are left out, with exit_loop 0 and argmax -1,
        and windows are batched by length (a padded position that loops long no longer prolongs a pass)."""
        ckpt_id = model_id(self.model)
        store = resolve_cache(self.cache)
        ids_np = np.asarray(self.ids.cpu() if hasattr(self.ids, "cpu") else self.ids, dtype=np.int64)
        shape = (ids_np.shape[0], ids_np.shape[1] - 1)
        cut = None if lengths is None else np.clip(np.asarray(lengths, dtype=np.int64), 1, shape[1])
        mode = exact_mode(resolve_model(self.model)[0], policy, min(shape[0], DECODE_BATCH))
        key = _exact_key(ckpt_id, ids_np, [policy], max_loops, seed, order="decoding", mode=mode,
                         **({} if cut is None else {"lengths": cut.tolist()}))
        path = None if store is None else store.trace_path(ckpt_id, f"decoded-{key[:32]}")
        hit = None if store is None else store.load(path, key, {f: shape for f in ("exit_loop", "argmax", "targets")})
        if hit is not None:
            return hit[0]["exit_loop"], hit[0]["argmax"]
        if self.cache_only:
            return None
        exit_loop, argmax = self._decode(policy, (max_loops, seed, mode), ids_np, guess, cut)
        if store is not None:
            store.save(path, key, {"exit_loop": exit_loop, "argmax": argmax, "targets": split_inputs(ids_np)[1].numpy()},
                       {"kind": "teacher-forced decoding (recompute)", "policies": [repr(policy)]})
        return exit_loop, argmax

    def _decode(self, policy: Policy, run: tuple[int, int, str], ids: np.ndarray, guess: np.ndarray | None,
                lengths: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """decoded's computation, run = (max_loops, seed, teacher_forced's mode): batches of DECODE_BATCH
        windows (by length when lengths are given, each batch cut to its longest), every window with
        its own noise row, on the CPU's cores (recur_core.analysis.parallel: a batch's steps or passes
        are many small ops, which torch's intra-op threads split poorly)."""
        max_loops, seed, mode = run
        N, T = ids.shape[0], ids.shape[1] - 1
        exit_loop, argmax = np.zeros((N, T), dtype=np.int64), np.full((N, T), -1, dtype=np.int64)
        order = np.arange(N) if lengths is None else np.argsort(lengths, kind="stable")
        cut = lambda rows: T if lengths is None else int(lengths[rows].max())  # noqa: E731
        update, close = progress_bar(self.progress, N, f"decoding {policy!r} (windows)")

        def decode(rows: np.ndarray):
            L = cut(rows)
            return teacher_forced(self.model, ids[rows, :L + 1], policy, "recompute", seed=seed, max_loops=max_loops,
                                  batch_size=len(rows), mode=mode, noise_rows=rows,
                                  guess=None if guess is None or mode != "fixed_point" else np.asarray(guess)[rows, :L])

        def take(rows: np.ndarray, out) -> None:
            L = cut(rows)
            exit_loop[rows, :L], argmax[rows, :L] = out.exit_loop.numpy(), out.argmax.numpy()
            update(len(rows))
        batches = [order[start:start + DECODE_BATCH] for start in range(0, N, DECODE_BATCH)]
        map_batches(decode, batches, next(resolve_model(self.model)[0].parameters()).device, on_done=take)
        close()
        if lengths is not None:
            beyond = np.arange(T)[None, :] >= lengths[:, None]
            exit_loop[beyond], argmax[beyond] = 0, -1
        return exit_loop, argmax

    def decoded_text(self, policy: Policy, max_loops: int | None, seed: int, guess=None) -> TextDecoding | None:
        """Decode `ids`, one text (T,), with real halting under the "recompute" KV rule (for a rule
        that reads only the state, the masking harness), with window 0's noise of `seed` (as
        trace(ckpt, text, ...) draws it), exactly as token by token, by the fixed point of parallel
        passes, through the disk cache; None on a miss with cache_only. `progress` hears the tokens
        settled after each pass. guess: exits (T,) that seed the fixed point (the fast path's, which
        a page has already): less work, the same result."""
        ids = np.asarray(self.ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError(f"decoded_text takes one non-empty text (T,), got shape {ids.shape}")
        model, ckpt = resolve_model(self.model)
        cap = policy.cap(default_max_loops(policy, ckpt, max_loops))
        store = resolve_cache(self.cache)
        key = _exact_key(model_id(self.model), ids[None], [policy], cap, seed, order="decoded-text")
        path = None if store is None else store.trace_path(model_id(self.model), f"text-{key[:32]}")
        hit = None if store is None else store.load(path, key, {f: ids.shape for f in TextDecoding.FIELDS})
        if hit is not None:
            return TextDecoding(**{f: hit[0][f] for f in TextDecoding.FIELDS})
        if self.cache_only:
            return None
        update, close = progress_bar(self.progress, len(ids), f"decoding a text ({policy!r})")
        settled = [0]

        def advance(done: int, _total: int) -> None:
            update(done - settled[0])
            settled[0] = done
        window = np.concatenate([ids, ids[-1:]])[None]  # the last token's stand-in target: its loss is dropped
        out = teacher_forced(self.model, window, policy, "recompute", seed=seed, max_loops=max_loops, keep_logits=True,
                             mode="fixed_point", position_progress=advance,
                             guess=None if guess is None else np.asarray(guess, dtype=np.int64)[None])
        close()
        depth = out.exit_loop[0].numpy().astype(np.int64)
        ce = out.ce[0].numpy().astype(np.float32)
        ce[-1] = np.nan
        decoded = TextDecoding(depth, (depth < cap) | (policy.min_loops >= cap), out.argmax[0].numpy().astype(np.int64),
                               torch.softmax(out.logits[0], dim=-1).max(dim=-1).values.numpy(), ce)
        if store is not None:
            store.save(path, key, {f: getattr(decoded, f) for f in TextDecoding.FIELDS},
                       {"kind": "teacher-forced decoding of one text (recompute)", "policies": [repr(policy)]})
        return decoded


@dataclass
class TextDecoding:
    """One text under a policy in real decoding, per token (T,): exit_depth, converged (False where
    the token ran to the policy's cap; a rule first met at the cap counts as capped, decoding cannot
    tell them apart), and its output at exit: argmax (what greedy decoding emits), top_prob (that
    token's probability), ce (next-token loss in nats; NaN for the last token, which has no next)."""

    exit_depth: np.ndarray
    converged: np.ndarray
    argmax: np.ndarray
    top_prob: np.ndarray
    ce: np.ndarray
    FIELDS: ClassVar[tuple[str, ...]] = ("exit_depth", "converged", "argmax", "top_prob", "ce")

    @property
    def mean_loops(self) -> float:
        """Over the tokens that have a next token (all but the last), as the fast path counts."""
        return float(self.exit_depth[:-1].mean()) if len(self.exit_depth) > 1 else float("nan")

    @property
    def loss(self) -> float:
        return float(np.nanmean(self.ce)) if len(self.ce) > 1 else float("nan")


def _exact_key(ckpt_id: str, ids: np.ndarray, policies: list[Policy], max_loops: int, seed: int,
               order: str = "lockstep", mode: str = "fixed_point", **extra) -> str:
    """A decoding's key names its mode (teacher_forced's), and the fixed point's STEP_ROWS, which decides
    when it goes on token by token: at a threshold at the float noise of its signal the order of
    arithmetic decides some exits."""
    decoding = {"order": order, "mode": mode, **({"step_rows": STEP_ROWS} if mode == "fixed_point" else {})}
    spec = {"checkpoint_id": ckpt_id, "policies": [repr(p) for p in policies], "max_loops": max_loops,
            "seed": seed, "format_version": EXACT_FORMAT_VERSION, **({} if order == "lockstep" else decoding), **extra}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(np.ascontiguousarray(ids).tobytes())
    return h.hexdigest()
