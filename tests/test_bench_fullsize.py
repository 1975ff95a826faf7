"""bench.bench_fullsize's baselines on the tiny checkpoint: the plain loop's weight products timed
alone (`matmuls_alone`) count exactly the weight FLOPs of `trace_flops` (which adds causal attention)."""
from bench.bench_fullsize import matmuls_alone, trace_flops


def test_matmuls_alone_counts_the_weight_flops_of_a_trace(ckpt):
    cfg, T, loops = ckpt.config, 7, 3
    seconds, flops = matmuls_alone(ckpt.model, T, loops, repeats=1)
    blocks = cfg.n_prelude + loops * cfg.n_core + (loops + 1) * cfg.n_coda
    attention = blocks * 2 * T * T * cfg.n_heads * cfg.head_dim  # QK^T and AV: no weights
    assert flops == trace_flops(cfg, T, loops) - attention
    assert seconds > 0

