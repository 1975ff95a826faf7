"""Training throughput of a preset: tokens/s and model FLOP/s as a fraction of a matmul peak.

The peak is measured in the same run: a square matmul in bf16 (and fp32) on the same device with
the same threads. Model FLOPs count every matmul of a step with the sampled depth r: prelude, r
core loops (adapter + blocks), coda and head forward, plus 2x forward for the backward of the parts
that get gradients (prelude, the last k loops, coda, head), and causal attention scores/values.

    python -m training.bench_train [--preset demo] [--steps 30] [--device cpu] [--threads N] [--set KEY=VALUE ...]
Last line: a JSON object with tokens_per_s and fraction_of_peak.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from recur_core import LoopedLM
from training.depth_sampler import sample_depth
from training.presets import PRESETS
from training.run import parse_overrides
from training.trainer import autocast_context, make_optimizer


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def block_params(blocks) -> int:
    return sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)


def step_flops(model: LoopedLM, batch: int, seq: int, r: int, k: int) -> float:
    """Matmul FLOPs of one training step at depth r with backprop depth k."""
    cfg, tokens = model.cfg, batch * seq
    attn_per_layer = 4 * cfg.d_model * (seq + 1) / 2  # causal QK^T and AV per token
    pre = 2 * block_params(model.prelude_blocks) + cfg.n_prelude * attn_per_layer
    loop = 2 * (block_params(model.core_blocks) + model.adapter.weight.numel()) + cfg.n_core * attn_per_layer
    out = 2 * block_params(model.coda_blocks) + cfg.n_coda * attn_per_layer + 2 * model.head_weight.numel()
    forward = pre + r * loop + out
    backward = 2 * (pre + min(r, k) * loop + out)
    return tokens * (forward + backward)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--autocast", default="auto")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset or shape field, as training.run's --set")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = PRESETS[args.preset].with_overrides(parse_overrides(args.overrides))
    torch.manual_seed(0)
    model = LoopedLM(cfg.model_config(args.vocab)).to(device).train()
    opt = make_optimizer(model, cfg, device)
    data = torch.randint(0, args.vocab, (cfg.batch_size, cfg.seq_len + 1), device=device)
    flops, tokens, elapsed = 0.0, 0, 0.0
    for step in range(args.warmup + args.steps):
        r = sample_depth(step, cfg.r_bar, cfg.r_max, cfg.sigma)
        sync(device)
        t0 = time.perf_counter()
        with autocast_context(device, args.autocast):
            logits = model(data[:, :-1], r, torch.Generator().manual_seed(step), backprop_depth=cfg.backprop_depth)
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sync(device)
        if step >= args.warmup:
            elapsed += time.perf_counter() - t0
            flops += step_flops(model, cfg.batch_size, cfg.seq_len, r, cfg.backprop_depth)
            tokens += cfg.batch_size * cfg.seq_len
    peak_bf16 = matmul_peak(device, torch.bfloat16)
    peak_fp32 = matmul_peak(device, torch.float32)
    achieved = flops / elapsed
    result = {"preset": args.preset, "device": str(device), "threads": torch.get_num_threads(),
              "params": model.num_params(), "steps": args.steps, "tokens_per_s": round(tokens / elapsed, 1),
              "model_tflops": round(achieved / 1e12, 4), "peak_bf16_tflops": round(peak_bf16 / 1e12, 4),
              "peak_fp32_tflops": round(peak_fp32 / 1e12, 4),
              "fraction_of_peak": round(achieved / peak_bf16, 3),
              "fraction_of_fp32_peak": round(achieved / peak_fp32, 3)}
    print(f"{args.preset} on {device} ({result['threads']} threads), {result['params']:,} params, "
          f"{args.steps} steps with sampled depth")
    print(f"  tokens/s           {result['tokens_per_s']:>12,.0f}")
    print(f"  model FLOP/s       {achieved / 1e9:>12,.1f} G")
    print(f"  bf16 matmul peak   {peak_bf16 / 1e9:>12,.1f} G   -> {result['fraction_of_peak']:.1%} of peak")
    print(f"  fp32 matmul peak   {peak_fp32 / 1e9:>12,.1f} G   -> {result['fraction_of_fp32_peak']:.1%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
