"""Shared cases for the readout tests: random inputs and a per-dtype comparison to the reference."""
import math

import torch

from recur_core.exits.readout import ReadoutStats

# (atol, rtol) per input dtype; the chunked path upcasts W chunks, so bf16 differs from the
# reference (which upcasts too) only by summation order.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-3, 1e-4), torch.float16: (1e-3, 1e-4)}
FLOAT_FIELDS = ("lse", "ce", "entropy", "top1_prob", "kl_prev", "kl_prev_reverse", "topk_probs")


def make_inputs(T, d, V, scale=1.0, dtype=torch.float32, batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if batch is None else (batch, T)
    W = torch.randn(V, d, generator=g) / math.sqrt(d)
    h = scale * torch.randn(*lead, d, generator=g)
    h_prev = h + scale * 0.5 * torch.randn(*lead, d, generator=g)
    targets = torch.randint(0, V, lead, generator=g)
    targets.view(-1)[::5] = -1  # ignored positions
    return h.to(dtype), W.to(dtype), targets, h_prev.to(dtype)


def assert_stats_close(actual: ReadoutStats, expected: ReadoutStats, dtype=torch.float32):
    atol, rtol = TOL[dtype]
    for name in FLOAT_FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        assert (a is None) == (e is None), name
        if e is not None:
            assert a.dtype == torch.float32 and a.shape == e.shape, name
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True, msg=name)
    assert actual.argmax.dtype == torch.int64
    assert torch.equal(actual.argmax, expected.argmax)
    if expected.topk_ids is not None:
        assert torch.equal(actual.topk_ids, expected.topk_ids)
