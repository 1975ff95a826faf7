"""Training on multi-hop programs (the task, its generator and ground truth: recur_core/tasks/hops.py):
the infinite training stream and its loss weights, the saved eval / selection / probe windows, and the
structured embeddings training starts from."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer

from recur_core.analysis.ground_truth import GROUND_TRUTH
from recur_core.tasks.hops import (
    BINDINGS,
    PAD,
    QUERIES,
    VALUES,
    VARIABLES,
    HopsTask,
    eval_windows,
    program_ids,
    trained_hops,
    training_program,
)


def structured_embedding(tok: Tokenizer, d_model: int, seed: int, scale: float = 0.1) -> torch.Tensor:
    """Initial token embeddings (V, d_model) in which a statement's token is built from its parts:
    the first half codes the variable it binds (zero for a query), the second half what it points at
    (a variable's or a digit's code; a query `x?` points at x). Other tokens get random vectors. This
    is only where training starts (the embeddings are then trained freely; the model format is
    unchanged).

    Why shared codes: with independent random rows, each of the 2,704 `v=w;` tokens must learn on its
    own that it points at w, from the few chains that pass through it; built from shared codes,
    "match the variable, read what it is bound to" is one linear map for all of them (1-hop lookups
    at 100% by step 800 in a CPU pilot, against 90% at step 1,400 without).

    Why a query sits in the pointer half, like a binding's right-hand side: then a query `x?` and a
    binding `b=x;` make the same lookup (find the binding of the variable I point at), so the one
    attention pattern that answers 1-hop queries also sends every binding to its parent's binding,
    and a loop that copies the parent's resolved value resolves one more hop of every chain. With
    queries in the binder half, 2-hop answers stayed at chance in every pilot; with this layout they
    left it within 2,000 steps (docs/BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(seed)
    half = d_model // 2
    var_code, value_code = torch.randn(len(VARIABLES), half, generator=g), torch.randn(len(VALUES), half, generator=g)
    emb = torch.randn(tok.get_vocab_size(), d_model, generator=g)
    code = lambda c: var_code[VARIABLES.index(c)] if c in VARIABLES else value_code[VALUES.index(c)]
    # ("k=7;": k's code, then 7's; "x?": zeros, then x's code)
    for word in BINDINGS:
        emb[tok.token_to_id(word), :2 * half] = torch.cat((code(word[0]), code(word[2])))
    for word in QUERIES:
        emb[tok.token_to_id(word), :2 * half] = torch.cat((torch.zeros(half), code(word[0])))
    return emb * scale


def answer_mask(inputs: torch.Tensor, tok: Tokenizer) -> torch.Tensor:
    """True where the next token is an answer (the input token is a query `v?`)."""
    query_ids = torch.tensor([tok.token_to_id(q) for q in QUERIES], device=inputs.device)
    return torch.isin(inputs, query_ids)


class HopsStream:
    """The infinite training stream; `position` (programs drawn) is its whole state."""

    def __init__(self, task: HopsTask, tok: Tokenizer, seed: int, window_len: int):
        self.task, self.tok, self.seed, self.window_len = task, tok, seed, window_len
        self.position = 0

    def next_batch(self, n: int) -> torch.Tensor:
        """n programs, padded to the longest in the batch (not to the window: saves compute)."""
        rows = [program_ids(self.tok, training_program(self.task, self.seed, self.position + i), self.window_len)[0]
                for i in range(n)]
        self.position += n
        batch = torch.tensor(rows, dtype=torch.int64)
        pad = self.tok.token_to_id(PAD)
        used = int((batch != pad).sum(1).max()) + 1  # the leading EOS and the longest program
        return batch[:, :min(used, self.window_len)]

    def loss_weights(self, inputs: torch.Tensor, targets: torch.Tensor, rows: slice) -> torch.Tensor:
        """Per target token: answer_weight on answers, other_weight on other program tokens, 0 on
        padding. (`rows`, the batch's rows these are, is not needed: a program's tokens say it all.)"""
        pad = self.tok.token_to_id(PAD)
        w = torch.full(targets.shape, self.task.other_weight)
        w[answer_mask(inputs, self.tok)] = self.task.answer_weight
        w[(targets == pad) & (inputs == pad)] = 0.0
        return w

    @property
    def epoch(self) -> None:
        return None  # an infinite stream has no epochs

    @property
    def trained_hops(self) -> int:
        return trained_hops(self.task, self.position)

    def state(self) -> dict:
        return {"position": self.position, "kind": "hops"}

    def load_state(self, state: dict) -> None:
        self.position = int(state["position"])


def training_data(task: HopsTask, tok: Tokenizer, seed: int, window_len: int, n_windows: int = 128,
                  n_select: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HopsStream, dict]:
    """(eval windows, selection windows, probe windows, training stream, extra checkpoint tensors).

    Eval windows are held-out programs (hop counts to H + 4); the selection windows best/ is chosen
    on are the held-out programs right after them (disjoint); probe windows (for A2's router) are
    training-distribution programs from indices the stream never reaches."""
    eval_ids, eval_hops = eval_windows(task, tok, seed, n_windows, window_len)
    select_ids, _ = eval_windows(task, tok, seed, n_select, window_len, offset=n_windows)
    late = 10 ** 12  # past any training run: the curriculum is complete there
    probe = [program_ids(tok, training_program(task, seed, late + i), window_len) for i in range(n_windows)]
    probe_ids, probe_hops = (torch.tensor([r[k] for r in probe], dtype=torch.int64) for k in (0, 1))
    ground_truth = {GROUND_TRUTH: {"hops": eval_hops, "probe_hops": probe_hops,
                                   "max_train_hops": torch.tensor([task.max_hops])}}
    return eval_ids, select_ids, probe_ids, HopsStream(task, tok, seed, window_len), ground_truth
