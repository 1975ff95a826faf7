"""Depth-wise batched decoding: a pool of sequences whose tokens sit at different loops share one
core step (continuous batching over depth).

    pool = Pool(ckpt, slots=8)
    ids = [pool.submit(Request(prompt, 128, ConvergenceExit(1e-2), seed=n)) for n, prompt in ...]
    done = pool.run()                       # {request id: Completion}

The core is weight-tied, so a token at loop 2 and a token at loop 7 run the same matmuls: only the
KV-cache slab their attention reads, (their sequence, their loop, the layer), differs. Every
`step()`:

  1. free slots take waiting requests; one batched prelude call runs their prompts and the tokens
     sampled on the previous step together. A prompt's positions become the sequence's rows: they
     loop together, one loop per step, inside the shared core step (in-batch prefill: a joining
     request never stalls the others; with the request's prefill_chunk, one chunk of positions
     after another, so it adds at most that many rows); a sampled token's state starts as noise;
  2. every in-flight row runs one core loop, whatever its loop index, in one batched
     `model.core_step`; row n reads and writes its own slab (recur_core.decoding.kv.GatherKV: keys gathered
     per row and masked at the row's position, rows in chunks sorted by position, kv.key_chunks);
  3. the policies that decide without a readout decide (one call per policy for all its rows when it
     takes a loop per token, `HaltSchedule.per_token_loops`; else one per policy and loop);
  4. one batched coda + head call reads out the rows whose policy reads out at this loop (A1) and
     the halted ones of step 3, at their exit states; then A1 decides;
  5. halted tokens finish their position under their KV rule, and the next token is sampled; a
     prompt does this when its last position halts (until then its halted positions are frozen, as
     in `Decoder.prefill`: under "latest" they leave the core step, `_Sequence.sheds_halted`); a
     finished sequence leaves its slot.

So a step makes one call of each kind whatever the mix of policies and prompts in it (plus the
noise state's readout before the core when a readout policy checks from loop 1): on a CPU most of
a small call's cost is fixed (docs/benchmarks/serving-pool.md).

Each sequence keeps batch-1 semantics: its policy, KV rule ("recompute" and "continue" fill its
missing entries with its own small core step before the batched one), noise (model.seeded_state([0], seed), as `generate`),
sampler (seeded with its seed) and the parallel prefill's rules for its prompt, so it decodes to
what `decode.generate` gives it alone (tests/test_serve.py), up to float rounding of the batched
matmuls.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby, pairwise

import numpy as np
import torch
from torch import Tensor

from ..exits.halting import Freezing, HaltSchedule, read_start
from ..exits.policies import Policy, Uniform
from ..exits.signals import readout_signals, state_signals
from ..model.checkpoint import resolve_model
from .decode import (
    Decoder,
    check_chunk,
    check_lengths,
    default_max_loops,
    encode_prompt,
    sample_next,
    takes_argmax,
)
from .kv import GatherKV, LoopKVCache, key_chunks, kv_rule


@dataclass
class Request:
    """One generation: what `decode.generate` takes, as data. policy None: no exits (every token
    runs the pool's max_loops)."""

    prompt: object  # text (needs the checkpoint's tokenizer) or token ids
    max_new_tokens: int
    policy: Policy | None = None
    kv_rule: str | None = None  # None: the model's default (recur_core.decoding.kv.default_rule)
    seed: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple = ()
    check_every: int = 1
    prefill_chunk: int | None = None  # the prompt loops in chunks of this many positions (None: all at once)


@dataclass
class Completion:
    """A finished request. token_s[k]: perf_counter time at which new token k was sampled;
    token_steps[k]: the pool step that sampled it (a token that exits at loop e is sampled e steps
    after the one before it: no sequence ever waits a step); admitted_s: when it took a slot (its
    prefill began). error: why a request was refused (nothing else is set)."""

    request_id: int
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)
    logits: Tensor | None = None
    prompt_exit_loops: list[int] = field(default_factory=list)
    prompt_row_loops: list[int] = field(default_factory=list)  # per prompt position: core loops it was run in
    prompt_row_readouts: list[int] = field(default_factory=list)  # per prompt position: coda + head passes
    step_readouts: list[int] = field(default_factory=list)  # coda + head passes per decode step
    prefill_readouts: int = 0
    token_s: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    admitted_s: float = 0.0
    policy: str = ""
    kv_rule: str = ""
    error: str | None = None

    @property
    def latencies_s(self) -> list[float]:
        """Per new token: seconds since the previous one (the first: since admission, the prefill)."""
        stamps = [self.admitted_s] + self.token_s
        return [b - a for a, b in pairwise(stamps)]

    @property
    def decode_exit_loops(self) -> list[int]:
        return self.exit_loops[1:]


class _Sequence:
    """A request in a slot: its decoder (slot cache view, schedule, KV rule), sampler and the rows it
    puts in the core step. While prefilling (`freezing` is not None: the chunk's halted positions
    and exit loops, recur_core.exits.halting.Freezing) the rows are positions of its prompt's current
    chunk, pos .. pos + chunk - 1 (the whole prompt unless the request sets prefill_chunk), looping
    together. With `sheds_halted` (a KV rule that keeps a halted token's exit entry, "latest", and a
    policy that neither remembers earlier loops nor reads out) only the ones still looping (`live`:
    their indices in the chunk; a halted one's entries are copied forward, its state waits in the
    cache's exit_state), else all of them, the halted ones frozen;
    then one row, the token in flight at position pos. `loop` loops run so far (0: not yet looped).
    state / inject: (rows, 1, d); run: the prompt rows' running states under a rule whose halted
    tokens loop on (KVRule.loops_on; the halted rows' `state` is their exit state), else None."""

    def __init__(self, rid: int, slot: int, req: Request, dec: Decoder, prompt_ids, keep_logits: bool):
        self.rid, self.slot, self.req, self.dec = rid, slot, req, dec
        self.sampler = torch.Generator().manual_seed(req.seed)
        self.sample = dict(greedy=req.greedy, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        self.stops = {int(i) for i in req.stop_ids}
        self.out = Completion(rid, prompt_ids=list(prompt_ids), policy=repr(dec.policy), kv_rule=dec.rule.name)
        self.kept = [] if keep_logits else None
        # halted prompt positions leave the core step: their entries are copied anyway ("latest"),
        # no per-row memory to keep aligned, and no readout whose later coda layers they would feed
        self.sheds_halted = (dec.rule.keeps_exit_entry and not dec.policy.remembers_loops
                             and not dec.schedule.needs_readout)
        self.pos = 0
        self.loop = 0
        self.readouts_before = 0
        self.freezing = self.live = self.row_loops = self.row_readouts = None
        self.positions = self.state = self.inject = self.logp_prev = self.logits = self.signals = None
        self.run = None

    @property
    def schedule(self):
        return self.dec.schedule

    @property
    def prefilling(self) -> bool:
        return self.freezing is not None

    @property
    def n_rows(self) -> int:
        return len(self.positions)  # its rows' positions

    @property
    def greedy(self) -> bool:
        return takes_argmax(self.req.greedy, self.req.temperature)

    def emit(self, logits: Tensor, exit_loop: int, step: int, token: int | None = None) -> bool:
        """Sample the next token from logits (V,) at pool step `step` (token: its argmax, when the
        caller took it already); True when the sequence is finished."""
        token = sample_next(logits, self.sampler, **self.sample) if token is None else token
        if self.out.ids:
            self.out.step_readouts.append(self.dec.readouts - self.readouts_before)
        else:
            self.out.prefill_readouts = self.dec.readouts
        self.readouts_before = self.dec.readouts
        self.out.ids.append(token)
        self.out.exit_loops.append(exit_loop)
        self.out.token_s.append(time.perf_counter())
        self.out.token_steps.append(step)
        if self.kept is not None:
            self.kept.append(logits.float())
        return len(self.out.ids) >= self.req.max_new_tokens or token in self.stops

    def finish(self) -> Completion:
        if self.kept is not None:
            self.out.logits = torch.stack(self.kept).cpu()
        return self.out


class Pool:
    """Continuous batching of `slots` sequences, each token at its own loop (module doc).

    max_loops: the loop budget of the cache (default: the checkpoint recipe's r_max); every
    request's cap is min(its policy's r_max, max_loops). max_len: context of the cache (default
    the model's max_seq_len); a request must fit in it.
    """

    def __init__(self, ckpt_or_model, slots: int = 8, *, max_loops: int | None = None, max_len: int | None = None,
                 keep_logits: bool = True, tokenizer=None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.ckpt = resolve_model(ckpt_or_model)
        cfg = self.model.cfg
        self.max_loops = default_max_loops(None, self.ckpt, max_loops)
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        self.tokenizer, self.keep_logits, self.slots = tokenizer, keep_logits, slots
        weight = self.model.embed.weight
        self.device = weight.device
        self.cache = LoopKVCache(cfg, slots, self.max_loops, self.max_len, weight.device, weight.dtype)
        self.waiting: deque = deque()
        self.active: dict[int, _Sequence] = {}  # slot -> sequence
        self.next_id = 0
        self.steps = 0
        self.mixed_steps = 0  # steps whose core batch held tokens at more than one loop index
        # batched model calls of each kind, the rows (token positions) they carried and the seconds
        # spent in them (cache reads included): on a CPU a call's time grows far more slowly than its
        # rows (docs/BENCHMARKS.md), so calls matter too; the rest of a step is the scheduler's
        self.calls = {"prelude": 0, "core": 0, "readout": 0}
        self.call_rows = {"prelude": 0, "core": 0, "readout": 0}
        self.call_s = {"prelude": 0.0, "core": 0.0, "readout": 0.0}

    # -- requests -------------------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. A request the pool cannot run raises ValueError here,
        before it touches any state (the other sequences are unaffected)."""
        if isinstance(request.prompt, str) and self.tokenizer is None and self.ckpt is not None:
            self.tokenizer = self.ckpt.tokenizer()
        prompt_ids, _ = encode_prompt(request.prompt, None, self.tokenizer)
        check_lengths(len(prompt_ids), request.max_new_tokens, self.max_len)
        check_chunk(request.prefill_chunk)
        if any(not 0 <= i < self.model.cfg.vocab_size for i in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model.cfg.vocab_size})")
        policy = request.policy if request.policy is not None else Uniform(self.max_loops)
        HaltSchedule(policy, self.max_loops, request.check_every)  # raises on min_loops > budget, check_every < 1
        kv_rule(request.kv_rule, self.model)  # raises on an unknown rule
        rid = self.next_id
        self.next_id += 1
        self.waiting.append((rid, request, prompt_ids, policy))
        return rid

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def run(self) -> dict[int, Completion]:
        """Step until every queued request has finished."""
        done = {}
        while not self.idle:
            for c in self.step():
                done[c.request_id] = c
        return done

    # -- one step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Admit, then run one core loop for every in-flight row; returns the requests finished.

        Whatever mix of policies and prompts the rows have, a step makes at most one prelude call
        (joining prompts and sampled tokens together), one core call and one readout call after it
        (the rows whose policy reads out at this loop, and the halted ones that still need their
        logits: policies that decide without a readout decide first), plus, when an A1 token
        enters, the readout of its noise state before the core."""
        admitted = self._admit()
        seqs = sorted(self.active.values(), key=self._halt_group)  # a policy's rows at one loop: adjacent
        if not seqs:
            return []
        self.steps += 1
        joining = set(map(id, admitted))  # their prompts start prefilling in this step's prelude call
        entering = [s for s in seqs if s.loop == 0 and not s.prefilling and id(s) not in joining]
        if entering or admitted:
            self._prelude(entering, admitted)
        first = [s for s in seqs if s.loop == 0 and s.schedule.wants_readout(0)]  # A1: the noise state's readout
        if first:
            self._read(first, kl=first, start=True)  # kept as the previous readout of the first check
            for s in first:
                s.logits = None
        old, new = self._loop(seqs)
        row_counts = [s.n_rows for s in seqs]  # each one's rows of new / old (settling sheds halted prompt rows)
        states = state_signals(new, old)
        done_prefill, exiting = self._settle(seqs, self._halts(seqs, row_counts, new, old, states, reading=False))
        reading = [s for s in seqs if s.schedule.wants_readout(s.loop)]
        unread = done_prefill + [s for s in exiting if s.logits is None]  # none of them read at this loop
        if reading or unread:
            self._read(reading + unread, kl=reading)
        if reading:
            more_prefill, more_exiting = self._settle(seqs, self._halts(seqs, row_counts, new, old, states, reading=True))
            done_prefill, exiting = done_prefill + more_prefill, exiting + more_exiting
        finished = []
        for s in done_prefill:
            finished += self._leave_prefill(s)
        if exiting:
            finished += self._exit(exiting)
        return finished

    def _settle(self, seqs, halts: dict[int, Tensor]) -> tuple[list, list]:
        """(prompts whose chunk has halted entirely, sequences whose token halted) among the sequences
        decided in `halts` ({id(s): bool (rows,)}); halted prompt positions are frozen."""
        decided = [(s, halts[id(s)]) for s in seqs if id(s) in halts]
        done_prefill = [s for s, stop in decided if s.prefilling and self._prefill_halts(s, stop)]
        exiting = [s for s, stop in decided if not s.prefilling and bool(stop[0])]
        return done_prefill, exiting

    def _loop(self, seqs) -> tuple[Tensor, Tensor]:
        """One core loop for every row; returns the states (N, 1, d) before and after it."""
        for rule, mine in self._by_rule(seqs):  # each sequence's missing entries of the loop it is about to run
            rule.before_loops(self.model, self.cache, np.array([s.slot for s in mine]),
                              np.array([s.loop + 1 for s in mine]), np.array([s.pos for s in mine]))
        old = torch.cat([s.state for s in seqs])
        new = self._core(seqs, torch.cat([s.state if s.run is None else s.run for s in seqs]))
        at = 0
        for s in seqs:
            s.loop += 1
            s.state, s.logits, s.signals = new[at:at + s.n_rows], None, None
            if s.prefilling:
                s.row_loops[s.live] += 1
                if s.run is not None:  # halted prompt positions loop on, their exit states kept
                    s.run = s.state
                if not s.sheds_halted:  # halted prompt positions ride along, frozen
                    s.state = torch.where(s.freezing.frozen[:, None, None], old[at:at + s.n_rows], s.state)
            at += s.n_rows
        if any(s.prefilling for s in seqs):
            new = torch.cat([s.state for s in seqs])
        return old, new

    def _admit(self) -> list[_Sequence]:
        """Free slots take waiting requests; returns the new sequences (their prompts' prelude runs
        in the step's one prelude call, `_prelude`)."""
        free = [b for b in range(self.slots) if b not in self.active]
        admitted = []
        while free and self.waiting:
            rid, req, prompt_ids, policy = self.waiting.popleft()
            slot = free.pop(0)
            self.cache.reset_row(slot)
            dec = Decoder(self.model, HaltSchedule(policy, self.max_loops, req.check_every), kv_rule=req.kv_rule,
                          noise=self.model.seeded_state([0], req.seed), cache=self.cache.row(slot))
            s = _Sequence(rid, slot, req, dec, prompt_ids, self.keep_logits)
            s.out.admitted_s = time.perf_counter()
            self.active[slot] = s
            admitted.append(s)
        return admitted

    @staticmethod
    def _start_chunk(s: _Sequence, start: int) -> None:
        """The prompt positions start .. start + chunk - 1 become the sequence's rows, from loop 0
        (the prelude already ran over the whole prompt: it does not depend on the loops)."""
        end = min(len(s.out.prompt_ids), start + (s.req.prefill_chunk or len(s.out.prompt_ids)))
        cache = s.dec.cache
        s.positions, s.pos, s.loop, s.logp_prev = list(range(start, end)), start, 0, None
        s.inject = cache.inject[0, start:end, None]
        s.state = s.dec.model.start_state(s.dec.noise[0, start:end, None], s.inject)
        s.run = s.state if s.dec.rule.loops_on else None
        s.freezing = Freezing.start(end - start, cache.inject.device)
        s.live = torch.arange(end - start)
        s.row_loops, s.row_readouts = (torch.zeros(end - start, dtype=torch.long) for _ in range(2))

    @staticmethod
    def _rows(seqs) -> tuple[np.ndarray, np.ndarray]:
        """(slots (N,), positions (N,)) of the in-flight rows, on the host."""
        slots = np.array([s.slot for s in seqs for _ in s.positions], dtype=np.int64)
        pos = np.array([p for s in seqs for p in s.positions], dtype=np.int64)
        return slots, pos

    def _views(self, layers, slabs: np.ndarray, pos: np.ndarray, keep: Tensor | None = None) -> list[GatherKV]:
        """A GatherKV for each layer ((k, v) slabs) of rows reading slabs[n] at pos[n], one plan for all."""
        chunks = key_chunks(slabs, pos, self.cache.bytes_per_key, self.device)
        slabs, pos = torch.from_numpy(slabs).to(self.device), torch.from_numpy(pos).to(self.device)
        return [GatherKV(k, v, slabs, pos, chunks, keep) for k, v in layers]

    @contextmanager
    def _model_call(self, kind: str, rows: int):
        """Count and time one batched model call of `kind` carrying `rows` token positions."""
        self.calls[kind] += 1
        self.call_rows[kind] += rows
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)  # kernels run async
        sync()
        start = time.perf_counter()
        yield
        sync()
        self.call_s[kind] += time.perf_counter() - start

    def _prelude(self, entering, admitted) -> None:
        """One batched prelude call: the tokens sampled on the previous step (their state starts as
        noise) and the whole prompts of the admitted requests (their positions become the sequence's
        rows, looping from this step on; the prelude does not depend on the loops, so a chunked
        prompt's later chunks reuse it). A prompt's positions see each other causally, as in a
        parallel prefill (GatherKV writes every row before any reads)."""
        ids = [s.out.ids[-1] for s in entering] + [i for s in admitted for i in s.out.prompt_ids]
        slots = np.array([s.slot for s in entering] + [s.slot for s in admitted for _ in s.out.prompt_ids],
                         dtype=np.int64)
        pos = np.array([s.pos for s in entering] + [p for s in admitted for p in range(len(s.out.prompt_ids))],
                       dtype=np.int64)
        kv = self._views(self.cache.prelude_slabs(), slots, pos)
        slots_t, pos_t = (torch.from_numpy(x).to(self.device) for x in (slots, pos))  # a model without a prelude has no views
        with self._model_call("prelude", len(ids)):
            inject = self.model.inject(self.model.prelude(torch.tensor(ids, device=self.device)[:, None],
                                                          pos_t[:, None], kv))
        self.cache.inject[slots_t, pos_t] = inject[:, 0]
        for i, s in enumerate(entering):
            s.inject = inject[i:i + 1]
            s.state = self.model.start_state(s.dec.noise[:, s.pos:s.pos + 1], s.inject)
            s.logp_prev = None
        for s in admitted:
            self._start_chunk(s, 0)

    def _core(self, seqs, state: Tensor) -> Tensor:
        """One core loop for every row at its own loop: (N, 1, d) -> (N, 1, d)."""
        slots, pos = self._rows(seqs)
        loops = np.array([s.loop for s in seqs for _ in s.positions], dtype=np.int64)  # loops run so far
        self.mixed_steps += int(len({s.loop for s in seqs}) > 1)
        keep, at = None, 0  # "latest": a halted prompt position's entry of this loop is its previous loop's
        for s in seqs:
            if s.prefilling and s.sheds_halted and s.loop > 0 and bool(s.freezing.frozen.any()):
                self.cache.copy_core_entries(s.slot, s.loop, s.pos + torch.nonzero(s.freezing.frozen.cpu())[:, 0])
            elif s.prefilling and s.dec.rule.keeps_exit_entry:  # it rides along: copied inside the call
                keep = torch.zeros(len(slots), dtype=torch.bool, device=self.device) if keep is None else keep
                keep[at:at + s.n_rows] = s.freezing.frozen
            at += s.n_rows
        layers = [self.cache.core_flat(l) for l in range(self.model.cfg.n_core)]
        kv = self._views(layers, slots * self.max_loops + loops, pos, keep)  # slab of (slot, loop + 1)
        inject = torch.cat([s.inject for s in seqs])
        with self._model_call("core", len(state)):
            return self.model.core_step(state, None, positions=kv[0].pos[:, None], kv=kv, inject=inject)

    def _read(self, seqs, kl=(), start: bool = False) -> None:
        """Coda + head for these rows (each writes its coda entry; start: their initial states, p_0
        by `read_start`); sets s.logits (rows, 1, V) and, for the sequences in kl, s.signals =
        readout_signals(p_now, p_prev) where a previous readout exists (its log-probabilities are
        kept for the next check)."""
        slots, pos = self._rows(seqs)
        kv = self._views(self.cache.coda_slabs(), slots, pos)
        state, positions = torch.cat([s.state for s in seqs]), torch.from_numpy(pos).to(self.device)[:, None]
        with self._model_call("readout", len(state)):
            hidden = read_start(self.model, state, positions, kv) if start else self.model.coda(state, positions, kv)
            logits = self.model.head(hidden)
        at = 0
        for s in seqs:
            s.dec.readouts += 1
            if s.prefilling:
                s.row_readouts[s.live] += 1
            s.logits, at = logits[at:at + s.n_rows], at + s.n_rows
        checking = set(map(id, kl))
        self._check([s for s in seqs if id(s) in checking])

    @staticmethod
    def _check(seqs) -> None:
        """The readout signals of these sequences' rows against their previous readouts, in one pass
        over all of them (a few tensor operations whatever the number of sequences)."""
        if not seqs:
            return
        logp = torch.log_softmax(torch.cat([s.logits for s in seqs]).float(), dim=-1).split([s.n_rows for s in seqs])
        known = [i for i, s in enumerate(seqs) if s.logp_prev is not None]
        if known:
            fields = frozenset().union(*(seqs[i].schedule.readout_fields for i in known))  # what their policies read
            signals = readout_signals(torch.cat([logp[i] for i in known]), torch.cat([seqs[i].logp_prev for i in known]),
                                      fields)
            parts = {k: v.split([seqs[i].n_rows for i in known]) for k, v in signals.items()}
            for j, i in enumerate(known):
                seqs[i].signals = {k: v[j] for k, v in parts.items()}
        for s, part in zip(seqs, logp, strict=True):
            s.logp_prev = part

    @staticmethod
    def _by_rule(seqs) -> list[tuple]:
        """(KV rule, its sequences) for each rule among seqs, in order of first appearance."""
        groups: dict = {}
        for s in seqs:
            groups.setdefault(s.dec.rule, []).append(s)
        return list(groups.items())

    @staticmethod
    def _halt_group(s: _Sequence) -> tuple:
        """Sequences whose rows one policy call decides together: same policy object, cap and check
        period, and the same loop unless the schedule decides rows at their own loops (per_token_loops)."""
        sc = s.schedule
        return id(sc.policy), sc.cap, sc.every, -1 if sc.per_token_loops else s.loop

    def _halts(self, seqs, row_counts: list[int], new: Tensor, old: Tensor, states: dict[str, Tensor],
               reading: bool) -> dict[int, Tensor]:
        """The halt decision per row (bool (rows,)) of each sequence whose policy reads out at this
        loop (reading) or of each that does not, by id(s); one policy call per step (per_token_loops)
        or per loop index for all its rows (seqs are ordered by `_halt_group`, so a group's rows are
        one slice of new / old; a group reads out or not as a whole). row_counts: each sequence's
        rows in new / old; states: `state_signals(new, old)`."""
        halts: dict[int, Tensor] = {}
        n_rows = dict(zip(map(id, seqs), row_counts, strict=True))
        at = 0
        for _, group in groupby(seqs, key=self._halt_group):
            group = list(group)
            sizes = [n_rows[id(s)] for s in group]
            rows, sched = slice(at, at + sum(sizes)), group[0].schedule
            at = rows.stop
            if sched.wants_readout(group[0].loop) != reading:
                continue
            if sched.per_token_loops:
                loops = torch.tensor([s.loop for s, n in zip(group, sizes, strict=True) for _ in range(n)], device=new.device)[:, None]
                stop = sched.halt_at(loops, new[rows], {k: v[rows] for k, v in states.items()})
            else:
                sigs = [s.signals for s in group]
                readout = None if any(x is None for x in sigs) else {
                    k: torch.cat([x[k] for x in sigs]) for k in sigs[0]}
                stop = sched.halt(group[0].loop, new[rows], old[rows], readout, {k: v[rows] for k, v in states.items()})
            halts.update(zip(map(id, group), stop[:, 0].split(sizes), strict=True))
        return halts

    def _prefill_halts(self, s: _Sequence, stop: Tensor) -> bool:
        """Freeze the prompt tokens whose rows halt at this loop (stop: bool (rows,), the cap's
        decision included) through the chunk's Freezing; True when every one has halted, and then
        the rows are the whole chunk at its exit states (for its readout)."""
        freezing = s.freezing
        met = torch.zeros_like(freezing.frozen)
        at_cap = s.schedule.at_cap(s.loop)
        if not at_cap:  # at the cap the freezing halts every live token itself (none counts as converged)
            met[s.live.to(met.device)] = stop.to(met.device)
        stop = freezing.update(s.loop, met, at_cap).cpu()[s.live]  # the rows halted now
        done = bool(freezing.frozen.all())
        if not s.sheds_halted or not bool(stop.any()):
            return done
        cache = s.dec.cache  # the halted rows leave the core step: their exit states wait in the cache
        cache.exit_state[0, s.pos + s.live[stop]] = s.state[stop.to(s.state.device), 0]
        if done:
            end = s.pos + len(freezing.frozen)
            s.positions, s.live = list(range(s.pos, end)), torch.arange(len(freezing.frozen))
            s.state = cache.exit_state[0, s.pos:end, None].clone()
            return True
        going = ~stop
        s.live, s.positions = s.live[going], [p for p, g in zip(s.positions, going.tolist(), strict=True) if g]
        at = going.to(s.state.device)
        s.state, s.inject = s.state[at], s.inject[at]  # no readout policy sheds: no logp_prev to cut
        return False

    def _leave_prefill(self, s: _Sequence) -> list[Completion]:
        """Every token of the prompt's chunk has halted (s.logits: the readout of their exit states):
        finish its positions under the KV rule; then the next chunk, or sample the first new token
        and start decoding."""
        cache, start, end = s.dec.cache, s.pos, s.pos + s.n_rows
        cache.exit_state[:, start:end] = s.state[:, 0]
        cache.run_state[:, start:end] = (s.state if s.run is None else s.run)[:, 0]
        s.run = None
        exits = s.freezing.exit_depth.cpu()
        cache.exit_loop[:, start:end] = exits
        s.dec.rule.finish(cache, start, exits[None], s.loop)
        s.out.prompt_exit_loops += exits.tolist()
        s.out.prompt_row_loops += s.row_loops.tolist()
        s.out.prompt_row_readouts += s.row_readouts.tolist()
        P = len(s.out.prompt_ids)
        if end < P:
            self._start_chunk(s, end)
            return []
        if s.emit(s.logits[-1, 0], int(exits[-1]), self.steps):
            del self.active[s.slot]
            return [s.finish()]
        s.freezing = s.live = s.row_loops = s.row_readouts = None
        s.pos, s.loop = P, 0
        s.positions = [P]
        return []

    def _exit(self, seqs) -> list[Completion]:
        """These sequences' tokens halted: finish their positions under their KV rules and sample
        their next tokens."""
        slots, pos = (torch.from_numpy(a) for a in self._rows(seqs))
        at = slots.to(self.device), pos.to(self.device)
        self.cache.exit_state[at] = self.cache.run_state[at] = torch.cat([s.state for s in seqs])[:, 0]
        self.cache.exit_loop[slots, pos] = torch.tensor([s.loop for s in seqs])
        for rule, mine in self._by_rule(seqs):  # every halted token of a rule at once
            rule.finish_tokens(self.cache, torch.tensor([s.slot for s in mine]), torch.tensor([s.pos for s in mine]),
                               torch.tensor([s.loop for s in mine]))
        greedy = [i for i, s in enumerate(seqs) if s.greedy]  # one argmax for all of them
        argmax = (dict(zip(greedy, torch.cat([seqs[i].logits[0] for i in greedy]).argmax(-1).tolist(), strict=True))
                  if greedy else {})
        finished = []
        for i, s in enumerate(seqs):
            if s.emit(s.logits[0, 0], s.loop, self.steps, argmax.get(i)):
                del self.active[s.slot]
                finished.append(s.finish())
            else:
                s.pos, s.loop = s.pos + 1, 0
                s.positions = [s.pos]
        return finished


@dataclass
class ServeRun:
    """What `serve` returns: the completions in request order, the wall time of the run (prefills
    included), how many core steps mixed loop indices, and the pool's batched calls of each kind
    with the tokens they carried and the seconds spent in them (Pool.calls / call_rows / call_s;
    wall_s - model_s is the scheduler's time)."""

    completions: list[Completion]
    wall_s: float
    steps: int
    mixed_steps: int
    calls: dict = field(default_factory=dict)
    call_rows: dict = field(default_factory=dict)
    call_s: dict = field(default_factory=dict)

    def __iter__(self):
        return iter(self.completions)

    def __getitem__(self, i: int) -> Completion:
        return self.completions[i]

    @property
    def new_tokens(self) -> int:
        return sum(len(c.ids) for c in self.completions)

    @property
    def model_s(self) -> float:
        """Seconds inside the batched prelude, core and readout calls (the "recompute" rule's fills
        and the sampling are the scheduler's)."""
        return sum(self.call_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mean_loops(self) -> float:
        """Mean exit loop of the tokens decoded in the pool (each request's first comes from its prefill)."""
        loops = [x for c in self.completions for x in c.decode_exit_loops]
        return sum(loops) / len(loops) if loops else float("nan")


def serve(ckpt_or_model, requests, slots: int = 8, **pool_kwargs) -> ServeRun:
    """Run requests through a Pool; returns their completions in request order. A request the pool
    refuses gets a Completion with `error` set; the others run as usual."""
    pool = Pool(ckpt_or_model, slots, **pool_kwargs)
    ids, errors = [], []
    for req in requests:
        try:
            ids.append(pool.submit(req))
        except ValueError as err:
            ids.append(None)
            errors.append(str(err))
    t = time.perf_counter()
    done = pool.run()
    wall = time.perf_counter() - t
    errors = iter(errors)
    return ServeRun([done[i] if i is not None else Completion(-1, error=next(errors)) for i in ids], wall,
                    pool.steps, pool.mixed_steps, dict(pool.calls), dict(pool.call_rows), dict(pool.call_s))
