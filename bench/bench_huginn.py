"""Huginn-format checkpoints: peak memory while loading, and the time of a trace.

(a) Loading. A synthetic Huginn-format folder of about 1 GB (float32, the hub's tensor names,
    random weights) is loaded in a fresh subprocess per variant; the figure is the peak resident
    memory of the load (VmHWM after resetting it, minus the RSS before; file-backed pages of mapped
    weights count) divided by the size of the loaded weights. Variants:
      ours        recur_core.load_checkpoint (lazy safetensors, weights assigned into a meta-built
                  model, checkpoint_id hashed over every byte, so every page is touched);
      ours-bf16   the same with dtype="bfloat16" (converted tensor by tensor; ratio against the
                  bfloat16 weights' size);
      naive       the baseline, measured in the same run: build the model (its own weights), read the
                  whole file (safetensors.torch.load_file), copy the renamed tensors in
                  (load_state_dict).
    Goal: ours <= 1.3x (no second full copy).
(b) Trace. A synthetic Huginn-format model of about 100M parameters (d 768, 12 heads, FFN 2048,
    2 / 4 / 2 blocks, vocabulary 65,536) traces one 256-token text over 32 loops with the readout
    statistics (recur_core.analysis.trace.trace, top-5, no cache). Printed: time, matmul FLOPs per loop
    (counted: adapter, core and coda blocks, causal attention, and the LM head over h and h_prev,
    which the readout multiplies together), the achieved FLOP rate, and the fraction of the matmul
    peak measured in the same run (best of 5 float32 2048^3 torch.mm, same threads).

    python -m bench.bench_huginn [--skip-load] [--skip-trace] [--loops 32] [--tokens 256] [--threads N]
On a shared, loaded 2-core machine --threads 1 is the stable figure: with 2 threads every small op
pays thread-synchronisation latency whenever another process holds a core.
Last line: a JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from recur_core import load_checkpoint
from recur_core.analysis.trace import trace
from recur_core.model.huginn import huginn_config, huginn_shapes

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "huginn_tiny" / "tokenizer.json"
LOAD_MODEL = dict(n_embd=1024, num_attention_heads=8, intermediate_size=5632)   # ~0.97 GB in float32
TRACE_MODEL = dict(n_embd=768, num_attention_heads=12, intermediate_size=2048)  # ~108M parameters


def hf_config(**dims) -> dict:
    d, heads = dims["n_embd"], dims["num_attention_heads"]
    return {"model_type": "huginn_raven", "architectures": ["RavenForCausalLM"], "torch_dtype": "bfloat16",
            "n_embd": d, "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": dims["intermediate_size"], "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
            "n_layers_in_coda": 2, "block_size": 4096, "vocab_size": 65536, "padded_vocab_size": 65536,
            "rope_base": 50000, "norm_eps": 1e-6, "qk_bias": True, "tie_embeddings": True, "mean_recurrence": 32,
            "init_values": {"std": (2 / (5 * d)) ** 0.5, "embed_scale": d ** 0.5}}


def write_folder(folder: Path, hf: dict, seed: int = 0) -> int:
    """A Huginn-format folder with random weights; returns the weights' bytes."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    shutil.copyfile(TOKENIZER, folder / "tokenizer.json")
    cfg, _ = huginn_config(hf)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape, generator=g))
               for name, shape in huginn_shapes(cfg).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- (a) memory, in a child process per variant -----------------------------------------------------
def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def measure_load(folder: str, variant: str) -> dict:
    """Run in the child: peak RSS of one load above the RSS before it, and the loaded weights' bytes."""
    from safetensors.torch import load_file

    from recur_core.model.huginn import huginn_tensors
    from recur_core.model.looped_lm import LoopedLM
    cfg, _ = huginn_config(json.loads((Path(folder) / "config.json").read_text()))
    before = proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    if variant == "naive":
        model = LoopedLM(cfg)
        state = {}
        for name, t in load_file(str(Path(folder) / "model.safetensors")).items():
            state.update(huginn_tensors(name, t, cfg))
        model.load_state_dict(state)
        del state
    else:
        model = load_checkpoint(folder, dtype="bfloat16" if variant == "ours-bf16" else None).model
    seconds = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # q/k/v split views: no overlap
    return {"variant": variant, "peak_extra_bytes": proc_status("VmHWM") - before, "weights_bytes": weights,
            "seconds": seconds}


def run_child(folder: Path, variant: str) -> dict:
    out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(folder), variant], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- (b) trace -------------------------------------------------------------------------------------
def block_flops(cfg, T: int) -> float:
    d, hd = cfg.d_model, cfg.head_dim
    proj = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_dim
    return 2 * T * proj + 2 * T * T * cfg.n_heads * hd  # + QK^T and AV over the causal half


def flops_per_loop(cfg, T: int) -> dict:
    core = 2 * T * 2 * cfg.d_model * cfg.d_model + cfg.n_core * block_flops(cfg, T)
    coda = cfg.n_coda * block_flops(cfg, T)
    head = 2 * (2 * T) * cfg.d_model * cfg.vocab_size  # logits of h and h_prev
    return {"core": core, "coda": coda, "head": head, "total": core + coda + head}


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_trace(folder: Path, tokens: int, loops: int) -> dict:
    ckpt = load_checkpoint(folder)
    ids = torch.randint(0, ckpt.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).numpy()
    peak_before = matmul_peak()
    trace(ckpt, ids[:16], 2, seed=0, cache=False)  # warm-up
    seconds = _timed(lambda: trace(ckpt, ids, loops, seed=0, cache=False))
    peak = max(peak_before, matmul_peak())
    # the prelude runs once; the noise state's readout (p_0) once: count them with the loops
    f = flops_per_loop(ckpt.config, tokens)
    total = loops * f["total"] + ckpt.config.n_prelude * block_flops(ckpt.config, tokens) + f["coda"] + f["head"] / 2
    return {"n_params": ckpt.model.num_params(), "tokens": tokens, "loops": loops, "seconds": seconds,
            "flops_per_loop": f, "achieved_flops": total / seconds, "matmul_peak_flops": peak,
            "fraction_of_peak": total / seconds / peak, "threads": torch.get_num_threads()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--skip-trace", action="store_true")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--loops", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure_load(*args.child)))
        return
    result = {}
    with tempfile.TemporaryDirectory(prefix="bench_huginn_") as tmp:
        if not args.skip_load:
            folder = Path(tmp) / "load"
            size = write_folder(folder, hf_config(**LOAD_MODEL))
            print(f"(a) loading a synthetic Huginn-format checkpoint: {size / 1e9:.2f} GB float32 on disk")
            print(f"  {'variant':10s} {'peak extra RSS':>15s} {'weights':>10s} {'ratio':>6s} {'time':>7s}")
            rows = []
            for variant in ("ours", "ours-bf16", "naive"):
                r = run_child(folder, variant)
                r["ratio"] = r["peak_extra_bytes"] / r["weights_bytes"]
                rows.append(r)
                print(f"  {variant:10s} {r['peak_extra_bytes'] / 1e9:12.3f} GB {r['weights_bytes'] / 1e9:7.3f} GB "
                      f"{r['ratio']:6.2f} {r['seconds']:6.1f}s")
            result["load"] = rows
            shutil.rmtree(folder)
        if not args.skip_trace:
            folder = Path(tmp) / "trace"
            write_folder(folder, hf_config(**TRACE_MODEL))
            r = bench_trace(folder, args.tokens, args.loops)
            f = r["flops_per_loop"]
            print(f"(b) trace: {r['n_params'] / 1e6:.0f}M-parameter Huginn-format model, {r['tokens']} tokens x "
                  f"{r['loops']} loops, {r['threads']} threads: {r['seconds']:.1f} s "
                  f"({r['seconds'] / r['loops']:.2f} s per loop)")
            print(f"  GFLOP per loop: {f['total'] / 1e9:.1f} (core {f['core'] / 1e9:.1f}, coda {f['coda'] / 1e9:.1f}, "
                  f"head over h and h_prev {f['head'] / 1e9:.1f})")
            print(f"  achieved {r['achieved_flops'] / 1e9:.1f} GFLOP/s; matmul peak (same run) "
                  f"{r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s; fraction of peak {r['fraction_of_peak']:.2f}")
            result["trace"] = r
    print(json.dumps(result))


if __name__ == "__main__":
    main()
