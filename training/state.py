"""Trainer state for --resume: optimizer moments, step, data position and RNG, in safetensors + JSON."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from recur_core.model.checkpoint import read_safetensors

OPTIMIZER, TRAINER_STATE = "optimizer.safetensors", "trainer_state.json"


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    out = {f"state.{idx}.{key}": t.detach().cpu().contiguous()
           for idx, st in sd["state"].items() for key, t in st.items()}
    out["rng.torch"] = torch.get_rng_state()
    return out


def write_trainer_state(ckpt_dir: Path, opt: torch.optim.Optimizer, info: dict) -> None:
    save_file(optimizer_tensors(opt), str(ckpt_dir / OPTIMIZER))
    groups = [{k: v for k, v in g.items()} for g in opt.state_dict()["param_groups"]]
    (ckpt_dir / TRAINER_STATE).write_text(json.dumps({**info, "param_groups": groups}, indent=2))


def read_trainer_state(ckpt_dir: Path, opt: torch.optim.Optimizer) -> dict:
    """Restore optimizer and torch RNG in place; return the JSON info (step, data position, ...)."""
    info = json.loads((ckpt_dir / TRAINER_STATE).read_text())
    tensors = read_safetensors(ckpt_dir / OPTIMIZER)
    torch.set_rng_state(tensors.pop("rng.torch"))
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    opt.load_state_dict({"state": state, "param_groups": info.pop("param_groups")})
    return info
