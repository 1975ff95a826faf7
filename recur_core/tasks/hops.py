"""Multi-hop variable-binding programs: a task whose answer tokens need a known number of sequential steps.

A program binds variables in several independent chains, then queries one variable in each of
some of them (the others are decoys):

    <|endoftext|>k=7;d=3;b=k;x=b;m=5;q=d;x?7;q?3;

`k=7` binds a literal (1 hop); `b=k` adds one hop to `k`'s count, so `x` is 3 hops from its value.
The token after `?` is the answer, and its **hop count** is its ground-truth depth; other tokens
carry none (0). The chains have distinct values, so the most frequent value cannot score; each
chain is queried at most once, so no earlier answer is a shortcut to a later one; and unqueried
decoy chains keep the last answer from following by elimination of the earlier ones. `hop_counts` recovers the
hop count of every answer from the program text alone, so pasted or hand-edited programs have their
ground truth too.

The training stream (training/hops.py) is infinite and needs no data files: program i is drawn from
its own RNG, seeded by (seed, i) (`training_program`), so the stream's state is one integer and resume
is exact. A curriculum raises
the largest hop count with the program index. Held-out evaluation programs use another seed and
go to hop counts past the training range (extrapolation).

Tokens are words (`build_tokenizer`): one per statement, per query and per answer, so a hop is one
attention lookup; in training, statement tokens start from embeddings built from shared variable and
value codes (`training.hops.structured_embedding`). Both choices, and the untied LM head of the `hops` preset, come from CPU
pilots in which nothing else formed the lookup (docs/BENCHMARKS.md).

Settings come from the dataset string: `hops` or `hops:max_hops=6,chains=4,...` (see `HopsTask`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from recur_core.settings import seed_for

from .base import EOS, EOS_PIECE, Example, Task, Tokens, interleaved_chains, parse_settings
from .prose import Prose

VARIABLES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
VALUES = "0123456789"
SYMBOLS = "=;?"
BINDINGS = [f"{v}={w};" for v in VARIABLES for w in VALUES + VARIABLES]  # one token per statement
QUERIES = [f"{v}?" for v in VARIABLES]  # one token per query; the answer is the token after it
ANSWERS = [f"{d};" for d in VALUES]
VOCAB = [EOS, *SYMBOLS, *VALUES, *VARIABLES, *BINDINGS, *QUERIES, *ANSWERS]
WORD = r"[a-zA-Z]=[a-zA-Z0-9];|[a-zA-Z]\?|[0-9];|."  # a statement, a query, an answer, else one character
PAD = EOS  # windows are padded with EOS after the program; padded positions are not trained
EVAL_SEED_OFFSET, PROBE_SEED_OFFSET = 1_000_000_007, 2_000_000_011


def is_hops(dataset: str) -> bool:
    return dataset == "hops" or dataset.startswith("hops:")


@dataclass(frozen=True)
class HopsTask(Task):
    """The multi-hop program task and its settings; an answer's depth is its hop count."""
    kind: ClassVar[str] = "hops"
    unit: ClassVar[str] = "hop"
    noun: ClassVar[str] = "program"
    padding: ClassVar[str] = PAD
    about: ClassVar[str] = ("Programs bind variables in chains (`k=7;b=k;x=b;` … `x?7;`). The answer after `v?` needs "
                            "one lookup per hop, so its **hop count** is the depth it should need.")

    max_hops: int = 6  # H: hop counts 1..H in training
    extra_eval_hops: int = 4  # held-out programs go to H + 4
    chains: int = 6  # queried chains per program, each queried once
    decoys: int = 2  # further chains that are never queried (so that no answer follows by elimination)
    max_tail: int = 1  # variables bound after the queried one in its chain (distractors)
    start_hops: int = 2  # curriculum: the largest hop count starts here ...
    programs_per_level: int = 160_000  # ... and grows by one every this many programs (5,000 steps of 32)
    recall_programs: int = 0  # warm start: the first this many programs are associative recall
    #                           (recall_pairs literal bindings, all but 2 queried: dense answers)
    recall_pairs: int = 8
    answer_weight: float = 1.0  # loss weight of answer tokens
    other_weight: float = 0.1  # loss weight of the other program tokens (padding: 0)

    @classmethod
    def parse(cls, dataset: str) -> "HopsTask":
        """`hops` or `hops:key=value,...` with HopsTask's fields."""
        if not is_hops(dataset):
            raise ValueError(f"not a hops dataset: {dataset!r}")
        _, _, spec = dataset.partition(":")
        kwargs = parse_settings(cls, spec, "hops")
        task = cls(**kwargs)
        train_need = task.chains * task.max_hops + task.decoys  # every queried chain at H hops
        eval_need = task.max_hops + task.extra_eval_hops + task.chains - 1 + task.decoys  # one at H + 4
        if task.chains + task.decoys > len(VALUES) or max(train_need, eval_need) > len(VARIABLES):
            raise ValueError(f"hops: {task.chains} + {task.decoys} chains to {task.max_hops} hops "
                             f"(one to {task.max_hops + task.extra_eval_hops} in evaluation) do not fit "
                             f"{len(VALUES)} values / {len(VARIABLES)} variables")
        return task

    def curriculum_hops(self, index: int) -> int:
        """The largest hop count of training program `index`."""
        return min(self.max_hops, self.start_hops + index // self.programs_per_level)

    def read(self, tok: Tokenizer, text: str) -> Tokens:
        """EOS + the program's tokens, as the model was trained, with each answer token's hop count
        (read off the text, so pasted and hand-edited programs have their ground truth too)."""
        ids, hops = token_hops(tok, text)
        return Tokens(tuple(ids), (EOS_PIECE, *(tok.id_to_token(i) for i in ids[1:])), tuple(hops))

    def labelled(self, tok: Tokenizer, example: Example) -> Tokens:
        return self.read(tok, example.text)

    def text_examples(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> dict[str, str]:
        """The first n held-out programs, named by their deepest answer (prose for a folder without
        eval windows)."""
        if eval_windows is None:
            return Prose().text_examples(tok, None, n)
        return {program_label(p, i): p for i, p in enumerate(window_texts(tok, eval_windows[:n]))}

    def prompts(self, tok: Tokenizer, eval_windows: torch.Tensor | None, n: int) -> list[str]:
        """Held-out programs up to their first query (the model writes the answer)."""
        if eval_windows is None:
            return Prose().prompts(tok, None, n)
        return [p[:p.index("?") + 1] if "?" in p else p for p in window_texts(tok, eval_windows[:n])]

    def eval_examples(self, tok: Tokenizer, eval_windows: torch.Tensor, seed: int, n: int) -> list[Example]:
        """The first n held-out programs (the checkpoint's eval windows)."""
        return [Example(p, tuple(hop_counts(p))) for p in window_texts(tok, eval_windows[:n])]

    def random_example(self, seed: int, deepest: int) -> Example:
        program = random_program(self, seed, deepest)
        return Example(program.text, tuple(program.hops))

    def ground_truth_windows(self, tok: Tokenizer, seed: int, n: int,
                             window_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_windows(self, tok, seed, n, window_len)


# -- tokenizer -----------------------------------------------------------------------------------
def build_tokenizer() -> Tokenizer:
    """Word-level: a binding `k=7;` / `b=k;` is one token, a query `x?` one, an answer `7;` one;
    anything else is one token per character; EOS is token 0.

    Why words, not characters: with one token per statement a hop is one attention lookup (the
    query's variable matches a binding token's left-hand side, which carries its right-hand side).
    Character-level, the binding's variable and value sit in different positions, so a lookup
    first needs a previous-token head; in CPU pilots that two-head circuit never formed, while the
    word-level lookup reached 100% in 800-1,500 steps (docs/BENCHMARKS.md)."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(WORD), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS])
    return tok


# -- programs -------------------------------------------------------------------------------------
@dataclass
class Program:
    text: str  # without the leading EOS
    hops: list[int]  # per character of text: the hop count of an answer token, else 0


def make_program(rng: random.Random, query_hops: list[int], max_tail: int, decoy_hops: list[int] = ()) -> Program:
    """Queried chains with the given hop counts for their queried variable (plus 0..max_tail
    distractor variables bound after it) and unqueried decoy chains, interleaved in random order
    (each chain in order), then one query per queried chain in random order.

    Decoys keep the answers from following by elimination: after k answers, 2 + decoys - k values
    remain possible. Decoys and tails are shortened (to 1 and 0) when the variables run out."""
    query_hops, decoy_hops = list(query_hops), list(decoy_hops)
    tails = [rng.randint(0, max_tail) for _ in query_hops]
    while sum(query_hops) + sum(tails) + sum(decoy_hops) > len(VARIABLES):
        if any(d > 1 for d in decoy_hops):
            decoy_hops[decoy_hops.index(max(decoy_hops))] -= 1
        elif any(tails):
            tails[tails.index(max(tails))] -= 1
        else:
            raise ValueError(f"hop counts {query_hops} with {len(decoy_hops)} decoys need more than "
                             f"{len(VARIABLES)} variables")
    lengths = [h + t for h, t in zip(query_hops, tails, strict=True)] + decoy_hops
    names = rng.sample(VARIABLES, sum(lengths))
    values = rng.sample(VALUES, len(lengths))
    chains, links = interleaved_chains(rng, names, lengths)
    statements = []
    for c, i in links:
        rhs = values[c] if i == 0 else chains[c][i - 1]
        statements.append(f"{chains[c][i]}={rhs};")
    queries = [f"{chains[c][h - 1]}?{values[c]};" for c, h in enumerate(query_hops)]
    rng.shuffle(queries)
    text = "".join(statements + queries)
    return Program(text, hop_counts(text))


def hop_counts(text: str) -> list[int]:
    """Per character of a program: the hop count of the answer after `v?`, else 0.

    A literal binding `v=7` is 1 hop; `v=u` is one more than `u`. An answer to an unbound variable
    (or to a variable bound to an unbound one) has no ground truth (0)."""
    hops = [0] * len(text)
    depth: dict[str, int] = {}
    pos = 0
    for stmt in text.split(";"):
        if len(stmt) == 3 and stmt[0] in VARIABLES:
            lhs, op, rhs = stmt
            if op == "=" and rhs in VALUES:
                depth[lhs] = 1
            elif op == "=" and rhs in VARIABLES:
                if rhs in depth:
                    depth[lhs] = depth[rhs] + 1
                else:
                    depth.pop(lhs, None)
            elif op == "?" and lhs in depth:
                hops[pos + 2] = depth[lhs]
        pos += len(stmt) + 1
    return hops


def token_hops(tok: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(ids, hops) of a program text, per token, EOS first: an answer token carries its hop count
    (answers are one character, so the count sits at the token's first character), others 0."""
    enc = tok.encode(text)
    hops = hop_counts(text)
    return [tok.token_to_id(EOS)] + enc.ids, [0] + [hops[start] for start, _ in enc.offsets]


def program_ids(tok: Tokenizer, program: Program, window_len: int) -> tuple[list[int], list[int]]:
    """(ids, hops) of one window: EOS, the program, EOS padding to window_len."""
    ids, hops = token_hops(tok, program.text)
    if len(ids) > window_len:
        raise ValueError(f"a program of {len(ids)} tokens does not fit a window of {window_len}")
    pad = window_len - len(ids)
    return ids + [tok.token_to_id(PAD)] * pad, hops + [0] * pad


def training_program(task: HopsTask, seed: int, index: int) -> Program:
    rng = random.Random(seed_for(seed, index))
    if index < task.recall_programs:  # 1-hop only, many answers per program, 2 decoys
        return make_program(rng, [1] * (task.recall_pairs - 2), 0, [1, 1])
    top = task.curriculum_hops(index - task.recall_programs)
    return make_program(rng, [rng.randint(1, top) for _ in range(task.chains)], task.max_tail,
                        [rng.randint(1, top) for _ in range(task.decoys)])


def program_led_by(rng: random.Random, task: HopsTask, first: int, top: int) -> Program:
    """A program whose first queried chain has `first` hops; the other queried chains and the
    decoys get 1..top, capped so that every chain fits the 52 variables."""
    cap = max(1, (len(VARIABLES) - first - task.decoys) // max(1, task.chains - 1))
    others = min(top, cap)
    return make_program(rng, [first] + [rng.randint(1, others) for _ in range(task.chains - 1)], task.max_tail,
                        [rng.randint(1, others) for _ in range(task.decoys)])


def eval_program(task: HopsTask, seed: int, index: int) -> Program:
    """Held-out programs: the first chain cycles through hop counts 1..H+4, the others are 1..H."""
    rng = random.Random(seed_for(seed, index + EVAL_SEED_OFFSET))
    return program_led_by(rng, task, 1 + index % (task.max_hops + task.extra_eval_hops), task.max_hops)


def eval_windows(task: HopsTask, tok: Tokenizer, seed: int, n: int, window_len: int,
                 offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, hops), each n x window_len, of held-out programs offset .. offset + n - 1."""
    rows = [program_ids(tok, eval_program(task, seed, offset + i), window_len) for i in range(n)]
    return (torch.tensor([r[0] for r in rows], dtype=torch.int64),
            torch.tensor([r[1] for r in rows], dtype=torch.int64))


def trained_hops(task: HopsTask, programs_drawn: int) -> int:
    """The largest hop count among the first `programs_drawn` training programs: the curriculum's
    top so far (a run stopped early has not reached task.max_hops)."""
    if programs_drawn <= task.recall_programs:
        return 1 if programs_drawn else 0
    return task.curriculum_hops(programs_drawn - 1 - task.recall_programs)


def window_hops(tok: Tokenizer, windows: torch.Tensor) -> torch.Tensor:
    """(N, window_len) hop counts of saved program windows (EOS, program, EOS padding), recovered
    from their text: the ground truth of windows saved without it."""
    pad = tok.token_to_id(PAD)
    rows = []
    for w in windows.tolist():
        body = w[1:w.index(pad, 1)] if pad in w[1:] else w[1:]
        ids, hops = token_hops(tok, tok.decode(body))
        if ids != w[:len(ids)]:
            raise ValueError("a saved window does not re-tokenize to itself: not a hops program window")
        rows.append(hops + [0] * (len(w) - len(hops)))
    return torch.tensor(rows, dtype=torch.int64)


def window_texts(tok: Tokenizer, windows: torch.Tensor) -> list[str]:
    """Program windows as text (EOS and padding removed)."""
    eos = tok.token_to_id(EOS)
    return [tok.decode([i for i in w.tolist() if i != eos]) for w in windows]


def program_label(program: str, i: int) -> str:
    deepest = max(hop_counts(program) or [0])
    return f"#{i} · deepest answer {deepest} hop{'s' if deepest != 1 else ''} · {program[:40]}…"


def random_program(task: HopsTask, seed: int, max_hops: int) -> Program:
    """A program whose deepest answer has exactly max_hops hops."""
    return program_led_by(random.Random(seed), task, max_hops, max_hops)


def elimination_chance(text: str) -> list[float]:
    """Per answer of a program, in order: the accuracy of guessing among the literal values not yet
    answered (what a model that reads the values but does no lookup can get)."""
    literals = {s[2] for s in text.split(";") if len(s) == 3 and s[1] == "=" and s[2] in VALUES}
    answered: set[str] = set()
    out = []
    for s in text.split(";"):
        if len(s) == 3 and s[1] == "?":
            out.append(1.0 / max(1, len(literals - answered)))
            answered.add(s[2])
    return out
