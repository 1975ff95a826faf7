"""The selected checkpoint as the pages use it: a `Handle` whose methods are the analyses of
ui/compute.py on this checkpoint (`m.sweep_fast(ids)`, `m.trace(ids)`, `m.text_outcome(...)`).

Streamlit caches a function by the values of its arguments, so the cached calls stay functions of
compute.py taking (path, checkpoint id, device) as plain values; a handle carries that key and the
recipe's depths and passes them on, so a page never spells the key out.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recur_core.model.checkpoint import EVAL_WINDOWS
from recur_core.model.recipe import Recipe

from . import compute, jobs


@dataclass(frozen=True)
class Handle:
    """What the pages need to know about the selected checkpoint (the weights stay cached), and the
    analyses they ask of it."""

    path: str
    checkpoint_id: str
    device: str
    meta: dict
    recipe: Recipe
    r_max: int
    r_bar: int  # the recipe's r̄ as a whole loop count (the uniform depth policies are matched to)
    loops: int  # depth of every trace: max(S.min_trace_loops, r_max)
    max_seq_len: int
    n_params: int
    vocab_size: int
    id_mismatch: str | None = None  # set when meta.json's id is not the weights' hash
    has_windows: bool = True  # False for folders that ship no eval windows (Huginn): pasted text only

    @classmethod
    def open(cls, path: str, device: str) -> Handle:
        """The checkpoint at `path` loaded on `device` (cached); CheckpointError if it is unusable."""
        ckpt = compute.checkpoint(path, device)
        recipe = ckpt.recipe
        stated = str(ckpt.meta.get("checkpoint_id", ""))
        mismatch = None
        if stated and stated != ckpt.checkpoint_id:
            mismatch = (f"meta.json names checkpoint id {stated}, but the weights hash to {ckpt.checkpoint_id}: "
                        "the folder's files do not belong together (results are keyed by the weights' hash).")
        return cls(path=path, checkpoint_id=ckpt.checkpoint_id, device=device, meta=ckpt.meta, recipe=recipe,
                   r_max=recipe.r_max, r_bar=recipe.depth, loops=compute.S.trace_loops(recipe),
                   max_seq_len=ckpt.config.max_seq_len, n_params=ckpt.model.num_params(),
                   vocab_size=ckpt.config.vocab_size, id_mismatch=mismatch,
                   has_windows=(Path(path) / EVAL_WINDOWS).is_file())

    @property
    def key(self) -> tuple[str, str, str]:
        """(path, checkpoint id, device): what compute's cached calls are keyed by."""
        return self.path, self.checkpoint_id, self.device

    # -- the checkpoint itself --------------------------------------------------------------------------
    def checkpoint(self):
        """The loaded recur_core Checkpoint (shared: never mutate it)."""
        return compute._ckpt(*self.key)

    def tokenizer(self):
        return compute.tokenizer(self.path, self.checkpoint_id)

    def decode_ids(self, ids) -> list[str]:
        return compute.decode_ids(self.path, self.checkpoint_id, ids)

    def probes(self) -> dict:
        return compute.probes(*self.key)

    def gate(self) -> tuple | None:
        return compute.gate(*self.key)

    def training_log(self) -> dict | None:
        """The parsed metrics.jsonl, None when the folder has none."""
        stamp = compute.log_stamp(self.path)
        return None if stamp == "missing" else compute.training_log(self.path, stamp)

    # -- traces -----------------------------------------------------------------------------------------
    def trace(self, ids: tuple[int, ...] | None, with_probes: bool = True, first_look: bool = False):
        """The eval-window trace (ids None; its first look when first_look) or a pasted text's."""
        return compute.source_trace(*self.key, ids, with_probes, first_look)

    def eval_trace_ready(self) -> bool:
        return compute.eval_trace_ready(*self.key)

    def start_eval_trace(self) -> jobs.Job:
        return compute.start_eval_trace(*self.key)

    # -- policies ---------------------------------------------------------------------------------------
    def a1(self, eps: float):
        return compute.a1(eps, self.r_max)

    def a2(self, kind: str, tau: float):
        return compute.a2(*self.key, kind, tau, self.r_max)

    def policy(self, name: str, threshold):
        """A catalogue family that needs neither a probe nor a gate, capped at r_max."""
        return compute.policy(name, threshold, self.r_max)

    def lipschitz(self, text: tuple[int, ...] | None) -> dict:
        """The certified exit's L: measured on the probe windows, or on `text` for a folder without them."""
        return compute.lipschitz(*self.key, text)

    def gate_exit(self, q: float):
        return compute.gate_exit(*self.key, q, self.r_max)

    def text_outcome(self, ids: tuple[int, ...], tr, policy, exact: bool) -> compute.Outcome:
        return compute.text_outcome(*self.key, ids, tr, policy, exact)

    # -- the eval set's measurements --------------------------------------------------------------------
    def sweep_fast(self, ids: tuple[int, ...] | None, first_look: bool = False) -> dict:
        return compute.sweep_fast(*self.key, ids, self.r_max, self.r_bar, first_look)

    def sweep_exact(self, ids: tuple[int, ...] | None, n_windows: int) -> dict:
        return compute.sweep_exact(*self.key, ids, self.r_max, self.r_bar, n_windows)

    def exact_cached(self, ids: tuple[int, ...] | None, n_windows: int) -> bool:
        return compute.exact_cached(*self.key, ids, self.r_max, self.r_bar, n_windows)

    def start_exact_sweep(self, ids: tuple[int, ...] | None, n_windows: int) -> jobs.Job:
        return compute.start_exact_sweep(*self.key, ids, self.r_max, self.r_bar, n_windows)

    def convergence(self, ids: tuple[int, ...] | None, first_look: bool = False) -> dict:
        return compute.convergence(*self.key, ids, first_look)

    def dynamics(self, ids: tuple[int, ...] | None, first_look: bool = False) -> dict:
        return compute.dynamics(*self.key, ids, first_look)

    def exit_depths(self, ids: tuple[int, ...] | None, eps: float, first_look: bool = False) -> dict:
        return compute.exit_depths(*self.key, ids, eps, self.r_max, first_look)

    def token_classes(self, ids: tuple[int, ...] | None, eps: float, first_look: bool = False) -> dict:
        return compute.token_classes(*self.key, ids, eps, self.r_max, self.vocab_size, first_look)

    def elasticity(self, first_look: bool = False) -> dict:
        return compute.elasticity(*self.key, first_look)

    def elasticity_difference(self, ref: Handle, first_look: bool = False) -> dict:
        """Loss at each depth minus `ref`'s, paired over the same eval windows (ValueError when they
        do not share them)."""
        return compute.elasticity_difference(self.path, self.checkpoint_id, ref.path, ref.checkpoint_id, self.device,
                                             first_look)

    # -- overthinking: the sweep far past r_max --------------------------------------------------------
    def overthinking_size(self, ids: tuple[int, ...] | None) -> tuple[int, int]:
        """(windows, loops); a ValueError naming the memory limit when the sweep would not fit."""
        return compute.overthinking_size(*self.key, ids)

    def overthinking_job(self, ids: tuple[int, ...] | None) -> jobs.Job | None:
        return jobs.get(compute.overthinking_key(*self.key, ids))

    def overthinking_ready(self, ids: tuple[int, ...] | None) -> bool:
        return compute.overthinking_ready(*self.key, ids)

    def start_overthinking(self, ids: tuple[int, ...] | None) -> jobs.Job:
        return compute.start_overthinking(*self.key, ids)

    def overthinking(self, ids: tuple[int, ...] | None) -> dict:
        return compute.overthinking_figures(*self.key, ids)
