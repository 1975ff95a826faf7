"""The KV cache of looped decoding, the views through which model.py's attention uses it, and the
KV rules (what a later loop reads for a token that has already halted). docs/DECODING.md explains
the design.

A view is what `model.Attention.forward(..., kv=view)` takes: `attention(q, k, v, sdpa)` writes this
call's keys and values into the cache and returns the queries' attention outputs over what the
cache holds (sdpa: the model's scaled-dot-product attention).

  SlabKV    rows in lockstep (the batch-1 decoder, teacher-forced windows, a prompt's prefill):
            all rows at the same positions and loop, one slab (B, Hkv, max_len, hd) per layer.
  RowsKV    some of those rows at one position (a lockstep step's rows still looping).
  GatherKV  the pool's ragged step: every row is one token of its own sequence, at its own position
            and loop; each row's keys are gathered from its own (sequence, loop) slab and masked at
            its position, in chunks of rows at adjacent positions (KeyChunks).

A rule runs a lockstep loop (`KVRule.run_loop`): it first gives the earlier positions what this
loop reads for them ("latest" copies, "recompute" steps frozen states), or ("continue") computes
them in the same core call as the loop's own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..settings import SETTINGS


# -- views for model.Attention -----------------------------------------------------------------------
class SlabKV:
    """Rows in lockstep over one slab pair k, v (B, Hkv, max_len, hd).

    pos: an int (one query per row) or an ascending LongTensor (Tq,) of the queries' positions.
    keep: optional (k_prev, v_prev, frozen (B, Tq)): frozen tokens' entries are copied from the
    slabs k_prev / v_prev instead of being written from this call ("latest" rule in a prefill).
    """

    def __init__(self, k: Tensor, v: Tensor, pos, keep=None):
        self.k, self.v, self.pos, self.keep = k, v, pos, keep

    def attention(self, q: Tensor, k: Tensor, v: Tensor, sdpa) -> Tensor:
        self.store(k, v)
        return sdpa(q, *self._keys())

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write this call's entries (B, Hkv, Tq, hd) at its positions (a frozen token's from `keep`)."""
        kc, vc, pos = self.k, self.v, self.pos
        if isinstance(pos, int):
            kc[:, :, pos] = k[:, :, 0]
            vc[:, :, pos] = v[:, :, 0]
            return
        if self.keep is not None:
            k_prev, v_prev, frozen = self.keep
            m = frozen[:, None, :, None]
            k, v = torch.where(m, k_prev[:, :, pos], k), torch.where(m, v_prev[:, :, pos], v)
        kc[:, :, pos] = k
        vc[:, :, pos] = v

    def _keys(self):
        """(keys, values, mask) the queries attend to: every entry up to each query's position."""
        kc, vc, pos = self.k, self.v, self.pos
        if isinstance(pos, int):
            return kc[:, :, :pos + 1], vc[:, :, :pos + 1], None
        n_keys = int(pos[-1]) + 1
        mask = torch.arange(n_keys, device=pos.device)[None, :] <= pos[:, None]  # (Tq, n_keys)
        return kc[:, :, :n_keys], vc[:, :, :n_keys], mask


class RowsKV:
    """Some rows of a slab pair at one position (a lockstep step once most of its rows have halted,
    `Decoder.step`): writes their entries at pos and attends over a copy of their keys up to pos, so
    the rows that have halted are not read at all."""

    def __init__(self, k: Tensor, v: Tensor, rows: Tensor, pos: int):
        self.k, self.v, self.rows, self.pos = k, v, rows, pos

    def attention(self, q: Tensor, k: Tensor, v: Tensor, sdpa) -> Tensor:
        self.store(k, v)
        n_keys = self.pos + 1
        return sdpa(q, self.k[:, :, :n_keys].index_select(0, self.rows),
                    self.v[:, :, :n_keys].index_select(0, self.rows), None)

    def store(self, k: Tensor, v: Tensor) -> None:
        self.k[self.rows, :, self.pos] = k[:, :, 0]
        self.v[self.rows, :, self.pos] = v[:, :, 0]


class ExitContextKV:
    """A parallel readout that reads the earlier tokens at their exit states (the fixed-point pass,
    recur_core.decoding.fixed_point): the query at position t attends to the context slabs' entries at
    positions < t (the coda run on every token's exit state, or a guess of it) and to its own entry
    of this call, which is not stored: the context stays what it was for every loop of the pass.

    k, v: the context slabs (B, Hkv, max_len, hd); pos: an ascending LongTensor (Tq,) of the queries'
    positions. The queries may stack G calls' rows on the batch, (G * B, ...) call-major (a replay's
    readahead, recur_core.decoding.decode): each reads the same context."""

    def __init__(self, k: Tensor, v: Tensor, pos: Tensor):
        self.k, self.v, self.pos = k, v, pos

    def attention(self, q: Tensor, k: Tensor, v: Tensor, sdpa) -> Tensor:
        n_ctx = int(self.pos[-1])  # context keys 0 .. n_ctx - 1: every query's strictly earlier positions
        calls = q.shape[0] // self.k.shape[0]
        keys = torch.cat([self.k[:, :, :n_ctx].repeat(calls, 1, 1, 1), k], dim=2)
        values = torch.cat([self.v[:, :, :n_ctx].repeat(calls, 1, 1, 1), v], dim=2)
        earlier = torch.arange(n_ctx, device=self.pos.device)[None, :] < self.pos[:, None]  # (Tq, n_ctx)
        itself = torch.eye(len(self.pos), dtype=torch.bool, device=self.pos.device)  # (Tq, Tq)
        return sdpa(q, keys, values, torch.cat([earlier, itself], dim=1))


# Bytes of gathered keys + values one attention call of a pool step may read (CPU): a chunk of rows
# whose gathered slabs fit in a core's L2 cache is attended while the copy is still there, instead
# of one gather of a whole step going to memory and back (docs/BENCHMARKS.md has the measurement).
CPU_CHUNK_BYTES = 1 << 20


@dataclass
class KeyChunks:
    """How a ragged step's rows gather their keys and attend, shared by the layers of the step: the
    rows, permuted by `order` (None: as they are; `inverse` undoes it), are cut into consecutive
    chunks of `sizes`; chunk c gathers slabs `slabs[c]` up to `n_keys[c]` positions, masked by
    `masks[c]` (M, 1, 1, n_keys) keys <= each row's position (None: every row sits at the last key)."""

    order: Tensor | None
    inverse: Tensor | None
    sizes: list[int]
    slabs: tuple[Tensor, ...]
    n_keys: list[int]
    masks: list[Tensor | None]


def key_chunks(slabs: np.ndarray, pos: np.ndarray, bytes_per_key: int, device) -> KeyChunks:
    """Plan a ragged step (row n: slab slabs[n], position pos[n]; numpy, built on the host, since
    a plan is a dozen tiny arrays): rows sorted by position, in chunks that each gather keys only
    up to their own longest context and, on a CPU, at most CPU_CHUNK_BYTES of them (bytes_per_key:
    one position's keys + values of one row, all kv heads). Sorting matters: with per-token
    halting, sequences drift apart and a joining prompt sits at positions 0.., so one gather padded
    to the longest context read a third more keys than the rows use (demo-r8, A2 at pool 32)."""
    n_rows, hi = len(pos), int(pos.max())
    on_cpu = torch.device(device).type == "cpu"
    per_chunk = max(1, CPU_CHUNK_BYTES // (bytes_per_key * (hi + 1))) if on_cpu else n_rows

    def tensor(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(device)

    if per_chunk >= n_rows:
        mask = None if pos.min() == hi else tensor(_causal_mask(pos, hi))
        return KeyChunks(None, None, [n_rows], (tensor(slabs),), [hi + 1], [mask])
    order = np.argsort(pos, kind="stable")
    p = pos[order]
    starts = range(0, n_rows, per_chunk)
    sizes = [min(per_chunk, n_rows - a) for a in starts]
    n_keys = [int(p[a + m - 1]) + 1 for a, m in zip(starts, sizes, strict=True)]
    mask = _causal_mask(p, hi)
    masks = [None if p[a] == n - 1 else tensor(mask[a:a + m, ..., :n])
             for a, m, n in zip(starts, sizes, n_keys, strict=True)]
    slabs = slabs[order]
    return KeyChunks(tensor(order), tensor(np.argsort(order)), sizes,
                     tuple(tensor(slabs[a:a + m]) for a, m in zip(starts, sizes, strict=True)), n_keys, masks)


def _causal_mask(pos: np.ndarray, hi: int) -> np.ndarray:
    """(M, 1, 1, hi + 1) keys <= each row's position."""
    return (np.arange(hi + 1)[None, :] <= pos[:, None])[:, None, None, :]


class GatherKV:
    """One query per row; row n reads and writes slab `rows[n]` of k, v (S, Hkv, max_len, hd) at
    position pos[n], gathering and attending as `chunks` (key_chunks(rows, pos, ...)) says.
    Several rows may be positions of one sequence (a prompt in the pool): every row writes before
    any reads, so they see each other causally, as in a parallel prefill.
    keep: optional bool (N,): these rows copy their entry from slab rows[n] - 1 (the same sequence's
    previous loop) instead of writing this call's ("latest" rule, halted prompt tokens)."""

    def __init__(self, k: Tensor, v: Tensor, rows: Tensor, pos: Tensor, chunks: KeyChunks,
                 keep: Tensor | None = None):
        self.k, self.v, self.rows, self.pos, self.chunks, self.keep = k, v, rows, pos, chunks, keep

    def attention(self, q: Tensor, k: Tensor, v: Tensor, sdpa) -> Tensor:
        k, v = k[:, :, 0], v[:, :, 0]
        if self.keep is not None:
            prev, m = (self.rows - 1).clamp_min(0), self.keep[:, None, None]
            k, v = torch.where(m, self.k[prev, :, self.pos], k), torch.where(m, self.v[prev, :, self.pos], v)
        self.k[self.rows, :, self.pos] = k
        self.v[self.rows, :, self.pos] = v
        plan = self.chunks
        if plan.order is not None:
            q = q.index_select(0, plan.order)
        out = [sdpa(q_c, self.k[:, :, :n].index_select(0, slabs), self.v[:, :, :n].index_select(0, slabs), mask)
               for q_c, slabs, n, mask in zip(q.split(plan.sizes), plan.slabs, plan.n_keys, plan.masks, strict=True)]
        out = out[0] if len(out) == 1 else torch.cat(out)
        return out if plan.inverse is None else out.index_select(0, plan.inverse)


# -- the cache ---------------------------------------------------------------------------------------
class LoopKVCache:
    """Preallocated K/V of B sequences (docs/DECODING.md).

    core (2, n_core, B, loops, Hkv, max_len, hd): entry (loop i, layer l) of position j is what
    layer l's attention at loop i reads for j. prelude / coda (2, n_layers, B, Hkv, max_len, hd).
    exit_state (B, max_len, d): the state each token halted with; run_state (B, max_len, d): its
    state after its `filled` loops (the exit state, unless a rule whose halted tokens loop on ran it
    further); inject (B, max_len, d): its adapter input from the prelude (model.inject(e));
    exit_loop (B, max_len); filled (B, max_len): how many loops of core entries each position has
    (the KV rules fill the rest lazily, when read).
    `row(b)` is a view of one sequence (same storage), which is how the pool runs a prompt's prefill
    in its slot.
    """

    def __init__(self, cfg, batch: int, loops: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.loops, self.max_len = loops, max_len
        self.core = torch.zeros(2, cfg.n_core, batch, loops, cfg.n_kv_heads, max_len, cfg.head_dim,
                                device=device, dtype=dtype)
        self.prelude = torch.zeros(2, cfg.n_prelude, *shape, device=device, dtype=dtype)
        self.coda = torch.zeros(2, cfg.n_coda, *shape, device=device, dtype=dtype)
        self.exit_state = torch.zeros(batch, max_len, cfg.d_model, device=device, dtype=dtype)
        self.run_state = torch.zeros_like(self.exit_state)
        self.inject = torch.zeros_like(self.exit_state)
        self.exit_loop = torch.zeros(batch, max_len, dtype=torch.long)
        self.filled = np.zeros((batch, max_len), dtype=np.int64)
        self.positions = torch.arange(max_len, device=device)

    @property
    def bytes_per_key(self) -> int:
        """Bytes of one position's keys and values in one layer (all kv heads)."""
        _, _, _, hkv, _, hd = self.prelude.shape
        return 2 * hkv * hd * self.prelude.element_size()

    def row(self, b: int) -> LoopKVCache:
        view = object.__new__(LoopKVCache)
        view.loops, view.max_len, view.positions = self.loops, self.max_len, self.positions
        view.core, view.prelude, view.coda = self.core[:, :, b:b + 1], self.prelude[:, :, b:b + 1], self.coda[:, :, b:b + 1]
        for name in ("exit_state", "run_state", "inject", "exit_loop", "filled"):
            setattr(view, name, getattr(self, name)[b:b + 1])
        return view

    def select(self, rows: Tensor) -> LoopKVCache:
        """A cache of the sequences `rows` (a LongTensor of row indices) alone, copied."""
        twin = object.__new__(LoopKVCache)
        twin.loops, twin.max_len, twin.positions = self.loops, self.max_len, self.positions
        on = rows.to(self.core.device)
        twin.core, twin.prelude, twin.coda = (x.index_select(2, on) for x in (self.core, self.prelude, self.coda))
        for name in ("exit_state", "run_state", "inject"):
            setattr(twin, name, getattr(self, name).index_select(0, on))
        twin.exit_loop = self.exit_loop.index_select(0, rows.to(self.exit_loop.device))
        twin.filled = self.filled[rows.cpu().numpy()]
        return twin

    def reset_row(self, b: int) -> None:
        """Forget sequence b (its slot is reused): only the bookkeeping, entries are overwritten."""
        self.filled[b] = 0
        self.exit_loop[b] = 0

    def copy_core_entries(self, b: int, loop: int, pos: Tensor) -> None:
        """Sequence b's entries of loop `loop` (1-based) at positions pos into loop + 1, every core layer."""
        pos = pos.to(self.core.device)
        self.core[:, :, b, loop, :, pos] = self.core[:, :, b, loop - 1, :, pos]

    # slabs of all rows for one layer
    def core_slabs(self, loop: int) -> list[tuple[Tensor, Tensor]]:
        """(k, v) per core layer of loop `loop` (1-based), each (B, Hkv, max_len, hd)."""
        return [(self.core[0, l, :, loop - 1], self.core[1, l, :, loop - 1]) for l in range(self.core.shape[1])]

    def prelude_slabs(self) -> list[tuple[Tensor, Tensor]]:
        return [(self.prelude[0, l], self.prelude[1, l]) for l in range(self.prelude.shape[1])]

    def coda_slabs(self) -> list[tuple[Tensor, Tensor]]:
        return [(self.coda[0, l], self.coda[1, l]) for l in range(self.coda.shape[1])]

    def core_flat(self, layer: int) -> tuple[Tensor, Tensor]:
        """Core layer `layer` as (B * loops, Hkv, max_len, hd): slab b * loops + (i - 1) is (row b, loop i)."""
        k, v = self.core[0, layer], self.core[1, layer]
        return k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])


# -- the KV rules --------------------------------------------------------------------------------------
def core_loop(model, cache: LoopKVCache, loop: int, state: Tensor, inject: Tensor, pos, keep=None,
              rows: Tensor | None = None) -> Tensor:
    """Loop `loop` (1-based) of the core for tokens at positions pos of every row (an int, one token
    per row, or an ascending LongTensor) from states (B, Tq, d), reading and writing the loop's slabs
    (keep: per core layer SlabKV's `keep`, or None); returns their new states. rows: only these rows
    of the cache (ascending), state and inject being theirs (k, 1, d), at one position pos (RowsKV)."""
    if rows is not None:
        kv = [RowsKV(k, v, rows, pos) for k, v in cache.core_slabs(loop)]
    else:
        kv = [SlabKV(k, v, pos, None if keep is None else keep[l]) for l, (k, v) in enumerate(cache.core_slabs(loop))]
    positions = cache.positions[pos:pos + 1] if isinstance(pos, int) else pos
    return model.core_step(state, None, positions=positions, kv=kv, inject=inject)


def frozen_entries(model, cache: LoopKVCache, loop: int, pos: Tensor, has: Tensor | None = None) -> None:
    """Loop `loop`'s entries of the tokens at positions pos (an ascending LongTensor) from their exit
    states, as the "recompute" rule offers a halted token (`LoopedLM.core_entries`: the entries of
    `core_loop` without the outputs nobody reads). has: (B, len(pos)) bool, the tokens that hold
    their entry of the loop already (computed while they looped), which keep it."""
    kv = [SlabKV(k, v, pos, None if has is None else (k, v, has)) for k, v in cache.core_slabs(loop)]
    model.core_entries(cache.exit_state[:, pos], pos, kv, cache.inject[:, pos])


def missing_positions(cache: LoopKVCache, loop: int, upto: int) -> np.ndarray:
    """Positions before `upto` that lack loop `loop`'s entries in any row (rows of a lockstep step
    that stopped computing its halted rows hold different loops)."""
    filled = cache.filled[:, :upto]
    missing = np.flatnonzero((filled < loop).any(axis=0))
    if missing.size and (filled[:, missing] < loop - 1).any():
        raise RuntimeError(f"fill of loop {loop} out of order")  # loops are always filled in order
    return missing


class KVRule:
    """What a token at loop i reads for a past token j that halted at loop e_j < i.

    keeps_exit_entry  True: a halted token's entry of a later loop is the one of its exit loop
                      (it is not stepped again); False: its state keeps being stepped.
    loops_on          True: that state is not frozen at the exit but loops on, as if the token had
                      not halted (its exit only picks its output); the decoders then keep a running
                      state apart from the exit state (LoopKVCache.run_state).
    run_loop(model, cache, loop, state, inject, pos, keep, rows)  one lockstep loop of tokens at pos
                                        (of the cache's rows `rows` only, if given), the earlier
                                        positions first given what the loop reads for them.
    prefill_keep(cache, loop, halted)  in a parallel prefill, per core layer the `keep` argument of
                                        SlabKV for loop `loop` (None: halted tokens write as usual).
    before_loop(model, cache, loop, upto)  before positions >= upto run loop `loop` (token by token).
    before_loops(model, cache, rows, loops, uptos)  the same for many sequences of one cache at once
                                        (the pool's step): sequence rows[n] is about to run loop
                                        loops[n] at positions >= uptos[n] (numpy arrays).
    finish(cache, start, exits, loops_run)  positions start.. have halted with exits (B, P) after
                                        the rows ran loops_run loops (an int, or (B, 1) per row: a
                                        lockstep step stops computing rows that have halted).
    finish_tokens(cache, rows, pos, exits)  N single tokens (position pos[n] of sequence rows[n], all
                                        (N,) on the CPU) have halted, each at its loop exits[n] (the
                                        pool's decoded tokens: one call per step).
    """

    name = ""
    keeps_exit_entry = False
    loops_on = False

    def run_loop(self, model, cache: LoopKVCache, loop: int, state: Tensor, inject: Tensor, pos,
                 keep=None, rows: Tensor | None = None) -> Tensor:
        self.before_loop(model, cache, loop, pos if isinstance(pos, int) else int(pos[0]))
        return core_loop(model, cache, loop, state, inject, pos, keep, rows)

    def prefill_keep(self, cache: LoopKVCache, loop: int, halted: Tensor):
        if not self.keeps_exit_entry or loop == 1 or not bool(halted.any()):
            return None
        return [(k, v, halted) for k, v in cache.core_slabs(loop - 1)]

    def before_loop(self, model, cache: LoopKVCache, loop: int, upto: int) -> None:
        pass

    def before_loops(self, model, cache: LoopKVCache, rows, loops, uptos) -> None:
        for b, loop, upto in zip(rows.tolist(), loops.tolist(), uptos.tolist(), strict=True):
            self.before_loop(model, cache.row(b), loop, upto)

    def finish(self, cache: LoopKVCache, start: int, exits: Tensor, loops_run: int) -> None:
        raise NotImplementedError

    def finish_tokens(self, cache: LoopKVCache, rows: Tensor, pos: Tensor, exits: Tensor) -> None:
        cache.filled[rows.numpy(), pos.numpy()] = exits.numpy()  # a decoded token ran exactly its exit loops

    def __repr__(self) -> str:
        return repr(self.name)


class LatestRule(KVRule):
    """Huginn's rule: j's entry of loop e_j (the latest it wrote). The entry is one loop stale (loop
    e_j's keys come from the state entering that loop, s_{e_j - 1}).

    A later token reads loop i's slab as it is, so j's entry must sit in every slab i > e_j that
    is read. It is copied there lazily, like "recompute"'s fill: before a token runs loop i, the past
    positions that lack loop i get loop i - 1's entry (which is e_j's, by induction). Only loops
    that a later token reaches are copied, which spares the pool a strided copy per halted token
    and loop up to the cap."""

    name = "latest"
    keeps_exit_entry = True

    def before_loop(self, model, cache, loop, upto):
        B = cache.filled.shape[0]  # every row: lockstep rows halt at their own loops
        self.before_loops(model, cache, np.arange(B), np.full(B, loop), np.full(B, upto))

    def before_loops(self, model, cache, rows, loops, uptos):
        filled = cache.filled[rows]
        need = (filled < loops[:, None]) & (np.arange(filled.shape[1]) < uptos[:, None])
        at, pos = np.nonzero(need)
        if pos.size == 0:
            return
        b, loop = rows[at], loops[at]
        if (cache.filled[b, pos] < loop - 1).any():
            raise RuntimeError("latest fill out of order")  # loops are always filled in order
        cache.filled[b, pos] = loop
        core = cache.core  # (2, n_core, B, loops, Hkv, max_len, hd)
        b, pos, loop = (torch.from_numpy(a).to(core.device) for a in (b, pos, loop))
        core[:, :, b, loop - 1, :, pos] = core[:, :, b, loop - 2, :, pos]

    def finish(self, cache, start, exits, loops_run):
        # loops after a row's exit hold what its frozen state wrote (lockstep decoding) or copies
        # (prefill): either way they are refilled from the exit loop's entry when read
        cache.filled[:, start:start + exits.shape[1]] = exits.cpu().numpy()


class RecomputeRule(KVRule):
    """The masking harness's rule: the entry j would write at loop i with its state frozen (the core
    step run on its exit state at loop i). Missing entries are filled lazily, all past positions
    that lack loop i in one core step, before a later token runs loop i."""

    name = "recompute"

    def before_loop(self, model, cache, loop, upto):
        missing = missing_positions(cache, loop, upto)
        if missing.size == 0:
            return
        has = cache.filled[:, missing] >= loop  # rows that computed the loop there while looping
        frozen_entries(model, cache, loop, torch.from_numpy(missing).to(cache.exit_state.device),
                       torch.from_numpy(has).to(cache.exit_state.device) if has.any() else None)
        cache.filled[:, missing] = np.maximum(cache.filled[:, missing], loop)

    def finish(self, cache, start, exits, loops_run):
        cache.filled[:, start:start + exits.shape[1]] = loops_run


class ContinueRule(KVRule):
    """Ouro's rule (its reference code runs every token through every step; the gate only picks
    which step's output a token returns): the entry j writes at loop i with its state never frozen,
    i.e. the loops after its exit run on from its exit state as if it had not halted. With this
    rule every entry is the uniform-depth forward's, whatever the policy, and a token's output at its
    exit loop is the full forward's output at that loop: decoding is exactly the reference's full
    recompute with the exit chosen per token.

    Nothing past a token's exit is computed when it halts. A later token that reaches loop i needs
    loop i of every earlier position: those that lack it run loop i from their running state
    (`LoopKVCache.run_state`) in the same core call as the later token's own loop i (`run_loop`:
    one pass over the weights for all of them, which at batch 1 costs about what the token alone
    does), so a position runs at most as many loops as the deepest exit at or after it."""

    name = "continue"
    loops_on = True

    def run_loop(self, model, cache, loop, state, inject, pos, keep=None):
        """As KVRule.run_loop; the positions before pos that lack the loop run in the same call
        (keep is None for this rule: prefill_keep never sets it)."""
        missing = missing_positions(cache, loop, pos if isinstance(pos, int) else int(pos[0]))
        if missing.size == 0:
            return core_loop(model, cache, loop, state, inject, pos)
        ride = torch.from_numpy(missing).to(state.device)
        at = torch.cat([ride, cache.positions[pos:pos + 1] if isinstance(pos, int) else pos])
        out = core_loop(model, cache, loop, torch.cat([cache.run_state[:, ride], state], 1),
                        torch.cat([cache.inject[:, ride], inject], 1), at)
        self._advance(cache, loop, missing, out[:, :len(missing)])
        return out[:, len(missing):]

    def before_loop(self, model, cache, loop, upto):
        missing = missing_positions(cache, loop, upto)
        if missing.size == 0:
            return
        pos = torch.from_numpy(missing).to(cache.run_state.device)
        self._advance(cache, loop, missing, core_loop(model, cache, loop, cache.run_state[:, pos],
                                                      cache.inject[:, pos], pos))

    @staticmethod
    def _advance(cache, loop, missing: np.ndarray, state: Tensor) -> None:
        cache.run_state[:, torch.from_numpy(missing).to(state.device)] = state
        cache.filled[:, missing] = loop

    def finish(self, cache, start, exits, loops_run):
        cache.filled[:, start:start + exits.shape[1]] = loops_run  # halted rows looped on to loops_run


KV_RULES = {rule.name: rule for rule in (LatestRule(), RecomputeRule(), ContinueRule())}


def default_rule(model=None) -> str:
    """The KV rule decoding uses unless told: "continue" for a model with a learned exit gate (Ouro,
    whose own code and training run every token through every step: its outputs are the
    reference's only under this rule), else SETTINGS.kv_rule."""
    return "continue" if getattr(model, "exit_gate", None) is not None else SETTINGS.kv_rule


def kv_rule(rule: str | KVRule | None, model=None) -> KVRule:
    """The rule object of a name ("latest", "recompute" or "continue"), or the rule itself; None:
    the model's default (`default_rule`)."""
    if isinstance(rule, KVRule):
        return rule
    rule = default_rule(model) if rule is None else rule
    if rule not in KV_RULES:
        raise ValueError(f"kv_rule must be one of {tuple(KV_RULES)}, got {rule!r}")
    return KV_RULES[rule]
