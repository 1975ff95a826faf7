"""The FLOP proxy the decoding benchmarks hold realized speedups against: multiply-accumulates of the
prelude, core loops, coda, head and exit checks, counted with the real exit loops, readouts and
context lengths of a run."""
from __future__ import annotations

from recur_core.exits.policies import Policy, Uniform


class CostModel:
    """Multiply-accumulates of one decode step, by part (weights once per token, plus attention)."""

    def __init__(self, cfg):
        self.cfg = cfg
        d, H, Hkv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.block_weights = d * (H + 2 * Hkv) * hd + H * hd * d + 3 * d * cfg.ffn_dim
        self.attn_per_key = 2 * H * hd
        self.head = cfg.vocab_size * d

    def block(self, ctx: int) -> float:
        return self.block_weights + self.attn_per_key * ctx

    def step(self, ctx: int, loops: int, readouts: int, checks: int, kl_checks: int) -> float:
        """ctx keys attended; loops core loops; readouts coda + head passes; checks latent-rule
        evaluations (~3d); kl_checks KL computations (~3V)."""
        c = self.cfg
        prelude = c.n_prelude * self.block(ctx) + c.d_model * c.d_model  # + the adapter's e-part, once
        loop = c.d_model * c.d_model + c.n_core * self.block(ctx)
        readout = c.n_coda * self.block(ctx) + self.head
        return prelude + loops * loop + readouts * readout + 3 * c.d_model * checks + 3 * c.vocab_size * kl_checks


def generation_cost(cost: CostModel, gen, policy: Policy, check_every: int = 1) -> float:
    """FLOP proxy of a generation's decode steps (the first new token comes from the prefill) under
    `policy`, consulted every `check_every` loops."""
    prompt_len = len(gen.prompt_ids)
    min_loops = policy.min_loops
    total = 0.0
    for k, (loops, readouts) in enumerate(zip(gen.decode_exit_loops, gen.step_readouts, strict=True)):
        consults = 0 if isinstance(policy, Uniform) else max(loops - min_loops, -1) // check_every + 1
        kl = consults if policy.needs_readout else 0
        total += cost.step(prompt_len + k + 1, loops, readouts, consults, kl)
    return total


def served_cost(cost: CostModel, completions, policy: Policy) -> float:
    """FLOP proxy of a pool's completions: each one's decode steps (generation_cost) plus its prefill,
    each prompt position charged the core loops and readouts the pool ran it for
    (Completion.prompt_row_loops / _readouts)."""
    total = 0.0
    for c in completions:
        total += generation_cost(cost, c, policy)
        total += sum(cost.step(t + 1, loops, readouts, 0, 0)
                     for t, (loops, readouts) in enumerate(zip(c.prompt_row_loops, c.prompt_row_readouts, strict=True)))
    return total


def program_cost(cost: CostModel, exits: list[list[int]], policy: Policy) -> float:
    """FLOP proxy of teacher-forced decoding of programs whose tokens exit at these loops under `policy`."""
    total = 0.0
    reads_every_loop = policy.needs_readout
    checks = not isinstance(policy, Uniform)
    for program in exits:
        for t, loops in enumerate(program):
            consults = loops if checks else 0
            total += cost.step(t + 1, loops, loops if reads_every_loop else 1, consults,
                               consults if reads_every_loop else 0)
    return total
