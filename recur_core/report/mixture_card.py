"""The card section of a checkpoint trained on text mixed with word problems (stories-reasoning):
what the generated half is, and answer-token accuracy against uniform loops on the eval windows,
measured here with the product's trace and ground truth (the same numbers `python -m
bench.bench_specimen` prints as figures 2 and 3; its figure 4, exact A1, is in docs/BENCHMARKS.md)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from recur_core.analysis.cache import TraceCache
from recur_core.analysis.ground_truth import answer_hops, load_ground_truth, uniform_answer_accuracy
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.model.formats import load_checkpoint
from recur_core.settings import SETTINGS
from recur_core.tasks import WordProblems

CARD_DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def _forms(task: WordProblems) -> str:
    """How the problems are told, in words."""
    sentences = f"in story form, {task.running_share:.0%} told \"running\", stating each intermediate value"
    if not task.terse_share:
        return sentences
    terse = "the where stories in two-word clauses (\"Ben zoo. Amy Ben. Amy? zoo.\"), one question each"
    return terse if task.terse_share == 1 and task.kind_list == ["where"] else \
        f"{task.terse_share:.0%} of {terse}, the rest {sentences}"


def _unit(task: WordProblems) -> str:
    return "facts read (1: a direct recall)" if task.recall else "composition steps"


def mixture_section(ckpt_dir: Path, task: WordProblems, loops: int) -> str:
    ckpt = load_checkpoint(ckpt_dir)
    steps, max_train = load_ground_truth(ckpt_dir)
    windows = ckpt.windows("eval")[:SETTINGS.windows]
    tr = trace(ckpt, windows, loops, SETTINGS.seed, cache=TraceCache(), progress=True)
    boot = Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed)
    ah = answer_hops(tr, steps)
    answers = (ah > 0) & (ah <= max_train)
    depths = [r for r in CARD_DEPTHS if r <= loops]
    header = "| answers | " + " | ".join(f"{r}" for r in depths) + " |\n|---|" + "---|" * len(depths)
    rows = [("all trained steps", answers)] + [(f"{k} step{'s' if k > 1 else ''} ({int((ah == k).sum())})", ah == k)
                                               for k in np.unique(ah[ah > 0])]
    lines = [f"| {name} | " + " | ".join(f"{uniform_answer_accuracy(tr, mask, r, boot)[0]:.3f}" for r in depths) + " |"
             for name, mask in rows]
    r_bar = min(ckpt.recipe.depth, loops)
    rise = boot.summarise(100 * (uniform_answer_accuracy(tr, answers, r_bar, boot)
                                 - uniform_answer_accuracy(tr, answers, 1, boot)))
    return f"""## Word problems (the generated half of the mixture)

{task.share:.0%} of every training batch's windows are word problems
(`recur_core/tasks/word_problems.py`; kinds {', '.join(task.kind_list)}; {_forms(task)}), whose answer words
need 1–{task.max_steps} {_unit(task)} in training and up to {task.max_steps + task.extra_eval_steps} in the
held-out windows. The eval windows
alternate TinyStories text and problems; `ground_truth.safetensors` labels each answer token with its
steps (the Ground truth page and `python -m bench.bench_specimen` read it).

Answer-token accuracy (argmax) at uniform depth, loops across ({int(answers.sum())} answers at the trained
steps in {tr.n_windows} eval windows; steps past {max_train} are extrapolation):

{header}
{chr(10).join(lines)}

From 1 loop to r̄ = {r_bar}: **{rise.value:+.1f} points** [{rise.ci_low:+.1f}, {rise.ci_high:+.1f}]
({int(100 * boot.level)}% paired bootstrap over windows).
"""
