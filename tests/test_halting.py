"""The halting contract (recur_core/exits/halting.py): the schedule's checks and cap, and the
freezing bookkeeping every halting run shares, on torch and numpy alike."""
import numpy as np
import pytest
import torch

from recur_core.exits.halting import Freezing, HaltSchedule
from recur_core.exits.policies import ArgmaxStable, ConvergenceExit, LatentDiff, Uniform
from recur_core.exits.signals import LoopSignals


def test_freezing_halts_met_live_tokens_and_every_live_token_at_the_cap():
    f = Freezing.start(4, "numpy")
    now = f.update(1, np.array([True, False, False, False]), at_cap=False)
    assert now.tolist() == [True, False, False, False]
    now = f.update(2, np.array([True, True, False, False]), at_cap=False)  # token 0 is frozen already
    assert now.tolist() == [False, True, False, False]
    now = f.update(3, np.array([False, False, True, False]), at_cap=True)
    assert now.tolist() == [False, False, True, True] and f.frozen.all()
    assert f.exit_depth.tolist() == [1, 2, 3, 3]
    assert f.converged.tolist() == [True, True, True, False]  # token 3: only the cap stopped it


def test_freezing_copy_never_sees_its_twins_later_loops():
    f = Freezing.start((1, 3), "cpu")
    twin = f.copy()
    twin.update(1, torch.tensor([[True, False, True]]), at_cap=False)
    assert not f.frozen.any() and (f.exit_depth == 0).all()
    assert twin.exit_depth.tolist() == [[1, 0, 1]] and twin.frozen.dtype == torch.bool


def signals_of(change):
    change = torch.tensor([change], dtype=torch.float32)
    return LoopSignals(state=torch.zeros(1, len(change[0]), 2), state_change=change)


def test_schedule_consults_from_min_loops_every_check_and_halts_all_at_the_cap():
    policy = LatentDiff(0.5, min_loops=2, r_max=6)
    sched = HaltSchedule(policy, max_loops=9, check_every=2)
    assert sched.cap == 6 and [sched.is_check(i) for i in range(1, 7)] == [False, True, False, True, False, True]
    small = signals_of([0.1, 0.9])
    assert sched.met(3, small).tolist() == [[False, False]]  # between checks: never
    assert sched.met(4, small).tolist() == [[True, False]]
    new = torch.ones(1, 2, 2)  # no change: the rule holds for both tokens
    assert sched.consult(4, new, new, None).all() and not sched.consult(5, new, new, None).any()
    assert not sched.consult(6, new, new, None).any()  # the decoders do not consult the cap's loop
    assert sched.halt(6, new, new, None).all() and sched.at_cap(6) and not sched.at_cap(5)


def test_readout_schedule_reads_out_before_its_first_check():
    sched = HaltSchedule(ConvergenceExit(1e-3), max_loops=8, check_every=3)  # FIRST_CHECK = 2
    assert sched.first_readout == 0 and [i for i in range(9) if sched.wants_readout(i)] == [0, 2, 5, 8]
    assert HaltSchedule(Uniform(4), max_loops=8).first_readout is None
    with pytest.raises(ValueError, match="check_every"):
        HaltSchedule(Uniform(4), max_loops=8, check_every=0)


def test_a_remembering_rule_checked_every_loop_is_asked_from_loop_1():
    """Its memory covers the loops before min_loops (as its fast face reads them), in every caller."""
    sched = HaltSchedule(ArgmaxStable(2, min_loops=3), max_loops=8)
    assert [sched.asks(i) for i in range(1, 5)] == [True] * 4 and sched.first_readout == 0
    assert [sched.is_check(i) for i in range(1, 5)] == [False, False, True, True]
    argmax = torch.tensor([[7]])
    said = [sched.met(i, LoopSignals(state=torch.zeros(1, 1, 2), state_change=torch.ones(1, 1), argmax=argmax))
            for i in range(1, 4)]
    assert [bool(x) for x in said] == [False, False, True]  # the argmax held since loop 1: a run of 2 at loop 3
    plain = HaltSchedule(LatentDiff(0.5, min_loops=3), max_loops=8)
    assert [plain.asks(i) for i in range(1, 5)] == [False, False, True, True]
    sparse = HaltSchedule(ArgmaxStable(2, min_loops=3), max_loops=8, check_every=2)  # a new run at every check
    assert [i for i in range(1, 9) if sparse.asks(i)] == [3, 5, 7] and sparse.first_readout == 1


class FirstKL(ConvergenceExit):
    """A1 at eps 0 (it never halts), first consulted at loop 1, recording loop 1's KLs (both directions)."""

    readout_fields = frozenset({"kl_prev", "kl_prev_reverse"})

    def __init__(self):
        super().__init__(0.0, min_loops=1)
        self.seen = []

    def _rule_online(self, loop, signals):
        if loop == 1:
            self.seen.append((signals.kl_prev.clone(), signals.kl_prev_reverse.clone()))
        return super()._rule_online(loop, signals)


def test_p0_and_the_first_kl_are_one_readout_in_tracer_harness_and_decoder(ckpt, monkeypatch):
    """p_0 is read in one place (`read_start`) by the tracer, the harness, the decoders' parallel
    prefill and the pool's prompt: the same hidden, and loop 1's kl_prev (both directions) alike in all."""
    import recur_core.decoding.decode as decode_module
    import recur_core.decoding.serve as serve_module
    import recur_core.exits.halting as halting
    from recur_core.analysis.harness import run_exact
    from recur_core.analysis.trace import trace
    from recur_core.decoding.teacher_forced import teacher_forced

    starts, read_start = [], halting.read_start

    def spy(*args, **kwargs):
        starts.append(read_start(*args, **kwargs))
        return starts[-1]
    monkeypatch.setattr(halting, "read_start", spy)
    monkeypatch.setattr(decode_module, "read_start", spy)
    monkeypatch.setattr(serve_module, "read_start", spy)
    windows = ckpt.windows("eval")[:2, :12]
    traced = trace(ckpt, windows, 3, seed=4, cache=False)
    harness, decoder, pool = FirstKL(), FirstKL(), FirstKL()
    run_exact(ckpt, windows, harness, 3, seed=4)
    teacher_forced(ckpt, windows, decoder, "recompute", seed=4, max_loops=3, mode="prefill", batch_size=2)
    serve_module.serve(ckpt, [serve_module.Request(windows[0, :-1].tolist(), 1, pool, seed=4)], max_loops=3)
    assert len(starts) == 4 and [h.shape for h in starts] == [(2, 11, ckpt.config.d_model)] * 3 + [(11, 1, ckpt.config.d_model)]
    assert torch.equal(starts[0], starts[1])  # tracer, harness: the same call on the same states
    torch.testing.assert_close(starts[2], starts[0], rtol=0, atol=1e-6)  # the decoder, through its cache views
    torch.testing.assert_close(starts[3][:, 0], starts[0][0], rtol=0, atol=1e-6)  # the pool: window 0's noise
    for at, kl in enumerate(("kl_prev", "kl_prev_reverse")):
        first = torch.from_numpy(getattr(traced, kl)[..., 0])
        assert torch.equal(harness.seen[0][at], first)
        torch.testing.assert_close(decoder.seen[0][at], first, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool.seen[0][at][:, 0], first[0], rtol=1e-5, atol=1e-6)
        assert (first > 0).all()
