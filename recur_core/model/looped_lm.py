"""A depth-recurrent transformer: prelude -> (adapter + core) x r -> coda -> norm -> tied head.

The pieces are exposed one by one so that analysis and decoding can run the model loop by loop:

    e = model.prelude(ids)                      # (B, T, d)  unique blocks, run once
    s = model.init_state(B, T, generator)       # (B, T, d)  seeded noise, std sqrt(2/5)
    for i in range(r):
        s = model.core_step(s, e, freeze)       # adapter(concat(s, e)) -> weight-tied core blocks
    logits = model.readout(s)                   # coda blocks -> final RMSNorm -> tied LM head

`forward(ids, loops)` is exactly that composition.

Architecture variants are configuration (recur_core.model.config), not other classes: sandwich prelude /
coda blocks, no prelude-output norm, q/k biases, interleaved RoPE pairs, an embedding scale, a
truncated-normal initial state and a final norm before the coda as well. recur_core.model.huginn sets them
to open Huginn-0125 checkpoints with this same class.

Decoding runs the same pieces with a KV cache: every attention takes an optional `kv` (one per
layer), an object with `attention(q, k, v, sdpa) -> out` that writes this call's keys and values
into its cache slab and attends the queries to what the slab holds (recur_core.decoding.kv holds them).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..settings import seed_for
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 math whatever the input dtype; one fused op (a third of the time of the spelled-out
        # formula at decoding's one-token calls)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


SKINNY_ROWS = 128  # up to this many token rows, a large bfloat16 product takes the streaming form of `linear`
LARGE_WEIGHT = 1 << 22  # elements: a weight below this stays in cache, F.linear is as fast


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T (F.linear without a bias), in the fastest of equal forms for inference on a CPU.

    For a few token rows (decoding's one, a text's dozens) of a large bfloat16 matrix the product is
    bound by streaming the weight from memory, and oneDNN streams it faster as the left operand:
    `weight @ x^T` for 2..SKINNY_ROWS rows (1.2-1.8x at 8-128 rows of Huginn-0125's matrices, the same
    bits) and torch.mv for one row (1.5-1.7x; 99.98% of the values equal, the others one rounding
    apart); measured in docs/benchmarks/fullsize.md. Float32, autograd, other devices, more rows and
    small weights take F.linear."""
    rows = x.numel() // x.shape[-1]
    if (rows > SKINNY_ROWS or x.dtype != torch.bfloat16 or x.device.type != "cpu"
            or weight.numel() < LARGE_WEIGHT or torch.is_grad_enabled()):
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mv(weight, flat[0])[None] if rows == 1 else torch.mm(weight, flat.t()).t().contiguous()
    return out.view(*x.shape[:-1], weight.shape[0])


class Dense(nn.Linear):
    """nn.Linear without a bias whose product is `linear` (the same parameters and state-dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight) if self.bias is None else super().forward(x)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_len, head_dim // 2) for rotary position embeddings."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate pairs of the head dim by frequency j: "half" pairs (j, j + hd/2), "interleaved"
    (Huginn's complex form) pairs (2j, 2j + 1). x: (B, H, T, hd); cos/sin: (T, hd/2), or
    (B, 1, T, hd/2) when every row has its own positions."""
    if layout == "interleaved":
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE, through scaled_dot_product_attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_layout = cfg.rope_layout
        self.q_proj = Dense(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv_proj = Dense(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Dense(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        if cfg.qk_bias:  # added to q and k before RoPE (Huginn's qk_bias)
            self.q_bias = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))
            self.k_bias = nn.Parameter(torch.zeros(cfg.n_kv_heads, cfg.head_dim))
        else:
            self.q_bias = self.k_bias = None

    def project_qkv(self, x, cos, sin):
        """q: (B, H, T, hd); k, v: (B, H_kv, T, hd), biases (if any) and RoPE applied to q and k."""
        return (self.project_q(x, cos, sin), *self.project_kv(x, cos, sin))

    def project_q(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        if self.q_bias is not None:
            q = q + self.q_bias[:, None]
        return apply_rope(q, cos, sin, self.rope_layout)

    def project_kv(self, x, cos, sin):
        B, T, _ = x.shape
        k, v = self.kv_proj(x).view(B, T, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.k_bias is not None:
            k = k + self.k_bias[:, None]
        return apply_rope(k, cos, sin, self.rope_layout), v

    def store_kv(self, x, cos, sin, kv) -> None:
        """Write the keys and values of x through the cache view kv, attending nothing: the entries
        `forward(x, cos, sin, kv)` would write, bit for bit (the same projection of the same x)."""
        kv.store(*self.project_kv(x, cos, sin))

    def sdpa(self, q, k, v, attn_mask=None, is_causal: bool = False):
        """softmax(q k^T / sqrt(hd)) v per head, each group of query heads on its kv head.
        q: (B, H, Tq, hd); k, v: (B, H_kv, Tk, hd) -> (B, H, Tq, hd)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=self.n_heads != self.n_kv_heads)

    def attend(self, q, k, v, is_causal: bool = True, attn_mask=None):
        """Attention output projected back to d_model. q: (B, H, Tq, hd); k, v: (B, H_kv, Tk, hd)."""
        return self.project_out(self.sdpa(q, k, v, attn_mask, is_causal))

    def project_out(self, out):
        """(B, H, T, hd) head outputs -> (B, T, d_model)."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cos, sin, kv=None, rows=None):
        """kv: None (causal over x itself) or a cache view: its attention(q, k, v, sdpa) stores this
        call's keys/values and attends the queries to what the cache holds (recur_core.decoding.kv).
        rows: optional (B, M) positions (without kv); then only their outputs (B, M, d) are computed,
        each attending causally to every position of x up to its own (keys / values from all of x)."""
        if rows is not None:  # queries only at rows, at their positions' rotations
            k, v = self.project_kv(x, cos, sin)
            at = (lambda t: t[rows][:, None]) if cos.dim() == 2 else (
                lambda t: t.gather(2, rows[:, None, :, None].expand(-1, 1, -1, t.shape[-1])))
            q = self.project_q(take_rows(x, rows), at(cos), at(sin))
            causal = torch.arange(k.shape[2], device=x.device)[None, None, None, :] <= rows[:, None, :, None]
            return self.attend(q, k, v, is_causal=False, attn_mask=causal)
        q, k, v = self.project_qkv(x, cos, sin)
        if kv is not None:
            return self.project_out(kv.attention(q, k, v, self.sdpa))
        return self.attend(q, k, v)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = Dense(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.down = Dense(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm block (prelude, coda): x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, kv=None, rows=None, valid=None):
        """kv: optional cache view (see Attention.forward); rows: optional (B, M) positions whose
        outputs alone are wanted; valid: optional bool (B, M), the rows that are not padding (the
        MLP skips the others, whose outputs are then left unfinished and must not be read)."""
        x = self.attn_residual(x, cos, sin, kv, rows)
        if valid is None:
            return self.mlp_residual(x)
        out = x.clone()
        out[valid] = self.mlp_residual(x[valid])
        return out

    def attn_residual(self, x, cos, sin, kv, rows):
        return take_rows(x, rows) + self.attn(self.attn_norm(x), cos, sin, kv, rows)

    def store_entries(self, x, cos, sin, kv) -> None:
        """The cache entries this block writes for input x, without its output (Attention.store_kv)."""
        self.attn.store_kv(self.attn_norm(x), cos, sin, kv)

    def mlp_residual(self, x):
        return x + self.mlp(self.mlp_norm(x))


class SandwichBlock(Block):
    """Core block with sandwich norm: x = norm(attn(norm(x)) + x); x = norm(mlp(norm(x)) + x), or with
    cfg.sandwich "branch" (Ouro) the outer norm on the branch alone: x = x + norm(attn(norm(x))), ...

    The outer norms keep the recurrent state from growing or collapsing over many loops.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.attn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_branch = cfg.sandwich == "branch"

    def attn_residual(self, x, cos, sin, kv, rows):
        branch = self.attn(self.attn_norm(x), cos, sin, kv, rows)
        if self.norm_branch:
            return take_rows(x, rows) + self.attn_out_norm(branch)
        return self.attn_out_norm(branch + take_rows(x, rows))

    def mlp_residual(self, x):
        if self.norm_branch:
            return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        return self.mlp_out_norm(self.mlp(self.mlp_norm(x)) + x)


def take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, d) at positions rows (B, M) -> (B, M, d); x itself when rows is None."""
    return x if rows is None else x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive to build a model, got {cfg.vocab_size} (a preset's "
                             "shape takes its vocabulary from the tokenizer: TrainConfig.model_config)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        outer = SandwichBlock if cfg.outer_blocks == "sandwich" else Block
        self.prelude_blocks = nn.ModuleList(outer(cfg) for _ in range(cfg.n_prelude))
        self.prelude_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.prelude_norm else None
        self.adapter = Dense(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.loop_input == "adapter" else None
        self.core_blocks = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_core))
        self.coda_blocks = nn.ModuleList(outer(cfg) for _ in range(cfg.n_coda))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Dense(cfg.d_model, cfg.vocab_size, bias=False)
        self.exit_gate = nn.Linear(cfg.d_model, 1) if cfg.exit_gate else None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()
        self.reset_parameters()

    def reset_rope(self, device=None):
        """(Re)compute the RoPE tables, e.g. after the model was built on the meta device."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_base)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def reset_parameters(self):
        n_layers = self.cfg.n_prelude + self.cfg.n_core + self.cfg.n_coda
        for name, p in self.named_parameters():
            if name == "exit_gate.bias":
                nn.init.zeros_(p)
            if p.dim() < 2 or name.endswith(("q_bias", "k_bias")):  # biases start at zero (the gate's too)
                continue
            # residual output projections are scaled down by depth (GPT-2 style)
            scale = 1 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down.weight")) else 1.0
            nn.init.normal_(p, std=0.02 * scale)

    # -- pieces -------------------------------------------------------------------------
    @property
    def head_weight(self) -> torch.Tensor:
        """(V, d) weight of the LM head (the embedding matrix when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, seq_len: int, positions: torch.Tensor | None = None):
        """cos/sin for positions 0 .. seq_len - 1, or for `positions`: (T,) shared by the batch, or
        (B, T) one row each (returned as (B, 1, T, hd/2), to broadcast over heads)."""
        if positions is None:
            if seq_len > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {seq_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        if positions.dim() == 2:
            return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        return self.rope_cos[positions], self.rope_sin[positions]

    def prelude(self, ids: torch.Tensor, positions: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        """Token ids (B, T) -> prelude output e (B, T, d), re-injected at every loop.

        e is RMS-normed, like the sandwich-normed state it is concatenated with: an un-normed
        pre-norm residual stream grows several times larger than the state, the adapter then
        all but ignores the state, and every token sits at its fixed point after two loops.
        """
        cos, sin = self.rope(ids.shape[1], positions)
        x = self.embed(ids)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        for block, cache in zip(self.prelude_blocks, kv or [None] * len(self.prelude_blocks), strict=True):
            x = block(x, cos, sin, cache)
        return x if self.prelude_norm is None else self.prelude_norm(x)

    def init_state(self, batch: int, seq_len: int, generator: torch.Generator | None = None,
                   device=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Initial recurrent state: N(0, state_init_std^2) noise of shape (batch, seq_len, d), cut at
        +-3 std when cfg.state_init is "trunc_normal"; in the model's dtype.

        Noise is drawn for all max_seq_len positions of each row and then sliced, so the state of
        position t depends only on (generator state, row, t), never on the sequence length:
        a prefix gets the same noise as the full text, which keeps the model causal.

        A model whose loop starts from e (cfg.loop_input "state", see `start_state`) draws nothing:
        its "noise" is a broadcast zero (no memory, however long max_seq_len is).
        """
        device = device if device is not None else self.embed.weight.device
        if self.adapter is None:
            length = seq_len if positions is None else positions.shape[-1]
            return torch.zeros((), device=device, dtype=self.embed.weight.dtype).expand(
                batch, length, self.cfg.d_model)
        gen_device = generator.device if generator is not None else torch.device("cpu")
        shape = (batch, self.cfg.max_seq_len, self.cfg.d_model)
        if self.cfg.state_init == "trunc_normal":
            noise = nn.init.trunc_normal_(torch.empty(shape, device=gen_device), a=-3.0, b=3.0, generator=generator)
        else:
            noise = torch.randn(shape, generator=generator, device=gen_device)
        noise = noise[:, positions] if positions is not None else noise[:, :seq_len]
        return (noise * self.cfg.state_init_std).to(device=device, dtype=self.embed.weight.dtype)

    def seeded_state(self, rows: Sequence[int], seed: int, seq_len: int | None = None) -> torch.Tensor:
        """Initial states (len(rows), seq_len or max_seq_len, d) on the model's device; row n (a
        window or sequence index) draws from its own generator seeded seed_for(seed, n), so its state
        never depends on which rows share its batch. Every trace, harness and decoder starts here."""
        seq_len = self.cfg.max_seq_len if seq_len is None else seq_len
        if self.adapter is None:  # nothing to draw (see init_state)
            return self.init_state(len(rows), seq_len)
        return torch.cat([self.init_state(1, seq_len, torch.Generator().manual_seed(seed_for(seed, n)))
                          for n in rows])

    def inject(self, e: torch.Tensor) -> torch.Tensor:
        """The adapter's e-part W_e e: adapter(concat(s, e)) = W_s s + W_e e (decoding computes it once
        per token instead of once per loop). Without an adapter (Ouro) e itself: the loops never
        read it, `start_state` does."""
        return e if self.adapter is None else linear(e, self.adapter.weight[:, self.cfg.d_model:])

    def start_state(self, noise: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The state loop 1 reads: the seeded noise, or for a model whose loop reads its own state
        (cfg.loop_input "state", Ouro) the prelude output e (the embedded tokens). Decoding passes
        `inject(e)` for e, which is e itself for those models."""
        return noise if self.adapter is not None else e.to(noise.dtype)

    def gate_lambda(self, state: torch.Tensor) -> torch.Tensor:
        """The exit gate's per-token exit probability sigmoid(w . s + b) of a state (B, T, d) -> (B, T),
        float32 (Ouro's lambda_t: the hazard of exiting at this loop)."""
        if self.exit_gate is None:
            raise ValueError("this model has no exit gate (an Ouro checkpoint has one)")
        return torch.sigmoid(self.exit_gate(state).float()[..., 0])

    def core_step(self, state: torch.Tensor, e: torch.Tensor | None, freeze: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, kv=None, inject: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """One loop: adapter(concat(state, e)) through the core blocks.

        freeze: optional bool (B, T); frozen tokens keep their state bit-for-bit, while the other
        tokens still attend to them (their keys/values are computed from the frozen state).
        kv: optional cache views, one per core block (the slabs of this loop).
        inject: `inject(e)` precomputed (e is then unused): the adapter runs as W_s s + inject.
        rows, valid: optional (B, M) positions that include every unfrozen one, padded per row with
        any positions, and bool (B, M) True where not padding (default: no padding; repeats are then
        computed twice); the last core block then runs only for them (its MLP only for the valid
        ones: a frozen token's own output is discarded). The same pair as `coda`'s.
        """
        cos, sin = self.rope(state.shape[1], positions)
        x = self.loop_input(state, e, inject)
        last = len(self.core_blocks) - 1
        for i, (block, cache) in enumerate(zip(self.core_blocks, kv or [None] * len(self.core_blocks), strict=True)):
            x = block(x, cos, sin, cache, *((rows, valid) if i == last else (None, None)))
        if self.cfg.loop_final_norm:
            x = self.final_norm(x)
        if rows is not None:
            valid = torch.ones_like(rows, dtype=torch.bool) if valid is None else valid
            lane = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(rows)[valid]
            out = state.clone()
            out[lane, rows[valid]] = x[valid].to(state.dtype)
            x = out
        if freeze is not None:
            x = torch.where(freeze.unsqueeze(-1), state, x.to(state.dtype))
        return x

    def loop_input(self, state: torch.Tensor, e: torch.Tensor | None, inject: torch.Tensor | None = None):
        """What the core blocks read at a loop: adapter(concat(state, e)), computed as W_s s + inject
        when `inject(e)` is given; without an adapter the state itself (e, inject unused)."""
        if self.adapter is None:
            return state
        if inject is None:
            return self.adapter(torch.cat((state, e), dim=-1))
        return linear(state, self.adapter.weight[:, :self.cfg.d_model]) + inject

    def core_entries(self, state: torch.Tensor, positions: torch.Tensor, kv, inject: torch.Tensor) -> None:
        """The cache entries one loop writes for tokens whose new state nobody reads (halted tokens
        under the "recompute" KV rule, whose state stays frozen while later tokens read what it
        offers): the core blocks before the last in full, the last one only its keys and values.
        Bit for bit the entries `core_step(state, None, positions=positions, kv=kv, inject=inject)`
        writes, without the last block's queries, attention and MLP: on a one-block core a token's
        entries from its frozen state are a projection of it."""
        cos, sin = self.rope(state.shape[1], positions)
        x = self.loop_input(state, None, inject)
        *earlier, last = self.core_blocks
        for block, cache in zip(earlier, kv[:-1], strict=True):
            x = block(x, cos, sin, cache)
        last.store_entries(x, cos, sin, kv[-1])

    def coda(self, state: torch.Tensor, positions: torch.Tensor | None = None, kv=None,
             rows: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """State -> coda blocks -> final RMSNorm: the hidden the LM head reads (B, T, d); with rows
        (B, M), only at those positions (B, M, d) (the last coda block runs only for them; with
        valid (B, M), its MLP only for the rows that are not padding, the others are not to be read).
        With cfg.coda_input_norm the final norm is applied before the coda too (Huginn's ln_f); with
        cfg.loop_final_norm (Ouro) every loop ended with it, and the state is returned as it is."""
        cos, sin = self.rope(state.shape[1], positions)
        x = self.final_norm(state) if self.cfg.coda_input_norm else state
        last = len(self.coda_blocks) - 1
        for i, (block, cache) in enumerate(zip(self.coda_blocks, kv or [None] * len(self.coda_blocks), strict=True)):
            x = block(x, cos, sin, cache, *((rows, valid) if i == last else (None, None)))
        if not self.coda_blocks:
            x = take_rows(x, rows)
        return x if self.cfg.loop_final_norm else self.final_norm(x)

    def readout(self, state: torch.Tensor, positions: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        """State -> logits (B, T, V)."""
        return self.head(self.coda(state, positions, kv))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: the coda's hidden (..., d) -> logits (..., V)."""
        return linear(hidden, self.head_weight)

    # -- composition --------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, loops: int, generator: torch.Generator | None = None,
                backprop_depth: int | None = None, token_loops: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) after `loops` core loops from seeded noise.

        backprop_depth k: truncated backprop through depth, the first loops - k loops run under
        no_grad and only the last k loops (plus prelude, coda and head) get gradients.
        token_loops: optional (B, T) per-token depths, each <= loops (training's per-token depth
        mode). A token past its depth is frozen as the exact harness freezes a halted token: its
        state stops, and later tokens read its keys at that exit state. Its backprop covers its own
        last k loops. With every depth equal to `loops` this is exactly the call without it.
        """
        e = self.prelude(ids)
        state = self.start_state(self.init_state(ids.shape[0], ids.shape[1], generator, device=ids.device), e)
        k = loops if backprop_depth is None else backprop_depth
        if token_loops is None:
            no_grad_loops = max(loops - k, 0)
            with torch.no_grad():
                for _ in range(no_grad_loops):
                    state = self.core_step(state, e)
            for _ in range(loops - no_grad_loops):
                state = self.core_step(state, e)
            return self.readout(state)
        if int(token_loops.max()) > loops or int(token_loops.min()) < 1:
            raise ValueError(f"token_loops must lie within 1..{loops}")
        no_grad_loops = max(int(token_loops.min()) - k, 0)  # loops before every token's backprop window
        with torch.no_grad():
            for _ in range(no_grad_loops):
                state = self.core_step(state, e)
        for i in range(no_grad_loops + 1, loops + 1):
            before_window = (i <= token_loops - k).unsqueeze(-1)
            state = self.core_step(torch.where(before_window, state.detach(), state), e, freeze=token_loops < i)
        return self.readout(state)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
