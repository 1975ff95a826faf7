"""The "continue" KV rule (a halted token's later entries are its state looping on: Ouro's
semantics, recur_core.decoding.kv.ContinueRule) in the serving pool, on the tiny checkpoint: each
sequence decodes to what batch-1 `generate` gives it alone, whatever the mix of policies (A1's
readouts among them), prompt chunks and rules sharing the pool. Ouro itself: tests/test_ouro.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_serve import CAP, alone, assert_same, mixed_policies, requests

from recur_core.decoding.serve import Pool


@pytest.fixture(scope="module")
def windows(ckpt):
    return ckpt.windows("eval")[:8]


def test_pool_equals_batch1_generate_under_continue(ckpt, windows):
    """8 requests (A0, A1, latent, A2; chunked and whole prompts), all but two under "continue", the
    others "latest" and "recompute" beside them, 3 slots: requests join and leave mid-run, prompts
    ride the shared step with their halted positions looping on."""
    reqs = [replace(r, kv_rule="continue") for r in requests(windows, mixed_policies(ckpt, windows))]
    reqs[2], reqs[5] = replace(reqs[2], kv_rule="latest"), replace(reqs[5], kv_rule="recompute")
    pool = Pool(ckpt, slots=3, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    done = pool.run()
    assert pool.mixed_steps > 0
    for rid, req in zip(ids, reqs, strict=True):
        assert done[rid].kv_rule == req.kv_rule
        assert_same(done[rid], alone(ckpt, req))
    assert len({x for rid in ids for x in done[rid].exit_loops + done[rid].prompt_exit_loops}) > 2
