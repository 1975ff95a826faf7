"""Depth-wise batched decoding (recur_core.decoding.serve) on the tiny checkpoint: every sequence of the pool
decodes to what batch-1 `generate` gives it alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from recur_core import load_checkpoint
from recur_core.analysis.probe import Probe
from recur_core.decoding import kv
from recur_core.decoding.decode import full_depth_logits, generate
from recur_core.decoding.kv import KV_RULES
from recur_core.decoding.serve import Pool, Request, serve
from recur_core.exits.policies import ArgmaxStable, ConvergenceExit, EntropyDiff, LatentDiff, LinearRouter, Uniform

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5  # float32: the pool's batched matmuls and masked, gathered attention vs batch 1
CAP = 6


@pytest.fixture(scope="module")
def windows(ckpt):
    return ckpt.windows("eval")[:8]


def random_probe(d_model: int, seed: int = 0) -> Probe:
    """A2's router with seeded random weights: a real Probe whose chances spread around 0.5."""
    g = torch.Generator().manual_seed(seed)
    return Probe(torch.randn(d_model + 1, generator=g), 0.0, torch.zeros(d_model + 1), torch.ones(d_model + 1),
                 "kl", 1e-3)


def mixed_policies(ckpt, windows):
    """A0, A1, the latent rule and A2 with thresholds at which the tiny model's exits are mixed."""
    prompt = windows[0, :12]
    lat = [generate(ckpt, prompt, 12, LatentDiff(d, r_max=CAP), greedy=True).decode_exit_loops
           for d in (0.5, 0.3, 0.2, 0.1, 0.05)]
    delta = [0.5, 0.3, 0.2, 0.1, 0.05][max(range(5), key=lambda i: len(set(lat[i])))]
    a1 = [generate(ckpt, prompt, 12, ConvergenceExit(e, r_max=CAP), greedy=True).decode_exit_loops
          for e in (1e-1, 3e-2, 1e-2, 3e-3, 1e-3)]
    eps = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3][max(range(5), key=lambda i: len(set(a1[i])))]
    return [Uniform(3), ConvergenceExit(eps, r_max=CAP), LatentDiff(delta, r_max=CAP),
            LinearRouter(random_probe(ckpt.config.d_model), 0.5, r_max=CAP)]


def requests(windows, policies, n=8):
    """n requests of different prompt lengths, lengths of output, policies, KV rules, sampling and
    prefill chunks (A1 among the chunked: its chunks read earlier chunks' exit readouts)."""
    out = []
    for i in range(n):
        out.append(Request(windows[i, :4 + 2 * i].tolist(), 5 + 3 * (i % 3), policies[i % len(policies)],
                           kv_rule=list(KV_RULES)[(i // len(policies)) % 2], seed=i, greedy=i % 3 != 2,
                           temperature=0.9, top_k=40, prefill_chunk=(None, 3, 5)[(i // 2) % 3]))
    return out


def alone(ckpt, req: Request):
    return generate(ckpt, req.prompt, req.max_new_tokens, req.policy, kv_rule=req.kv_rule, seed=req.seed,
                    greedy=req.greedy, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                    max_loops=CAP, prefill_chunk=req.prefill_chunk)


def assert_same(completion, gen):
    assert completion.error is None
    assert completion.ids == gen.ids
    assert completion.exit_loops == gen.exit_loops
    assert completion.prompt_exit_loops == gen.prompt_exit_loops
    torch.testing.assert_close(completion.logits, gen.logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk_keys", [None, 48], ids=["cache-sized chunks", "a few rows per chunk"])
def test_pool_equals_batch1_generate_per_sequence(ckpt, windows, monkeypatch, chunk_keys):
    """Mixed policies (A0, A1, latent, A2), both KV rules, greedy and sampled; 3 slots for 8
    requests of different lengths, so requests join and leave mid-run, and one more is submitted
    while the pool is running. The rows' attention runs in chunks of rows sorted by position (on
    the tiny model the default budget holds a whole step; 48 key positions' bytes, 1-4 rows)."""
    if chunk_keys:
        cfg = ckpt.config
        monkeypatch.setattr(kv, "CPU_CHUNK_BYTES", chunk_keys * 2 * cfg.n_kv_heads * cfg.head_dim * 4)
    reqs = requests(windows, mixed_policies(ckpt, windows))
    pool = Pool(ckpt, slots=3, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    done = {}
    for _ in range(5):
        done.update({c.request_id: c for c in pool.step()})
    late = Request(windows[7, :9].tolist(), 7, reqs[1].policy, kv_rule="recompute", seed=42, greedy=True)
    ids.append(pool.submit(late))
    reqs.append(late)
    done.update(pool.run())
    assert pool.mixed_steps > 0  # some core steps batched tokens at different loops
    for rid, req in zip(ids, reqs, strict=True):
        assert_same(done[rid], alone(ckpt, req))
    exits = {x for rid in ids for x in done[rid].decode_exit_loops}
    assert len(exits) > 2  # the exits really were mixed
    for rid in ids:  # no sequence waits a step: each new token takes exactly its exit loop's steps
        c = done[rid]
        assert [b - a for a, b in pairwise(c.token_steps)] == c.decode_exit_loops


@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_uniform_depth_in_the_pool_equals_the_full_forward(ckpt, windows, kv_rule):
    reqs = [Request(windows[i, :3 + 5 * i].tolist(), 6 + i, Uniform(4), kv_rule=kv_rule, seed=i, greedy=True)
            for i in range(4)]
    for req, c in zip(reqs, serve(ckpt, reqs, slots=2, max_loops=CAP), strict=True):
        assert set(c.exit_loops) == {4}
        seq = c.prompt_ids + c.ids[:-1]
        ref = full_depth_logits(ckpt, seq, 4, seed=req.seed)[len(c.prompt_ids) - 1:]
        torch.testing.assert_close(c.logits, ref, atol=TOL, rtol=0)
        assert c.ids == [int(r.argmax()) for r in ref]


def test_a_joining_prompt_loops_inside_the_shared_core_step(ckpt, windows):
    """A prompt's positions are rows of the pool's one core call per step: while a late request
    prefills (4 loops), the running sequence keeps emitting tokens; both still equal batch 1."""
    reqs = [Request(windows[0, :4].tolist(), 12, Uniform(2), greedy=True),
            Request(windows[1, :20].tolist(), 3, Uniform(4), kv_rule="recompute", greedy=True)]
    pool = Pool(ckpt, slots=2, max_loops=CAP)
    first = pool.submit(reqs[0])
    for _ in range(3):
        pool.step()
    late = pool.submit(reqs[1])
    done = pool.run()
    a, b = done[first], done[late]
    assert [t for t in a.token_s if b.admitted_s < t < b.token_s[0]]  # a emitted while b's prompt looped
    assert pool.calls["core"] == pool.steps
    for c, req in zip((a, b), reqs, strict=True):
        assert_same(c, alone(ckpt, req))


@pytest.mark.parametrize("policy", ["A2", "latent"])
def test_one_policy_call_decides_tokens_at_different_loops(ckpt, windows, policy):
    """Sequences sharing a policy that takes per-token loops are decided by one call per step
    whatever their loops (A2's probe reads the loop index); each still equals batch 1."""
    shared = (LinearRouter(random_probe(ckpt.config.d_model, seed=3), 0.5, r_max=CAP) if policy == "A2"
              else LatentDiff(0.2, r_max=CAP))
    reqs = [Request(windows[i, :3 + 4 * i].tolist(), 10, shared, kv_rule=list(KV_RULES)[i % 2], seed=i,
                    greedy=True) for i in range(5)]
    pool = Pool(ckpt, slots=5, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    calls = []
    halt = shared.halt
    shared.halt = lambda loop, signals: calls.append(loop) or halt(loop, signals)
    done = pool.run()
    assert len(calls) == pool.steps  # one call per step
    assert any(len(set(loops.flatten().tolist())) > 1 for loops in calls)  # tokens at different loops
    for rid, req in zip(ids, reqs, strict=True):
        assert_same(done[rid], alone(ckpt, req))


@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_halted_prompt_positions_leave_the_core_step_under_latest(ckpt, windows, kv_rule):
    """Under "latest" a prompt position that halted is not stepped again (its entries are copied
    forward): it runs exactly its exit loops. Under "recompute" its entries of later loops come
    from stepping its frozen state, so it rides along to its chunk's deepest exit. The pool's core
    rows are exactly these plus the decoded tokens' loops."""
    reqs = [Request(windows[i, :6 + 5 * i].tolist(), 6, LatentDiff(0.2, r_max=CAP), kv_rule=kv_rule, seed=i,
                    greedy=True, prefill_chunk=(None, 7)[i % 2]) for i in range(4)]
    pool = Pool(ckpt, slots=4, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    done = pool.run()
    assert any(len(set(done[rid].prompt_exit_loops)) > 1 for rid in ids)
    for rid, req in zip(ids, reqs, strict=True):
        c, chunk = done[rid], req.prefill_chunk or len(req.prompt)
        deepest = [max(c.prompt_exit_loops[a:a + chunk]) for a in range(0, len(req.prompt), chunk)]
        riders = [deepest[t // chunk] for t in range(len(req.prompt))]
        assert c.prompt_row_loops == (c.prompt_exit_loops if kv_rule == "latest" else riders)
        assert_same(c, alone(ckpt, req))
    assert pool.call_rows["core"] == sum(sum(done[r].prompt_row_loops) + sum(done[r].decode_exit_loops) for r in ids)


def test_sequences_sharing_a_remembering_policy_keep_their_own_memory(ckpt, windows):
    """One EntropyDiff object (its rule compares each loop with the previous one) for three requests:
    in the pool their tokens sit at different loops, and each still decodes as it does alone."""
    for policy in (EntropyDiff(1e-2, r_max=CAP), ArgmaxStable(2, r_max=CAP)):
        reqs = [Request(windows[i, :3 + 4 * i].tolist(), 6 + 2 * i, policy, seed=i, greedy=True) for i in range(3)]
        for req, c in zip(reqs, serve(ckpt, reqs, slots=3, max_loops=CAP), strict=True):
            assert_same(c, alone(ckpt, req))


def test_bad_requests_get_clear_errors_and_leave_the_others_alone(ckpt, windows):
    max_len = ckpt.config.max_seq_len
    good = [Request(windows[i, :6].tolist(), 8, LatentDiff(0.2, r_max=CAP), seed=i, greedy=True) for i in range(3)]
    pool = Pool(ckpt, slots=2, max_loops=CAP)
    ids = [pool.submit(r) for r in good[:2]]
    pool.step()
    pool.step()
    with pytest.raises(ValueError, match="empty prompt"):
        pool.submit(Request([], 4))
    with pytest.raises(ValueError, match="exceed the context"):
        pool.submit(Request([1] * max_len, 2))
    with pytest.raises(ValueError, match="exceed the context"):
        pool.submit(Request([1] * 10, max_len))
    with pytest.raises(ValueError, match="kv_rule"):
        pool.submit(Request([1, 2], 2, kv_rule="oldest"))
    with pytest.raises(ValueError, match="min_loops"):
        pool.submit(Request([1, 2], 2, Uniform(CAP + 1)))
    with pytest.raises(ValueError, match="prefill_chunk"):
        pool.submit(Request([1, 2], 2, prefill_chunk=0))
    ids.append(pool.submit(good[2]))
    done = pool.run()
    for rid, req in zip(ids, good, strict=True):
        assert_same(done[rid], alone(ckpt, req))
    # serve(): a refused request gets its error, the rest run
    out = serve(ckpt, [good[0], Request("", 3), good[1]], slots=2, max_loops=CAP, tokenizer=ckpt.tokenizer())
    assert out[1].error and "empty prompt" in out[1].error and not out[1].ids
    assert_same(out[0], alone(ckpt, good[0]))
    assert_same(out[2], alone(ckpt, good[1]))


def test_latencies_and_readouts_are_recorded(ckpt, windows):
    c = serve(ckpt, [Request(windows[0, :5].tolist(), 6, ConvergenceExit(0.0, r_max=3), greedy=True)],
              slots=1, max_loops=CAP)[0]
    assert len(c.latencies_s) == 6 and all(t >= 0 for t in c.latencies_s)
    # loops 1..3, as generate counts them: A1 first checks at loop 2 (KL against loop 1), so the
    # noise state (loop 0) is never read out
    assert c.step_readouts == [3] * 5


def test_batched_calls_are_counted(ckpt, windows):
    """Two 5-token prompts at uniform depth 3 in lockstep. Both prompts join in one prelude call;
    then their 10 positions share three core calls and one readout call (the first new tokens);
    each of the 3 later tokens is one prelude row, three core rows and one readout row, and the two
    sequences share every call."""
    run = serve(ckpt, [Request(windows[n, :5].tolist(), 4, Uniform(3), greedy=True) for n in range(2)],
                slots=2, max_loops=CAP)
    assert run.calls == {"prelude": 1 + 3, "core": 3 + 9, "readout": 1 + 3}
    assert run.call_rows == {"prelude": 10 + 6, "core": 30 + 18, "readout": 10 + 6}
    assert set(run.call_s) == set(run.calls) and all(t > 0 for t in run.call_s.values())
    assert run.model_s < run.wall_s  # the calls are timed inside the run, the scheduler's time besides


@pytest.mark.parametrize("readers", ["first", "last"])
def test_a_step_makes_one_call_of_each_kind_whatever_its_mix_of_rows(ckpt, windows, monkeypatch, readers):
    """Mixed policies (A0, A1, latent, A2), chunked prompts and requests joining while others decode:
    every step makes one core call, at most one prelude call (joining prompts and entering tokens
    together) and at most one readout call (A1's checks and the other policies' halted tokens
    together; A1's first check is at loop 2, so no noise state is read before the core); the
    sequences still equal batch 1. The step's order of policies is forced both ways: a latent-rule
    prompt under "latest" sheds its halted rows before or after A1's rows are decided."""
    key = Pool._halt_group
    monkeypatch.setattr(Pool, "_halt_group",
                        staticmethod(lambda s: (s.schedule.needs_readout == (readers == "last"), *key(s))))
    reqs = requests(windows, mixed_policies(ckpt, windows))
    pool = Pool(ckpt, slots=4, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    done, per_step = {}, []
    while not pool.idle:
        before = dict(pool.calls)
        done.update({c.request_id: c for c in pool.step()})
        per_step.append({k: pool.calls[k] - before[k] for k in before})
    assert all(d["core"] == 1 and d["prelude"] <= 1 and d["readout"] <= 1 for d in per_step)
    assert sum(d["readout"] for d in per_step) < sum(done[i].prefill_readouts + sum(done[i].step_readouts)
                                                     for i in ids)  # calls were shared across policies
    for rid, req in zip(ids, reqs, strict=True):
        assert_same(done[rid], alone(ckpt, req))


def test_a_prompt_shedding_rows_beside_a_reading_policy(ckpt, windows, monkeypatch):
    """A latent-rule prompt under "latest" sheds its halted positions, and gets them back for its
    readout when the last one halts, in the steps where an A1 sequence's rows, decided after the
    readout, come after it: A1 still decides on its own rows and both equal batch 1."""
    key = Pool._halt_group
    monkeypatch.setattr(Pool, "_halt_group", staticmethod(lambda s: (s.schedule.needs_readout, *key(s))))
    reqs = [Request(windows[0, :4].tolist(), 20, ConvergenceExit(1e-2, r_max=CAP), greedy=True),
            Request(windows[2, :24].tolist(), 4, LatentDiff(0.02, r_max=CAP), kv_rule="latest", greedy=True)]
    done = serve(ckpt, reqs, slots=2, max_loops=CAP)
    assert len(set(done[1].prompt_exit_loops)) > 1  # the prompt's positions halted at different loops
    for c, req in zip(done, reqs, strict=True):
        assert_same(c, alone(ckpt, req))


def test_a_chunked_prompt_puts_at_most_a_chunk_of_rows_in_a_step(ckpt, windows):
    """A 10-token prompt in chunks of 3 at uniform depth 2: chunks 3, 3, 3, 1 loop one after the
    other (2 core calls each, then one readout each); then the 2 later tokens, one row each."""
    run = serve(ckpt, [Request(windows[0, :10].tolist(), 3, Uniform(2), greedy=True, prefill_chunk=3)],
                slots=1, max_loops=CAP)
    assert run.calls == {"prelude": 1 + 2, "core": 4 * 2 + 2 * 2, "readout": 4 + 2}
    assert run.call_rows == {"prelude": 10 + 2, "core": 2 * 10 + 2 * 2, "readout": 10 + 2}
    assert run[0].prompt_exit_loops == [2] * 10


def test_bench_serve_runs_on_tiny(tiny_ckpt, tmp_path):
    env = {**os.environ, "RECUR_CACHE_DIR": str(tmp_path / "cache")}
    bench = [sys.executable, "-m", "bench.bench_serve", "--ckpt", str(tiny_ckpt), "--quick",
             "--calibration", str(tmp_path / "calibration.json")]
    out = subprocess.run(bench, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("pool", "realized_speedup_vs_a0_rbar", "realized_speedup_vs_best_uniform", "flop_proxy_speedup",
                "fraction_of_bound", "best_uniform_depth", "pools"):
        assert key in result, key
    for row in result["pools"].values():
        for figure in ("tokens_per_s", "flop_proxy_speedup", "fraction_of_bound", "latency_p50_ms",
                       "latency_p95_ms", "realized_speedup_vs_a0_rbar", "realized_speedup_vs_best_uniform",
                       "sequence_slowdown_p50", "sequence_slowdown_p95", "sequence_slowdown_max",
                       "model_call_speedup", "model_call_fraction_of_bound", "scheduler_share",
                       "realized_speedup_vs_a0_rbar_paired", "fraction_of_bound_paired",
                       "realized_speedup_vs_best_uniform_paired"):
            assert all(figure in r for r in row.values()), figure
        a0 = next(iter(row.values()))  # A0@r_bar against itself
        assert a0["model_call_speedup"] == a0["realized_speedup_vs_a0_rbar"] == a0["fraction_of_bound_paired"] == 1.0
        assert all(0 < r["scheduler_share"] < 1 for r in row.values())
    assert all(r["sequence_slowdown_max"] == 1.0 for r in result["pools"]["1"].values())  # pool 1 over itself
    assert result["calibration_metric"] == "loss" and result["sequence_slowdown_p95"] > 0
    for figure in ("tok/s", "FLOP-proxy", "realized", "p50", "p95", "best uniform", "run 2 of 2",
                   "batched calls per new token", "ms per batched call", "the same request at pool 1",
                   "where the time goes", "paired over repetitions"):
        assert figure in out.stdout, figure
    assert result["repeats"] == 2
    step = subprocess.run([sys.executable, "-m", "bench.bench_pool_step", "--ckpt", str(tiny_ckpt), "--calibration",
                           str(tmp_path / "calibration.json"), "--requests", "6", "--new-tokens", "8", "--prompt-len",
                           "8", "--pool", "3", "--repeats", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)
    assert step.returncode == 0, step.stderr[-3000:]
    mixed = json.loads(step.stdout.strip().splitlines()[-1])
    assert set(mixed["runs"]) == {*mixed["singles"], "mixed"} and mixed["step_cost_ratio"] > 0
    assert all(r["calls_per_step"]["readout"] <= 1 and r["calls_per_step"]["core"] == 1 for r in mixed["runs"].values())
    saved = json.loads((tmp_path / "calibration.json").read_text())  # the search, written for later runs
    cap = result["loop_cap"]
    assert saved["checkpoint"] == load_checkpoint(tiny_ckpt).checkpoint_id and saved["loop_cap"] == cap
    (tmp_path / "calibration.json").write_text(json.dumps({**saved, "loop_cap": cap + 1}))
    refused = subprocess.run(bench, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert refused.returncode != 0 and f"at loop cap {cap + 1}, not" in refused.stderr
    for table in ("call_ms", "call_ms_cold"):
        assert set(result[table]["1"]) == {"prelude", "core", "readout"}
        assert all(ms > 0 for row in result[table].values() for ms in row.values())


def test_generate_page_pool_mode(tiny_ckpt):
    import re

    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(str(ROOT / "pages" / "generate.py"), default_timeout=120)
    at.session_state["checkpoint_path"] = str(tiny_ckpt)
    at.run()
    at.toggle[0].set_value(True).run()
    at.text_area[0].input("Lily saw a\nTom had\nBen found a red")
    next(s for s in at.slider if s.label == "Loop cap").set_value(3)
    next(s for s in at.slider if s.label == "New tokens").set_value(5)
    next(s for s in at.slider if s.label.startswith("Pool size")).set_value(2)
    at.button[0].click().run()
    assert not at.exception
    strips = [str(h.proto) for h in at.get("html") if "token-strip" in str(h.proto)]
    assert len(strips) == 3
    for s in strips:
        depths = [int(d) for d in re.findall(r'data-depth=\\"(\d+)\\"', s)]
        assert len(depths) == 5 and all(1 <= d <= 3 for d in depths)
    labels = [x.label for x in at.metric]
    assert any("pool of 2" in label and "tokens/s" in label for label in labels)
    assert any(label.startswith("Uniform") and "same pool" in label for label in labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_on_cuda_equals_batch1_generate_on_cuda(tiny_ckpt, ckpt, windows):
    """The pool on a GPU (one key chunk per step, timed calls synchronised, sampling on the host's
    seeded generators): every sequence equals `generate` on the same GPU."""
    cuda = load_checkpoint(tiny_ckpt, device="cuda")
    reqs = requests(windows, mixed_policies(ckpt, windows), n=6)
    pool = Pool(cuda, slots=3, max_loops=CAP)
    ids = [pool.submit(r) for r in reqs]
    done = pool.run()
    for rid, req in zip(ids, reqs, strict=True):
        c, gen = done[rid], alone(cuda, req)
        assert (c.ids, c.exit_loops, c.prompt_exit_loops) == (gen.ids, gen.exit_loops, gen.prompt_exit_loops)
        torch.testing.assert_close(c.logits.cpu(), gen.logits.cpu(), atol=TOL, rtol=0)
    assert pool.call_s["core"] > 0


def test_pool_on_a_huginn_format_model():
    """The pool runs the model's own blocks, so Huginn's variants (interleaved RoPE at per-row
    positions, q/k biases, sandwich prelude / coda, embedding scale) decode as generate does."""
    from recur_core import load_checkpoint
    huginn = load_checkpoint(ROOT / "tests" / "fixtures" / "huginn_tiny")
    reqs = [Request(list(range(3 + 2 * i, 9 + 3 * i)), 5, policy, seed=i, greedy=True)
            for i, policy in enumerate([Uniform(3), EntropyDiff(1e-2, r_max=8), LatentDiff(0.05, r_max=8)])]
    for req, c in zip(reqs, serve(huginn, reqs, slots=2, max_loops=8), strict=True):
        gen = generate(huginn, req.prompt, req.max_new_tokens, req.policy, seed=req.seed, greedy=True, max_loops=8)
        assert c.ids == gen.ids and c.exit_loops == gen.exit_loops
        torch.testing.assert_close(c.logits, gen.logits, atol=1e-4, rtol=0)
