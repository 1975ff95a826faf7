"""The lm-evaluation-harness model `recur`: a recur checkpoint scored with real per-token halting.

    recur-lm-eval --model recur --model_args pretrained=checkpoints/hops,policy=a1,threshold=1e-3 \\
        --tasks hops_qa --include_path recur_eval/tasks

model_args:
  pretrained   a checkpoint folder (any format `recur_core.load_checkpoint` opens)
  policy       a family of recur_core.exits.catalogue, by name in any case or alias: A0 (uniform) | A1 |
               A2 | latent | huginn_kl (reverse_kl) | huginn_entropy (entropy) | huginn_cosine (cosine)
               | huginn_argmax (argmax) (default a1)
  threshold    the policy's threshold (A1's / huginn_kl's ε, A2's τ, latent / entropy / cosine's δ,
               argmax's run length n; default: the catalogue's)
  loops        A0's depth (default: the recipe's r̄)
  max_loops    the loop cap of every token (default: the recipe's r_max)
  min_loops    the first loop the policy is consulted at (default: the policy's own)
  probe        A2's label kind (argmax | kl | argmax_any | kl_any; default argmax)
  kv_rule      latest | recompute (default SETTINGS.kv_rule)
  mode         fixed_point (default: what `generate` computes, by parallel passes) | decode (token by
               token, the reference) | prefill (one parallel pass: exact for rules that read only the state)
  seed         the state noise (default SETTINGS.seed); every sequence gets noise row 0, as in `generate`
  batch_size   sequences decoded in lockstep (default 16)
  add_bos      prefix every context with <|endoftext|> (default true: the project's windows and
               documents start after it)
  device, dtype  as for load_checkpoint

`loglikelihood` and `loglikelihood_rolling` score through recur_eval.scoring (teacher-forced, every
token halting on its own, halted tokens frozen as in decoding); `generate_until` decodes with
`recur_core.decoding.decode.generate`. Each result carries the exit loops of its scored tokens
(`LoopScored.loops`): the local tasks (recur_eval/tasks) turn them into a `mean_loops` metric beside
acc, and `get_model_info` reports mean loops per task for every task, so results["config"]["recur"]
holds them whatever the task.
"""
from __future__ import annotations

import math
import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from recur_core import load_checkpoint
from recur_core.decoding.decode import generate
from recur_core.decoding.teacher_forced import TEACHER_FORCED_MODES
from recur_core.exits import catalogue
from recur_core.exits.policies import Policy, Uniform
from recur_core.settings import SETTINGS

from .scoring import Request, score_requests

EOS = "<|endoftext|>"


class LoopScored(tuple):
    """lm-eval's (logprob, is_greedy) pair, carrying the exit loops of the scored tokens as `.loops`."""

    loops: tuple[int, ...]

    def __new__(cls, logprob: float, greedy: bool, loops=()):
        pair = super().__new__(cls, (logprob, greedy))
        pair.loops = tuple(loops)
        return pair

    def __reduce__(self):  # lm-eval's request cache pickles results
        return LoopScored, (self[0], self[1], self.loops)


def make_policy(ckpt, policy: str = "a1", threshold: float | None = None, loops: int | None = None,
                min_loops: int | None = None, max_loops: int | None = None, probe: str = "argmax",
                seed: int = SETTINGS.seed) -> Policy:
    """The recur_core policy that model_args name (see the module docstring)."""
    fam = catalogue.family(policy)
    if fam.needs_gate:
        raise ValueError(f"policy {policy!r} needs a learned exit gate: lm-eval runs the readout and state rules")
    recipe = ckpt.recipe
    cap = recipe.r_max if max_loops is None else int(max_loops)
    if fam.name == "A0":
        r = round(recipe.r_bar) if loops is None else int(loops)
        if r < 1 or r > cap:
            raise ValueError(f"loops must be in 1..{cap} (max_loops), got {r}")
        return Uniform(r)
    if loops is not None:
        raise ValueError(f"loops sets A0's depth; policy {fam.name} takes threshold (and max_loops for its cap)")
    router = None
    if fam.needs_probe:
        from recur_core.analysis.probe import ProbeSpec, load_or_train_probes
        router = load_or_train_probes(ckpt, cap, seed, ProbeSpec(kinds=(probe,)))[probe]
    return catalogue.make(fam.name, threshold, r_max=cap, min_loops=None if min_loops is None else int(min_loops),
                          probe=router)


def pick_device(device: str | None) -> str:
    """The device to load on: lm-eval's CLI asks for "cuda" by default, which falls back to the CPU
    (with a warning) on a machine without CUDA; None picks CUDA when there is one."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        warnings.warn(f"device {device!r} asked for, but CUDA is not available: running on the CPU", stacklevel=2)
        return "cpu"
    return str(device)


@register_model("recur")
class RecurLM(TemplateLM):
    """A recur checkpoint under one exit policy, for lm-evaluation-harness (see the module docstring)."""

    def __init__(self, pretrained: str, policy: str = "a1", threshold: float | None = None, loops: int | None = None,
                 max_loops: int | None = None, min_loops: int | None = None, probe: str = "argmax",
                 kv_rule: str = SETTINGS.kv_rule, mode: str = "fixed_point", seed: int = SETTINGS.seed,
                 batch_size: int | str | None = 16, add_bos: bool = True, device: str | None = None,
                 dtype: str | None = None, check_every: int = 1, **unused):
        super().__init__()
        unknown = set(unused) - {"max_batch_size"}  # lm-eval passes max_batch_size to every model
        if unknown:
            raise ValueError(f"unknown model_args for recur: {', '.join(sorted(unknown))}")
        if mode not in TEACHER_FORCED_MODES:
            raise ValueError(f"mode must be one of {', '.join(TEACHER_FORCED_MODES)}, got {mode!r}")
        device = pick_device(device)
        self.ckpt = load_checkpoint(pretrained, device=device, dtype=dtype)
        self.ckpt.model.eval()
        self.tok = self.ckpt.tokenizer()
        self.policy = make_policy(self.ckpt, policy, threshold, loops, min_loops, max_loops, probe, int(seed))
        self.cap = self.policy.cap(self.ckpt.recipe.r_max if max_loops is None else int(max_loops))
        self.kv_rule, self.mode, self.seed, self.check_every = kv_rule, mode, int(seed), int(check_every)
        self.batch_size = 16 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.eos = self.tok.token_to_id(EOS)
        self.add_bos = bool(add_bos) and self.eos is not None
        self.max_length = self.ckpt.model.cfg.max_seq_len
        self.loops_by_task: dict[str, list[int]] = {}  # exit loops of the scored (or generated) tokens
        self.run_loops_by_task: dict[str, list[int]] = {}  # of every position run (shared ones once)
        self._task = ""
        self._device = torch.device(device)

    # -- tokens --------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if self.eos is None:
            raise ValueError(f"this checkpoint's tokenizer has no {EOS}: an empty context has nothing to condition on")
        return self.eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def _with_bos(self, ids: list[int]) -> list[int]:
        return [self.eos] + ids if self.add_bos and (not ids or ids[0] != self.eos) else ids

    # -- scoring ---------------------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = False):
        """Scores of (context ids, continuation ids) pairs; contexts cut from the left to the model's context."""
        requests = []
        for context, continuation in pairs:
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the context "
                                 f"(max_seq_len {self.max_length})")
            inputs = (context + continuation)[:-1][-self.max_length:]
            requests.append(Request(tuple(inputs), tuple(continuation)))
        bar = tqdm(total=None, desc="recur: scoring runs", disable=disable_tqdm)

        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        scoring = score_requests(self.ckpt, requests, self.policy, kv_rule=self.kv_rule, seed=self.seed,
                                 max_loops=self.cap, batch_size=self.batch_size, mode=self.mode,
                                 check_every=self.check_every, pad_id=self.eos or 0, progress=progress)
        bar.close()
        self.run_loops_by_task.setdefault(self._task, []).extend(scoring.run_loops)
        return scoring.scores

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(self._with_bos(list(context)), list(continuation)) for _, context, continuation in requests]
        return [LoopScored(s.logprob, s.greedy, s.loops) for s in self._score(pairs, disable_tqdm)]

    def _by_task(self, requests, score) -> list:
        """score(requests of one task) for each task's requests (runs are shared within a task only, so
        each task's compute is its own); results in the order of requests."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(req.task_name or "", []).append(i)
        results = [None] * len(requests)
        for task, idx in groups.items():
            self._task = task
            for i, res in zip(idx, score([requests[i] for i in idx]), strict=True):
                results[i] = res
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        results = self._by_task(requests, lambda reqs: super(RecurLM, self).loglikelihood(reqs, disable_tqdm))
        for req, res in zip(requests, results, strict=True):
            self.loops_by_task.setdefault(req.task_name or "", []).extend(res.loops)
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """The whole string scored in disjoint windows of the model's context (lm-eval's rolling scheme),
        each window teacher-forced with per-token halting."""
        return self._by_task(requests, lambda reqs: self._rolling(reqs, disable_tqdm))

    def _rolling(self, requests, disable_tqdm: bool):
        pairs, owner = [], []
        for i, req in enumerate(requests):
            ids = self.tok_encode(req.args[0])
            windows = get_rolling_token_windows(ids, self.eot_token_id, self.max_length, 1)
            for window in map(make_disjoint_window, windows):
                pairs.append((list(window[0]), list(window[1])))
                owner.append(i)
        scores = self._score(pairs, disable_tqdm)
        totals = [0.0] * len(requests)
        loops = [[] for _ in requests]
        for i, s in zip(owner, scores, strict=True):
            totals[i] += s.logprob
            loops[i].extend(s.loops)
        for req, total, lp in zip(requests, totals, loops, strict=True):
            self.loops_by_task.setdefault(req.task_name or "", []).extend(lp)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request decoded alone by `generate` (batch 1, the policy's per-token halting), stopped at
        EOS, max_gen_toks or the first `until` string (cut there)."""
        out = []
        for req in tqdm(requests, desc="recur: generating", disable=disable_tqdm):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            greedy = not kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0 if greedy else 1.0))
            max_new = max(1, min(max_new, self.max_length))
            prompt = self._with_bos(self.tok_encode(context))[-(self.max_length - max_new + 1):]
            gen = generate(self.ckpt, prompt, max_new, self.policy, kv_rule=self.kv_rule, greedy=greedy,
                           temperature=temperature, top_p=float(kwargs.pop("top_p", 1.0)),
                           top_k=int(kwargs.pop("top_k", 0) or 0), seed=self.seed, max_loops=self.cap,
                           stop_ids=() if self.eos is None else (self.eos,), keep_logits=False, tokenizer=self.tok)
            ids = gen.ids[:-1] if gen.ids and gen.ids[-1] == self.eos else gen.ids
            text = self.tok.decode(ids)
            cut = min([text.index(s) for s in until if s and s in text], default=len(text))
            out.append(text[:cut])
            self.loops_by_task.setdefault(req.task_name or "", []).extend(gen.exit_loops)
            self.run_loops_by_task.setdefault(req.task_name or "", []).extend(gen.prompt_exit_loops + gen.exit_loops[1:])
            self.cache_hook.add_partial("generate_until", req.args, text[:cut])
        return out

    # -- what the results report -----------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """results["config"]["recur"]: the policy, and per task the mean exit loop of the scored (or
        generated) tokens (`mean_loops`) and of every position the model ran (`mean_loops_run`, context
        included, each shared position once: the compute)."""
        def means(loops: dict[str, list[int]]) -> dict[str, float]:
            return {task: (sum(v) / len(v) if v else math.nan) for task, v in loops.items()}

        return {"recur": {"checkpoint": str(self.ckpt.path), "checkpoint_id": self.ckpt.checkpoint_id,
                          "policy": repr(self.policy), "kv_rule": self.kv_rule, "mode": self.mode,
                          "seed": self.seed, "max_loops": self.cap, "mean_loops": means(self.loops_by_task),
                          "scored_tokens": {t: len(v) for t, v in self.loops_by_task.items()},
                          "mean_loops_run": means(self.run_loops_by_task),
                          "run_tokens": {t: len(v) for t, v in self.run_loops_by_task.items()}}}
