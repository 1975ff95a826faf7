"""Readout statistics: the chunked backend and the dispatcher against the float32 reference.

Ground truth is readout_stats_reference (materialised float32 logits); cases follow the Cut Cross
Entropy tests: odd shapes, a vocabulary smaller than / not a multiple of the chunk, peaked and flat
distributions, ignored targets, batched input and low-precision inputs with looser tolerances.
"""
import math
import platform

import pytest
import torch
from readout_cases import assert_stats_close, make_inputs

from recur_core.exits.readout import (
    ReadoutStats,
    readout_stats,
    readout_stats_chunked,
    readout_stats_reference,
    readout_stats_sequence,
)
from recur_core.kernels.cpu_gemm import bf16_matmul_nt, can_multiply

# Logit scales: N(0, scale^2) logits. 40 makes one token dominate, 1e-3 is nearly uniform.
SCALES = {"peaked": 40.0, "normal": 1.0, "flat": 1e-3}


@pytest.mark.parametrize("T,d,V,chunk", [
    (37, 48, 1007, 256),   # V not a multiple of the chunk
    (1, 48, 100, 4096),    # one token, V smaller than one chunk
    (64, 32, 512, 128),    # V a multiple of the chunk
])
@pytest.mark.parametrize("kind", list(SCALES))
@pytest.mark.parametrize("with_prev", [False, True])
def test_chunked_matches_reference(T, d, V, chunk, kind, with_prev):
    h, W, targets, h_prev = make_inputs(T, d, V, SCALES[kind])
    h_prev = h_prev if with_prev else None
    expected = readout_stats_reference(h, W, targets, h_prev)
    actual = readout_stats_chunked(h, W, targets, h_prev, chunk=chunk)
    assert_stats_close(actual, expected)


def test_ignored_targets_give_nan_and_no_targets_give_none():
    h, W, targets, _ = make_inputs(10, 16, 50)
    stats = readout_stats_chunked(h, W, targets, chunk=16)
    assert torch.equal(stats.ce.isnan(), targets < 0)
    assert stats.kl_prev is None
    assert readout_stats_chunked(h, W, chunk=16).ce is None


@pytest.mark.parametrize("topk", [1, 5, 40])
def test_topk(topk):
    h, W, targets, h_prev = make_inputs(37, 48, 1007)
    expected = readout_stats_reference(h, W, targets, h_prev, topk=topk)
    actual = readout_stats_chunked(h, W, targets, h_prev, topk=topk, chunk=32)  # topk > chunk too
    assert actual.topk_ids.shape == (37, topk)
    assert_stats_close(actual, expected)
    torch.testing.assert_close(actual.topk_probs[:, 0], actual.top1_prob)


def test_topk_out_of_range():
    h, W, _, _ = make_inputs(3, 16, 20)
    with pytest.raises(ValueError):
        readout_stats_chunked(h, W, topk=21)


def test_batched_input_keeps_leading_shape():
    h, W, targets, h_prev = make_inputs(13, 32, 300, batch=3)
    actual = readout_stats_chunked(h, W, targets, h_prev, topk=3, chunk=64)
    assert actual.lse.shape == (3, 13) and actual.argmax.shape == (3, 13)
    assert actual.topk_ids.shape == (3, 13, 3)
    assert_stats_close(actual, readout_stats_reference(h, W, targets, h_prev, topk=3))
    flat = readout_stats_chunked(h.flatten(0, 1), W, targets.flatten(), h_prev.flatten(0, 1), chunk=64)
    torch.testing.assert_close(actual.kl_prev.flatten(), flat.kl_prev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    h, W, targets, h_prev = make_inputs(37, 48, 1007, dtype=dtype)
    expected = readout_stats_reference(h, W, targets, h_prev, topk=4)
    actual = readout_stats_chunked(h, W, targets, h_prev, topk=4, chunk=256)
    assert_stats_close(actual, expected, dtype)


def test_argmax_ties_pick_lowest_id():
    """Integer data gives exact, tied logits; ties span chunks, so merging must keep the first."""
    W = torch.zeros(300, 16)
    W[:, 0] = 1.0
    W[[7, 150, 299], 1] = 2.0  # the tied maxima, in three different chunks of 64
    h = torch.ones(4, 16)
    expected = readout_stats_reference(h, W)
    assert torch.equal(expected.argmax, torch.full((4,), 7))
    assert torch.equal(readout_stats_chunked(h, W, chunk=64).argmax, expected.argmax)


def test_limits():
    """Uniform logits: entropy log V, top-1 1/V; same h twice: KL 0; one dominant token: entropy 0."""
    V = 1000
    W = torch.nn.functional.normalize(torch.randn(V, 32), dim=1)  # h = 1000 W[i] peaks at id i
    h = torch.zeros(5, 32)
    stats = readout_stats_chunked(h, W, h_prev=h, chunk=128)
    torch.testing.assert_close(stats.entropy, torch.full((5,), math.log(V)))
    torch.testing.assert_close(stats.top1_prob, torch.full((5,), 1 / V))
    torch.testing.assert_close(stats.kl_prev, torch.zeros(5), atol=1e-6, rtol=0)
    peaked = readout_stats_chunked(1e3 * W[:5], W, chunk=128)
    assert torch.equal(peaked.argmax, torch.arange(5))
    torch.testing.assert_close(peaked.entropy, torch.zeros(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(peaked.top1_prob, torch.ones(5))


def test_kl_direction():
    """KL(p_cur || p_prev) = sum p_cur log(p_cur / p_prev), against explicit distributions."""
    h, W, _, h_prev = make_inputs(6, 16, 40)
    p, q = (torch.softmax(x @ W.T, -1) for x in (h, h_prev))
    torch.testing.assert_close(readout_stats_chunked(h, W, h_prev=h_prev, chunk=16).kl_prev,
                               (p * (p / q).log()).sum(-1))


def test_dispatcher(monkeypatch):
    h, W, targets, h_prev = make_inputs(9, 16, 70)
    expected = readout_stats_reference(h, W, targets, h_prev, topk=2)
    assert_stats_close(readout_stats(h, W, targets, h_prev, topk=2), expected)  # CPU: chunked
    assert_stats_close(readout_stats(h, W, targets, h_prev, topk=2, backend="reference"), expected)
    monkeypatch.setenv("RECUR_READOUT_BACKEND", "reference")
    assert_stats_close(readout_stats(h, W, targets, h_prev, topk=2), expected)
    with pytest.raises(ValueError):
        readout_stats(h, W, backend="nope")
    with pytest.raises(ValueError):
        readout_stats(h, W, topk=2, backend="triton")


def test_shape_checks():
    h, W, targets, h_prev = make_inputs(9, 16, 70)
    with pytest.raises(ValueError):
        readout_stats_chunked(h, W[:, :8])
    with pytest.raises(ValueError):
        readout_stats_chunked(h, W, h_prev=h_prev[:4])
    with pytest.raises(ValueError):
        readout_stats_chunked(h, W, targets[:4])


@pytest.mark.parametrize("kind", list(SCALES))
def test_reverse_kl_is_kl_with_the_roles_swapped(kind):
    """KL(p_prev || p_cur) of (h, h_prev) is KL(p_cur || p_prev) of (h_prev, h), and differs from it."""
    h, W, _, h_prev = make_inputs(29, 24, 301, SCALES[kind])
    forward = readout_stats_chunked(h, W, h_prev=h_prev, chunk=64)
    swapped = readout_stats_chunked(h_prev, W, h_prev=h, chunk=64)
    torch.testing.assert_close(forward.kl_prev_reverse, swapped.kl_prev, atol=1e-5, rtol=1e-4)
    if kind != "flat":
        assert not torch.allclose(forward.kl_prev_reverse, forward.kl_prev, atol=1e-3)


def test_reused_buffers_never_leak_into_earlier_results():
    """The chunked path reuses its thread's buffers: a later call (larger, then smaller) must not
    change what an earlier one returned, nor its own results."""
    small, large = make_inputs(9, 24, 300, seed=1), make_inputs(41, 24, 300, seed=2)
    first = readout_stats_chunked(*small, chunk=128)
    kept = {name: getattr(first, name).clone() for name in ("lse", "entropy", "kl_prev", "argmax")}
    assert_stats_close(readout_stats_chunked(*large, chunk=128), readout_stats_reference(*large))
    assert_stats_close(readout_stats_chunked(*small, chunk=128), readout_stats_reference(*small))
    for name, value in kept.items():
        assert torch.equal(getattr(first, name), value), name


def test_threads_use_their_own_buffers():
    from concurrent.futures import ThreadPoolExecutor
    cases = [make_inputs(33, 24, 500, seed=s) for s in range(6)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda c: readout_stats_chunked(*c, chunk=128), cases * 3))
    for case, stats in zip(cases * 3, got, strict=True):
        assert_stats_close(stats, readout_stats_reference(*case))


def test_buffers_made_in_inference_mode_are_not_reused_outside_it():
    case = make_inputs(5, 16, 64)
    with torch.inference_mode():
        readout_stats_chunked(*case)
    assert_stats_close(readout_stats_chunked(*case), readout_stats_reference(*case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [0, 3])
def test_a_sequence_equals_its_pairs(dtype, topk):
    """readout_stats_sequence over hiddens (h_0 .. h_3) = readout of h_j against h_{j-1} for each j,
    against the float32 reference; the batched leading shape is kept."""
    g = torch.Generator().manual_seed(5)
    W = (torch.randn(700, 32, generator=g) / math.sqrt(32)).to(dtype)
    hs = torch.randn(4, 2, 11, 32, generator=g).cumsum(0).to(dtype)  # consecutive "loops", drifting
    targets = torch.randint(0, 700, (2, 11), generator=g)
    targets[0, ::3] = -1
    got = readout_stats_sequence(hs, W, targets, topk=topk)
    assert got.lse.shape == (3, 2, 11)
    for j in range(1, 4):
        expected = readout_stats_reference(hs[j], W, targets, hs[j - 1], topk=topk)
        assert_stats_close(ReadoutStats(**{f: None if getattr(got, f) is None else getattr(got, f)[j - 1]
                                           for f in ReadoutStats.__dataclass_fields__}), expected, dtype)


def test_a_sequence_needs_two_hiddens():
    with pytest.raises(ValueError):
        readout_stats_sequence(torch.zeros(1, 3, 8), torch.zeros(10, 8))


def test_bfloat16_logits_on_the_cpu_are_float32_products():
    """The MKL product of bfloat16 operands equals float32 math on the upcast values (exact products,
    float32 sums); on x86 torch carries MKL, so the readout's bfloat16 path is that product."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g).bfloat16()
    W = torch.randn(1001, 300, generator=g).bfloat16()
    if platform.machine() in ("x86_64", "AMD64"):
        assert can_multiply(x, W)
    if not can_multiply(x, W):
        pytest.skip("no MKL in this torch build")
    out = torch.full((37, 400), math.nan)
    bf16_matmul_nt(x, W[500:900], out)  # a row slice of W, as the readout's chunks are
    torch.testing.assert_close(out, x.float() @ W[500:900].float().T, atol=1e-4, rtol=1e-5)
    assert not can_multiply(x.float(), W) and not can_multiply(x, W.T)
    assert not can_multiply(x[:1].expand(37, 300), W)  # overlapping rows (stride 0): not a cblas matrix
    with pytest.raises(ValueError):
        bf16_matmul_nt(x, W, torch.empty(37, 1001, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("topk", [0, 3])  # 0: the Triton kernel where triton is installed; 3: chunked
def test_a_sequence_on_cuda_equals_the_reference(topk):
    g = torch.Generator().manual_seed(7)
    W = (torch.randn(5000, 64, generator=g) / 8).bfloat16()
    hs = torch.randn(5, 40, 64, generator=g).cumsum(0).bfloat16()
    targets = torch.randint(-1, 5000, (40,), generator=g)
    got = readout_stats_sequence(hs.cuda(), W.cuda(), targets.cuda(), topk=topk)
    for j in range(1, 5):
        expected = readout_stats_reference(hs[j], W, targets, hs[j - 1], topk=topk)
        for name in ("lse", "ce", "entropy", "top1_prob", "kl_prev", "kl_prev_reverse"):
            torch.testing.assert_close(getattr(got, name)[j - 1].cpu(), getattr(expected, name), atol=2e-3, rtol=1e-4,
                                       equal_nan=True, msg=name)
        assert (got.argmax[j - 1].cpu() == expected.argmax).float().mean() > 0.97
