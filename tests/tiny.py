"""A tiny trained checkpoint for tests and smoke benchmarks (seconds on a CPU, no ../shared needed)."""
from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Lily", "Tom", "Ben", "Mia", "Sam", "Anna"]
THINGS = ["ball", "cat", "tree", "red kite", "box", "dog", "cake"]
VERBS = ["saw", "liked", "found", "lost", "shared", "painted"]


def synthetic_stories(n: int, seed: int = 0) -> list[str]:
    """Small, repetitive TinyStories-like documents with words, numbers and punctuation."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = []
        for _ in range(rng.randint(2, 5)):
            a, b = rng.sample(NAMES, 2)
            lines.append(f"{a} {rng.choice(VERBS)} {rng.randint(2, 9)} {rng.choice(THINGS)}s with {b}. "
                         f"\"Look!\" said {a}, and they were happy.")
        docs.append(" ".join(lines))
    return docs


def write_corpus(folder: Path, n_train: int = 400, n_val: int = 60) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    train, val = folder / "train.txt", folder / "val.txt"
    train.write_text("\n<|endoftext|>\n".join(synthetic_stories(n_train, seed=1)) + "\n")
    val.write_text("\n<|endoftext|>\n".join(synthetic_stories(n_val, seed=2)) + "\n")
    return train, val


TINY_SETTINGS = {"d_model": "32", "n_heads": "2", "n_kv_heads": "1", "ffn_dim": "64", "n_prelude": "1",
                 "n_core": "1", "n_coda": "1", "seq_len": "32", "tokenizer": "bpe:300", "batch_size": "8",
                 "r_bar": "3", "r_max": "8", "backprop_depth": "2", "warmup_steps": "5", "lr": "3e-3",
                 "eval_every": "20", "ckpt_every": "20", "eval_windows": "8", "log_every": "5"}


def make_tiny_checkpoint(root: Path, steps: int = 60, trainer_kwargs: dict | None = None,
                         **overrides: str) -> Path:
    """Train the tiny preset for a few steps with the real trainer; returns the checkpoint dir.

    trainer_kwargs go to Trainer (e.g. stop_at_step, resume); overrides are preset fields.
    """
    from training.data import DataSpec
    from training.presets import PRESETS
    from training.trainer import Trainer

    train, val = write_corpus(root / "data")
    settings = {**TINY_SETTINGS, **overrides}
    cfg = PRESETS["demo"].with_overrides(settings)
    tokens = steps * cfg.batch_size * cfg.seq_len
    cfg = cfg.with_overrides({"max_tokens": str(tokens)})
    Trainer("demo", cfg, settings, DataSpec(str(train), str(val)), root / "run", progress=False,
            **(trainer_kwargs or {})).train()
    return root / "run" / "latest"


TINY_HOPS_DATASET = "hops:max_hops=3,extra_eval_hops=1,chains=2,decoys=1,start_hops=1,programs_per_level=64"


def make_tiny_hops_checkpoint(root: Path, steps: int = 40, trainer_kwargs: dict | None = None,
                              **overrides: str) -> Path:
    """A tiny model trained for seconds on multi-hop programs (training/hops.py); a checkpoint
    with ground truth. Returns the checkpoint dir."""
    from training.data import DataSpec
    from training.presets import PRESETS
    from training.trainer import Trainer

    settings = {**TINY_SETTINGS, "tokenizer": "hops", "dataset": TINY_HOPS_DATASET, "seq_len": "64",
                "r_bar": "3", "r_max": "6", **overrides}
    cfg = PRESETS["hops"].with_overrides(settings)
    cfg = cfg.with_overrides({"max_tokens": str(steps * cfg.batch_size * cfg.seq_len)})
    Trainer("hops", cfg, settings, DataSpec(cfg.dataset), root / "run", progress=False,
            **(trainer_kwargs or {})).train()
    return root / "run" / "latest"


TINY_MIXTURE = "word_problems:share=0.5,max_steps=3,extra_eval_steps=1"


def make_tiny_reasoning_checkpoint(root: Path, steps: int = 40, preset: str = "stories-reasoning",
                                   trainer_kwargs: dict | None = None, **overrides: str) -> Path:
    """A mixture preset (stories-reasoning, or specimen) at its smallest: tiny stories mixed with word
    problems (training/word_problems.py), a checkpoint with labelled answers. trainer_kwargs go to
    Trainer (e.g. stop_at_step, resume); overrides are preset fields. Returns the checkpoint dir."""
    from training.data import DataSpec
    from training.presets import PRESETS
    from training.trainer import Trainer

    train, val = write_corpus(root / "data", n_val=20)  # fewer eval windows: the page's exact harness stays short
    settings = {**TINY_SETTINGS, "mixture": TINY_MIXTURE, "seq_len": "96", "tokenizer": "bpe:400", **overrides}
    cfg = PRESETS[preset].with_overrides(settings)
    cfg = cfg.with_overrides({"max_tokens": str(steps * cfg.batch_size * cfg.seq_len)})
    Trainer(preset, cfg, settings, DataSpec(str(train), str(val)), root / "run", progress=False,
            **(trainer_kwargs or {})).train()
    return root / "run" / "latest"
