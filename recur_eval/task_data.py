"""The local lm-eval tasks' data (recur_eval/tasks/): how it is made, loaded and scored.

  hops_qa            multiple choice over the 10 values: for every query of a checkpoint's held-out hops
                     programs (recur_core/tasks/hops.py), the program up to and including the query `x?` is the
                     context and the answers `0;` .. `9;` (recur_core.tasks.hops.ANSWERS, in the YAML)
                     are the choices, `gold` the true one's index; `hops` is the answer's hop count
                     (its ground-truth depth), `program` the eval window it comes from.
  tinystories_cloze  multiple-choice next word over held-out TinyStories paragraphs: a paragraph cut
                     before a word, that word among 3 other words of the same paragraph.

`python -m recur_eval.task_data hops_qa --ckpt checkpoints/hops` and `python -m recur_eval.task_data
tinystories_cloze --text <TinyStories-valid file>` regenerate the shipped JSONL files; a task YAML
loads them through `load_task` (`dataset_kwargs: {data_file: ...}` points it at another file).
`process_results` scores a multiple-choice document and reads the exit loops that the model `recur`
attaches to each result, so `mean_loops` (per scored token) sits in the results beside `acc`.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import numpy as np

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DATA_FILES = {"hops_qa": TASKS_DIR / "data" / "hops_qa.jsonl",
              "tinystories_cloze": TASKS_DIR / "data" / "tinystories_cloze.jsonl"}


# -- making the data -----------------------------------------------------------------------------------
def hops_qa_docs(ckpt_path: str | Path) -> list[dict]:
    """One document per answer of a hops checkpoint's eval windows (with their ground truth)."""
    from recur_core import load_checkpoint
    from recur_core.analysis.ground_truth import load_ground_truth
    from recur_core.tasks import HopsTask, task_of
    from recur_core.tasks.hops import ANSWERS, EOS

    ckpt = load_checkpoint(ckpt_path)
    if not isinstance(task_of(ckpt.meta), HopsTask):
        raise ValueError(f"{ckpt_path} was not trained on hops programs: hops_qa needs a hops checkpoint")
    truth = load_ground_truth(ckpt_path)
    if truth is None:
        raise ValueError(f"{ckpt_path} has no ground_truth.safetensors: hops_qa needs a hops checkpoint")
    hops, _ = truth
    tok = ckpt.tokenizer()
    eos = tok.token_to_id(EOS)
    docs = []
    for n, (window, window_hops) in enumerate(zip(ckpt.windows("eval").tolist(), hops.tolist(), strict=True)):
        if window[0] != eos:
            raise ValueError(f"eval window {n} does not start with {EOS}")
        for t, h in enumerate(window_hops):
            if h <= 0:
                continue
            context = tok.decode(window[1:t])
            answer = tok.decode([window[t]])
            if answer not in ANSWERS:
                raise ValueError(f"window {n} position {t}: the ground truth marks {answer!r}, not an answer")
            if tok.encode(context + answer, add_special_tokens=False).ids != window[1:t + 1]:
                raise ValueError(f"window {n}: its text does not encode back to its tokens")
            docs.append({"program": n, "position": t, "hops": int(h), "context": context,
                         "gold": ANSWERS.index(answer)})
    return docs


WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")  # a word, with its apostrophe part ("wouldn't")


def _plain(word: str) -> bool:
    """A word a cloze can ask for or offer: 3+ letters, no apostrophe."""
    return len(word) >= 3 and word.isalpha()


def tinystories_cloze_docs(text: str, n: int, seed: int = 0, choices: int = 4, min_context_words: int = 12,
                           max_context_chars: int = 600) -> list[dict]:
    """n cloze documents from paragraphs of `text` (blank-line separated; `paragraph` is the index among
    them): a paragraph is cut before a word of 3+ letters (at least min_context_words in, the context
    at most max_context_chars), and that word (with its leading space) is the gold choice among
    choices - 1 other distinct words of the same paragraph (so every choice fits the story's topic)."""
    paragraphs = [(i, p.strip()) for i, p in enumerate(re.split(r"\n\s*\n", text))
                  if len(WORD.findall(p)) >= 2 * min_context_words]
    rng = random.Random(seed)
    docs = []
    for index, para in rng.sample(paragraphs, len(paragraphs)):
        words = list(WORD.finditer(para))
        spots = [k for k in range(min_context_words, len(words))
                 if _plain(words[k].group()) and para[words[k].start() - 1] == " "]
        rng.shuffle(spots)
        for k in spots:
            gold = words[k].group()
            others = sorted({w.group() for w in words if _plain(w.group()) and w.group().lower() != gold.lower()})
            if len(others) < choices - 1:
                continue
            distractors = rng.sample(others, choices - 1)
            options = [gold, *distractors]
            rng.shuffle(options)
            context = para[:words[k].start() - 1][-max_context_chars:]
            docs.append({"paragraph": index, "context": context, "choices": [" " + w for w in options],
                         "gold": options.index(gold)})
            break
        if len(docs) == n:
            return docs
    raise ValueError(f"the text gives only {len(docs)} cloze documents, {n} asked")


def write_jsonl(docs: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))


# -- loading and scoring (the YAMLs' !function hooks) -----------------------------------------------
def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task data {path} not found")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_task(task: str, data_file: str | None = None, **metadata):
    """lm-eval's custom_dataset hook: {"test": the documents}, read from the repository (offline)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(read_jsonl(data_file or DATA_FILES[task]))})


def load_hops_qa(data_file: str | None = None, **metadata):
    return load_task("hops_qa", data_file)


def load_tinystories_cloze(data_file: str | None = None, **metadata):
    return load_task("tinystories_cloze", data_file)


def process_results(doc: dict, results) -> dict:
    """acc (the choice with the highest log-likelihood is the gold one) and mean_loops: (sum, count) of
    the exit loops of the scored tokens, which `token_mean` aggregates per token. A model other than
    `recur` attaches no loops (mean_loops is then NaN)."""
    lls = [r[0] for r in results]
    loops = [loop for r in results for loop in getattr(r, "loops", ())]
    return {"acc": float(int(np.argmax(lls)) == int(doc["gold"])), "mean_loops": (sum(loops), len(loops))}


def token_mean(items) -> float:
    """Mean over tokens of per-document (sum, count) pairs."""
    total, count = (sum(x) for x in zip(*items, strict=True)) if items else (0, 0)
    return total / count if count else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m recur_eval.task_data", description="Regenerate a local task's data.")
    p.add_argument("task", choices=sorted(DATA_FILES))
    p.add_argument("--ckpt", default="checkpoints/hops", help="hops_qa: the hops checkpoint")
    p.add_argument("--text", help="tinystories_cloze: held-out TinyStories text")
    p.add_argument("--n", type=int, default=200, help="tinystories_cloze: documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output JSONL (default: the shipped file)")
    args = p.parse_args(argv)
    if args.task == "hops_qa":
        docs = hops_qa_docs(args.ckpt)
    else:
        if not args.text:
            p.error("tinystories_cloze needs --text")
        docs = tinystories_cloze_docs(Path(args.text).read_text(), args.n, args.seed)
    out = args.out or DATA_FILES[args.task]
    write_jsonl(docs, out)
    print(f"{len(docs)} documents -> {out}")


if __name__ == "__main__":
    main()
