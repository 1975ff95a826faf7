"""recur in lm-evaluation-harness: the model `recur` (real per-token halting under any exit policy) and
local tasks whose data ships in the repository (recur_eval/tasks: hops_qa, tinystories_cloze).

lm-eval 0.4 finds a model only in its registry, which has no plugin entry points, so the model is
registered when this package is imported: `recur-lm-eval` (= `python -m recur_eval`) is lm-eval's own
command line with it registered; in Python, `import recur_eval` before `lm_eval.simple_evaluate(model="recur")`.
"""
from .model import RecurLM

__all__ = ["RecurLM"]
