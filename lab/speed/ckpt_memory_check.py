"""Why does the dense side stop fitting beside the sparse one with activation checkpointing (train_throughput's
largest-micro-batch timing)? Steps dense / sparse / dense at large micro-batches on the 0.5B shape with checkpointing,
printing what stays allocated after each step and, at the end, the largest CUDA tensors still alive and who holds them."""
import gc
import sys
import torch
from sfl.experiments.speed.bench import build_paper_model, calibrate_paper_model, paper_profile
from sfl.experiments.speed.train_throughput import Trainer

GiB = 2 ** 30
dev = torch.device("cuda")
m = build_paper_model(8, dev, torch.bfloat16)
g = torch.Generator().manual_seed(0)
V = m.config.vocab_size
ids = torch.randint(0, V, (8, 2049), generator=g).to(dev)
calibrate_paper_model(m, paper_profile(8, 39.0), ids[:, :-1], heavy_ids=torch.randperm(V, generator=g)[: V // 100])
m.config.l1_reduction = "sum"
m.float().train()
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
tr = Trainer(m, ids, dev)
plan = [("dense L1=0", 24), ("sparse", 32), ("dense L1=0", 24), ("sparse", 8), ("dense L1=0", 24)]
if sys.argv[1:] == ["oom"]:  # what a failed (out-of-memory) step leaves behind, on each side
    plan = [("sparse", 80), ("dense L1=0", 24), ("dense L1=0", 80), ("dense L1=0", 24), ("sparse", 32)]
for side, mb in plan:
    torch.cuda.reset_peak_memory_stats()
    try:
        tr.step(side, mb)
        ok = "ok"
    except torch.OutOfMemoryError:
        ok = "OOM"
    tr.release()
    print(f"{side:10s} mb {mb:2d} {ok:3s}: allocated after {torch.cuda.memory_allocated() / GiB:.2f} GiB, "
          f"peak {torch.cuda.max_memory_allocated() / GiB:.2f}, reserved {torch.cuda.memory_reserved() / GiB:.2f}", flush=True)
params = {p.untyped_storage().data_ptr() for p in m.parameters()}
state = {t.untyped_storage().data_ptr() for s in tr.opt.state.values() for t in s.values() if torch.is_tensor(t)}
live = [o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda
        and o.untyped_storage().data_ptr() not in params | state]
live.sort(key=lambda t: -t.untyped_storage().nbytes())
print("live CUDA tensors besides parameters and AdamW state:", len(live),
      f"{sum(t.untyped_storage().nbytes() for t in live) / GiB:.2f} GiB (storages may repeat)")
for t in live[:12]:
    refs = [type(r).__name__ + (f"[{list(r)[:4]}]" if isinstance(r, dict) else "") for r in gc.get_referrers(t)][:3]
    print(tuple(t.shape), t.dtype, f"{t.untyped_storage().nbytes() / 2**20:.0f} MiB", refs)
