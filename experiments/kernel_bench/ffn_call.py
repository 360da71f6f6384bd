"""Single eager FFN calls through the modules users run: HF's LlamaMLP (ReLU) against SparseLlamaMLP(mlp_impl="cuda")
and TwELLGatedMLP, the same weights. GPU only.

    python -m sfl.experiments.kernel_bench.ffn_call --out results/kernel_bench/ffn_call_h100.jsonl

Each row: one shape and activity; per side the median time of single calls (a sync before each, CUDA events around
it: what a host-bound caller such as eager decode pays) and of back-to-back calls (steady state), and the host time
per call (the loop's wall time with the GPU kept busy by a long kernel first, so only enqueueing is measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from sfl.kernels.ffn import TwELLGatedMLP
from sfl.models import SparseLlamaConfig
from sfl.models.modeling_sparse_llama import SparseLlamaMLP

from ..trainer.provenance import collect


def make_weights(K: int, N: int, p: float, seed: int):
    """bf16 weights whose gate gives activity ~p on inputs whose feature 0 is 1 (the gate's bias channel)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    wg = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    wu = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    wd = torch.randn(K, N, device="cuda", generator=g) / N ** 0.5
    wg[:, 0] = -torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - p)).item()
    return [w.to(torch.bfloat16) for w in (wg, wu, wd)]


def sides(K: int, N: int, p: float):
    wg, wu, wd = make_weights(K, N, p, seed=K + N)
    hf = LlamaMLP(LlamaConfig(hidden_size=K, intermediate_size=N, hidden_act="relu", mlp_bias=False))
    ours = SparseLlamaMLP(SparseLlamaConfig(hidden_size=K, intermediate_size=N, mlp_impl="cuda", num_attention_heads=8,
                                            num_key_value_heads=8))
    out = {"hf LlamaMLP": hf, "SparseLlamaMLP cuda": ours}
    for m in out.values():
        m.to("cuda", torch.bfloat16).eval()
        with torch.no_grad():
            m.gate_proj.weight.copy_(wg), m.up_proj.weight.copy_(wu), m.down_proj.weight.copy_(wd)
    out["TwELLGatedMLP"] = TwELLGatedMLP.from_linears(hf.gate_proj, hf.up_proj, hf.down_proj).eval()
    return out


def time_side(m, x: torch.Tensor, reps: int, busy_cycles: int = int(2e9)) -> dict:
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(5):
        m(x)
    single = []
    for a, b in ev:
        torch.cuda.synchronize()
        a.record()
        m(x)
        b.record()
    torch.cuda.synchronize()
    single = [a.elapsed_time(b) for a, b in ev]
    a, b = ev[0]
    a.record()
    for _ in range(reps):
        m(x)
    b.record()
    torch.cuda.synchronize()
    steady = a.elapsed_time(b) / reps
    torch.cuda._sleep(busy_cycles)  # the GPU stays busy: the loop below measures host (enqueue) time only
    t0 = time.perf_counter()
    for _ in range(reps):
        m(x)
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return {"single_ms": statistics.median(single), "steady_ms": steady, "host_ms": host}


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/kernel_bench/ffn_call.jsonl"))
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args(argv)
    cases = [(2048, 5632, 0.005, M) for M in (1, 8, 16, 64)] + [(576, 1536, 0.01, 8192), (2048, 5632, 0.005, 16384)]
    prov = collect()
    rows = []
    for K, N, p, M in cases:
        ms = sides(K, N, p)
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        x[:, 0] = 1
        r = {"K": K, "N": N, "activity_target": p, "M": M}
        for name, m in ms.items():
            r[name] = time_side(m, x, a.reps)
        r["measured_activity"] = float((torch.relu(x @ ms["hf LlamaMLP"].gate_proj.weight.t()) > 0).float().mean())
        r["kernel_config"] = ms["SparseLlamaMLP cuda"].plan.config.to_dict()
        r["plan_info"] = {k: v for k, v in ms["SparseLlamaMLP cuda"].plan.info().items() if k != "timings"}
        hf = r["hf LlamaMLP"]
        for name in ("SparseLlamaMLP cuda", "TwELLGatedMLP"):
            r[name]["single_speedup"] = hf["single_ms"] / r[name]["single_ms"]
            r[name]["steady_speedup"] = hf["steady_ms"] / r[name]["steady_ms"]
        rows.append({**r, **prov})
        s = r["SparseLlamaMLP cuda"]
        print(f"K {K} N {N} M {M:5d} p {p}: single {s['single_speedup']:.2f}x steady {s['steady_speedup']:.2f}x "
              f"host {s['host_ms'] * 1e3:.0f} us vs HF {hf['host_ms'] * 1e3:.0f} us; path {r['plan_info'].get('path')}",
              flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
