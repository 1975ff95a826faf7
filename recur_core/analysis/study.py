"""The study of a checkpoint, written once: A2's probes → the eval trace → its bootstrap → the allocation
curves (fast, then the exact plan) → the ground truth (on checkpoints that ship it) → overthinking.

`python -m recur_core.analyze` and the app (its canonical trace, probes and Ground truth page) are thin
callers: each makes a `Study` of a loaded checkpoint with its `StudySettings` (the defaults are
SETTINGS, what the app asks for) and reads the steps it needs. (The hops card and `bench.bench_specimen`
keep settings of their own: the card's 32-loop cap, a trace without probes.) Every step reads and fills recur_core's disk cache under
a key derived from its own inputs (windows, loops, seed, probes, policies), so callers with equal
settings share every result, and a caller with other settings (`analyze --max-loops 8`) gets its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..exits.policies import ConvergenceExit, Policy
from ..model.checkpoint import Checkpoint, CheckpointError
from ..settings import SETTINGS
from .allocation import allocation, allocation_families, model_gate
from .certify import measured_lipschitz
from .dynamics import overthinking, overthinking_loops
from .exact import ExactPath
from .ground_truth import Labels, answer_hops, ground_truth_section, operating_point_families, probe_answers
from .harness import SweepWork
from .probe import LABEL_EPS_A1, ProbeSet, ProbeSpec, load_or_train_probes
from .stats import Bootstrap
from .trace import Trace, is_cached, trace


@dataclass(frozen=True)
class StudySettings:
    """What a study depends on besides the checkpoint. max_loops None: the trace runs
    SETTINGS.trace_loops(recipe) = max(32, r_max) loops; label_eps: A2's KL labels' ε, a number or
    "a1" (A1's matched ε on the probe windows); a1_first_check: the first loop A1 may exit at."""

    windows: int = SETTINGS.windows
    max_loops: int | None = None
    seed: int = SETTINGS.seed
    n_boot: int = SETTINGS.n_boot
    topk: int = SETTINGS.topk
    probe_windows: int = SETTINGS.probe_windows
    probe_tokens: int = SETTINGS.probe_tokens
    label_eps: float | str = LABEL_EPS_A1
    a1_first_check: int = ConvergenceExit.FIRST_CHECK
    batch_size: int = 16  # windows per forward batch (not part of any result)


class Study:
    """One checkpoint's study. `cache`: the disk cache (True: the default folder; False: none; a
    folder or a TraceCache). Steps that take minutes take `progress` (as trace's: True for a bar, a
    callable(done, total), or None) and `cache_only` (None instead of computing on a cache miss)."""

    def __init__(self, ckpt: Checkpoint, settings: StudySettings = StudySettings(), cache=True):
        self.ckpt, self.settings, self.cache = ckpt, settings, cache
        recipe = ckpt.recipe
        self.max_loops = settings.max_loops or SETTINGS.trace_loops(recipe)
        self.r_max = min(recipe.r_max, self.max_loops)
        self.r_bar = min(recipe.depth, self.r_max)
        self._probes: ProbeSet | None = None
        self._trace: Trace | None = None

    @property
    def eval_windows(self):
        return self.ckpt.windows("eval")[:self.settings.windows]

    def probes(self, progress=None, cache_only: bool = False) -> ProbeSet | None:
        """A2's router probes, trained on the checkpoint's probe windows (KL labels matched on answer
        accuracy where it ships ground truth); empty when r_max < 2 or it has no probe windows."""
        if self._probes is None:
            s = self.settings
            try:
                self.ckpt.windows("probe")
            except CheckpointError:
                return ProbeSet({})
            if self.r_max < 2:
                return ProbeSet({})
            answers = None if self.ckpt.text_windows else probe_answers(self.ckpt.path, s.probe_windows)
            spec = ProbeSpec(label_eps=s.label_eps, r_bar=self.r_bar, n_windows=s.probe_windows,
                             tokens_per_window=s.probe_tokens)
            self._probes = load_or_train_probes(self.ckpt, self.r_max, s.seed, spec, answers=answers, cache=self.cache,
                                                progress=progress, cache_only=cache_only)
        return self._probes

    def trace(self, progress=None) -> Trace:
        """The eval windows traced to max_loops with A2's chances (and a gate's lambdas)."""
        if self._trace is None:
            s = self.settings
            self._trace = trace(self.ckpt, self.eval_windows, self.max_loops, s.seed, topk=s.topk,
                                probes=list(self.probes().values()), batch_size=s.batch_size, cache=self.cache,
                                progress=progress)
        return self._trace

    def is_traced(self) -> bool:
        """Whether the probes and the eval trace are in the disk cache (nothing is loaded)."""
        probes = self.probes(cache_only=True)
        s = self.settings
        return probes is not None and is_cached(self.ckpt, self.eval_windows, self.max_loops, s.seed, topk=s.topk,
                                                probes=list(probes.values()), cache=self.cache)

    @cached_property
    def boot(self) -> Bootstrap:
        return Bootstrap(self.trace().n_windows, self.settings.n_boot, self.settings.seed)

    def exact_path(self, progress=None, work: SweepWork | None = None, cache_only: bool = False) -> ExactPath:
        return ExactPath(self.ckpt, self.eval_windows, self.cache, progress, cache_only, work)

    def allocation_families(self) -> dict[str, list[Policy]]:
        return allocation_families(self.r_max, probes=self.probes(), a1_min_loops=self.settings.a1_first_check,
                                   gate=model_gate(self.ckpt))

    def allocation(self, exact: ExactPath | None = None) -> dict | None:
        """Table 4's curves (recur_core.analysis.allocation): fast, or exact on `exact` (exact_path)."""
        return allocation(self.trace(), self.boot, self.r_bar, self.allocation_families(), exact)

    @cached_property
    def lipschitz(self) -> dict:
        """The certified exit's measured L on the probe windows (recur_core.analysis.certify)."""
        return measured_lipschitz(self.ckpt, self.max_loops, self.settings.seed)

    @cached_property
    def labels(self) -> Labels | None:
        """The eval windows' ground truth, or None (a checkpoint without it, or windows from a text)."""
        return None if self.ckpt.text_windows else Labels.of(self.ckpt)

    def ground_truth(self, exact: ExactPath | None = None) -> dict | None:
        """The ground_truth section (recur_core.analysis.ground_truth), fast or exact; None without labels."""
        if self.labels is None:
            return None
        families = operating_point_families(self.r_max, self.probes(), lipschitz=self.lipschitz["lipschitz"])
        return ground_truth_section(self.trace(), self.labels, self.r_max, self.r_bar, self.boot, families, exact)

    def overthinking(self, progress=None) -> dict:
        """Loss (and answer accuracy) far past r_max: the eval windows traced to 4 x r_max loops (at most 128)."""
        s = self.settings
        deep = trace(self.ckpt, self.eval_windows, overthinking_loops(self.ckpt.recipe.r_max), s.seed,
                     batch_size=s.batch_size, cache=self.cache, progress=progress)
        hops = None if self.labels is None else answer_hops(deep, self.labels.hops)
        return overthinking(deep, self.boot, self.r_max, hops)

