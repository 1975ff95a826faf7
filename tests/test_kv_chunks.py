"""The pool's ragged attention (recur_core.decoding.kv.GatherKV, key_chunks): rows sorted by position and cut
into chunks give every row exactly the attention it would get alone, over its own slab up to its
own position (float64 per-row reference, odd shapes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recur_core.decoding import kv
from recur_core.decoding.kv import GatherKV, key_chunks

S, HKV, H, L, HD = 11, 2, 6, 23, 5  # slabs, kv heads, query heads (3 per kv head), context, head dim
BYTES_PER_KEY = 2 * HKV * HD * 4


def ragged_rows(n: int, seed: int):
    g = np.random.default_rng(seed)
    return g.integers(0, S, n), g.integers(0, L, n)


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("budget_keys", [1, 7, 100, 10_000])  # rows per chunk: 1, 1, 4, all
def test_chunks_cover_every_row_once_in_position_order_within_the_budget(monkeypatch, budget_keys):
    monkeypatch.setattr(kv, "CPU_CHUNK_BYTES", budget_keys * BYTES_PER_KEY)
    slabs, pos = ragged_rows(37, seed=budget_keys)
    plan = key_chunks(slabs, pos, BYTES_PER_KEY, "cpu")
    order = np.arange(37) if plan.order is None else plan.order.numpy()
    assert sorted(order.tolist()) == list(range(37))
    if plan.order is not None:
        assert np.all(np.diff(pos[order]) >= 0)
        assert plan.inverse.numpy()[order].tolist() == list(range(37))
    assert sum(plan.sizes) == 37
    at = 0
    for size, chunk_slabs, n_keys, mask in zip(plan.sizes, plan.slabs, plan.n_keys, plan.masks, strict=True):
        rows = order[at:at + size]
        assert chunk_slabs.tolist() == slabs[rows].tolist()
        assert n_keys == pos[rows].max() + 1
        assert size == 1 or size * (pos.max() + 1) <= budget_keys  # a lone row may exceed it
        expect = np.arange(n_keys)[None, :] <= pos[rows][:, None]
        if mask is None:
            assert expect.all()
        else:
            assert mask.shape == (size, 1, 1, n_keys) and mask[:, 0, 0].numpy().tolist() == expect.tolist()
        at += size
    assert (len(plan.sizes) == 1) == (budget_keys >= 37 * (pos.max() + 1))


def test_rows_at_one_position_need_no_mask():
    plan = key_chunks(np.array([3, 1, 4]), np.array([9, 9, 9]), BYTES_PER_KEY, "cpu")
    assert plan.order is None and plan.sizes == [3] and plan.n_keys == [10] and plan.masks == [None]


@pytest.mark.parametrize("budget_keys", [1, 100, 10_000])
def test_chunked_gathered_attention_equals_each_row_alone(monkeypatch, budget_keys):
    monkeypatch.setattr(kv, "CPU_CHUNK_BYTES", budget_keys * BYTES_PER_KEY)
    g = torch.Generator().manual_seed(budget_keys)
    k_cache, v_cache = torch.randn(S, HKV, L, HD, generator=g), torch.randn(S, HKV, L, HD, generator=g)
    slabs, pos = ragged_rows(13, seed=0)
    slabs[5], pos[5] = slabs[4], pos[4] + 1 if pos[4] + 1 < L else pos[4] - 1  # two rows of one slab
    q = torch.randn(13, H, 1, HD, generator=g)
    k_new, v_new = torch.randn(13, HKV, 1, HD, generator=g), torch.randn(13, HKV, 1, HD, generator=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for n in range(13):  # every row writes before any reads
        k_ref[slabs[n], :, pos[n]], v_ref[slabs[n], :, pos[n]] = k_new[n, :, 0], v_new[n, :, 0]

    plan = key_chunks(slabs, pos, BYTES_PER_KEY, "cpu")
    view = GatherKV(k_cache, v_cache, torch.from_numpy(slabs), torch.from_numpy(pos), plan)
    out = view.attention(q, k_new, v_new, sdpa)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    for n in range(13):
        keys = k_ref[slabs[n], :, :pos[n] + 1].double().repeat_interleave(H // HKV, 0)  # (H, keys, hd)
        values = v_ref[slabs[n], :, :pos[n] + 1].double().repeat_interleave(H // HKV, 0)
        weights = torch.softmax(q[n].double() @ keys.transpose(1, 2) / HD ** 0.5, dim=-1)
        torch.testing.assert_close(out[n].double(), weights @ values, atol=1e-6, rtol=0)
