"""A2's router: a logistic-regression probe on the core state that predicts "the output still changes".

Features at loop i: the core state s_i (d values) and the loop index i. Four label kinds, two
horizons (the next loop, or any later loop up to r_max) times two notions of "change":
  "argmax"      argmax p_{i+1} != argmax p_i                              (the paper's labels)
  "kl"          KL(p_{i+1} || p_i) >= label_eps                           (A1's own signal)
  "argmax_any"  argmax p_j != argmax p_i for some j in i+1 .. r_max       (the paper's router
                predicts whether the prediction changes in *later* loops and halts on "no more change")
  "kl_any"      KL(p_j || p_{j-1}) >= label_eps for some j in i+1 .. r_max  (not yet settled for good:
                a later loop still moves the output by at least label_eps)
so a label exists for loops 1 .. r_max - 1 (the harvest runs to r_max). label_eps, the KL labels'
threshold, is by default tied to A1: the ε at which A1 (fast path, first check at loop 2) first
reaches A0's quality at r_bar on the probe's own training windows (`a1_matched_eps`); a float fixes it.
Quality is what the checkpoint is judged by: the all-token loss, or, where the probe windows have
ground truth (answer tokens of known depth), answer accuracy within 1 point. (On the hops task early
exit *lowers* the all-token loss, most tokens being unpredictable statements, so loss matching picks
an ε larger than any KL and every label is negative.) Labels of one class are refused
(`SingleClassLabels`): such a "probe" is a constant, and `load_or_train_probes` leaves it out and
says why (`ProbeSet.refused`).

Labels and states are harvested from uniform runs of the checkpoint's training-side windows
(`ckpt.windows("probe")`); a seeded sample of token positions per window keeps memory bounded (every
loop of a sampled token is kept). Windows are split into train and held-out sets (disjoint), and the
probe's accuracy and AUC are measured on the held-out windows. The fit is an L2-regularised logistic
regression on standardised features, full-batch LBFGS.

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

from ..exits.policies import ConvergenceExit, Uniform
from ..exits.trace_type import Trace
from ..model.checkpoint import Checkpoint, model_id, resolve_model
from .cache import CacheCorrupt, TraceCache, read_arrays, write_arrays
from .curves import EPS_GRID, fast_sums
from .ground_truth import TOLERANCE, correct_at
from .matching import cheapest
from .parallel import map_batches
from .trace import Recording, padding_token, progress_bar, resolve_cache, split_inputs, trace_batch, zero_weight_mask

LABEL_KINDS = ("argmax", "kl", "argmax_any", "kl_any")
PROBE_FORMAT_VERSION = 2
FALLBACK_LABEL_EPS = 1e-3  # KL labels' ε when A1 never reaches A0's loss at r_bar on the probe windows
LABEL_EPS_A1 = "a1"  # label_eps setting: tie it to A1's matched ε (see module doc)
DEFAULT_LABEL_EPS = LABEL_EPS_A1


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

    @property
    def rule_id(self) -> str:
        """Content hash of the parameters alone: probes with equal rule_ids give equal chances."""
        h = hashlib.sha256(json.dumps(self.bias).encode())
        for t in (self.weight, self.mean, self.std):
            h.update(t.detach().cpu().float().numpy().tobytes())
        return h.hexdigest()[:16]

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of standardised-then-weighted features (..., d + 1)."""
        x = (features.float() - self.mean.to(features.device)) / self.std.to(features.device)
        return x @ self.weight.to(features.device) + self.bias

    def chance(self, state: torch.Tensor, loop) -> torch.Tensor:
        """Predicted chance (B, T) that the output changes after loop `loop` (an int, or a tensor
        broadcastable to (B, T): each token's own loop), from states (B, T, d)."""
        loop_col = torch.as_tensor(loop, dtype=torch.float32, device=state.device).expand(state.shape[:-1])[..., None]
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
    """Probe training data: M samples of (state, loop) features with what every label kind needs.

    features (M, d + 1) float32; window (M,) int (the sample's window, for the disjoint split);
    changed_argmax / changed_argmax_any (M,) bool; kl_next (M,) KL(p_{i+1} || p_i) and kl_later_max
    (M,) the largest KL(p_j || p_{j-1}) over j > i, so the KL labels follow label_eps. trace: the
    uniform trace of the harvested windows (calibrates label_eps), None when built by hand.
    """

    features: np.ndarray
    window: np.ndarray
    changed_argmax: np.ndarray
    changed_argmax_any: np.ndarray
    kl_next: np.ndarray
    kl_later_max: np.ndarray
    label_eps: float
    trace: Trace | None = None

    def labels(self, kind: str) -> np.ndarray:
        if kind not in LABEL_KINDS:
            raise ValueError(f"label kind must be one of {LABEL_KINDS}, got {kind!r}")
        return {"argmax": lambda: self.changed_argmax, "argmax_any": lambda: self.changed_argmax_any,
                "kl": lambda: self.kl_next >= self.label_eps,
                "kl_any": lambda: self.kl_later_max >= self.label_eps}[kind]()


@torch.inference_mode()
def harvest(ckpt_or_model, windows, max_loops: int, seed: int = 0, *, tokens_per_window: int = 64,
            label_eps: float = FALLBACK_LABEL_EPS, batch_size: int = 16, progress=None) -> Harvest:
    """Run windows (N, T + 1) to max_loops and keep features/labels of a seeded sample of positions
    (and the windows' whole uniform trace, without top-k)."""
    if max_loops < 2:
        raise ValueError("labels look one loop ahead: harvest needs max_loops >= 2")
    model, ckpt_id = resolve_model(ckpt_or_model)[0], model_id(ckpt_or_model)
    device = next(model.parameters()).device
    inputs, targets = split_inputs(windows)
    N, T = inputs.shape
    positions = _sample_positions(N, T, tokens_per_window, seed)  # (N, P)
    update, close = progress_bar(progress, N, "probe harvest")

    def run(rows: range):
        return _harvest_batch(model, inputs[rows.start:rows.stop].to(device), targets[rows.start:rows.stop],
                              model.seeded_state(rows, seed, T), positions[rows.start:rows.stop], max_loops, rows)
    try:
        batches = [range(start, min(start + batch_size, N)) for start in range(0, N, batch_size)]
        parts, traced = zip(*map_batches(run, batches, device, on_done=lambda rows, _: update(len(rows))), strict=True)
    finally:
        close()
    arrays = {name: torch.cat([o[name] for o in traced]).numpy() for name in traced[0]}
    tr = Trace(ids=inputs.numpy(), targets=targets.numpy(), **arrays, max_loops=max_loops, seed=seed,
               checkpoint_id=ckpt_id,
               zero_weight=zero_weight_mask(inputs.numpy(), targets.numpy(), padding_token(ckpt_or_model)))
    return Harvest(*(np.concatenate(a) for a in zip(*parts, strict=True)), label_eps=label_eps, trace=tr)


def _sample_positions(n_windows: int, seq_len: int, per_window: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    k = min(per_window, seq_len)
    return torch.from_numpy(np.stack([np.sort(rng.choice(seq_len, k, replace=False)) for _ in range(n_windows)]))


def _harvest_batch(model, inputs, targets, noise, positions, max_loops, rows):
    """((features, window, changed_argmax, changed_argmax_any, kl_next, kl_later_max), trace fields)
    of one batch; samples in (window, position, loop) order, for loops 1 .. max_loops - 1 (the last
    loop has no later loop to label it)."""
    states = []
    gather = positions.to(inputs.device)[..., None].expand(-1, -1, model.cfg.d_model)
    out = trace_batch(model, inputs, targets, noise, Recording(max_loops),
                      on_state=lambda loop, s: states.append(s.gather(1, gather).float().cpu()))
    at_positions = positions[..., None].expand(-1, -1, max_loops)
    argmax, kl_prev = out["argmax"].gather(1, at_positions), out["kl_prev"].gather(1, at_positions)
    state = torch.stack(states[:-1], dim=2)  # (B, P, L - 1, d)
    loop = torch.arange(1, max_loops, dtype=torch.float32).expand(*state.shape[:-1])[..., None]
    window = torch.tensor(list(rows))[:, None, None].expand(*state.shape[:-1])
    features = torch.cat([state, loop], dim=-1).flatten(0, 2)
    now = argmax[..., :-1]  # argmax p_i at loops i = 1 .. L - 1
    changed_argmax = argmax[..., 1:] != now
    # any j > i with argmax p_j != argmax p_i: compare every later loop with loop i
    later = argmax[..., None, :] != now[..., :, None]  # (B, P, i, j)
    changed_any = (later & torch.ones(max_loops - 1, max_loops, dtype=torch.bool).triu(1)).any(-1)
    kl_next = kl_prev[..., 1:]  # KL(p_{i+1} || p_i), labelled at loop i
    kl_later_max = kl_next.flip(-1).cummax(-1).values.flip(-1)  # max over j = i + 1 .. L
    samples = tuple(t.flatten().numpy() for t in (window, changed_argmax, changed_any, kl_next, kl_later_max))
    return (features.numpy(), *samples), {k: out[k] for k in out}


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


class SingleClassLabels(ValueError):
    """Every training label of a probe is the same: the fit would be a constant."""


class ProbeSet(dict):
    """{label kind: Probe} of the kinds that could be trained; `refused` {kind: why} for the others."""

    def __init__(self, probes: dict, refused: dict[str, str] | None = None):
        super().__init__(probes)
        self.refused = dict(refused or {})


def train_probe(data: Harvest, kind: str, *, l2: float = 1e-3, heldout_fraction: float = 0.25,
                seed: int = 0) -> Probe:
    """Fit on the training windows; metrics (accuracy, AUC, positive rate) on the held-out ones.
    Raises SingleClassLabels when the training labels are all of one class."""
    labels = data.labels(kind)
    held = split_windows(data.window, heldout_fraction, seed)
    if labels[~held].all() or not labels[~held].any():
        value = "positive" if labels[~held].all() else "negative"
        why = (f" (label ε {data.label_eps:.3g} nats is {'below' if value == 'positive' else 'above'} every KL)"
               if kind.startswith("kl") else "")
        raise SingleClassLabels(f"A2 probe '{kind}': all {int((~held).sum())} training labels are {value}{why}; "
                                "a probe fit to one class is a constant, so it is not used")
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
def a1_matched_eps(tr: Trace, r_bar: int, r_max: int, answers: np.ndarray | None = None) -> float | None:
    """A1's ε at the matched point on a trace: the cheapest ε of analysis.EPS_GRID (fast path, A1's
    default first check) whose loss is at most A0's at r_bar, or with `answers` ((N, T) bool, the
    answer tokens that have ground truth) whose answer accuracy is within TOLERANCE of A0's at r_bar;
    None if no ε reaches it."""
    eps_grid = [eps for eps in EPS_GRID if 0 < eps < float("inf")]
    if answers is None:
        target = fast_sums(tr, Uniform(r_bar)).mean_loss
        sums = {eps: fast_sums(tr, ConvergenceExit(eps, r_max=r_max)) for eps in eps_grid}
        return cheapest(sums, lambda eps: sums[eps].mean_loss <= target, lambda eps: (sums[eps].mean_loops, eps))
    accuracy = lambda policy: float(correct_at(tr, policy.exit_depth(tr))[answers].mean())  # noqa: E731
    target = accuracy(Uniform(r_bar)) - TOLERANCE
    points = {eps: ConvergenceExit(eps, r_max=r_max) for eps in eps_grid}
    return cheapest(points, lambda eps: accuracy(points[eps]) >= target,
                    lambda eps: (points[eps].exit_depth(tr).mean(), eps))


PROBE_L2 = 1e-3  # the logistic regression's L2 penalty
HELDOUT_FRACTION = 0.25  # probe windows held out for the probes' metrics


@dataclass(frozen=True)
class ProbeSpec:
    """What a probe set is trained from: its label kinds; the KL labels' ε, a float or LABEL_EPS_A1
    ("a1": A1's matched ε on the probe windows at r_bar, default the recipe's r_bar capped at
    max_loops); the first n_windows probe windows and tokens_per_window sampled positions in each."""

    kinds: tuple[str, ...] = LABEL_KINDS
    label_eps: float | str = DEFAULT_LABEL_EPS
    r_bar: int | None = None
    n_windows: int = 32
    tokens_per_window: int = 64


def load_or_train_probes(ckpt: Checkpoint, max_loops: int, seed: int = 0, spec: ProbeSpec = ProbeSpec(), *,
                         answers: np.ndarray | None = None, cache=True, progress=None,
                         cache_only: bool = False) -> ProbeSet | None:
    """Probes of each label kind of `spec` for a checkpoint; loaded from <cache>/<ckpt id>/probes/
    when saved with the same settings, else harvested and trained.

    With label_eps "a1", A1's ε is matched on answer accuracy where `answers` ((n_windows, T) bool:
    the probe windows' answer tokens with ground truth) is given, else on the loss; each probe
    records the ε it used (`probe.label_eps`, and `metrics["label_eps_rule"]`). Kinds whose labels
    are all of one class are left out, with the reason in the result's `refused` (and a warning).
    cache_only: None instead of training when a kind is not saved (a refused kind is never saved).
    """
    n_windows, tokens_per_window, label_eps, r_bar = spec.n_windows, spec.tokens_per_window, spec.label_eps, spec.r_bar
    windows = ckpt.windows("probe")[:n_windows]
    if r_bar is None:
        r_bar = round(float(ckpt.meta.get("recipe", {}).get("r_bar", max_loops)))
    r_bar = max(1, min(r_bar, max_loops))
    settings = {"max_loops": max_loops, "seed": seed, "label_eps": label_eps, "l2": PROBE_L2, "r_bar": r_bar,
                "tokens_per_window": tokens_per_window, "heldout_fraction": HELDOUT_FRACTION,
                "format_version": PROBE_FORMAT_VERSION,
                "answers": None if answers is None else hashlib.sha256(np.packbits(answers).tobytes()).hexdigest()}
    store = resolve_cache(cache)
    probes, missing = {}, []
    for kind in spec.kinds:
        key = _probe_key(ckpt.checkpoint_id, windows.numpy(), {**settings, "kind": kind})
        path = None if store is None else store.probe_path(ckpt.checkpoint_id, f"{kind}-{key[:16]}")
        probes[kind] = _load_probe(store, path, key)
        if probes[kind] is None:
            missing.append((kind, path, key))
    refused = {}
    if missing and cache_only:
        return None
    if missing:
        data = harvest(ckpt, windows, max_loops, seed, tokens_per_window=tokens_per_window, progress=progress)
        rule = f"fixed {label_eps}"
        if label_eps == LABEL_EPS_A1:
            quality = "answer accuracy" if answers is not None else "loss"
            matched = a1_matched_eps(data.trace, r_bar, max_loops, answers)
            data.label_eps = FALLBACK_LABEL_EPS if matched is None else matched
            rule = (f"A1's matched ε at r_bar {r_bar} on the probe windows' {quality}" if matched is not None else
                    f"A1 never reaches A0's {quality} at r_bar {r_bar} on the probe windows: "
                    f"fallback {FALLBACK_LABEL_EPS}")
        else:
            data.label_eps = float(label_eps)
        for kind, path, key in missing:
            try:
                probes[kind] = train_probe(data, kind, l2=PROBE_L2, heldout_fraction=HELDOUT_FRACTION, seed=seed)
            except SingleClassLabels as err:
                warnings.warn(str(err), stacklevel=2)
                refused[kind] = str(err)
                del probes[kind]
                continue
            probes[kind].metrics["label_eps_rule"] = rule
            if path is not None:
                probes[kind].save(path, key)
    return ProbeSet(probes, refused)


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
