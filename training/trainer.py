"""The randomized-depth training loop: sample r per step, truncated backprop, eval, checkpoints.

Run layout under --out DIR:
    DIR/metrics.jsonl   live log (one JSON object a line; events in recur_core/model/metrics_log.py)
    DIR/latest/         newest checkpoint + optimizer/data/RNG state for --resume
    DIR/best/           checkpoint with the lowest validation loss at r_bar loops so far, measured on
                        the selection windows: the cfg.eval_windows validation windows that follow the
                        128 saved eval windows, so the windows every analysis uses never choose it
                        (short validation text gives fewer of both: see Trainer._validation_windows)
Both are written atomically, so a run killed at any moment keeps its last complete checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from itertools import chain, islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from recur_core.analysis.ground_truth import GROUND_TRUTH
from recur_core.model.checkpoint import (
    EVAL_WINDOWS,
    METRICS,
    PROBE_WINDOWS,
    TOKENIZER,
    CheckpointError,
    read_meta,
    recover_interrupted,
    save_checkpoint,
)
from recur_core.model.formats import load_checkpoint
from recur_core.model.looped_lm import LoopedLM
from recur_core.model.metrics_log import append as append_metrics
from recur_core.report.sources import file_record
from recur_core.settings import seed_for
from recur_core.tasks import HopsTask, WordProblems, parse_task

from . import hops, word_problems
from .data import (
    MAX_HOLDOUT_SHARE,
    USUAL_HOLDOUT_BELOW,
    VAL_PER_MILLE,
    DataError,
    DataSpec,
    ShuffledWindows,
    StreamedWindows,
    enlarged_holdout_below,
    holdout_rank,
    is_heldout,
    local_files,
    pack_windows,
    take_windows,
    token_counts,
)
from .depth_sampler import sample_depth, sample_token_depths
from .presets import TrainConfig
from .state import read_trainer_state, write_trainer_state
from .tokenizer import eos_id, load_tokenizer

N_SAVED_WINDOWS = 128  # the paper evaluates on 128 validation windows
# The least validation a run takes (it refuses below): 8 saved eval windows give the analyses'
# bootstrap over windows 8 values to resample (with fewer, its intervals say little), and 4 selection
# windows keep best/ from being chosen on one or two windows' noise.
MIN_EVAL_WINDOWS, MIN_SELECT_WINDOWS = 8, 4
EVAL_SEED = 0  # the recurrent-state noise of every eval


class NonFiniteLoss(RuntimeError):
    pass


# -- environment ---------------------------------------------------------------------------
def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises torch.distributed under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_context(device: torch.device, mode: str):
    """bf16 autocast where it is faster: CUDA with bf16, or a CPU with native bf16 (AVX512-BF16/AMX)."""
    if mode not in ("auto", "bf16", "fp32"):
        raise ValueError(f"autocast must be auto, bf16 or fp32, got {mode!r}")
    use = mode == "bf16" or (mode == "auto" and (
        torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_bf16()))
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else nullcontext()


def code_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: LoopedLM, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), fused=device.type == "cuda")


# -- evaluation ----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: LoopedLM, windows: torch.Tensor, depths: list[int], device: torch.device,
             amp_mode: str = "auto", batch: int = 16) -> dict[int, float]:
    """Mean next-token loss (nats/token) on windows at each depth, from one run to max(depths)."""
    model.eval()
    totals = {d: 0.0 for d in depths}
    n_tokens = 0
    gen = torch.Generator().manual_seed(EVAL_SEED)
    for start in range(0, len(windows), batch):
        w = windows[start:start + batch].to(device)
        inputs, targets = w[:, :-1], w[:, 1:]
        with autocast_context(device, amp_mode):
            e = model.prelude(inputs)
            state = model.init_state(*inputs.shape, generator=gen, device=device)
            for i in range(1, max(depths) + 1):
                state = model.core_step(state, e)
                if i in totals:
                    logits = model.readout(state).float()
                    totals[i] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        n_tokens += targets.numel()
    return {d: totals[d] / n_tokens for d in depths}


# -- validation windows --------------------------------------------------------------------
def split_validation(n_windows: int, want_select: int) -> tuple[int, int] | None:
    """(saved eval, selection) windows out of n_windows <= N_SAVED_WINDOWS + want_select: all wanted
    ones when there are enough; else the selection keeps its usual share (at least its minimum) and
    the eval windows get the rest. None below MIN_EVAL_WINDOWS eval windows."""
    n_select = max(min(MIN_SELECT_WINDOWS, want_select), n_windows * want_select // (N_SAVED_WINDOWS + want_select))
    n_eval = min(N_SAVED_WINDOWS, n_windows - n_select)
    return (n_eval, n_select) if n_eval >= MIN_EVAL_WINDOWS else None


def validation_line(v: dict) -> str:
    """The one line a run prints when its validation differs from the usual (meta.json's "validation")."""
    got = f"{v['eval_windows']} eval + {v['selection_windows']} selection windows"
    usual = f"the usual {v['wanted_eval_windows']} + {v['wanted_selection_windows']}"
    if v["enlarged"]:
        return (f"the usual {VAL_PER_MILLE / 10:g}% validation hold-out is too small for this text, so "
                f"{v['documents_held_out']:,} of its {v['documents_total']:,} documents (first in hash order) are "
                f"held out of training; validation: {got}" + (f" instead of {usual}" if v["shrunk"] else f", {usual}"))
    return f"the validation data is short: {got} instead of {usual}"


# -- the run -------------------------------------------------------------------------------
class Trainer:
    def __init__(self, preset: str, cfg: TrainConfig, overrides: dict, data: DataSpec, out: Path,
                 resume: bool = False, stop_at_step: int | None = None, progress: bool = True,
                 init_from: Path | None = None):
        self.preset, self.cfg, self.overrides, self.data, self.out = preset, cfg, overrides, data, Path(out)
        self.resume, self.stop_at_step, self.progress = resume, stop_at_step, progress
        self.init_from, self.init_record = init_from, None
        self.rank, self.world, self.device = setup_distributed()
        self.is_main = self.rank == 0
        self.step, self.tokens_seen, self.best_eval, self.last_eval = 0, 0, math.inf, {}
        self.wall_s = 0.0
        self.code_revision = code_revision()  # the code this process runs (later commits do not change it)
        self._stop_requested = False

    # setup ------------------------------------------------------------------------------
    def _latest(self) -> Path:
        return self.out / "latest"

    def setup(self) -> None:
        cfg = self.cfg
        recover_interrupted(self._latest())
        recover_interrupted(self.out / "best")
        if self.resume and not (self._latest() / "trainer_state.json").is_file():
            raise FileNotFoundError(f"--resume: no resumable checkpoint at {self._latest()}")
        if not self.resume and (self._latest()).exists():
            raise FileExistsError(f"{self._latest()} exists: pass --resume to continue that run, "
                                  "or choose another --out")
        self.task = parse_task(self.data.train, cfg.mixture)
        self.tokenizer = self._tokenizer()
        window_len = cfg.seq_len + 1
        self.ground_truth = {}
        sources = (("train", self.data.train), ("validation", self.data.val))
        self.data_files = [file_record(f, role) for role, spec in sources if spec for f in (local_files(spec) or [])]
        load_data = {"hops": self._program_data, "prose": self._text_data, "word_problems": self._mixture_data}
        load_data[self.task.kind](window_len)
        torch.manual_seed(cfg.seed)
        self.model = LoopedLM(cfg.model_config(self.tokenizer.get_vocab_size())).to(self.device)
        if isinstance(self.task, HopsTask):  # statement tokens start from shared codes (see the function)
            with torch.no_grad():
                self.model.embed.weight.copy_(hops.structured_embedding(self.tokenizer, cfg.model.d_model, cfg.seed))
        self.opt = make_optimizer(self.model, cfg, self.device)
        if self.resume:
            self._load_latest()
        elif self.init_from is not None:
            self._load_initial_weights()
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model)
        self.total_steps = max(1, cfg.max_tokens // cfg.tokens_per_step(self.world))

    def _program_data(self, window_len: int) -> None:
        """Generated programs, with per-token hop counts: eval, selection and probe windows and the stream."""
        (self.eval_windows, self.select_windows, self.probe_windows, self.train_windows,
         self.ground_truth) = hops.training_data(self.task, self.tokenizer, self.cfg.seed, window_len,
                                                 n_select=self.cfg.eval_windows)
        self.validation = self._validation_record("held-out generated programs (recur_core/tasks/hops.py)")

    def _text_data(self, window_len: int) -> None:
        """Text: the validation windows, probe windows from the training text, and its windows."""
        self.eval_windows, self.select_windows = self._validation_windows(window_len)
        self.validation = self._validation_record(self._validation_made_by())
        eos = eos_id(self.tokenizer)
        make_train = lambda: pack_windows(self.data.train_docs(), self.tokenizer, window_len, eos)
        self.probe_windows = take_windows(make_train(), N_SAVED_WINDOWS)
        if local_files(self.data.train) is not None:
            self.train_windows = ShuffledWindows(take_windows(make_train(), 2 ** 62), self.cfg.seed)
        else:
            self.train_windows = StreamedWindows(make_train)

    def _mixture_data(self, window_len: int) -> None:
        """Text with generated word problems alongside (training/word_problems.py)."""
        self._text_data(window_len)
        (self.eval_windows, self.select_windows, self.probe_windows, self.train_windows,
         self.ground_truth) = word_problems.mixture_data(
            self.task, self.tokenizer, self.cfg.seed, window_len, self.eval_windows,
            self.select_windows, self.probe_windows, self.train_windows)
        self.validation = self._validation_record(self._validation_made_by() + " and held-out generated "
                                                  f"problems ({self.cfg.mixture}, recur_core/tasks/word_problems.py)")
        split = word_problems.split_answer_words(self.tokenizer, self.task)
        if split and self.is_main:
            print(f"{self.preset}: the tokenizer splits {len(split)} answer words ({', '.join(split[:5])}, ...); "
                  "their answers are scored on their first token", file=sys.stderr)

    def _validation_windows(self, window_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The 128 saved eval windows (what every analysis reads) and, after them in the same stream,
        the cfg.eval_windows selection windows the periodic eval picks best/ on: disjoint sets.

        Short validation text first enlarges a hashed hold-out of local files (_enlarge_holdout, which
        changes self.data and may retrain a BPE; a resumed run reuses the recorded hold-out), then gives
        fewer windows (split_validation), down to MIN_EVAL_WINDOWS + MIN_SELECT_WINDOWS; below that it
        is a DataError."""
        wanted = N_SAVED_WINDOWS + self.cfg.eval_windows
        if self.resume:
            self.data = dataclasses.replace(self.data, holdout_below=self._recorded_holdout_below())
        rows = self._validation_rows(window_len, wanted)
        if len(rows) < wanted and not self.resume and self.data.can_enlarge_holdout():
            self._enlarge_holdout(window_len * wanted)
            rows = self._validation_rows(window_len, wanted)
        counts = split_validation(len(rows), self.cfg.eval_windows)
        if counts is None:
            raise self._too_little_validation(len(rows), window_len)
        n_eval, n_select = counts
        return rows[:n_eval].clone(), rows[n_eval:n_eval + n_select].clone()

    def _validation_rows(self, window_len: int, n: int) -> torch.Tensor:
        """The first n windows (fewer if that is all there is) of the validation stream."""
        stream = pack_windows(self.data.val_docs(), self.tokenizer, window_len, eos_id(self.tokenizer))
        return torch.tensor(list(islice(stream, n)), dtype=torch.int64)

    def _enlarge_holdout(self, need_tokens: int) -> None:
        """Hold out more training documents, in hash order, to fill need_tokens of validation windows
        (at most MAX_HOLDOUT_SHARE of the text). A BPE trained here is trained again without them, so
        that no held-out text shapes the model's training."""
        docs = list(self.data.all_train_docs())
        tokens = token_counts(self.tokenizer, docs)
        below = enlarged_holdout_below([(holdout_rank(d), n) for d, n in zip(docs, tokens, strict=True)], need_tokens)
        self.data = dataclasses.replace(self.data, holdout_below=below)
        if self.cfg.tokenizer.startswith("bpe:"):
            self.tokenizer = self._tokenizer()

    def _recorded_holdout_below(self) -> int:
        """The hashed hold-out of the run being resumed (its meta.json records an enlarged one)."""
        meta = read_meta(self._latest())
        return meta.get("validation", {}).get("hold_out_rank_below", USUAL_HOLDOUT_BELOW)

    def _too_little_validation(self, n_windows: int, window_len: int) -> DataError:
        """The refusal below the minimum, naming how much text would do."""
        n_select = min(MIN_SELECT_WINDOWS, self.cfg.eval_windows)
        need_tokens = (MIN_EVAL_WINDOWS + n_select) * window_len
        message = (f"the validation data holds {n_windows} windows of {window_len} tokens, and the trainer needs at "
                   f"least {MIN_EVAL_WINDOWS + n_select} ({MIN_EVAL_WINDOWS} saved eval windows plus {n_select} "
                   f"disjoint ones to choose best/ on; usually {N_SAVED_WINDOWS} + {self.cfg.eval_windows}), that is "
                   f"{need_tokens:,} tokens of validation text. ")
        if self.data.can_enlarge_holdout():
            have_kb, need_kb = self._text_kb(need_tokens / MAX_HOLDOUT_SHARE)
            if have_kb == 0:
                return DataError("the training text is empty (no documents with any text): give --data files "
                                 "that hold text")
            message += (f"It holds out at most {MAX_HOLDOUT_SHARE:.0%} of the training text for them, so give at "
                        f"least about {need_kb:,.0f} KB of text (this is {have_kb:,.0f} KB), or a separate "
                        "--val-data, or a lower --set seq_len")
        else:
            message += "Give more validation text (--val-data) or a lower --set seq_len"
        return DataError(message)

    def _text_kb(self, tokens: float) -> tuple[float, float]:
        """(KB of training text, KB of such text that holds `tokens` tokens)."""
        docs = list(self.data.all_train_docs())
        n_bytes = sum(len(d.encode()) + 1 for d in docs)
        n_tokens = sum(token_counts(self.tokenizer, docs))
        return n_bytes / 1000, tokens * n_bytes / max(n_tokens, 1) / 1000

    def _validation_made_by(self) -> str:
        if self.data.val:
            return f"a separate validation source ({self.data.val})"
        if not self.data.holds_out_by_hash():
            return "the dataset's validation split"
        if self.data.holdout_below == USUAL_HOLDOUT_BELOW:
            return (f"the hashed hold-out: training documents whose SHA-1 falls in the lowest {VAL_PER_MILLE} per "
                    "mille (training/data.py)")
        return (f"an enlarged hashed hold-out: the usual {VAL_PER_MILLE} per mille of training documents by SHA-1 "
                "was too small, so the documents first in that hash order (holdout_rank below hold_out_rank_below, "
                f"training/data.py) are held out of training, up to the wanted windows or {MAX_HOLDOUT_SHARE:.0%} "
                "of the text's tokens")

    def _validation_record(self, made_by: str) -> dict:
        """meta.json's "validation": how it was made and how many windows it gave (wanted: the usual)."""
        counts = (len(self.eval_windows), len(self.select_windows))
        wanted = (N_SAVED_WINDOWS, self.cfg.eval_windows)
        record = {"made_by": made_by, "enlarged": False, "shrunk": counts != wanted,
                  "eval_windows": counts[0], "selection_windows": counts[1],
                  "wanted_eval_windows": wanted[0], "wanted_selection_windows": wanted[1]}
        if not isinstance(self.task, HopsTask) and self.data.holds_out_by_hash():
            record["hold_out_rank_below"] = self.data.holdout_below
            if self.data.holdout_below != USUAL_HOLDOUT_BELOW:
                docs = list(self.data.all_train_docs())
                record.update(enlarged=True, documents_total=len(docs),
                              documents_held_out=sum(is_heldout(d, self.data.holdout_below) for d in docs))
        return record

    def _tokenizer(self):
        if self.resume:
            return load_tokenizer(str(self._latest() / TOKENIZER))
        if not self.cfg.tokenizer.startswith("bpe:"):
            return load_tokenizer(self.cfg.tokenizer)
        if self.world == 1:
            return load_tokenizer(self.cfg.tokenizer, self._bpe_docs())
        # multi-process BPE training: rank 0 trains, the others read its file
        path = self.out / TOKENIZER
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            load_tokenizer(self.cfg.tokenizer, self._bpe_docs()).save(str(path))
        dist.barrier()
        return load_tokenizer(str(path))

    def _bpe_docs(self):
        """What a BPE is trained on: the training documents, and a mixture's generated problems."""
        docs = self.data.train_docs()
        if not isinstance(self.task, WordProblems):
            return docs
        return chain(docs, word_problems.tokenizer_sample(self.task, self.cfg.seed))

    def _load_initial_weights(self) -> None:
        """--init-from: start from another checkpoint's weights (same model shape and tokenizer), with
        a fresh optimizer, schedule and data stream; meta.json records where the weights came from."""
        ckpt = load_checkpoint(self.init_from, device=self.device)
        if ckpt.config != self.model.cfg:
            raise CheckpointError(f"--init-from {self.init_from}: its model config differs from this run's: "
                                  f"{ckpt.config} vs {self.model.cfg}")
        if ckpt.tokenizer().to_str() != self.tokenizer.to_str():
            raise CheckpointError(f"--init-from {self.init_from}: its tokenizer differs from this run's")
        self.model.load_state_dict(ckpt.model.state_dict())
        self.init_record = {"path": str(self.init_from), "checkpoint_id": ckpt.checkpoint_id,
                            "recipe": ckpt.recipe.to_meta(), "step": ckpt.meta.get("step")}

    def _load_latest(self) -> None:
        ckpt = load_checkpoint(self._latest(), device=self.device)
        if ckpt.config != self.model.cfg:
            raise ValueError(f"--resume: the checkpoint's model config differs from this run's: "
                             f"{ckpt.config} vs {self.model.cfg}")
        self.model.load_state_dict(ckpt.model.state_dict())
        info = read_trainer_state(self._latest(), self.opt)
        self.step, self.tokens_seen = info["step"], info["tokens_seen"]
        self.best_eval, self.last_eval = info["best_eval"], ckpt.meta.get("last_eval", {})
        self.wall_s = info.get("wall_s", 0.0)
        self.init_record = ckpt.meta.get("init_from")
        self.train_windows.load_state(info["data"])
        if self.is_main:  # the live log continues from the checkpoint's copy
            (self.out / METRICS).write_bytes((self._latest() / METRICS).read_bytes())

    # bookkeeping ------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if self.is_main:
            append_metrics(self.out / METRICS, record)

    def meta(self) -> dict:
        cfg = self.cfg
        return {
            "preset": self.preset, "overrides": self.overrides, "step": self.step,
            "tokens_seen": self.tokens_seen, "train_config": dataclasses.asdict(cfg),
            "recipe": cfg.recipe().to_meta(),
            "best_selected_on": f"{len(self.select_windows)} validation windows after the {len(self.eval_windows)} "
                                "saved eval windows (disjoint from them)",
            "validation": self.validation,
            "data": self.data.describe(), "data_files": self.data_files, "tokenizer": cfg.tokenizer,
            "code_revision": self.code_revision,
            "last_eval": {str(d): v for d, v in self.last_eval.items()}, "best_eval_r_bar": self.best_eval,
            "epochs": self.train_windows.epoch, "wall_seconds": round(self.wall_s, 1),
            "n_params": self.model.num_params(), "world_size": self.world,
            **({"init_from": self.init_record} if self.init_record else {}),
        }

    def save(self, which: str) -> None:
        if not self.is_main:
            return
        if hasattr(self.train_windows, "trained_hops"):  # the hop counts trained so far, not the task's H
            self.ground_truth[GROUND_TRUTH]["max_train_hops"] = torch.tensor([self.train_windows.trained_hops])
        extra_tensors = {EVAL_WINDOWS: {"ids": self.eval_windows}, PROBE_WINDOWS: {"ids": self.probe_windows},
                         **self.ground_truth}
        info = {"step": self.step, "tokens_seen": self.tokens_seen, "best_eval": self.best_eval,
                "data": self.train_windows.state(), "wall_s": self.wall_s}
        extra_files = {METRICS: self.out / METRICS}
        state_writer = (lambda d: write_trainer_state(d, self.opt, info)) if which == "latest" else None
        save_checkpoint(self.out / which, self.model, self.meta(), self.tokenizer.to_str(),
                        extra_files=extra_files, extra_tensors=extra_tensors, after_write=state_writer)

    def run_eval(self, split: str) -> dict[int, float]:
        """Loss by depth on the selection windows (split "select") or the saved eval windows ("eval")."""
        windows = self.select_windows if split == "select" else self.eval_windows
        losses = evaluate(self.model, windows, self.cfg.eval_depths(), self.device, self.cfg.autocast)
        self.model.train()
        self.last_eval = losses
        self.log({"event": "eval", "step": self.step, "tokens": self.tokens_seen, "windows": len(windows),
                  "split": split, "loss_by_depth": {str(d): round(v, 5) for d, v in losses.items()}})
        return losses

    # training ---------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.cfg
        r = sample_depth(self.step, cfg.r_bar, cfg.r_max, cfg.sigma, cfg.seed, cfg.sampler_mean)
        lr = lr_at(self.step, cfg, self.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        rows = slice(self.rank, None, self.world)  # this rank's rows of the global batch
        batch = self.train_windows.next_batch(cfg.batch_size * self.world)[rows].to(self.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        gen = torch.Generator().manual_seed(seed_for(cfg.seed, self.step) * 64 + self.rank)
        token_loops = None
        if cfg.depth_mode == "per_token":
            token_loops = sample_token_depths(self.step, r, tuple(inputs.shape), cfg.token_share, cfg.seed,
                                              self.rank).to(self.device)
        with autocast_context(self.device, cfg.autocast):
            logits = self.ddp(inputs, r, gen, backprop_depth=cfg.backprop_depth, token_loops=token_loops)
        if hasattr(self.train_windows, "loss_weights"):  # e.g. answers weighted above other tokens
            weights = self.train_windows.loss_weights(inputs, targets, rows).to(self.device).flatten()
            ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
            loss = (ce * weights).sum() / weights.sum()
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if not torch.isfinite(loss):
            raise NonFiniteLoss(f"loss became {loss.item()} at step {self.step} (r = {r})")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLoss(f"gradient norm became {grad_norm.item()} at step {self.step} (r = {r})")
        self.opt.step()
        stats = {"loss": loss.item(), "r": r, "lr": lr, "grad_norm": grad_norm.item()}
        if getattr(self.train_windows, "has_curriculum", False):
            stats.update(self._advance_curriculum(logits.detach(), targets, rows))
        if token_loops is not None:  # mean loops per token this step
            stats["mean_token_loops"] = token_loops.float().mean().item()
        return stats

    def _advance_curriculum(self, logits: torch.Tensor, targets: torch.Tensor, rows: slice) -> dict:
        """Score this batch's answers at the curriculum's top (before the update: the logits of this
        step's forward), summed over ranks so that every rank's curriculum moves alike."""
        counts = self.train_windows.curriculum_counts(logits, targets, rows)
        if self.world > 1:
            dist.all_reduce(counts)
        self.train_windows.record(counts)
        right, seen = counts.tolist()
        return {"curriculum_top": self.train_windows.trained_hops, "top_answers": seen, "top_right": right}

    def _request_stop(self, signum, frame):
        self._stop_requested = True

    def train(self) -> None:
        self.setup()
        cfg = self.cfg
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / METRICS).touch()
            if not self.resume:
                self.log({"event": "start", "preset": self.preset, "overrides": self.overrides,
                          "recipe": cfg.recipe().to_meta(), "data": self.data.describe(),
                          "train_config": dataclasses.asdict(cfg)})
            print(f"{self.preset}: recipe {cfg.recipe().describe()}", file=sys.stderr)
            if self.validation["enlarged"] or self.validation["shrunk"]:
                print(f"{self.preset}: {validation_line(self.validation)}", file=sys.stderr)
        old_handlers = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (self.is_main and self.progress),
                   dynamic_ncols=True, desc=self.preset)
        try:
            while self.step < self.total_steps and not self._stop_requested:
                t0 = time.perf_counter()
                stats = self.train_step()
                self.step += 1
                self.tokens_seen += cfg.tokens_per_step(self.world)
                dt = time.perf_counter() - t0
                self.wall_s += dt
                tok_s = cfg.tokens_per_step(self.world) / dt
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", r=stats["r"], tok_s=f"{tok_s:,.0f}")
                if self.step % cfg.log_every == 0 or self.step == 1:
                    self.log({"event": "train", "step": self.step, "tokens": self.tokens_seen,
                              **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()},
                              "tokens_per_s": round(tok_s, 1)})
                self._periodic()
                if self.stop_at_step is not None and self.step >= self.stop_at_step:
                    break
        except NonFiniteLoss as err:
            self.log({"event": "nonfinite", "step": self.step, "message": str(err)})
            raise SystemExit(f"training stopped: {err}. The last good checkpoint is kept at "
                             f"{self._latest()}; lower the learning rate or resume from there.") from None
        finally:
            bar.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        self._finish()

    def _periodic(self) -> None:
        cfg = self.cfg
        if self.is_main and self.step % cfg.eval_every == 0:
            self._eval_for_best()
        if self.step % cfg.ckpt_every == 0:
            self.save("latest")
        if self.world > 1:
            dist.barrier()

    def _eval_for_best(self) -> None:
        """The periodic eval on the selection windows; a new lowest loss at r_bar saves best/."""
        loss_rbar = self.run_eval("select")[round(self.cfg.r_bar)]
        if loss_rbar < self.best_eval:
            self.best_eval = loss_rbar
            self.save("best")

    def _finish(self) -> None:
        """Final (or interrupted) save. The final weights (learning rate fully decayed) also compete
        for best/ on the selection windows; the final eval then uses the saved eval windows."""
        done = self.step >= self.total_steps
        if self.is_main and done:
            if self.step % self.cfg.eval_every:
                self._eval_for_best()
            self.run_eval("eval")
        self.save("latest")
        if self.is_main and done and not (self.out / "best").exists():
            self.save("best")
        if self.world > 1:
            dist.barrier()
        if self.is_main:
            state = "finished" if done else f"stopped at step {self.step}; continue with --resume"
            print(f"{self.preset}: {state}. Checkpoints in {self.out}/latest and {self.out}/best", file=sys.stderr)
