"""The Triton readout kernel against the float32 reference: the interpreted cases
(tests/readout_triton_cases.py) in a subprocess under TRITON_INTERPRET=1, so that the interpreter
never leaks into the rest of the suite or its subprocesses; with CUDA, the compiled kernel too.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_cases_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "readout_triton_cases.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_the_suite_runs_without_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1 leaked into the test session"


CUDA_CHECK = """
import torch
from recur_core.exits.readout import readout_stats, readout_stats_reference
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
    run = subprocess.run([sys.executable, "-c", CUDA_CHECK], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
