"""A folder with random weights in a public looped LM's exact published format, for dry runs of
memory and time before a download:

    python -m bench.synthetic {huginn-0125, ouro-1.4b} OUT [--seed 0] [--shard-gb 2]

OUT gets the published config.json (the model card's values and keys: Huginn-0125's
raven_config_minimal.json, Ouro-1.4B's config as transformers < 4.56 saved it, `torch_dtype`), the
format's tensor names at full size, sharded bfloat16 safetensors with `model.safetensors.index.json`,
and a tokenizer. Weights: N(0, 0.02²) matrices (the exit gate's too), norms at 1, biases at 0.
The tokenizer is a stand-in: the test fixture's small byte-level BPE of the same format (its ids are
the first few hundred of the vocabulary), because the real vocabularies (65,536 / 49,152 tokens)
cannot be downloaded here; every model id is still in range.

Shards are written one at a time (peak memory: one shard); the random numbers come from one seeded
generator, so the same seed writes the same folder.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from recur_core.model.hf_folder import INDEX
from recur_core.model.huginn import huginn_config, huginn_shapes
from recur_core.model.ouro import ouro_config, ouro_shapes

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"

HUGINN_0125 = {  # tomg-group-umd/huginn-0125's config.json (recpre/raven_config_minimal.json)
    "name": "nebel-raven-3.5b", "architectures": ["RavenForCausalLM"],
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    "torch_dtype": "bfloat16", "transformers_version": "4.28.1",
    "hf_config": {"org": "tomg-group-umd", "name": "nebel-raven-3.5b"}, "model_type": "huginn_raven",
    "block_size": 4096, "vocab_size": 65536, "padding_multiple": 4096, "tie_embeddings": True,
    "num_attention_heads": 55, "num_key_value_heads": 55, "n_embd": 5280, "intermediate_size": 17920,
    "bias": False, "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
    "init_strategy": "takase", "init_orthogonal": False, "state_init": "like-init", "injection_type": "linear",
    "n_layers_in_recurrent_block": 4, "mean_recurrence": 32, "sampling_scheme": "poisson-lognormal-filling",
    "mean_backprop_depth": 8, "n_layers_in_prelude": 2, "n_layers_in_coda": 2, "qk_bias": True,
    "activation_checkpoint_impl": "per-iteration",
    "init_values": {"std": math.sqrt(2 / (5 * 5280)), "embed_scale": math.sqrt(5280)},
}
OURO_1_4B = {  # ByteDance/Ouro-1.4B's config.json (the published shapes; Ouro's README in the oracle)
    "architectures": ["OuroForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "bos_token_id": 0, "eos_token_id": 0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "layer_types": ["full_attention"] * 24,
    "max_position_embeddings": 65536, "max_window_layers": 28, "model_type": "ouro", "num_attention_heads": 16,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "total_ut_steps": 4, "early_exit_threshold": 1.0, "transformers_version": "4.55.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 49152,
}
# (config, shapes of its tensors, the fixture whose tokenizer stands in)
MODELS = {
    "huginn-0125": (HUGINN_0125, lambda hf: huginn_shapes(huginn_config(hf)[0]), FIXTURES / "huginn_tiny"),
    "ouro-1.4b": (OURO_1_4B, lambda hf: ouro_shapes(ouro_config(hf)[0]), FIXTURES / "ouro_tiny"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_tensor(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """bfloat16: norms 1, biases 0, matrices N(0, 0.02^2)."""
    if name.endswith(("norm.weight", "_layernorm.weight", "layernorm_2.weight")) or ".norm_" in name \
            or name.endswith("ln_f.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) == 1 or name.endswith("qk_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)


def plan_shards(shapes: dict[str, tuple], shard_bytes: float) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most shard_bytes (bfloat16), as the hub's are."""
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + [current] if current else shards


def write(model: str, out: Path, seed: int = 0, shard_gb: float = 2.0) -> dict:
    """Write the folder; returns {"files", "bytes", "n_params", "seconds"}."""
    from safetensors.torch import save_file
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    hf, shapes_of, fixture = MODELS[model]
    shapes = shapes_of(hf)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    t0 = time.perf_counter()
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (fixture / name).is_file():
            shutil.copyfile(fixture / name, out / name)
    g = torch.Generator().manual_seed(seed)
    shards = plan_shards(shapes, shard_gb * 1e9)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(n, shapes[n], g) for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: file for n in names})
        del tensors
        print(f"  {file}: {len(names)} tensors", file=sys.stderr)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return {"files": len(shards), "bytes": total, "n_params": sum(math.prod(s) for s in shapes.values()),
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0, help="largest shard (GB of bfloat16; default 2)")
    args = p.parse_args(argv)
    r = write(args.model, args.out, args.seed, args.shard_gb)
    print(f"{args.model}: {r['n_params'] / 1e9:.3f}B parameters, {r['bytes'] / 1e9:.2f} GB bfloat16 in "
          f"{r['files']} shards, written to {args.out} in {r['seconds']:.0f} s")
    print(json.dumps({"model": args.model, "out": str(args.out), **r}))


if __name__ == "__main__":
    main()
