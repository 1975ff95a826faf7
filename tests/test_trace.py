import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import recur_core.analysis.trace as trace_mod
from recur_core.analysis.cache import TraceCache, trace_key
from recur_core.analysis.trace import TRACE_FORMAT_VERSION, trace
from recur_core.exits.trace_type import NO_TARGET
from recur_core.settings import seed_for

LOOPS = 5


@pytest.fixture(scope="module")
def windows(ckpt):
    return ckpt.windows("eval")[:6]


@pytest.fixture(scope="module")
def tr(ckpt, windows):
    return trace(ckpt, windows, LOOPS, seed=3, cache=False)


def test_shapes_and_ranges(tr, windows):
    N, T = windows.shape[0], windows.shape[1] - 1
    assert tr.kl_prev.shape == tr.ce.shape == tr.argmax.shape == (N, T, LOOPS)
    assert tr.topk_ids.shape == (N, T, LOOPS, 5)
    np.testing.assert_array_equal(tr.ids, windows[:, :-1].numpy())
    np.testing.assert_array_equal(tr.targets, windows[:, 1:].numpy())
    for name in ("kl_prev", "state_change", "ce", "entropy", "top1_prob"):
        assert np.isfinite(getattr(tr, name)).all(), name  # loop 1 too: measured against the noise state
    assert (tr.kl_prev >= 0).all()
    assert (np.diff(tr.topk_probs, axis=-1) <= 0).all()
    np.testing.assert_array_equal(tr.topk_ids[..., 0], tr.argmax)
    np.testing.assert_allclose(tr.topk_probs[..., 0], tr.top1_prob, rtol=1e-5)


def test_ce_matches_the_model_forward(ckpt, windows, tr):
    """Window n's trace at loop r equals forward(window, r) from the noise of seed_for(seed, n)."""
    for n, r in [(0, 1), (2, 4)]:
        gen = torch.Generator().manual_seed(seed_for(3, n))
        with torch.no_grad():
            logits = ckpt.model(windows[n:n + 1, :-1], r, gen)[0]
        ce = F.cross_entropy(logits, windows[n, 1:], reduction="none").numpy()
        np.testing.assert_allclose(tr.ce[n, :, r - 1], ce, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(tr.argmax[n, :, r - 1], logits.argmax(-1).numpy())


def test_kl_prev_is_kl_of_current_against_previous(ckpt, windows, tr):
    gen = torch.Generator().manual_seed(seed_for(3, 1))
    with torch.no_grad():
        logp = [F.log_softmax(ckpt.model(windows[1:2, :-1], r, torch.Generator().set_state(gen.get_state()))[0], -1)
                for r in (2, 3)]
    kl = (logp[1].exp() * (logp[1] - logp[0])).sum(-1).clamp_min(0).numpy()  # KL(p_3 || p_2)
    np.testing.assert_allclose(tr.kl_prev[1, :, 2], kl, rtol=1e-3, atol=1e-6)


def test_deterministic_and_independent_of_batching(ckpt, windows, tr):
    again = trace(ckpt, windows, LOOPS, seed=3, cache=False, batch_size=4)
    part = trace(ckpt, windows[2:4], LOOPS, seed=3, cache=False)  # rows 0, 1 here: other noise
    for name in ("kl_prev", "ce", "state_change"):
        np.testing.assert_allclose(getattr(again, name), getattr(tr, name), rtol=1e-5, atol=1e-6)
    assert not np.allclose(part.state_change[:, :, 0], tr.state_change[2:4, :, 0])
    same = trace(ckpt, windows, LOOPS, seed=3, cache=False)
    for name in ("kl_prev", "ce", "state_change", "topk_ids"):
        np.testing.assert_array_equal(getattr(same, name), getattr(tr, name))
    other_seed = trace(ckpt, windows, LOOPS, seed=4, cache=False)
    assert not np.array_equal(other_seed.state_change, tr.state_change)


def test_pasted_text_has_no_target_for_its_last_token(ckpt, windows):
    text = windows[0, :12]
    t = trace(ckpt, text, 3, cache=False)
    assert t.ids.shape == (1, 12)
    assert t.targets[0, -1] == NO_TARGET and t.targets[0, 0] == text[1]
    assert np.isnan(t.ce[0, -1]).all() and np.isfinite(t.ce[0, :-1]).all()
    full = trace(ckpt, windows[:1, :13], 3, cache=False)  # the same tokens as window inputs
    np.testing.assert_allclose(t.ce[0, :-1], full.ce[0, :-1], rtol=1e-5, atol=1e-6)


def test_cache_hit_returns_identical_arrays(ckpt, windows, tmp_path, monkeypatch):
    store = TraceCache(tmp_path)
    first = trace(ckpt, windows[:3], LOOPS, seed=1, cache=store)
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and ckpt.checkpoint_id in str(files[0])
    monkeypatch.setattr(trace_mod, "_compute", _must_not_run)
    hit = trace(ckpt, windows[:3], LOOPS, seed=1, cache=store)
    for name, arr in first.arrays().items():
        np.testing.assert_array_equal(hit.arrays()[name], arr)
        assert hit.arrays()[name].dtype == arr.dtype
    assert (hit.max_loops, hit.seed, hit.checkpoint_id) == (LOOPS, 1, ckpt.checkpoint_id)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the cache should have answered")


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_cache_file_is_rebuilt(ckpt, windows, tmp_path, damage):
    store = TraceCache(tmp_path)
    first = trace(ckpt, windows[:2], 3, seed=1, cache=store)
    [path] = list(tmp_path.rglob("*.safetensors"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-40] ^= 0xFF  # inside the array bytes: only the digest notices
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="corrupt cache file"):
        rebuilt = trace(ckpt, windows[:2], 3, seed=1, cache=store)
    np.testing.assert_array_equal(rebuilt.kl_prev, first.kl_prev)
    np.testing.assert_array_equal(rebuilt.ce, first.ce)
    trace(ckpt, windows[:2], 3, seed=1, cache=store)  # the rewritten file is valid: no warning


def test_a_file_under_another_key_is_not_returned(ckpt, windows, tmp_path):
    store = TraceCache(tmp_path)
    trace(ckpt, windows[:2], 3, seed=1, cache=store)
    [path] = list(tmp_path.rglob("*.safetensors"))
    seed2_key = trace_key(ckpt.checkpoint_id, windows[:2].numpy(), 3, 2, 5, TRACE_FORMAT_VERSION)
    path.rename(store.trace_path(ckpt.checkpoint_id, seed2_key))  # the seed-1 trace under the seed-2 key
    with pytest.warns(UserWarning, match="corrupt cache file"):
        got = trace(ckpt, windows[:2], 3, seed=2, cache=store)
    np.testing.assert_array_equal(got.ce, trace(ckpt, windows[:2], 3, seed=2, cache=False).ce)


def test_export_one_row_per_token_and_loop(tr, tmp_path):
    N, T, L = tr.kl_prev.shape
    tr.to_parquet(tmp_path / "t.parquet")
    tr.to_csv(tmp_path / "t.csv")
    df = pd.read_parquet(tmp_path / "t.parquet")
    assert len(df) == N * T * L
    assert {"window", "position", "loop", "token_id", "target", "kl_prev", "state_change", "ce", "entropy",
            "argmax", "top1_prob", "top1_id", "top5_prob"} <= set(df.columns)
    row = df[(df.window == 1) & (df.position == 3) & (df.loop == 2)].iloc[0]
    assert row.kl_prev == pytest.approx(tr.kl_prev[1, 3, 1])
    assert row.top2_id == tr.topk_ids[1, 3, 1, 1]
    assert len(pd.read_csv(tmp_path / "t.csv")) == N * T * L



def test_a_progress_callback_hears_the_start_at_once(ckpt, windows, tr):
    """(0, total) before the first batch ends, so the app draws its bar at once; (total, total) last."""
    seen = []
    trace(ckpt, windows, tr.max_loops, tr.seed, cache=False, progress=lambda done, total: seen.append((done, total)))
    total = len(windows) * tr.max_loops
    assert seen[0] == (0, total) and seen[-1] == (total, total)


def test_loops_read_out_in_groups_equal_loops_read_out_alone(ckpt, windows, tr, monkeypatch):
    """The readout takes several loops' states per call (READOUT_ROWS); one loop per call, or all
    of them in one, gives the same trace up to float rounding."""
    import recur_core.exits.readout as readout_mod
    assert readout_mod.readout_group(16 * 128) == 1 and readout_mod.readout_group(32) == 16
    for rows in (1, 10 ** 6):
        monkeypatch.setattr(readout_mod, "READOUT_ROWS", rows)
        other = trace(ckpt, windows, LOOPS, seed=3, cache=False)
        for name in ("kl_prev", "kl_prev_reverse", "ce", "entropy", "top1_prob", "topk_probs"):
            np.testing.assert_allclose(getattr(other, name), getattr(tr, name), rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(other.topk_ids, tr.topk_ids)


def test_bfloat16_trace_reads_out_like_the_float32_reference(ckpt, windows, monkeypatch):
    """A bfloat16 model's readout (MKL's bfloat16 products into float32 on x86) equals the upcast
    float32 path on the same hidden states to float32 rounding, and the whole trace stays within
    bfloat16's tolerance of the float32 model's."""
    import copy

    import recur_core.exits.readout as readout_mod
    bf16 = copy.deepcopy(ckpt.model).to(torch.bfloat16)
    ids = windows[:3]
    fast = trace(bf16, ids, LOOPS, seed=3, cache=False)
    monkeypatch.setattr(readout_mod, "can_multiply", lambda x, w: False)
    upcast = trace(bf16, ids, LOOPS, seed=3, cache=False)
    for name in ("kl_prev", "kl_prev_reverse", "ce", "entropy", "top1_prob"):
        np.testing.assert_allclose(getattr(fast, name), getattr(upcast, name), rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(fast.argmax, upcast.argmax)
    fp32 = trace(copy.deepcopy(bf16).float(), ids, LOOPS, seed=3, cache=False)
    np.testing.assert_allclose(fast.ce, fp32.ce, rtol=0.05, atol=0.05)
    assert (fast.argmax == fp32.argmax).mean() > 0.9
