"""The certified exit's two measurements (recur_core.exits.policies.CertifiedExit):

`readout_lipschitz`: the readout's Lipschitz bound L for a checkpoint, measured on its training-side
(probe) windows: the largest ‖z_i − z_{i−1}‖_∞ / ‖s_i − s_{i−1}‖ over tokens and consecutive loops of
a uniform run (z = the logits, s = the core state). It is an empirical bound along the trajectories
the model takes, not a worst case over all states; the certificate is as good as it.

`violations`: how often the certificate is wrong in real decoding. For a position t, teacher-forced
decoding ("decode": token by token, the "recompute" KV rule) of the window up to t under the
certified exit gives every earlier token its certified exit; position t itself is run on past its
certified exit to `deep` loops in that same context, which tells whether its argmax ever moves off the
certified one (a violation). Its assumptions are checked on the same run: the contraction kept its
rate (the state's remaining motion ‖s_deep − s_e‖ stayed within the geometric tail bound) and L bounded
the readout (each later loop's top-1 − top-2 margin of the certified token stayed within 2 L ‖s_j − s_e‖
of its margin at the exit).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..decoding.teacher_forced import teacher_forced
from ..exits.policies import CertifiedExit, Policy, remaining_motion
from ..model.checkpoint import CheckpointError, resolve_model
from .trace import split_inputs


@torch.inference_mode()
def readout_lipschitz(ckpt_or_model, windows, loops: int, seed: int = 0) -> dict:
    """{"lipschitz": the largest secant ratio, "p99": its 99th percentile, "n_pairs": how many
    token-loop pairs (those whose state moved) it is taken over, "windows", "loops"}."""
    model = resolve_model(ckpt_or_model)[0]
    inputs, _ = split_inputs(windows)
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    e = model.prelude(inputs)
    state = model.start_state(model.seeded_state(range(len(inputs)), seed, inputs.shape[1]).to(device), e)
    weight = model.head_weight.float()
    z_prev, ratios = model.coda(state).float() @ weight.T, []
    for _ in range(loops):
        new = model.core_step(state, e)
        z = model.coda(new).float() @ weight.T
        step = (new.float() - state.float()).norm(dim=-1)
        moved = step > 0
        ratios.append(((z - z_prev).abs().amax(-1)[moved] / step[moved]).cpu())
        state, z_prev = new, z
    r = torch.cat(ratios).double().numpy()
    if not len(r):
        raise ValueError("no state moved on these windows: there is no Lipschitz ratio to measure")
    return {"lipschitz": float(r.max()), "p99": float(np.quantile(r, 0.99)), "n_pairs": int(len(r)),
            "windows": int(len(inputs)), "loops": int(loops)}


LIPSCHITZ_WINDOWS = 4  # probe windows a checkpoint's L is measured on (a uniform run to the trace depth)


def measured_lipschitz(ckpt, loops: int, seed: int = 0, text=None) -> dict:
    """The checkpoint's L as the app, the report and the benches state it: readout_lipschitz on its
    first LIPSCHITZ_WINDOWS probe (training-side) windows, or, for a folder that ships none (Huginn,
    Ouro), on `text` (token ids, the text being analysed); "measured_on" says which. "lipschitz" is
    the largest ratio rounded up to 3 significant digits (a bound stays a bound; the policy built
    from it, and so every cache key, does not move with the last bits of a float sum), "measured"
    the ratio itself."""
    try:
        windows, where = ckpt.windows("probe")[:LIPSCHITZ_WINDOWS], "probe windows"
    except CheckpointError:
        if text is None:
            raise CheckpointError(f"{ckpt.path} ships no probe windows: give the text to measure L on") from None
        windows, where = np.asarray(text, dtype=np.int64), "the text"
    lip = readout_lipschitz(ckpt, windows, loops, seed)
    return {**lip, "lipschitz": _round_up(lip["lipschitz"]), "measured": lip["lipschitz"], "measured_on": where}


def _round_up(x: float, digits: int = 3) -> float:
    """x rounded up to `digits` significant digits."""
    if x <= 0 or not math.isfinite(x):
        return x
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return float(round(math.ceil(x / unit) * unit, 12))


class _PastTheExit(Policy):
    """The certified exit for every position before `last`; position `last` never halts (it runs on to
    the cap) while its loops are recorded: the certified exit's decision there, its state, argmax,
    margin and step size."""

    readout_fields = frozenset({"margin", "argmax"})
    remembers_loops = True

    def __init__(self, certified: CertifiedExit, last: int):
        super().__init__(min_loops=1, r_max=None)
        self.certified, self.last = certified.private(), last
        self.position, self.record = -1, []

    def private(self) -> Policy:
        """Itself: one wrapper serves one decoding run (it holds its own copy of the rule's memory)."""
        return self

    def halt(self, loop, signals):
        self.position += loop == 1
        stop = self.certified.halt(loop, signals)
        if self.position < self.last:
            return stop
        met = stop if self.certified.r_max is None or loop < self.certified.r_max else torch.zeros_like(stop)
        self.record.append({"met": met[:, -1].cpu(), "state": signals.state[:, -1].float().cpu(),
                            "argmax": signals.argmax[:, -1].cpu(), "margin": signals.margin[:, -1].cpu(),
                            "step": signals.state_step[:, -1].cpu()})
        return torch.zeros_like(stop)


def violations(ckpt, windows, lipschitz: float, r_max: int, deep: int, positions, seed: int = 0) -> dict:
    """The certified exit at `lipschitz` (capped at r_max) in real decoding, at the given positions of
    windows (N, T + 1), each run on to `deep` loops past its exit (see the module doc). Counts: tokens,
    certified (halted by the rule before r_max), violations (argmax at `deep` differs from the one at
    the exit); among the certified, those whose remaining motion stayed within the tail bound
    (`tail_held`), those whose margin over every rival stayed within 2 L ‖s_j − s_e‖ of the exit's
    (`lipschitz_held`), both (`assumptions_held`), and the violations where both held (0 by the bound)."""
    windows = torch.as_tensor(windows, dtype=torch.long)
    counts = dict.fromkeys(("tokens", "certified", "violations", "tail_held", "lipschitz_held", "assumptions_held",
                            "violations_where_held"), 0)
    for t in positions:
        policy = _PastTheExit(CertifiedExit(lipschitz, r_max=r_max), t)
        teacher_forced(ckpt, windows[:, :t + 2], policy, "recompute", seed=seed, max_loops=deep + 1, mode="decode",
                       batch_size=len(windows))  # the cap's own loop is not consulted: deep + 1 records 1..deep
        for key, value in _judge(policy.record, lipschitz).items():
            counts[key] += value
    return counts


def _judge(record: list[dict], lipschitz: float) -> dict:
    """Per-row verdicts from one position's recorded loops 1..deep (see `violations`)."""
    met = torch.stack([r["met"] for r in record])  # (L, B)
    argmax, margin, step = (torch.stack([r[k] for r in record]) for k in ("argmax", "margin", "step"))
    states = torch.stack([r["state"] for r in record])  # (L, B, d)
    out = dict.fromkeys(("certified", "violations", "tail_held", "lipschitz_held", "assumptions_held",
                         "violations_where_held"), 0)
    out["tokens"] = met.shape[1]
    for b in range(met.shape[1]):
        if not met[:, b].any():
            continue
        e = int(met[:, b].float().argmax())  # index of the exit loop (never loop 1: e >= 1)
        moved = (states[e:, b] - states[e, b]).norm(dim=-1)  # ‖s_j − s_e‖, j >= e
        tail_held = bool(moved.max() <= remaining_motion(step[e, b], step[e - 1, b]))
        same = argmax[e:, b] == argmax[e, b]
        # the exit's top-1 over its best rival at loop j: the margin where it is still top-1, else at most -margin
        gap = torch.where(same, margin[e:, b], -margin[e:, b])
        lipschitz_held = bool((gap >= margin[e, b] - 2 * lipschitz * moved).all())
        wrong = not bool(same.all())
        out["certified"] += 1
        out["violations"] += wrong
        out["tail_held"] += tail_held
        out["lipschitz_held"] += lipschitz_held
        out["assumptions_held"] += tail_held and lipschitz_held
        out["violations_where_held"] += wrong and tail_held and lipschitz_held
    return out
