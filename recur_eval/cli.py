"""`recur-lm-eval` / `python -m recur_eval`: lm-eval's command line (every flag of `lm_eval`) with the
model `recur` registered, e.g.

    recur-lm-eval --model recur --model_args pretrained=checkpoints/hops,policy=uniform,loops=8 \\
        --tasks hops_qa --include_path recur_eval/tasks
"""
from __future__ import annotations

import sys


def main(argv=None) -> None:
    from lm_eval.__main__ import cli_evaluate

    import recur_eval  # noqa: F401  (registers the model "recur")

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
