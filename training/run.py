"""Command line: python -m training.run {demo,s0,s1} [--set key=value ...] [--data ...] [--out ...]

Multi-GPU: torchrun --nproc_per_node N -m training.run s1   (DDP; nccl on GPU, gloo on CPU).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from recur_core.model.checkpoint import CheckpointError

from .data import MAX_HOLDOUT_SHARE, VAL_PER_MILLE, DataError, DataSpec
from .presets import PRESETS
from .trainer import Trainer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.run",
                                description="Train a looped LM with the randomized-depth recipe.")
    p.add_argument("preset", choices=sorted(PRESETS), help="model + recipe preset (see training/presets.py)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset field, e.g. --set lr=3e-4 --set r_bar=8 (repeatable)")
    p.add_argument("--data", help="hub dataset id, or local .txt/.jsonl/.json/.parquet files, globs or folders "
                                  "(default: the preset's dataset, streamed from the hub)")
    p.add_argument("--val-data", default="", help="separate validation source (default: the dataset's "
                                                  f"validation split, else a hashed {VAL_PER_MILLE / 10:g}%% "
                                                  f"hold-out, enlarged up to {MAX_HOLDOUT_SHARE * 100:g}%% of "
                                                  "the text when that is too small)")
    p.add_argument("--out", type=Path, help="run directory (default: runs/<preset>)")
    p.add_argument("--max-tokens", type=int, help="training budget in tokens (sets the cosine schedule)")
    p.add_argument("--init-from", type=Path, metavar="DIR",
                   help="start from this checkpoint's weights (same shape and tokenizer; fresh optimizer and "
                        "schedule), e.g. to fine-tune with --set depth_mode=per_token; meta.json records it")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--stop-at-step", type=int, help="save and stop after this step, as if interrupted; "
                                                    "--resume continues exactly where it stopped")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.overrides)
    if args.max_tokens:
        overrides["max_tokens"] = str(args.max_tokens)
    try:
        cfg = PRESETS[args.preset].with_overrides(overrides)
    except ValueError as err:
        raise SystemExit(f"--set: {err}") from None
    data = DataSpec(train=args.data or cfg.dataset, val=args.val_data, hub_config=cfg.dataset_config)
    out = args.out or Path("runs") / args.preset
    trainer = Trainer(args.preset, cfg, overrides, data, out, resume=args.resume,
                      stop_at_step=args.stop_at_step, progress=not args.no_progress, init_from=args.init_from)
    try:
        trainer.train()
    except (FileExistsError, FileNotFoundError, DataError, CheckpointError) as err:
        raise SystemExit(f"training.run {args.preset}: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
