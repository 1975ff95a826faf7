"""The Triton readout kernel against the float32 reference.

The kernel runs under the Triton interpreter on CPU tensors (float32 / float16; the interpreter
simulates with numpy, so shapes stay small). TRITON_INTERPRET must be set before triton is
imported, hence the first lines. With CUDA, the compiled kernel is also checked, in a subprocess
without TRITON_INTERPRET.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from recur_core.kernels.readout_triton import readout_stats_triton  # noqa: E402
from recur_core.readout import readout_stats_reference  # noqa: E402
from readout_cases import assert_stats_close, make_inputs  # noqa: E402



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


CUDA_CHECK = """
import torch
from recur_core.readout import readout_stats, readout_stats_reference
g = torch.Generator(device="cuda").manual_seed(0)
for dtype, atol in [(torch.float32, 1e-3), (torch.bfloat16, 2e-3)]:
    for T, d, V in [(37, 48, 1007), (300, 576, 49152)]:
        W = (torch.randn(V, d, device="cuda", generator=g) / d ** 0.5).to(dtype)
        h = (3 * torch.randn(T, d, device="cuda", generator=g)).to(dtype)
        hp = (3 * torch.randn(T, d, device="cuda", generator=g)).to(dtype)
        tg = torch.randint(-1, V, (T,), device="cuda", generator=g)
        a = readout_stats(h, W, tg, hp, backend="triton")
        e = readout_stats_reference(h, W, tg, hp)
        for name in ("lse", "ce", "entropy", "top1_prob", "kl_prev", "kl_prev_reverse"):
            torch.testing.assert_close(getattr(a, name), getattr(e, name), atol=atol, rtol=1e-4,
                                       equal_nan=True, msg=name)
        assert (a.argmax == e.argmax).float().mean() > 0.99  # near-ties may round differently
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_on_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", CUDA_CHECK], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
