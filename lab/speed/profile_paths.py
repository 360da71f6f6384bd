"""Trial (lab): where do the remaining real-path gaps go? GPU only; output on stdout.

A. prefill through model.model at batch 1 and 16 x 2048: HF vs ours in auto / dense / sparse, then a kernel table
   of one forward per side at batch 1 (the 0.95x row).
B. one eager FFN call at M = 64 (the 0.52x row): host and GPU time, CPU-op table of 50 calls per side.
C. the training op at M = 16384 and 8192, 0.5%: CUDA-event time of fwd+bwd per mode, kernel table and the CPU-side
   synchronisations of one forced-sparse call.

    PYTHONPATH=. python lab/speed/profile_paths.py [layers] [parts]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.kernels.config import KernelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_generate import calibrated_pair  # noqa: E402  (the same calibrated model pair)


def ev_ms(fn, n=7) -> float:
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def table(prof, key="cuda_time_total", rows=16) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def part_prefill(layers: int) -> None:
    dev = torch.device("cuda")
    ours, hf, g, vocab = calibrated_pair(layers, dev)
    with torch.inference_mode():
        for b in (1, 16):
            ids = torch.randint(0, vocab, (b, 2048), generator=g).to(dev)
            res = {"hf": ev_ms(lambda: hf.model(input_ids=ids))}
            for mode in ("auto", "dense", "sparse"):
                ours.set_kernel_config(KernelConfig(mode=mode))
                for _ in range(3):
                    ours.model(input_ids=ids)
                res[mode] = ev_ms(lambda: ours.model(input_ids=ids))
                if mode == "auto":
                    mlps = list(ours.sparse_mlps())
                    print(f"  b{b} auto paths:", [m.plan.info().get("path") for m in mlps], flush=True)
            res["hf again"] = ev_ms(lambda: hf.model(input_ids=ids))
            print(f"A prefill b{b}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in res.items()), flush=True)
            ours.set_kernel_config(KernelConfig())
            for _ in range(3):
                ours.model(input_ids=ids)
            if b == 1:
                for name, m in (("hf", hf), ("ours", ours)):
                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        m.model(input_ids=ids)
                        torch.cuda.synchronize()
                    print(f"==== A b1 {name}: by device time")
                    print(table(prof, rows=14))
    del ours, hf
    torch.cuda.empty_cache()


def part_ffn64() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from sfl.models import SparseLlamaConfig
    from sfl.models.modeling_sparse_llama import SparseLlamaMLP

    dev = torch.device("cuda")
    cfg = SparseLlamaConfig(hidden_size=2048, intermediate_size=5632, mlp_impl="cuda")
    ours = SparseLlamaMLP(cfg).to(dev, torch.bfloat16).eval()
    hf = LlamaMLP(LlamaConfig(hidden_size=2048, intermediate_size=5632, hidden_act="relu")).to(dev, torch.bfloat16)
    hf.load_state_dict(ours.state_dict(), strict=False)
    with torch.no_grad():
        ours.gate_proj.weight[:, 0] = -3.0  # ~0.5% active with x[:, 0] = 1
        hf.gate_proj.weight.copy_(ours.gate_proj.weight)
    for M in (16, 64):
        x = torch.randn(M, 2048, device=dev, dtype=torch.bfloat16)
        x[:, 0] = 1.0
        with torch.inference_mode():
            for _ in range(300):
                ours(x); hf(x)
            torch.cuda.synchronize()
            for name, m in (("hf", hf), ("ours", ours)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    m(x)
                host = (time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
                gpu = ev_ms(lambda: [m(x) for _ in range(50)]) / 50 * 1e3
                print(f"B M={M} {name}: host {host:.1f} us/call, stream {gpu:.1f} us/call", flush=True)
            print(f"  plan: {ours.plan.info()}")
            if M == 64:
                for name, m in (("hf", hf), ("ours", ours)):
                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        for _ in range(50):
                            m(x)
                        torch.cuda.synchronize()
                    print(f"==== B M=64 {name}: by device time")
                    print(table(prof, rows=12))
                    print(f"==== B M=64 {name}: by CPU self time")
                    print(table(prof, key="self_cpu_time_total", rows=12))


def part_train() -> None:
    from sfl.experiments.kernel_bench.bench_training import make_case
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    K, N = 2048, 5632
    for M in (16384, 8192):
        x, (wg, wu, wd), gy = make_case(M, K, N, 0.005, 0.0, seed=M)
        params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        gl1 = torch.tensor(1000.0, device="cuda")
        st = DispatchState()

        def step(mode):
            for t in params:
                t.grad = None
            y, l, _ = sparse_gated_ffn_train(*params, mode=mode, state=st if mode == "auto" else None)
            torch.autograd.backward([y, l], [gy, gl1])

        def dense(l1):
            for t in params:
                t.grad = None
            xx, a, b, c = params
            h = torch.relu(xx @ a.t()) * (xx @ b.t())
            y = h @ c.t()
            if l1:
                torch.autograd.backward([y, h.abs().sum(dtype=torch.float32) / (M * N)], [gy, gl1])
            else:
                y.backward(gy)

        for _ in range(3):
            step("sparse"); step("auto"); dense(False)
        res = {}
        for _ in range(2):
            res["dense noL1"] = ev_ms(lambda: dense(False))
            res["sparse"] = ev_ms(lambda: step("sparse"))
            res["auto"] = ev_ms(lambda: step("auto"))
            res["dense L1"] = ev_ms(lambda: dense(True))
        print(f"C train M={M}: " + "  ".join(f"{k} {v:.3f} ms" for k, v in res.items()), flush=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step("sparse")
            torch.cuda.synchronize()
        print(f"==== C M={M} sparse: by device time")
        print(table(prof, rows=24))
        print(f"==== C M={M} sparse: by CPU self time")
        print(table(prof, key="self_cpu_time_total", rows=14))
        del x, wg, wu, wd, params


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 28
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["train", "ffn64", "prefill"]
    for p in parts:
        {"prefill": lambda: part_prefill(layers), "ffn64": part_ffn64, "train": part_train}[p]()


if __name__ == "__main__":
    main()
