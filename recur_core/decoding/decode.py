"""Autoregressive decoding with real per-token halting and a KV cache per (loop, core layer).

    gen = generate(ckpt, "Once upon a time", 64, ConvergenceExit(1e-3))
    gen.text, gen.exit_loops, gen.tokens_per_s, gen.mean_loops

Every token runs the prelude once, then core loops until its policy halts it, then the coda and the
LM head once, on its exit state; skipped loops are really not computed. The model's own blocks do
the work (model.py, with the cache views of recur_core.decoding.kv); the KV rules ("latest", "recompute",
"continue") are the objects of recur_core.decoding.kv. `generate` decodes one sequence, `teacher_forced` B windows in
lockstep; recur_core.decoding.serve batches many sequences whose tokens sit at different loops. The design
(signals, noise, caches, the rules, what is exact) is in docs/DECODING.md.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .. import cancel
from ..exits.halting import Freezing, HaltSchedule, read_start
from ..exits.policies import Policy, Uniform
from ..exits.readout import readout_group
from ..exits.signals import readout_signals
from ..model.checkpoint import Checkpoint, resolve_model
from ..model.looped_lm import LoopedLM
from ..settings import SETTINGS, seed_for
from .kv import ExitContextKV, LoopKVCache, RowsKV, SlabKV
from .kv import kv_rule as named_rule


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
    kv_rule: str = SETTINGS.kv_rule

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


# -- the decoder -------------------------------------------------------------------------------------
def default_max_loops(policy: Policy | None, ckpt: Checkpoint | None, max_loops: int | None) -> int:
    """max_loops if given, else the policy's r_max, else the checkpoint recipe's r_max."""
    if max_loops is not None:
        return int(max_loops)
    if policy is not None and policy.r_max is not None:
        return int(policy.r_max)
    if ckpt is not None:
        return ckpt.recipe.r_max
    raise ValueError("pass max_loops (a bare model has no recipe r_max)")


# A lockstep step computes only its rows still looping once at most this share of them does (their keys
# copied out of the cache, the others left alone), padded with halted rows up to COMPACT_MIN_ROWS: with
# fewer rows the CPU's matrix products take other kernels, whose float rounding differs.
COMPACT_SHARE = 0.5
COMPACT_MIN_ROWS = 4


def _all_rows(x, rows: Tensor | None, B: int):
    """A tensor (k, ...) of the rows `rows`, or a dict of them, as B rows (zeros elsewhere)."""
    if rows is None:
        return x
    if isinstance(x, dict):
        return {name: _all_rows(value, rows, B) for name, value in x.items()}
    return x.new_zeros((B, *x.shape[1:])).index_copy_(0, rows, x)


class Decoder:
    """One decoding session over B rows in lockstep: a cache, a halting schedule and a KV rule."""

    def __init__(self, model: LoopedLM, schedule: HaltSchedule, *, batch: int = 1, kv_rule=None, noise: Tensor,
                 cache: LoopKVCache | None = None, max_len: int | None = None):
        """schedule: the policy, its loop cap and check period (this session's own: a remembering
        policy's memory is the schedule's). max_len: the context the cache holds (default
        max_seq_len; generate sizes it to the prompt plus the new tokens, which keeps a large model's
        per-loop caches small). kv_rule: a name or rule of recur_core.decoding.kv (None: the model's
        default, kv.default_rule)."""
        self.model, self.B = model, batch
        self.schedule, self.policy = schedule, schedule.policy
        self.rule = named_rule(kv_rule, model)
        self.cap = schedule.cap
        cfg = model.cfg
        weight = model.embed.weight
        self.cache = cache or LoopKVCache(cfg, batch, self.cap, max_len or cfg.max_seq_len, weight.device,
                                          weight.dtype)
        self.positions = torch.arange(cfg.max_seq_len, device=weight.device)
        self.noise = noise.to(device=weight.device, dtype=weight.dtype)  # (B, max_seq_len, d)
        self.readouts = 0
        self.exit_context = False  # prefill's per-loop readouts: see _loop_hidden
        # a step leaves its halted rows out (`_rows_to_run`) only where that changes no bit: under "latest" their
        # later entries are copies; under "recompute" on a one-block core a projection of the frozen state
        # (`LoopedLM.core_entries`), while a deeper core's fill runs its first blocks over several positions at
        # once, whose attention rounds otherwise than one position's; "continue" steps halted rows on
        self.compacts = not self.rule.loops_on and (self.rule.keeps_exit_entry or len(model.core_blocks) == 1)

    def select(self, rows: Tensor) -> Decoder:
        """This session for the rows `rows` (a LongTensor of row indices) alone: their cache entries
        and noise copied, the schedule and KV rule shared, the readout count carried on (the fixed
        point drops the windows it has settled)."""
        twin = copy.copy(self)
        twin.B, twin.cache = len(rows), self.cache.select(rows)
        twin.noise = self.noise.index_select(0, rows.to(self.noise.device))
        return twin

    def _at(self, pos):
        """The positions tensor of pos (an int or a LongTensor)."""
        return self.positions[pos:pos + 1] if isinstance(pos, int) else pos

    def prelude(self, ids: Tensor, pos) -> Tensor:
        """The prelude for ids at positions pos (writing their prelude cache entries): e (B, Tq, d)."""
        kv = [SlabKV(k, v, pos) for k, v in self.cache.prelude_slabs()]
        return self.model.prelude(ids, self._at(pos), kv)

    def _check_room(self, end: int) -> None:
        """A clear error, before anything is written, for positions the cache cannot hold."""
        if end > self.cache.max_len:
            raise ValueError(f"positions up to {end - 1} do not fit the cache's context of {self.cache.max_len} "
                             "tokens (max_len)")

    def _readout(self, state: Tensor, pos, rows: Tensor | None = None) -> Tensor:
        """Coda (writing this position's coda cache entries) -> final norm -> head: logits (B, Tq, V);
        rows: the states are those of these rows of the cache alone (one position pos)."""
        self.readouts += 1
        kv = [SlabKV(k, v, pos) if rows is None else RowsKV(k, v, rows, pos) for k, v in self.cache.coda_slabs()]
        return self.model.readout(state, self._at(pos), kv)

    def _first_logp(self, state: Tensor, pos) -> Tensor:
        """log p_0 (float32) of the initial states at pos (an int, or a prefill's positions, every
        token live), before loop 1 (`HaltSchedule.first_readout`): `read_start` through the cache
        views of a per-loop readout (`_loop_views`)."""
        self.readouts += 1
        hidden = read_start(self.model, state, self._at(pos), self._loop_views(pos))
        return torch.log_softmax(self.model.head(hidden).float(), dim=-1)

    def _loop_signals(self, state: Tensor, pos: Tensor, live: Tensor, logp_prev: tuple | None,
                      logp: Tensor | None = None):
        """A prefill's per-loop readout: (the readout signals the policy reads, (B, P) each, or None
        before the first readout; this readout for the next loop). Only the live tokens' distributions
        and signals are computed (a halted token's are never consulted; its signals are NaN, argmax -1).
        A readout is (log p (n, V) float32 of its n live tokens in row-major order, their mask (B, P)):
        the live tokens of a later loop are among them, so the previous log p of each is a row of it
        (no (B, P, V) tensor is kept). logp: the live tokens' log p when already read out (a replay's
        readahead), else computed here."""
        if logp is None:
            logp = self._live_logp(state, pos, live)
        if logp_prev is None:
            return None, (logp, live)
        rows, was_live = logp_prev
        previous = rows if len(rows) == len(logp) else rows[live[was_live]]  # nothing halted since: as it is
        signals = {}
        for name, value in readout_signals(logp, previous, self.schedule.readout_fields).items():
            signals[name] = value.new_full(live.shape, -1 if name == "argmax" else math.nan)
            signals[name][live] = value
        return signals, (logp, live)

    def _live_logp(self, state: Tensor, pos: Tensor, live: Tensor) -> Tensor:
        """log p (n, V) float32 of the n live tokens (row-major order). With `exit_context` the coda
        reads only the columns where some row still loops (it writes nothing); without, it runs every
        position, writing each one's coda entry for the later positions to read."""
        self.readouts += 1
        if self.exit_context:
            cols = live.any(0).nonzero()[:, 0]
            hidden = self._loop_hidden(state[:, cols], pos[cols])[live[:, cols]]
        else:
            hidden = self._loop_hidden(state, pos)[live]
        return torch.log_softmax(self.model.head(hidden).float(), dim=-1)

    def _loop_hidden(self, state: Tensor, pos: Tensor) -> Tensor:
        """A prefill's per-loop coda hidden (B, P, d), through `_loop_views`; with `exit_context`,
        state may stack several loops' states of the B rows, (G * B, P, d) loop-major."""
        return self.model.coda(state, pos, self._loop_views(pos))

    def _loop_views(self, pos) -> list:
        """The coda's cache views of a per-loop readout: writing these positions' entries, or with
        `exit_context` set, reading the earlier positions' entries as the cache holds them (their exit
        states' of the previous fixed-point pass) without writing any (kv.ExitContextKV)."""
        view = ExitContextKV if self.exit_context else SlabKV
        return [view(k, v, pos) for k, v in self.cache.coda_slabs()]

    # -- one position (Tq = 1, B rows in lockstep) ---------------------------------------------------
    def step(self, ids: Tensor, pos: int) -> tuple[Tensor, Tensor]:
        """Run tokens ids (B,) at position pos until each halts; returns (logits (B, V), exits (B,)).

        Rows in lockstep loop until the last of them halts. Once at most COMPACT_SHARE of them still
        loop, a loop computes only those (`_rows_to_run`; padded to COMPACT_MIN_ROWS rows with rows
        that have halted, so the products keep their kernels and bits): a halted row's state is frozen
        and its output discarded, and the entries it would have written are filled when a later
        position reads them ("latest": copies; "recompute": computed alone), where that is bit for bit
        the same (`compacts`)."""
        B, cache, sched = self.B, self.cache, self.schedule
        self._check_room(pos + 1)
        inject = self.model.inject(self.prelude(ids.view(B, 1), pos))
        cache.inject[:, pos] = inject[:, 0]
        state = run = self.model.start_state(self.noise[:, pos:pos + 1], inject)  # run: see KVRule.loops_on
        logp_prev = kept = None
        if sched.wants_readout(0):
            logp_prev = self._first_logp(state, pos)
        # batch 1 stops at its token's halt; B rows in lockstep freeze the halted ones until all have
        freezing = Freezing.start((B, 1), state.device) if B > 1 else None
        read = torch.zeros(B, 1, dtype=torch.bool, device=state.device)  # the exit loop was read out
        rows, ran = None, np.zeros((B, 1), dtype=np.int64)  # rows computed (None: all); loops each ran
        for loop in range(1, self.cap + 1):
            if freezing is not None and self.compacts:
                rows, logp_prev = self._rows_to_run(freezing.live[:, 0], rows, logp_prev)
            out = self._run_loop(loop, run, inject, state, pos, rows)
            ran[slice(None) if rows is None else rows.cpu().numpy()] = loop
            new = out if freezing is None else torch.where(freezing.frozen[..., None], state, out)
            run = out if self.rule.loops_on else new
            signals = logits = None
            if sched.wants_readout(loop):
                logits = self._readout(new if rows is None else new[rows], pos, rows)
                logp = torch.log_softmax(logits.float(), dim=-1)
                if logp_prev is not None:
                    signals = _all_rows(readout_signals(logp, logp_prev, sched.readout_fields), rows, B)
                logp_prev = logp
                logits = _all_rows(logits, rows, B)
            if freezing is None:  # batch 1: this token is done when it halts
                stop, state = sched.halt(loop, new, state, signals), new
                if bool(stop):
                    kept, read[:] = logits, logits is not None
                    break
                continue
            stop = freezing.update(loop, sched.consult(loop, new, state, signals), sched.at_cap(loop))
            state = new
            if logits is not None:
                kept = logits if kept is None else torch.where(stop[..., None], logits, kept)
                read |= stop
            if bool(freezing.frozen.all()):
                break
        exits = torch.full((B, 1), loop, dtype=torch.long, device=state.device) if freezing is None \
            else freezing.exit_depth
        cache.exit_state[:, pos] = state[:, 0]
        cache.run_state[:, pos] = run[:, 0]
        cache.exit_loop[:, pos] = exits[:, 0].cpu()
        self.rule.finish(cache, pos, exits, loop if rows is None else ran)
        if kept is None:  # no readout at the exit loop: read out the exit state once
            kept = self._readout(state, pos)
        elif not bool(read.all()):  # rows that halted where nothing was read out
            kept = torch.where(read[..., None], kept, self._readout(state, pos))
        return kept[:, 0], exits[:, 0]

    def _rows_to_run(self, live: Tensor, rows: Tensor | None, logp_prev: Tensor | None):
        """The rows the next loop computes (an ascending LongTensor, or None for all) and logp_prev
        narrowed to them: every row while more than COMPACT_SHARE of them loop, then the live ones,
        padded with rows of the previous loop's set up to COMPACT_MIN_ROWS (a row once left out is
        never computed again: the loops a row ran at a position are 1 .. its last)."""
        n_live = int(live.sum())
        if n_live > COMPACT_SHARE * self.B:
            return rows, logp_prev
        pool = torch.arange(self.B, device=live.device) if rows is None else rows
        keep = live[pool]
        short = COMPACT_MIN_ROWS - n_live
        if short > 0:
            keep = keep | (torch.cumsum((~keep).long(), 0) <= short)
        if bool(keep.all()):
            return rows, logp_prev
        return pool[keep], None if logp_prev is None else logp_prev[keep]

    def _run_loop(self, loop: int, run: Tensor, inject: Tensor, state: Tensor, pos: int, rows: Tensor | None):
        """One core loop of the rows (all: the KV rule's run_loop), the others' state as it is."""
        if rows is None:
            return self.rule.run_loop(self.model, self.cache, loop, run, inject, pos)
        out = self.rule.run_loop(self.model, self.cache, loop, run[rows], inject[rows], pos, rows=rows)
        return state.index_copy(0, rows, out)

    # -- the prompt, in parallel ----------------------------------------------------------------------
    def prefill(self, ids: Tensor, start: int = 0, *, record: list | None = None,
                replay: list | None = None) -> tuple[Tensor, Tensor]:
        """Run prompt tokens ids (B, P) at positions start .. start + P - 1 in parallel with per-token
        exits (docs/DECODING.md); positions before start must already be in the cache (an earlier
        chunk of the prompt). Returns (logits (B, P, V) read out from the exit states, exits (B, P)).

        record: a list that receives the core's output of every loop. replay: such a list, read
        instead of running the core (its cache entries are the recorded pass's): exact up to the
        first token whose exit differs from the recorded pass's (the core depends on the exits alone),
        which is how the fixed point checks a guess at the cost of the readouts. Tokens still looping
        when the replay runs out exit at 0."""
        B, P = ids.shape
        cache, sched = self.cache, self.schedule
        self._check_room(start + P)
        pos = self.positions[start:start + P]
        inject = self.model.inject(self.prelude(ids, pos))
        cache.inject[:, pos] = inject
        state = run = self.model.start_state(self.noise[:, pos], inject)  # run: see KVRule.loops_on
        logp_prev = None
        freezing = Freezing.start((B, P), state.device)
        if sched.wants_readout(0):
            logp_prev = (self._first_logp(state, pos).flatten(0, 1), freezing.live)
        ahead = _Readahead(self, replay, pos) if replay is not None and self.exit_context else None
        for loop in range(1, self.cap + 1):
            cancel.check()
            if replay is not None:
                if loop > len(replay):
                    loop -= 1  # the loops run: the recorded pass wrote entries through this one
                    break
                out = replay[loop - 1]
            else:
                keep = self.rule.prefill_keep(cache, loop, freezing.frozen)
                out = self.rule.run_loop(self.model, cache, loop, run, inject, pos, keep)  # earlier chunks first
                if record is not None:
                    record.append(out)
            new = torch.where(freezing.frozen[..., None], state, out)
            run = out if self.rule.loops_on else new
            signals = None
            if sched.wants_readout(loop):
                logp = None if ahead is None else ahead.logp(loop, freezing.live)
                signals, logp_prev = self._loop_signals(new, pos, freezing.live, logp_prev, logp)
            freezing.update(loop, sched.consult(loop, new, state, signals), sched.at_cap(loop))
            state = new
            if bool(freezing.frozen.all()):
                break
        exits = freezing.exit_depth
        cache.exit_state[:, pos] = state
        cache.run_state[:, pos] = run
        cache.exit_loop[:, pos.cpu()] = exits.cpu()
        self.rule.finish(cache, start, exits, loop)
        return self._readout(state, pos), exits

    def prefill_chunked(self, ids: Tensor, chunk: int | None) -> tuple[Tensor, Tensor]:
        """`prefill` over the prompt in consecutive chunks of `chunk` positions (None: all at once).
        A chunk's tokens read the earlier chunks' entries of every loop under the KV rule, as a
        decoded token would; for policies that read only the state (A0, A2, the latent rule) that
        is exactly the one-piece prefill, while A1's readouts then see earlier chunks' exit
        readouts instead of their current loop's (tests/test_decode.py)."""
        P = ids.shape[1]
        check_chunk(chunk)
        chunk = chunk or P
        parts = [self.prefill(ids[:, c:c + chunk], c) for c in range(0, P, chunk)]
        return parts[-1][0], torch.cat([exits for _, exits in parts], dim=1)


# The float32 log-probabilities a replay's readahead (_Readahead) may hold at once.
READAHEAD_BYTES = 256 << 20


class _Readahead:
    """The readouts of a replayed prefill (`Decoder.prefill(replay=...)`, with `exit_context`), a group
    of upcoming read loops at a time. A token live at a replayed loop holds that loop's recorded core
    output, and an exit-context readout reads no other query of its call, so the states of the loops
    ahead are known before their halts are: one coda call over the group's loops stacked on the batch
    and one head call read each weight once per group instead of once per loop, which is what a readout
    costs on a large model; as many loops as the tracer groups (`readout_group`: a batch of many windows
    is read out a loop at a time, as a group would only add the readouts of tokens that halt inside it).
    A token that halts inside a group had readouts computed that nobody reads."""

    def __init__(self, dec: Decoder, replay: list[Tensor], pos: Tensor):
        self.dec, self.replay, self.pos = dec, replay, pos
        self.loops: list[int] = []
        self.live0 = self.group = None

    def logp(self, loop: int, live: Tensor) -> Tensor:
        """log p (n, V) float32 of the n tokens live at `loop` (row-major order), as `_live_logp`."""
        if loop not in self.loops:
            self._read(loop, live)
        self.dec.readouts += 1
        return self.group[self.loops.index(loop)][live[self.live0]]

    def _read(self, loop: int, live: Tensor) -> None:
        dec = self.dec
        n, V = int(live.sum()), dec.model.head_weight.shape[0]
        size = max(1, min(readout_group(n), READAHEAD_BYTES // (4 * n * V)))
        self.loops = [i for i in range(loop, len(self.replay) + 1) if dec.schedule.wants_readout(i)][:size]
        cols = live.any(0).nonzero()[:, 0]
        states = torch.cat([self.replay[i - 1][:, cols] for i in self.loops])  # (G * B, P', d), loop-major
        hidden = dec._loop_hidden(states, self.pos[cols]).unflatten(0, (len(self.loops), dec.B))
        self.live0 = live
        self.group = torch.log_softmax(dec.model.head(hidden[:, live[:, cols]]).float(), dim=-1)  # (G, n, V)


# -- sampling ----------------------------------------------------------------------------------------
def takes_argmax(greedy: bool, temperature: float) -> bool:
    """Whether sampling with these settings is the argmax (greedy, or temperature 0)."""
    return greedy or temperature <= 0


def sample_next(logits: Tensor, generator: torch.Generator | None, *, greedy: bool = False,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> int:
    """One token id from logits (V,): greedy (or temperature 0) takes the argmax; otherwise
    softmax(logits / temperature) restricted to the top_k ids and to the smallest set whose
    probability reaches top_p, sampled with `generator` on its device (the host's seeded
    generators: the same seed draws the same way whatever device the logits are on)."""
    if takes_argmax(greedy, temperature):
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
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs if generator is None else probs.to(generator.device), 1, generator=generator))


# -- public API --------------------------------------------------------------------------------------
def check_chunk(prefill_chunk: int | None) -> None:
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")


def check_lengths(prompt_len: int, max_new_tokens: int, max_len: int) -> None:
    """A clear error for a request the context cannot hold (the last new token is sampled, never run)."""
    if prompt_len == 0:
        raise ValueError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens - 1 > max_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + {max_new_tokens} new tokens exceed the context "
                         f"(max_seq_len {max_len})")


def encode_prompt(prompt, ckpt: Checkpoint | None, tokenizer):
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
def generate(ckpt_or_model, prompt, max_new_tokens: int, policy: Policy | None = None, *,
             kv_rule: str | None = None,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, max_loops: int | None = None, stop_ids=(), keep_logits: bool = True,
             tokenizer=None, on_token=None, check_every: int = 1, prefill_chunk: int | None = None) -> Generation:
    """Decode max_new_tokens after `prompt` (text, or token ids) at batch 1 with per-token exits.

    policy: a recur_core.exits.policies policy; None disables exits (every token runs max_loops).
    max_loops: the loop cap (default: the policy's r_max, else the checkpoint recipe's r_max).
    kv_rule: "latest", "recompute" or "continue" (recur_core.decoding.kv; None: the model's default,
    "continue" for Ouro, whose reference this then reproduces, else SETTINGS.kv_rule). Sampling: greedy, or temperature / top_k / top_p
    with a generator seeded by `seed` (which also seeds the state noise, see docs/DECODING.md).
    stop_ids: token ids that end the generation once sampled (kept in the output).
    on_token(index, token_id, exit_loop): called as each new token is sampled (for live display);
    its time is left out of decode_s.
    check_every: consult the policy at min_loops and then every n loops only (a cheaper check for
    A1: it reads out only there, and its kl_prev becomes KL(p_i || p_{i-n})).
    prefill_chunk: run the prompt in chunks of this many positions (Decoder.prefill_chunked; None:
    all at once), as a pool request with the same prefill_chunk does (there it bounds the rows a
    joining prompt adds to the shared step).
    """
    model, ckpt = resolve_model(ckpt_or_model)
    prompt_ids, tokenizer = encode_prompt(prompt, ckpt, tokenizer)
    check_lengths(len(prompt_ids), max_new_tokens, model.cfg.max_seq_len)
    check_chunk(prefill_chunk)
    cap = default_max_loops(policy, ckpt, max_loops)
    policy = policy if policy is not None else Uniform(cap)
    dec = Decoder(model, HaltSchedule(policy, cap, check_every), kv_rule=kv_rule, noise=model.seeded_state([0], seed),
                  max_len=len(prompt_ids) + max_new_tokens)
    sampler = torch.Generator().manual_seed(seed)
    sample = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    device = model.embed.weight.device

    t0 = time.perf_counter()
    logits, prompt_exits = dec.prefill_chunked(torch.tensor([prompt_ids], device=device), prefill_chunk)
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
                      readouts=dec.readouts, step_readouts=step_readouts, policy=repr(policy), kv_rule=dec.rule.name)


# -- drift of kept logits ----------------------------------------------------------------------------
@dataclass
class Drift:
    """How far kept logits are from a reference (e.g. the same tokens recomputed at full depth)."""

    kl_mean: float  # mean KL(p_ref || p_kept), nats
    kl_max: float
    argmax_agree: float  # fraction of tokens whose argmax is unchanged
    max_abs_logit: float


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
    model, _ = resolve_model(ckpt_or_model)
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.embed.weight.device)[None]
    gen = torch.Generator().manual_seed(seed_for(seed, row))
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
