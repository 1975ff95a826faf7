"""Cases of the Triton readout kernel against the float32 reference, under the Triton interpreter
on CPU tensors (float32 / float16; the interpreter simulates with numpy, so shapes stay small).

Not collected by the suite directly: Triton decides at import whether kernels are interpreted, for
the whole process, so tests/test_readout_triton.py runs this file in a subprocess with
TRITON_INTERPRET=1, and the rest of the suite keeps the compiled kernels and a clean environment.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_readout_triton.py under TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from readout_cases import assert_stats_close, make_inputs  # noqa: E402

from recur_core.exits.readout import (
    readout_stats_reference,  # noqa: E402
    readout_stats_triton,  # noqa: E402
)


@pytest.mark.parametrize("T,d,V,splits", [
    (37, 48, 1007, None),  # partial token block, d looped with a mask, partial last vocab tile
    (37, 48, 1007, 3),     # vocabulary splits merged by combine_partials
    (1, 16, 100, None),    # one token, V smaller than one tile
])
@pytest.mark.parametrize("scale", [40.0, 1.0, 1e-3])  # peaked, normal, flat
@pytest.mark.parametrize("with_prev", [False, True])
def test_kernel_matches_reference(T, d, V, splits, scale, with_prev):
    h, W, targets, h_prev = make_inputs(T, d, V, scale)
    h_prev = h_prev if with_prev else None
    expected = readout_stats_reference(h, W, targets, h_prev)
    assert_stats_close(readout_stats_triton(h, W, targets, h_prev, splits=splits), expected)


def test_no_targets_and_batched_input():
    h, W, targets, h_prev = make_inputs(7, 32, 300, batch=2)
    actual = readout_stats_triton(h, W, h_prev=h_prev, blocks=(16, 64, 16))
    assert actual.ce is None and actual.lse.shape == (2, 7)
    assert_stats_close(actual, readout_stats_reference(h, W, h_prev=h_prev))


def test_float16_inputs():
    h, W, targets, h_prev = make_inputs(20, 64, 500, dtype=torch.float16)
    expected = readout_stats_reference(h, W, targets, h_prev)
    assert_stats_close(readout_stats_triton(h, W, targets, h_prev), expected, torch.float16)


def test_argmax_ties_pick_lowest_id():
    W = torch.zeros(300, 16)
    W[:, 0] = 1.0
    W[[7, 150, 299], 1] = 2.0  # tied maxima in different tiles and splits
    h = torch.ones(4, 16)
    stats = readout_stats_triton(h, W, splits=3, blocks=(16, 32, 16))
    assert torch.equal(stats.argmax, torch.full((4,), 7))
