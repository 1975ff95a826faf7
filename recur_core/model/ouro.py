"""Ouro's on-disk format (ByteDance Seed's `ByteDance/Ouro-1.4B` / `Ouro-2.6B`, model_type "ouro"),
opened as an ordinary `Checkpoint` whose model is this project's `LoopedLM`, configured to compute
exactly what Ouro's reference implementation (the hub's modeling_ouro.py) does.

An Ouro folder is a transformers folder like Huginn's (recur_core.model.hf_folder reads it). The
architecture as configuration of LoopedLM (`ouro_config`):

  loop            the whole layer stack is the core and loops total_ut_steps times: no prelude, no
                  coda, no adapter, no noise (loop_input "state"); loop 1 reads the embedded tokens
                  (no scaling), every later loop the previous loop's output.
  loop state      each loop ends with the shared final norm (loop_final_norm): the state is the
                  normed output, which the untied head reads directly and the next loop takes in.
  blocks          4 RMSNorms per layer, on the branches (sandwich "branch"):
                  h = h + input_layernorm_2(attn(input_layernorm(h))),
                  h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h))).
  attention       separate q / k / v / o without biases, grouped-query, half-split RoPE with
                  rope_theta; full causal attention (sliding windows and RoPE scaling are refused).
  exit gate       early_exit_gate: lambda_t = sigmoid(w . s_t + b) per token and loop, the hazard of
                  exiting at loop t; recur_core.exits.policies.GateExit is Ouro's Q-exit on it.
  dtype           config.json's `dtype` (transformers >= 4.56) or `torch_dtype` (older) is reported,
                  but the weights' own dtype (their safetensors header) is what loads.

Tensor names (`ouro_tensors`): model.embed_tokens -> embed; model.layers.N.self_attn.{q,o}_proj ->
core_blocks.N.attn.{q,o}_proj; k_proj and v_proj -> kv_proj (k rows then v rows), mlp.gate_proj and
up_proj -> mlp.gate_up (gate rows then up rows), mlp.down_proj -> mlp.down; the four norms ->
attn_norm, attn_out_norm, mlp_norm, mlp_out_norm; model.norm -> final_norm; model.early_exit_gate ->
exit_gate; lm_head -> lm_head. The two pairs are concatenated (one copy each, read from a short-lived
mapping of the file so its pages go once copied); every other tensor is a view of the file.

Recipe: Ouro trains every token at total_ut_steps loops (T): r_bar = T, k = T, sigma 0; r_max = 2 T,
the depth traces run to (looping past T is extrapolation, as for Huginn).
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import hf_folder
from .checkpoint import CONFIG, TOKENIZER, Checkpoint, CheckpointError, checkpoint_id, resolve_dtype
from .config import ModelConfig

MODEL_TYPE = "ouro"
EMBED = "model.embed_tokens.weight"
# config keys whose other values this mapping does not compute: refused, not guessed
SUPPORTED = {"hidden_act": "silu", "use_sliding_window": False, "rope_scaling": None}
_NORMS = {"input_layernorm": "attn_norm", "input_layernorm_2": "attn_out_norm",
          "post_attention_layernorm": "mlp_norm", "post_attention_layernorm_2": "mlp_out_norm"}
# pairs stored apart in Ouro and as one tensor here: {their part: (our part, its place in the pair)}
_PAIRS = {"self_attn.k_proj.weight": ("attn.kv_proj.weight", 0), "self_attn.v_proj.weight": ("attn.kv_proj.weight", 1),
          "mlp.gate_proj.weight": ("mlp.gate_up.weight", 0), "mlp.up_proj.weight": ("mlp.gate_up.weight", 1)}
_SINGLES = {"self_attn.q_proj.weight": "attn.q_proj.weight", "self_attn.o_proj.weight": "attn.o_proj.weight",
            "mlp.down_proj.weight": "mlp.down.weight", **{f"{n}.weight": f"{o}.weight" for n, o in _NORMS.items()}}
_TOP = {EMBED: "embed.weight", "model.norm.weight": "final_norm.weight", "lm_head.weight": "lm_head.weight",
        "model.early_exit_gate.weight": "exit_gate.weight", "model.early_exit_gate.bias": "exit_gate.bias"}


# -- config ---------------------------------------------------------------------------------------
def config_dtype(hf: dict) -> str | None:
    """The dtype config.json names: `dtype` (transformers >= 4.56) or `torch_dtype` (older)."""
    value = hf.get("dtype", hf.get("torch_dtype"))
    return None if value is None else str(value).removeprefix("torch.")


def ouro_config(hf: dict, where: str = "config.json") -> tuple[ModelConfig, dict]:
    """(ModelConfig, recipe) from an Ouro config.json dict; refuses other models and options."""
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r} (Ouro)")
    for key, value in SUPPORTED.items():
        if hf.get(key, value) not in (value, {} if value is None else value):
            raise CheckpointError(f"{where}: {key} = {hf[key]!r} is not supported (only {value!r})")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise CheckpointError(f"{where}: layer_types {sorted(layer_types)} are not supported (only full_attention)")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        steps = int(hf.get("total_ut_steps", 4))
        if "head_dim" in hf and int(hf["head_dim"]) * heads != d:
            raise CheckpointError(f"{where}: head_dim {hf['head_dim']} x {heads} heads is not hidden_size {d} "
                                  "(not supported)")
        if steps < 1:
            raise CheckpointError(f"{where}: total_ut_steps must be >= 1, got {steps}")
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d, n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads), ffn_dim=int(hf["intermediate_size"]),
            n_prelude=0, n_core=int(hf["num_hidden_layers"]), n_coda=0,
            max_seq_len=int(hf.get("max_position_embeddings", 32768)), rope_base=float(hf.get("rope_theta", 10_000)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            prelude_norm=False, sandwich="branch", loop_input="state", loop_final_norm=True, exit_gate=True)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{where}: not a usable Ouro config ({type(err).__name__}: {err})") from err
    recipe = {"r_bar": steps, "r_max": 2 * steps, "k": steps, "sigma": 0.0, "sampler_mean": "r_bar"}
    return cfg, recipe


# -- tensor names ---------------------------------------------------------------------------------
def ouro_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The shape every Ouro tensor must have under this config."""
    d, hd, H, Hkv, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    layer = {"self_attn.q_proj.weight": (H * hd, d), "self_attn.k_proj.weight": (Hkv * hd, d),
             "self_attn.v_proj.weight": (Hkv * hd, d), "self_attn.o_proj.weight": (d, H * hd),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
             **{f"{n}.weight": (d,) for n in _NORMS}}
    shapes = {EMBED: (cfg.vocab_size, d), "model.norm.weight": (d,), "model.early_exit_gate.weight": (1, d),
              "model.early_exit_gate.bias": (1,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    shapes.update({f"model.layers.{i}.{part}": s for i in range(cfg.n_core) for part, s in layer.items()})
    return shapes


class OuroTensors:
    """Ouro tensor -> {LoopedLM state-dict name: tensor}; the halves of a pair are held until both
    have been read (shards may split them), then concatenated once."""

    def __init__(self):
        self.pending: dict[str, list[torch.Tensor | None]] = {}

    def __call__(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name in _TOP:
            return {_TOP[name]: t}
        _, _, i, part = name.split(".", 3)
        if part in _SINGLES:
            return {f"core_blocks.{i}.{_SINGLES[part]}": t}
        ours, at = _PAIRS[part]
        key = f"core_blocks.{i}.{ours}"
        halves = self.pending.setdefault(key, [None, None])
        halves[at] = t
        if any(h is None for h in halves):
            return {}
        del self.pending[key]
        return {key: torch.cat(halves)}


def is_paired(name: str) -> bool:
    """Whether a tensor is half of a pair (read from a short-lived mapping, then concatenated)."""
    return name.startswith("model.layers.") and name.split(".", 3)[-1] in _PAIRS


# -- loading --------------------------------------------------------------------------------------
def read_config(path: Path) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, recipe, the raw config.json dict) of an Ouro folder."""
    hf = hf_folder.read_config(path)
    cfg, recipe = ouro_config(hf, str(path / CONFIG))
    return cfg, recipe, hf


def _name(hf: dict, path: Path) -> str:
    return hf.get("_name_or_path") or path.name


def describe_ouro(path: str | Path) -> dict:
    """What an Ouro folder holds, from config.json and the safetensors headers only (no weights
    read): format, name, recipe, n_params, dtype as stored (and as config.json names it), the
    weights' bytes on disk and the memory estimate. Raises CheckpointError for an unusable folder."""
    path = Path(path)
    cfg, recipe, hf = read_config(path)
    return {"format": MODEL_TYPE, "preset": "ouro", "name": _name(hf, path), "recipe": recipe,
            **hf_folder.describe(path, cfg, ouro_shapes(cfg), EMBED),
            "config_dtype": config_dtype(hf), "exit_steps": recipe["r_bar"]}


def load_ouro(path: str | Path, device: str | torch.device = "cpu", dtype=None,
              max_bytes: int | None = None) -> Checkpoint:
    """Open an Ouro-format folder as a Checkpoint (see the module doc).

    dtype: None (the dtype the weights are stored in), "float32", "bfloat16" or "float16".
    max_bytes: the memory budget to check the estimate against (default: what the device has free).
    """
    path, device = Path(path), torch.device(device)
    cfg, recipe, hf = read_config(path)
    layout = hf_folder.TensorLayout("Ouro", ouro_shapes(cfg), OuroTensors(), EMBED, copied=is_paired)
    model, dtype, est = hf_folder.build_model(path, cfg, layout, dtype=resolve_dtype(dtype), device=device,
                                              max_bytes=max_bytes)
    meta = {"format": MODEL_TYPE, "name": _name(hf, path), "recipe": recipe, "exit_steps": recipe["r_bar"],
            "dtype": str(dtype).removeprefix("torch."), "config_dtype": config_dtype(hf), "device": str(device),
            "n_params": est["n_params"], "memory_estimate": est}
    return Checkpoint(path, cfg, model, meta, path / TOKENIZER, checkpoint_id(cfg, model.state_dict()))
