"""Huginn-0125's on-disk format (`tomg-group-umd/huginn-0125`, model_type "huginn_raven"), opened as
an ordinary `Checkpoint` whose model is this project's `LoopedLM`, configured to compute exactly what
Huginn's reference implementation (seal-rg/recurrent-pretraining, raven_modeling_minimal.py) does.

A Huginn folder holds `config.json` (a transformers config), `tokenizer.json` and the weights as
`model.safetensors` or shards listed in `model.safetensors.index.json` (read by
recur_core.model.hf_folder, which Ouro's folders share). What this module does:

  config.json -> ModelConfig   `huginn_config`: widths and counts; prelude / coda blocks are
                               sandwich blocks like the core; no norm on the prelude output; q/k
                               biases; interleaved ("complex") RoPE pairs with Huginn's base;
                               embeddings scaled by sqrt(n_embd); initial state truncated normal,
                               std init_values.std * embed_scale, cut at +-3 std; ln_f applied before
                               the coda and again after it (Huginn's ln_f is "used twice").
  tensor names                 `huginn_tensors`: transformer.wte -> embed, norm_1..norm_4 -> attn_norm,
                               attn_out_norm, mlp_norm, mlp_out_norm; the fused attn.Wqkv is split
                               into q_proj and kv_proj (k rows then v rows, the same layout), qk_bias
                               (2, 1, H, hd) into q_bias / k_bias; mlp.fc (gate rows, then up rows)
                               -> gate_up, mlp.proj -> down, attn.proj -> o_proj; ln_f -> final_norm;
                               freqs_cis (a saved RoPE table) is not needed and skipped. The splits
                               are views: no tensor is copied.
  loading                      lazily with safetensors, tensor by tensor, straight into the model
                               (built on the meta device, weights assigned): no second full copy.
                               The dtype is read from the tensors (config.json's torch_dtype is
                               not trusted), or converted to the requested one tensor by tensor.
  refusals                     a config of another model_type, options this mapping does not cover,
                               .bin / pickle weights, a missing shard, a missing or unexpected
                               tensor, a tensor of the wrong shape, and a model whose estimated
                               memory exceeds what the device has: each a CheckpointError that says so.

Windows: a Huginn folder ships no eval windows; analyses take them from a text
(`Checkpoint.use_text`, `python -m recur_core.analyze PATH --text FILE`).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from . import hf_folder
from .checkpoint import CONFIG, TOKENIZER, Checkpoint, CheckpointError, checkpoint_id, resolve_dtype
from .config import ModelConfig

MODEL_TYPE = "huginn_raven"
EMBED = "transformer.wte.weight"
# What the mapping covers: every other value of these config keys is refused, not guessed.
SUPPORTED = {"block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP",
             "nonlin_name": "SiLU", "injection_type": "linear", "bias": False, "state_init": "like-init"}


# -- config ---------------------------------------------------------------------------------------
def huginn_config(hf: dict, where: str = "config.json") -> tuple[ModelConfig, dict]:
    """(ModelConfig, recipe) from a Huginn config.json dict; refuses other models and options."""
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r} (Huginn-0125); "
                              "this loader opens Huginn-format folders and this project's own checkpoints only")
    for key, value in SUPPORTED.items():
        if key in hf and hf[key] != value:
            raise CheckpointError(f"{where}: {key} = {hf[key]!r} is not supported (only {value!r})")
    if hf.get("test_time_noise", 0):
        raise CheckpointError(f"{where}: test_time_noise = {hf['test_time_noise']} is not supported (only 0)")
    try:
        d = int(hf["n_embd"])
        n_heads = int(hf.get("num_attention_heads", hf.get("n_heads")))
        embed_scale = math.sqrt(d)  # what the reference multiplies embeddings by (its _init_func)
        init = hf.get("init_values") or {}
        if "embed_scale" in init and not math.isclose(float(init["embed_scale"]), embed_scale, rel_tol=1e-6):
            raise CheckpointError(f"{where}: init_values.embed_scale {init['embed_scale']} differs from "
                                  f"sqrt(n_embd) = {embed_scale:g}, which the reference uses")
        std = float(init.get("std", math.sqrt(2 / (5 * d))))
        cfg = ModelConfig(
            vocab_size=int(hf.get("padded_vocab_size", hf["vocab_size"])), d_model=d, n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads", n_heads)), ffn_dim=int(hf["intermediate_size"]),
            n_prelude=int(hf["n_layers_in_prelude"]), n_core=int(hf["n_layers_in_recurrent_block"]),
            n_coda=int(hf["n_layers_in_coda"]), max_seq_len=int(hf["block_size"]),
            rope_base=float(hf.get("rope_base", 50_000)), norm_eps=float(hf.get("norm_eps", 1e-6)),
            state_init_std=std * embed_scale, tie_embeddings=bool(hf.get("tie_embeddings", True)),
            outer_blocks="sandwich", prelude_norm=False, qk_bias=bool(hf.get("qk_bias", True)),
            rope_layout="interleaved", embed_scale=embed_scale, state_init="trunc_normal", coda_input_norm=True)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{where}: not a usable Huginn config ({type(err).__name__}: {err})") from err
    if cfg.qk_bias and cfg.n_kv_heads != cfg.n_heads:  # the reference adds one (n_heads, hd) bias to k too
        raise CheckpointError(f"{where}: qk_bias with {cfg.n_kv_heads} key/value heads for {cfg.n_heads} query "
                              "heads is not supported (the reference needs them equal)")
    mean = int(hf.get("mean_recurrence", 32))
    # r_max = 2 x the mean recurrence (ours): Huginn's papers evaluate up to about twice the mean
    # Huginn's sampler: sigma 0.5, and its code passes the mean itself, so E[r] = mean + 1 ("huginn")
    recipe = {"r_bar": mean, "r_max": 2 * mean, "k": hf.get("mean_backprop_depth"), "sigma": 0.5,
              "sampler_mean": "huginn"}
    return cfg, recipe


# -- tensor names ---------------------------------------------------------------------------------
_BLOCK_PARTS = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "attn_out_norm.weight",
                "norm_3.weight": "mlp_norm.weight", "norm_4.weight": "mlp_out_norm.weight",
                "attn.proj.weight": "attn.o_proj.weight", "mlp.fc.weight": "mlp.gate_up.weight",
                "mlp.proj.weight": "mlp.down.weight"}
_STACKS = {"prelude": "prelude_blocks", "core_block": "core_blocks", "coda": "coda_blocks"}
SKIPPED = ("freqs_cis",)


def huginn_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The shape every Huginn tensor must have under this config."""
    d, hd, H, Hkv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    block = {"norm_1.weight": (d,), "norm_2.weight": (d,), "norm_3.weight": (d,), "norm_4.weight": (d,),
             "attn.Wqkv.weight": ((H + 2 * Hkv) * hd, d), "attn.proj.weight": (d, H * hd),
             "mlp.fc.weight": (2 * cfg.ffn_dim, d), "mlp.proj.weight": (d, cfg.ffn_dim)}
    if cfg.qk_bias:
        block["attn.qk_bias"] = (2, 1, H, hd)
    shapes = {"transformer.wte.weight": (cfg.vocab_size, d), "transformer.adapter.weight": (d, 2 * d),
              "transformer.ln_f.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for stack, n in (("prelude", cfg.n_prelude), ("core_block", cfg.n_core), ("coda", cfg.n_coda)):
        shapes.update({f"transformer.{stack}.{i}.{part}": s for i in range(n) for part, s in block.items()})
    return shapes


def huginn_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Huginn tensor -> {LoopedLM state-dict name: tensor (a view of t)}."""
    if name == "transformer.wte.weight":
        return {"embed.weight": t}
    if name == "transformer.adapter.weight":
        return {"adapter.weight": t}
    if name == "transformer.ln_f.weight":
        return {"final_norm.weight": t}
    if name == "lm_head.weight":
        return {"lm_head.weight": t}
    _, stack, i, part = name.split(".", 3)
    ours = f"{_STACKS[stack]}.{i}."
    if part == "attn.Wqkv.weight":
        q_rows = cfg.n_heads * cfg.head_dim
        return {ours + "attn.q_proj.weight": t[:q_rows], ours + "attn.kv_proj.weight": t[q_rows:]}
    if part == "attn.qk_bias":
        return {ours + "attn.q_bias": t[0, 0], ours + "attn.k_bias": t[1, 0]}
    return {ours + _BLOCK_PARTS[part]: t}


# -- loading --------------------------------------------------------------------------------------
def read_config(path: Path) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, recipe, the raw config.json dict) of a Huginn folder."""
    hf = hf_folder.read_config(path)
    cfg, recipe = huginn_config(hf, str(path / CONFIG))
    return cfg, recipe, hf


def _skipped(cfg: ModelConfig) -> tuple[str, ...]:
    return SKIPPED + (("lm_head.weight",) if cfg.tie_embeddings else ())


def describe_huginn(path: str | Path) -> dict:
    """What a Huginn folder holds, from config.json and the safetensors headers only (no weights
    read): format, name, recipe, n_params, dtype as stored, the weights' bytes on disk and the
    memory estimate. Raises CheckpointError for an unusable folder."""
    path = Path(path)
    cfg, recipe, hf = read_config(path)
    return {"format": MODEL_TYPE, "preset": "huginn", "name": hf.get("name") or path.name, "recipe": recipe,
            **hf_folder.describe(path, cfg, huginn_shapes(cfg), EMBED)}


def load_huginn(path: str | Path, device: str | torch.device = "cpu", dtype=None,
                max_bytes: int | None = None) -> Checkpoint:
    """Open a Huginn-format folder as a Checkpoint (see the module doc).

    dtype: None (the dtype the weights are stored in), "float32", "bfloat16" or "float16".
    max_bytes: the memory budget to check the estimate against (default: what the device has free).
    """
    path, device = Path(path), torch.device(device)
    cfg, recipe, hf = read_config(path)
    layout = hf_folder.TensorLayout("Huginn", huginn_shapes(cfg), lambda name, t: huginn_tensors(name, t, cfg), EMBED,
                                    skipped=_skipped(cfg))
    model, dtype, est = hf_folder.build_model(path, cfg, layout, dtype=resolve_dtype(dtype), device=device,
                                              max_bytes=max_bytes)
    meta = {"format": MODEL_TYPE, "name": hf.get("name") or path.name, "recipe": recipe,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device), "n_params": est["n_params"],
            "memory_estimate": est}
    return Checkpoint(path, cfg, model, meta, path / TOKENIZER, checkpoint_id(cfg, model.state_dict()))
