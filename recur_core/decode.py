"""Autoregressive decoding with real per-token halting and a KV cache per (loop, core layer).

    gen = generate(ckpt, "Once upon a time", 64, ConvergenceExit(1e-3))
    gen.text, gen.exit_loops, gen.tokens_per_s, gen.mean_loops

Every token runs the prelude once, then core loops until its policy halts it (A0 `Uniform(r)`,
A1 `ConvergenceExit(eps)`, A2 `LinearRouter`, `LatentDiff(delta)`; see recur_core.policies), then
the coda and the LM head once, on its exit state. Compute is really skipped: a token that halts at
loop 5 costs 5 core loops, not r_max.

Signals (the same conventions as recur_core.trace). After loop i a policy sees, per token,
state_change = ||s_i - s_{i-1}|| / ||s_i|| and, when `policy.needs_readout`, kl_prev =
KL(p_i || p_{i-1}) in nats, p_i = softmax(head(coda(s_i))), with s_0 the initial noise state and
p_0 its readout. The policy is not consulted before its `min_loops` (signals and readouts that it
cannot use are not computed: A1 with min_loops m reads out from loop m - 1 on); every token halts
at the cap = min(policy.r_max, max_loops). `check_every=n` consults the policy at min_loops and
then every n loops only; A1 then reads out only at those loops (and n loops before the first), so
its kl_prev is KL(p_i || p_{i-n}): a cheaper check with its own threshold.

Noise. The initial state of position t is the noise the full forward gives position t: row n of a
batch (window n in `teacher_forced`, the one sequence of `generate`) uses
`init_state(1, max_seq_len, Generator().manual_seed(noise_seed(seed, n)))[:, t]`. Sampling uses a
separate generator seeded with `seed`, so a seeded generation repeats exactly.

The caches (`LoopKVCache`), all preallocated to max_seq_len (`generate`: to the prompt plus the new
tokens, which keeps a large model's per-loop caches small):
  prelude   K/V per prelude layer, as in any decoder.
  core      K/V per (loop i, core layer l): the entry of position j is what layer l's attention at
            loop i reads for j. A token that ran loop i wrote its own entry there.
  coda      K/V per coda layer, computed from each token's *exit* state: the coda of a past token is
            the one that produced its logits. When A1 reads out token t at loop i, its coda attends
            to the past tokens' exit-state coda entries (the past is finished in decoding).

The KV rules: what a token at loop i reads for a past token j that halted at loop e_j < i.
  "latest"     (Huginn's rule) j's entry of loop e_j for the same layer, the latest it wrote.
               Implemented by copying that entry into loops e_j + 1 .. cap when j halts, so a
               later token reads loop i's slab with no gather. Costs no compute. Note the entry is
               one loop stale: loop e_j's keys come from the state entering that loop, s_{e_j - 1},
               not from the exit state s_{e_j}.
  "recompute"  the entry j would have written at loop i with its state frozen: the core step run
               on j's frozen (exit) state at loop i, its attention reading every earlier position's
               loop-i entry (under this same rule). This is exactly what the masking harness
               computes (frozen tokens keep looping there; only their state is not updated). The
               missing entries are filled lazily: before the current token runs loop i, every
               past position that has no loop-i entry yet is run through loop i together (one
               batched core step over those positions). It costs compute: past tokens are in effect
               looped to the deepest loop any later token reaches, so it saves little or nothing.

Exactness. With exits disabled (every token runs the same r loops) both rules read entries the
tokens wrote themselves and decoding equals the full forward at depth r. With exits, "recompute"
with a state-based policy (Uniform, LatentDiff, LinearRouter) equals the masking harness exactly
(states, exits and the final logits readout(s_exit)); "latest" differs (past tokens' keys stop
changing). A1 differs from the harness under both rules in one more way: the harness reads out
all tokens together at loop i (a past token's coda from its loop-i state), the decoder from past
tokens' exit states. The kept logits of a token are the ones read out at its exit, never
recomputed; `logit_drift` measures how far they are from a later full-depth recomputation.
KL values below ~1e-6 nats are float32 rounding noise (a different batch shape changes them), so
A1 exits at eps <= 1e-6 are not reproducible across batch shapes; above that they are.

Prefill (`Decoder.prefill`) runs the prompt in parallel, loop by loop, with per-token exits: running
tokens step, halted tokens are frozen; under "latest" a frozen token's entries of later loops are
its latest ones, under "recompute" its frozen state keeps being stepped, so prefill with
"recompute" is the masking harness (A1 included: all prompt tokens are read out together each
loop). A final coda pass over the exit states fills the coda cache and gives the prompt's logits.
For state-based policies prefill equals token-by-token decoding under either rule (causality: a
token's loop-i entry depends only on earlier positions' loop-i entries), which makes it a fast
exact teacher-forced evaluator for them; for A1 it differs in the readout context above.

Batches. `generate` decodes one sequence (batch 1: a token stops looping when it halts).
`teacher_forced` decodes B windows in lockstep, position by position, with the true next tokens:
each position loops until its last row halts, halted rows are frozen (and, under "latest", their
later-loop entries overwritten by the latest ones when the position is done), so every row gets
exactly the result of decoding it alone; only the time is not that of batch 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .checkpoint import Checkpoint
from .model import LoopedLM, rope_pairs
from .policies import LoopSignals, Uniform
from .trace import noise_seed

KV_RULES = ("latest", "recompute")


# -- weights, fused once for decoding ---------------------------------------------------------------
@dataclass
class _BlockWeights:
    """One block's weights; q/k/v projections stacked into one matrix (rows: q heads, k heads, v heads)."""

    attn_norm: Tensor
    qkv: Tensor
    o: Tensor
    mlp_norm: Tensor
    gate_up: Tensor
    down: Tensor
    attn_out_norm: Tensor | None = None  # sandwich (core) blocks only
    mlp_out_norm: Tensor | None = None
    qkv_bias: Tensor | None = None  # q and k biases (cfg.qk_bias), zeros for v

    @classmethod
    def of(cls, block) -> _BlockWeights:
        attn = block.attn
        out_norm = getattr(block, "attn_out_norm", None)
        bias = None
        if getattr(attn, "q_bias", None) is not None:
            bias = torch.cat([attn.q_bias.flatten(), attn.k_bias.flatten(), torch.zeros_like(attn.k_bias.flatten())])
        return cls(block.attn_norm.weight, torch.cat([attn.q_proj.weight, attn.kv_proj.weight]),
                   attn.o_proj.weight, block.mlp_norm.weight, block.mlp.gate_up.weight, block.mlp.down.weight,
                   None if out_norm is None else out_norm.weight,
                   None if out_norm is None else block.mlp_out_norm.weight, bias)


def rope_matrices(model: LoopedLM) -> Tensor:
    """(max_seq_len, hd, hd): x @ R[t] applies the model's rotary embedding at position t.

    apply_rope maps each pair (x1, x2) (rope_pairs: halves, or interleaved) to
    (x1 cos - x2 sin, x1 sin + x2 cos); as one matrix that is one small matmul per step instead of
    a dozen elementwise ops.
    """
    cos, sin = model.rope_cos, model.rope_sin
    T, half = cos.shape
    R = torch.zeros(T, 2 * half, 2 * half, dtype=cos.dtype, device=cos.device)
    a, b = (i.to(cos.device) for i in rope_pairs(2 * half, model.cfg.rope_layout))
    R[:, a, a] = cos
    R[:, b, a] = -sin
    R[:, a, b] = sin
    R[:, b, b] = cos
    return R


class DecodeWeights:
    """Everything the decoder reads from the model, prepared once per model."""

    def __init__(self, model: LoopedLM):
        cfg = model.cfg
        self.cfg, self.d, self.eps = cfg, cfg.d_model, cfg.norm_eps
        self.H, self.Hkv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.embed, self.head = model.embed.weight, model.head_weight
        self.prelude = [_BlockWeights.of(b) for b in model.prelude_blocks]
        self.core = [_BlockWeights.of(b) for b in model.core_blocks]
        self.coda = [_BlockWeights.of(b) for b in model.coda_blocks]
        self.adapter_state = model.adapter.weight[:, :cfg.d_model].contiguous()  # acts on s
        self.adapter_inject = model.adapter.weight[:, cfg.d_model:].contiguous()  # acts on e
        norm = getattr(model, "prelude_norm", None)  # the prelude output is RMS-normed before re-injection
        self.prelude_norm = None if norm is None else norm.weight
        self.final_norm = model.final_norm.weight
        self.rope = rope_matrices(model).to(self.embed.dtype)
        self.positions = torch.arange(cfg.max_seq_len, device=self.embed.device)


# -- the cache ---------------------------------------------------------------------------------------
class LoopKVCache:
    """Preallocated K/V of one decoding session (see the module doc).

    core (2, loops, n_core, B, Hkv, max_len, hd); prelude / coda (2, n_layers, B, Hkv, max_len, hd);
    exit_state (B, max_len, d) the state each token halted with; inject (B, max_len, d) its
    adapter input from the prelude; exit_loop (B, max_len); filled[j] = how many loops of core
    entries position j has (all of them after "latest" propagation).
    """

    def __init__(self, cfg, batch: int, loops: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.loops, self.max_len = loops, max_len
        self.core = torch.zeros(2, loops, cfg.n_core, *shape, device=device, dtype=dtype)
        self.prelude = torch.zeros(2, cfg.n_prelude, *shape, device=device, dtype=dtype)
        self.coda = torch.zeros(2, cfg.n_coda, *shape, device=device, dtype=dtype)
        self.exit_state = torch.zeros(batch, max_len, cfg.d_model, device=device, dtype=dtype)
        self.inject = torch.zeros_like(self.exit_state)
        self.exit_loop = torch.zeros(batch, max_len, dtype=torch.long)
        self.filled = np.zeros(max_len, dtype=np.int64)
        self.length = 0
        # views per (loop, layer), so the hot loop does no indexing to find its slab
        self.core_kv = [[(self.core[0, i, l], self.core[1, i, l]) for l in range(cfg.n_core)]
                        for i in range(loops)]
        self.prelude_kv = [(self.prelude[0, l], self.prelude[1, l]) for l in range(cfg.n_prelude)]
        self.coda_kv = [(self.coda[0, l], self.coda[1, l]) for l in range(cfg.n_coda)]

    def propagate_latest(self, start: int, exits: Tensor) -> None:
        """"latest" rule: copy the entry of each token's exit loop into every later loop.

        exits (B, P) exit loops of positions start .. start + P - 1.
        """
        B, P = exits.shape
        if B == 1 and P == 1:
            e = int(exits)
            self.core[:, e:, :, :, :, start] = self.core[:, e - 1:e, :, :, :, start]
            return
        block = self.core[:, :, :, :, :, start:start + P]  # (2, R, L, B, Hkv, P, hd)
        idx = (exits.to(block.device) - 1).view(1, 1, 1, B, 1, P, 1).expand(2, 1, block.shape[2], B,
                                                                            block.shape[4], P, block.shape[6])
        latest = block.gather(1, idx)
        loop_ids = torch.arange(self.loops, device=block.device).view(1, -1, 1, 1, 1, 1, 1)
        later = loop_ids >= exits.to(block.device).view(1, 1, 1, B, 1, P, 1)
        block.copy_(torch.where(later, latest, block))


# -- results -----------------------------------------------------------------------------------------
@dataclass
class Generation:
    """What `generate` returns. Position k of the new tokens was sampled from logits[k], which the
    model produced at exit loop exit_loops[k] (the depth of the step that produced it)."""

    prompt_ids: list[int]
    ids: list[int]
    exit_loops: list[int]
    prompt_exit_loops: list[int]
    logits: Tensor | None
    text: str | None
    pieces: list[str] | None
    prefill_s: float
    decode_s: float
    decode_steps: int
    readouts: int  # coda + head passes in the decode steps (checks and final readouts)
    step_readouts: list[int] = field(default_factory=list)  # per decode step
    policy: str = ""
    kv_rule: str = "latest"

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Decode steps per second: each runs one token through the model and samples the next."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def decode_exit_loops(self) -> list[int]:
        """Exit loops of the tokens run one at a time (the first new token comes from the prefill)."""
        return self.exit_loops[1:]

    @property
    def mean_loops(self) -> float:
        loops = self.decode_exit_loops or self.exit_loops
        return float(np.mean(loops)) if loops else float("nan")


@dataclass
class TeacherForced:
    """Per-token results of teacher-forced decoding of windows (N, T + 1): ce / exit_loop (N, T)."""

    ce: Tensor
    exit_loop: Tensor
    logits: Tensor | None = None
    readouts: int = 0

    @property
    def loss(self) -> float:
        return float(self.ce.mean())

    @property
    def mean_loops(self) -> float:
        return float(self.exit_loop.float().mean())


# -- the decoder -------------------------------------------------------------------------------------
def resolve(ckpt_or_model) -> tuple[LoopedLM, Checkpoint | None]:
    if isinstance(ckpt_or_model, Checkpoint):
        return ckpt_or_model.model, ckpt_or_model
    return ckpt_or_model, None


def default_max_loops(policy, ckpt: Checkpoint | None, max_loops: int | None) -> int:
    """max_loops if given, else the policy's r_max, else the checkpoint recipe's r_max."""
    if max_loops is not None:
        return int(max_loops)
    if getattr(policy, "r_max", None) is not None:
        return int(policy.r_max)
    if ckpt is not None and "r_max" in ckpt.meta.get("recipe", {}):
        return int(ckpt.meta["recipe"]["r_max"])
    raise ValueError("pass max_loops (a bare model has no recipe r_max)")


class Decoder:
    """One decoding session over B rows: a cache, the fused weights, and the per-step loop."""

    def __init__(self, model: LoopedLM, policy, *, batch: int = 1, max_loops: int, kv_rule: str = "latest",
                 noise: Tensor, weights: DecodeWeights | None = None, check_every: int = 1,
                 max_len: int | None = None):
        if kv_rule not in KV_RULES:
            raise ValueError(f"kv_rule must be one of {KV_RULES}, got {kv_rule!r}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.model, self.policy, self.rule, self.B = model, policy, kv_rule, batch
        self.w = weights or DecodeWeights(model)
        self.cap = policy.cap(max_loops) if hasattr(policy, "cap") else int(max_loops)
        self.min_loops = getattr(policy, "min_loops", 1)
        self.every = check_every
        self.needs_readout = bool(getattr(policy, "needs_readout", False))
        # the readout before the first check (loop 0 = the noise state), then one per check
        self.first_readout = max(0, self.min_loops - check_every) if self.needs_readout else None
        cfg = model.cfg
        dev, dtype = self.w.embed.device, self.w.embed.dtype
        self.cache = LoopKVCache(cfg, batch, self.cap, max_len or cfg.max_seq_len, dev, dtype)
        self.noise = noise.to(device=dev, dtype=dtype)  # (B, max_seq_len, d)
        self.readouts = 0

    # -- layers ---------------------------------------------------------------------------------------
    def _rms(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.rms_norm(x, (self.w.d,), weight, self.w.eps)

    def _attention(self, w: _BlockWeights, h: Tensor, pos, kv, fix=None) -> Tensor:
        """Self-attention of normed h (B, Tq, d) at positions pos (an int when Tq == 1, else an
        ascending LongTensor) over the cache slab kv = (K, V), each (B, Hkv, max_len, hd); writes
        this step's keys and values at pos first. fix = (K_prev, V_prev, frozen (B, Tq)): frozen
        tokens' entries are taken from the previous loop's slab instead ("latest" in prefill)."""
        B, Tq, _ = h.shape
        H, Hkv, hd = self.w.H, self.w.Hkv, self.w.hd
        kc, vc = kv
        if Tq == 1 and isinstance(pos, int):
            qkv = F.linear(h, w.qkv, w.qkv_bias).view(B, H + 2 * Hkv, hd)
            rot = torch.matmul(qkv[:, :H + Hkv], self.w.rope[pos])
            kc[:, :, pos] = rot[:, H:]
            vc[:, :, pos] = qkv[:, H + Hkv:]
            out = F.scaled_dot_product_attention(rot[:, :H].unsqueeze(2), kc[:, :, :pos + 1], vc[:, :, :pos + 1],
                                                 enable_gqa=H != Hkv)
            return F.linear(out.reshape(B, 1, H * hd), w.o)
        qkv = F.linear(h, w.qkv, w.qkv_bias).view(B, Tq, H + 2 * Hkv, hd)
        rot = torch.matmul(qkv[:, :, :H + Hkv], self.w.rope[pos])
        k, v = rot[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
        if fix is not None:
            k_prev, v_prev, frozen = fix
            m = frozen[:, None, :, None]
            k, v = torch.where(m, k_prev[:, :, pos], k), torch.where(m, v_prev[:, :, pos], v)
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        n_keys = int(pos[-1]) + 1
        mask = self.w.positions[:n_keys][None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(rot[:, :, :H].transpose(1, 2), kc[:, :, :n_keys], vc[:, :, :n_keys],
                                             attn_mask=mask, enable_gqa=H != Hkv)
        return F.linear(out.transpose(1, 2).reshape(B, Tq, H * hd), w.o)

    def _mlp(self, w: _BlockWeights, h: Tensor) -> Tensor:
        gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down)

    def _block(self, w: _BlockWeights, x: Tensor, pos, kv, fix=None) -> Tensor:
        a = self._attention(w, self._rms(x, w.attn_norm), pos, kv, fix)
        if w.attn_out_norm is not None:  # sandwich: x = norm(f(norm(x)) + x)
            x = self._rms(a + x, w.attn_out_norm)
            return self._rms(self._mlp(w, self._rms(x, w.mlp_norm)) + x, w.mlp_out_norm)
        x = x + a
        return x + self._mlp(w, self._rms(x, w.mlp_norm))

    # -- pieces ---------------------------------------------------------------------------------------
    def _prelude(self, ids: Tensor, pos) -> Tensor:
        x = F.embedding(ids, self.w.embed)
        if self.w.cfg.embed_scale != 1.0:
            x = x * self.w.cfg.embed_scale
        for w, kv in zip(self.w.prelude, self.cache.prelude_kv):
            x = self._block(w, x, pos, kv)
        return x if self.w.prelude_norm is None else self._rms(x, self.w.prelude_norm)

    def _core_loop(self, state: Tensor, inject: Tensor, loop: int, pos, frozen: Tensor | None = None) -> Tensor:
        """One core loop (1-based `loop`): adapter(concat(s, e)) as two matmuls, e's part precomputed."""
        x = F.linear(state, self.w.adapter_state) + inject
        slabs = self.cache.core_kv[loop - 1]
        for l, (w, kv) in enumerate(zip(self.w.core, slabs)):
            fix = None
            if frozen is not None:
                k_prev, v_prev = self.cache.core_kv[loop - 2][l]
                fix = (k_prev, v_prev, frozen)
            x = self._block(w, x, pos, kv, fix)
        return x

    def _readout(self, state: Tensor, pos) -> Tensor:
        """Coda (writing this position's coda cache entries) -> final norm -> head: logits (B, Tq, V)."""
        x = self._rms(state, self.w.final_norm) if self.w.cfg.coda_input_norm else state
        for w, kv in zip(self.w.coda, self.cache.coda_kv):
            x = self._block(w, x, pos, kv)
        self.readouts += 1
        return F.linear(self._rms(x, self.w.final_norm), self.w.head)

    def _fill_recompute(self, loop: int, upto: int) -> None:
        """"recompute" rule: give every position < upto that has no entry of `loop` yet the entry
        its frozen state writes at that loop (one batched core step over those positions)."""
        filled = self.cache.filled[:upto]
        missing = np.flatnonzero(filled < loop)
        if missing.size == 0:
            return
        if (filled[missing] < loop - 1).any():
            raise RuntimeError("recompute fill out of order")  # loops are always filled in order
        pos = torch.from_numpy(missing).to(self.w.positions.device)
        self._core_loop(self.cache.exit_state[:, pos], self.cache.inject[:, pos], loop, pos)
        self.cache.filled[missing] = loop

    # -- signals ----------------------------------------------------------------------------------------
    def _is_check(self, loop: int) -> bool:
        """The policy is consulted at min_loops, then every check_every loops."""
        return loop >= self.min_loops and (loop - self.min_loops) % self.every == 0

    def _consult(self, loop: int, new: Tensor, old: Tensor, kl: dict | None) -> Tensor:
        """The policy's halt decision after `loop` (bool (B, Tq)); every token halts at the cap."""
        if loop >= self.cap:
            return torch.ones(new.shape[:2], dtype=torch.bool, device=new.device)
        if not self._is_check(loop):
            return torch.zeros(new.shape[:2], dtype=torch.bool, device=new.device)
        change = torch.linalg.vector_norm(new - old, dim=-1) / torch.linalg.vector_norm(new, dim=-1)
        cosine = 1 - F.cosine_similarity(new.float(), old.float(), dim=-1, eps=1e-30)
        return self.policy.halt(loop, LoopSignals(state=new, state_change=change, cosine_change=cosine,
                                                  **(kl or {})))

    def _wants_readout(self, loop: int) -> bool:
        """Readout policies read out at each check and once before the first; kl_prev is then
        KL(p_i || p_{i - check_every}) (KL(p_i || p_{i-1}) with the default check_every 1)."""
        return self.first_readout is not None and (loop == self.first_readout or self._is_check(loop))

    @staticmethod
    def _kl(logp: Tensor, logp_prev: Tensor) -> dict:
        """The readout signals: kl_prev = KL(p || p_prev) and kl_prev_reverse = KL(p_prev || p) in
        nats per token, clamped at 0; entropy (nats) and argmax of p."""
        p = logp.exp()
        return {"kl_prev": (p * (logp - logp_prev)).sum(-1).clamp_min(0.0),
                "kl_prev_reverse": (logp_prev.exp() * (logp_prev - logp)).sum(-1).clamp_min(0.0),
                "entropy": -(p * logp).sum(-1), "argmax": logp.argmax(-1)}

    # -- one position (Tq = 1, B rows in lockstep) ---------------------------------------------------
    def step(self, ids: Tensor, pos: int) -> tuple[Tensor, Tensor]:
        """Run tokens ids (B,) at position pos until each halts; returns (logits (B, V), exits (B,))."""
        B, cache = self.B, self.cache
        e = self._prelude(ids.view(B, 1), pos)
        inject = F.linear(e, self.w.adapter_inject)
        cache.inject[:, pos] = inject[:, 0]
        state = self.noise[:, pos:pos + 1]
        logp_prev = kept = None
        if self._wants_readout(0):
            logp_prev = torch.log_softmax(self._readout(state, pos).float(), dim=-1)
        dev = state.device
        halted = torch.zeros(B, 1, dtype=torch.bool, device=dev) if B > 1 else None
        read = torch.zeros(B, 1, dtype=torch.bool, device=dev) if B > 1 else None  # exit loop was read out
        exits = torch.zeros(B, 1, dtype=torch.long, device=dev)
        for loop in range(1, self.cap + 1):
            if self.rule == "recompute":
                self._fill_recompute(loop, pos)
            new = self._core_loop(state, inject, loop, pos)
            if halted is not None:
                new = torch.where(halted[..., None], state, new)
            kl = logits = None
            if self._wants_readout(loop):
                logits = self._readout(new, pos)
                logp = torch.log_softmax(logits.float(), dim=-1)
                if logp_prev is not None:
                    kl = self._kl(logp, logp_prev)
                logp_prev = logp
            stop = self._consult(loop, new, state, kl)
            state = new
            if halted is None:  # batch 1: this token is done when it halts
                if bool(stop):
                    exits[:] = loop
                    kept = logits
                    break
                continue
            stop = stop & ~halted
            exits[stop] = loop
            if logits is not None:
                kept = logits if kept is None else torch.where(stop[..., None], logits, kept)
                read[stop] = True
            halted |= stop
            if bool(halted.all()):
                break
        self._finish_position(pos, state, exits, loop)
        if kept is None:  # no readout at the exit loop: read out the exit state once
            kept = self._readout(state, pos)
        elif read is not None and not bool(read.all()):  # rows that halted where nothing was read out
            kept = torch.where(read[..., None], kept, self._readout(state, pos))
        return kept[:, 0], exits[:, 0]

    def _finish_position(self, pos: int, state: Tensor, exits: Tensor, loops_run: int) -> None:
        cache = self.cache
        cache.exit_state[:, pos] = state[:, 0]
        cache.exit_loop[:, pos] = exits[:, 0]
        if self.rule == "latest":
            cache.propagate_latest(pos, exits)
            cache.filled[pos] = self.cap
        else:
            cache.filled[pos] = loops_run
        cache.length = max(cache.length, pos + 1)

    # -- the prompt, in parallel ----------------------------------------------------------------------
    def prefill(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Run a prompt ids (B, P) from position 0 in parallel with per-token exits (module doc).
        Returns (logits (B, P, V) read out from the exit states, exits (B, P))."""
        B, P = ids.shape
        cache = self.cache
        pos = self.w.positions[:P]
        e = self._prelude(ids, pos)
        inject = F.linear(e, self.w.adapter_inject)
        cache.inject[:, :P] = inject
        state = self.noise[:, :P]
        logp_prev = None
        if self._wants_readout(0):
            logp_prev = torch.log_softmax(self._readout(state, pos).float(), dim=-1)
        halted = torch.zeros(B, P, dtype=torch.bool, device=state.device)
        exits = torch.zeros(B, P, dtype=torch.long, device=state.device)
        for loop in range(1, self.cap + 1):
            frozen = halted if self.rule == "latest" and bool(halted.any()) else None
            new = torch.where(halted[..., None], state, self._core_loop(state, inject, loop, pos, frozen))
            kl = None
            if self._wants_readout(loop):
                logp = torch.log_softmax(self._readout(new, pos).float(), dim=-1)
                if logp_prev is not None:
                    kl = self._kl(logp, logp_prev)
                logp_prev = logp
            stop = self._consult(loop, new, state, kl) & ~halted
            exits[stop] = loop
            halted |= stop
            state = new
            if bool(halted.all()):
                break
        cache.exit_state[:, :P] = state
        cache.exit_loop[:, :P] = exits
        if self.rule == "latest":
            cache.propagate_latest(0, exits)
            cache.filled[:P] = self.cap
        else:
            cache.filled[:P] = loop
        cache.length = P
        return self._readout(state, pos), exits


# -- sampling ----------------------------------------------------------------------------------------
def sample_next(logits: Tensor, generator: torch.Generator | None, *, greedy: bool = False,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> int:
    """One token id from logits (V,): greedy (or temperature 0) takes the argmax; otherwise
    softmax(logits / temperature) restricted to the top_k ids and to the smallest set whose
    probability reaches top_p, sampled with `generator`."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


# -- public API --------------------------------------------------------------------------------------
def _row_noise(model: LoopedLM, rows, seed: int) -> Tensor:
    """(len(rows), max_seq_len, d): the full forward's noise of each row (window index) at every position."""
    return torch.cat([model.init_state(1, model.cfg.max_seq_len, torch.Generator().manual_seed(noise_seed(seed, n)))
                      for n in rows])


def _encode(prompt, ckpt: Checkpoint | None, tokenizer):
    if isinstance(prompt, str):
        tokenizer = tokenizer or (ckpt.tokenizer() if ckpt is not None else None)
        if tokenizer is None:
            raise ValueError("a text prompt needs a checkpoint (for its tokenizer) or tokenizer=")
        return tokenizer.encode(prompt).ids, tokenizer
    ids = prompt.tolist() if torch.is_tensor(prompt) else list(prompt)
    if tokenizer is None and ckpt is not None:
        tokenizer = ckpt.tokenizer()
    return [int(i) for i in ids], tokenizer


def token_pieces(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> list[str]:
    """The text each new token adds (decoding the growing sequence, so byte-level merges stay whole)."""
    pieces, prev = [], tokenizer.decode(prompt_ids)
    for k in range(1, len(new_ids) + 1):
        text = tokenizer.decode(prompt_ids + new_ids[:k])
        pieces.append(text[len(prev):] if text.startswith(prev) else text)
        prev = text
    return pieces


def _notify(on_token, index: int, token_id: int, exit_loop: int) -> float:
    """Call on_token if given; returns the seconds it took (kept out of the decode time)."""
    if on_token is None:
        return 0.0
    t = time.perf_counter()
    on_token(index, token_id, exit_loop)
    return time.perf_counter() - t


@torch.inference_mode()
def generate(ckpt_or_model, prompt, max_new_tokens: int, policy=None, *, kv_rule: str = "latest",
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, max_loops: int | None = None, stop_ids=(), keep_logits: bool = True,
             tokenizer=None, weights: DecodeWeights | None = None, on_token=None,
             check_every: int = 1) -> Generation:
    """Decode max_new_tokens after `prompt` (text, or token ids) at batch 1 with per-token exits.

    policy: a recur_core.policies policy; None disables exits (every token runs max_loops).
    max_loops: the loop cap (default: the policy's r_max, else the checkpoint recipe's r_max).
    kv_rule: "latest" or "recompute" (module doc). Sampling: greedy, or temperature / top_k / top_p
    with a generator seeded by `seed` (which also seeds the state noise, see the module doc).
    stop_ids: token ids that end the generation once sampled (kept in the output).
    weights: a prepared `DecodeWeights` of this model, to skip re-fusing them on repeated calls.
    on_token(index, token_id, exit_loop): called as each new token is sampled (for live display);
    its time is left out of decode_s.
    check_every: consult the policy at min_loops and then every n loops only (a cheaper check for
    A1: it reads out only there, and its kl_prev becomes KL(p_i || p_{i-n})).
    """
    model, ckpt = resolve(ckpt_or_model)
    prompt_ids, tokenizer = _encode(prompt, ckpt, tokenizer)
    if not prompt_ids:
        raise ValueError("empty prompt")
    max_len = model.cfg.max_seq_len
    if len(prompt_ids) + max_new_tokens - 1 > max_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + {max_new_tokens} new tokens exceed max_seq_len {max_len}")
    cap = default_max_loops(policy, ckpt, max_loops)
    policy = policy if policy is not None else Uniform(cap)
    dec = Decoder(model, policy, max_loops=cap, kv_rule=kv_rule, noise=_row_noise(model, [0], seed),
                  weights=weights, check_every=check_every, max_len=len(prompt_ids) + max_new_tokens)
    sampler = torch.Generator().manual_seed(seed)
    sample = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    device = dec.w.embed.device

    t0 = time.perf_counter()
    logits, prompt_exits = dec.prefill(torch.tensor([prompt_ids], device=device))
    last = logits[0, -1]
    new_ids, exits, kept = [sample_next(last, sampler, **sample)], [int(prompt_exits[0, -1])], [last]
    t1 = time.perf_counter()
    callback_s = _notify(on_token, 0, new_ids[0], exits[0])
    dec.readouts = 0
    stops = set(int(i) for i in stop_ids)
    pos = len(prompt_ids)
    step_readouts = []
    while len(new_ids) < max_new_tokens and new_ids[-1] not in stops:
        before = dec.readouts
        last, exit_loop = dec.step(torch.tensor([new_ids[-1]], device=device), pos)
        step_readouts.append(dec.readouts - before)
        new_ids.append(sample_next(last[0], sampler, **sample))
        exits.append(int(exit_loop))
        if keep_logits:
            kept.append(last[0])
        pos += 1
        callback_s += _notify(on_token, len(new_ids) - 1, new_ids[-1], exits[-1])
    t2 = time.perf_counter() - callback_s

    pieces = token_pieces(tokenizer, prompt_ids, new_ids) if tokenizer is not None else None
    return Generation(prompt_ids=prompt_ids, ids=new_ids, exit_loops=exits,
                      prompt_exit_loops=prompt_exits[0].tolist(),
                      logits=torch.stack(kept).float().cpu() if keep_logits else None,
                      text="".join(pieces) if pieces is not None else None, pieces=pieces,
                      prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=len(new_ids) - 1,
                      readouts=dec.readouts, step_readouts=step_readouts, policy=repr(policy), kv_rule=kv_rule)


@torch.inference_mode()
def teacher_forced(ckpt_or_model, windows, policy, kv_rule: str = "latest", *, seed: int = 0,
                   max_loops: int | None = None, batch_size: int = 16, mode: str = "decode",
                   keep_logits: bool = False, first_window: int = 0,
                   weights: DecodeWeights | None = None, check_every: int = 1) -> TeacherForced:
    """Decode windows (N, T + 1) with the true next tokens and score every position.

    mode "decode": token by token, exactly what `generate` computes for each window (rows in
    lockstep, see the module doc). mode "prefill": all positions in parallel (`Decoder.prefill`);
    with kv_rule "recompute" that is the masking harness.
    Window n's noise is noise_seed(seed, first_window + n), as in recur_core.trace.
    Returns per-token ce (nats) and exit loops (N, T), and the kept logits when keep_logits.
    """
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    model, ckpt = resolve(ckpt_or_model)
    windows = torch.as_tensor(windows, dtype=torch.long)
    cap = default_max_loops(policy, ckpt, max_loops)
    weights = weights or DecodeWeights(model)
    device = weights.embed.device
    N, T = windows.shape[0], windows.shape[1] - 1
    ces, exits, logits_out, readouts = [], [], [], 0
    for start in range(0, N, batch_size):
        rows = range(start, min(start + batch_size, N))
        ids = windows[start:rows.stop].to(device)
        dec = Decoder(model, policy, batch=len(rows), max_loops=cap, kv_rule=kv_rule, weights=weights,
                      noise=_row_noise(model, [first_window + n for n in rows], seed), check_every=check_every)
        if mode == "prefill":
            logits, ex = dec.prefill(ids[:, :-1])
        else:
            steps = [dec.step(ids[:, t], t) for t in range(T)]
            logits = torch.stack([s[0] for s in steps], dim=1)
            ex = torch.stack([s[1] for s in steps], dim=1)
        readouts += dec.readouts
        logits = logits.float()
        ces.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").cpu())
        exits.append(ex.cpu())
        if keep_logits:
            logits_out.append(logits.cpu())
    return TeacherForced(torch.cat(ces), torch.cat(exits), torch.cat(logits_out) if keep_logits else None,
                         readouts)


# -- drift of kept logits ----------------------------------------------------------------------------
@dataclass
class Drift:
    """How far kept logits are from a reference (e.g. the same tokens recomputed at full depth)."""

    kl_mean: float  # mean KL(p_ref || p_kept), nats
    kl_max: float
    argmax_agree: float  # fraction of tokens whose argmax is unchanged
    max_abs_logit: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def logit_drift(kept: Tensor, reference: Tensor, mask: Tensor | None = None) -> Drift:
    """Drift of kept logits (..., V) from reference logits of the same tokens; mask selects tokens."""
    kept, reference = kept.float().reshape(-1, kept.shape[-1]), reference.float().reshape(-1, kept.shape[-1])
    if mask is not None:
        m = mask.reshape(-1).bool()
        kept, reference = kept[m], reference[m]
    if kept.shape[0] == 0:
        return Drift(0.0, 0.0, 1.0, 0.0)
    logp_ref, logp_kept = torch.log_softmax(reference, -1), torch.log_softmax(kept, -1)
    kl = (logp_ref.exp() * (logp_ref - logp_kept)).sum(-1).clamp_min(0.0)
    return Drift(float(kl.mean()), float(kl.max()), float((kept.argmax(-1) == reference.argmax(-1)).float().mean()),
                 float((kept - reference).abs().max()))


@torch.inference_mode()
def full_depth_logits(ckpt_or_model, ids, loops: int, seed: int = 0, row: int = 0) -> Tensor:
    """Logits (T, V) of one sequence ids (T,) from the full forward at uniform depth `loops`, with the
    noise of row `row` (what generate / teacher_forced used for it)."""
    model, _ = resolve(ckpt_or_model)
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.embed.weight.device)[None]
    gen = torch.Generator().manual_seed(noise_seed(seed, row))
    return model(ids, loops, generator=gen)[0].float().cpu()


def generation_drift(ckpt_or_model, gen: Generation, loops: int, seed: int = 0, halted_only: bool = True) -> Drift:
    """Drift of a generation's kept logits from the full forward at depth `loops` over the final text.

    halted_only: only tokens that exited before `loops` (the others ran the same depth).
    """
    if gen.logits is None:
        raise ValueError("generate(..., keep_logits=True) keeps the logits this needs")
    seq = gen.prompt_ids + gen.ids[:-1]
    ref = full_depth_logits(ckpt_or_model, seq, loops, seed)[len(gen.prompt_ids) - 1:]
    mask = torch.tensor(gen.exit_loops) < loops if halted_only else None
    return logit_drift(gen.logits, ref, mask)
