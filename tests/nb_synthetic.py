"""Small synthetic logs that follow the schemas in notebooks/README.md (used by tests/test_notebooks.py).

Never written into results/: the caller passes a temporary directory. Values are distinctive so the test can
find them in the generated tables.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

PROV = {"git_commit": "0" * 40, "git_dirty": False, "host": "synthetic", "time_utc": "2026-01-01T00:00:00+00:00",
        "python": "3.11", "torch": "2.13.0", "cuda": None, "gpu": "SyntheticGPU", "gpu_count": 0}
TASKS = ["hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_log(path: Path, *, l1: float, n: int = 256, layers: int = 3, final_nnz: float, start_nnz: float | None = None,
              dead: float = 0.1, act: str = "relu", gated: bool = True, steps: int = 12, final_ce: float = 4.0,
              extra_cfg: dict[str, Any] | None = None) -> None:
    """A train_log.jsonl whose non-zeros decay geometrically from start_nnz to final_nnz."""
    start = start_nnz if start_nnz is not None else min(n, max(final_nnz * 4, n * 0.3))
    cfg = {"model": {"intermediate_size": n, "hidden_size": 64, "num_hidden_layers": layers, "gated_mlp": gated,
                     "hidden_act": act, "l1_coeff": l1, "l1_reduction": "mean"},
           "train": {"max_steps": steps * 10, "lr": 1e-3}}
    if extra_cfg:
        cfg.update(extra_cfg)
    rows: list[dict[str, Any]] = [{"type": "header", "provenance": PROV, "config": cfg, "n_params": 123456}]
    for i in range(steps):
        f = i / (steps - 1)
        nnz = math.exp((1 - f) * math.log(start) + f * math.log(final_nnz))
        per = [nnz * (0.5 + k / max(1, layers - 1)) for k in range(layers)]
        mean = sum(per) / layers
        per = [p * nnz / mean for p in per]
        ce = final_ce + 2.0 * (1 - f)
        rows.append({"type": "step", "step": (i + 1) * 10, "tokens": (i + 1) * 10 * 4096, "loss": ce + 0.01, "ce": ce,
                     "l1": 0.5, "l1_coeff": l1, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
                     "nnz_mean": nnz, "nnz_max": max(per) * 12, "dead_frac": dead * f,
                     "nnz_mean_per_layer": per, "nnz_max_per_layer": [p * 12 for p in per],
                     "dead_frac_per_layer": [dead * f] * layers})
        if i in (steps // 2, steps - 1):
            rows.append({"type": "eval", "step": (i + 1) * 10, "val_ce": ce + 0.05, "val_nnz_mean": nnz})
    rows.append({"type": "final", "step": steps * 10, "val_ce": final_ce + 0.05, "wall_s": 12.5})
    _jsonl(path, rows)


PER_DOC_N = 400  # documents per task where a synthetic eval.json has per-document scores (acc * 400 is whole)


def eval_json(path: Path, accs: list[float], nnz: float, limit: int | None = 50, model: str = "synthetic",
              per_doc: bool = False) -> None:
    """An eval.json as experiments/trainer/evaluate.py writes it; with per_doc, 400 documents per task whose first
    acc * 400 are right (so two such files differ only where one model gets more of the same documents right)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = PER_DOC_N if per_doc else 50
    data = {"provenance": PROV, "model": model, "limit": limit,
            "tasks": {t: {"acc": a, "acc_norm": (a + 0.01 if t != "winogrande" else None), "n": n} for t, a in zip(TASKS, accs)},
            "nnz_per_token_mean": nnz, "nnz_per_token_per_layer": [nnz] * 3}
    if per_doc:
        ones = {t: round(a * n) for t, a in zip(TASKS, accs)}
        data["per_doc"] = {t: {"acc": "1" * k + "0" * (n - k), "acc_norm": None, "docs_sha256": f"synthetic-{t}"}
                           for t, k in ones.items()}
    path.write_text(json.dumps(data))


def make_synthetic_results(root: Path | str) -> Path:
    """Populate `root` (a results dir) with one small instance of every log the notebooks read."""
    root = Path(root)
    base_acc = [0.2625, 0.2, 0.55, 0.5, 0.4, 0.22, 0.14]
    # quickstart
    train_log(root / "quickstart" / "train_log.jsonl", l1=3e-3, final_nnz=4.25)
    eval_json(root / "quickstart" / "eval.json", base_acc, nnz=4.25)
    # l1 sweep: dense ReLU, SiLU, 4 sparse (active 0.51% at l1=3e-2 -> 1.3/256)
    sweep = [("relu_l1_0", 0.0, 41.5, "relu", 3.90), ("silu_dense", 0.0, 256.0, "silu", 3.85),
             ("relu_l1_3e-3", 3e-3, 9.5, "relu", 3.93), ("relu_l1_1e-2", 1e-2, 3.7, "relu", 3.96),
             ("relu_l1_3e-2", 3e-2, 1.31, "relu", 3.99), ("relu_l1_1e-1", 1e-1, 0.21, "relu", 4.30)]
    for i, (name, l1, nnz, act, ce) in enumerate(sweep):
        d = root / "l1_sweep" / name
        train_log(d / "train_log.jsonl", l1=l1, final_nnz=nnz, act=act, final_ce=ce, dead=0.05 + 0.1 * i,
                  start_nnz=256.0 if act == "silu" else None)
        eval_json(d / "eval.json", [a - 0.005 * i for a in base_acc], nnz=nnz, per_doc=name != "relu_l1_1e-2")
    # sparsify SmolLM2-135M (N=1536): dense twin + two L1 values, one also evaluated through the kernels
    for name, l1, nnz, drop in (("dense_relu", 0.0, 180.0, 0.0), ("l1_1e-2", 1e-2, 9.2, 0.01), ("l1_3e-2", 3e-2, 3.1, 0.03)):
        d = root / "sparsify_smollm2" / name
        train_log(d / "train_log.jsonl", l1=l1, n=1536, layers=30, final_nnz=nnz, final_ce=3.1 + drop)
        eval_json(d / "eval.json", [a + 0.1 - drop for a in base_acc], nnz=nnz, limit=None, model=f"smollm2-135m-{name}",
                  per_doc=name != "l1_3e-2")  # l1_3e-2 stands for a log from before per-document scores were kept
        if name == "l1_1e-2":
            eval_json(d / "eval_sparse.json", [a + 0.1 - drop for a in base_acc], nnz=nnz, limit=None, model="cuda",
                      per_doc=True)
    # sparsify seeds: the twin and one L1 value, three seeds each, all with per-document scores
    for name, l1, nnz, drop in (("dense_relu_l1_0", 0.0, 180.0, 0.0), ("sparse_l1_1e-3", 1e-3, 150.0, 0.0025)):
        for seed in range(3):
            d = root / "sparsify_smollm2" / "seeds" / (name if seed == 0 else f"{name}_seed{seed}")
            train_log(d / "train_log.jsonl", l1=l1, n=1536, layers=30, final_nnz=nnz + seed, final_ce=3.0 + drop + 0.002 * seed)
            eval_json(d / "eval.json", [a + 0.1 - drop - 0.0025 * seed for a in base_acc], nnz=nnz, limit=None, per_doc=True)
    # speed: paper shapes + our sweep models
    rows = []
    for scale, dense_tps, sp in (("0.5B", 400000.0, 1.21), ("1B", 180000.0, 1.22), ("1.5B", 120000.0, 1.23), ("2B", 90000.0, 1.24)):
        rows.append(dict(model=f"paper-shape {scale}", paper_scale=scale, l1_coeff=None, mode="inference", batch_tokens=65536,
                         dense_tokens_per_s=dense_tps, sparse_tokens_per_s=dense_tps * sp, dense_energy_j_per_token=2e-3,
                         sparse_energy_j_per_token=1.7e-3, dense_peak_mem_gb=20.0, sparse_peak_mem_gb=19.0, provenance=PROV))
        rows.append(dict(model=f"paper-shape {scale}", paper_scale=scale, l1_coeff=None, mode="training", batch_tokens=16384,
                         dense_tokens_per_s=dense_tps / 4, sparse_tokens_per_s=dense_tps / 4 * 1.1, dense_energy_j_per_token=None,
                         sparse_energy_j_per_token=None, dense_peak_mem_gb=40.0, sparse_peak_mem_gb=30.0, provenance=PROV))
    for name, l1, sp in (("relu_l1_0", 0.0, 0.97), ("relu_l1_3e-3", 3e-3, 1.05), ("relu_l1_3e-2", 3e-2, 1.17)):
        for mode in ("inference", "training"):
            rows.append(dict(model=f"l1_sweep/{name}", paper_scale=None, l1_coeff=l1, mode=mode, batch_tokens=8192,
                             dense_tokens_per_s=50000.0, sparse_tokens_per_s=50000.0 * sp,
                             dense_energy_j_per_token=1e-3 if mode == "inference" else None,
                             sparse_energy_j_per_token=0.9e-3 if mode == "inference" else None,
                             dense_peak_mem_gb=3.0, sparse_peak_mem_gb=2.5, provenance=PROV))
    _jsonl(root / "speed" / "speed.jsonl", rows)
    per_layer = [dict(layer=i, nnz_mean=10.0 + 5 * i, tokens=16384, dense_ms=1.0, sparse_ms=0.8 + 0.02 * i,
                      sparse_forced_ms=0.8 + 0.02 * i, path="sparse", flagged_rows_frac=0.0) for i in range(6)]
    _jsonl(root / "speed" / "layer_times_synthetic.jsonl",
           [dict(model="paper-shape 1.5B", paper_scale="1.5B", mode="layer_times", nnz_mean=22.5, layer_times=per_layer,
                 provenance=PROV)])
    _synthetic_training_speed(root / "speed" / "training")
    _synthetic_paper_scale(root / "paper_scale")
    # kernel bench: inference rows in experiments/kernel_bench's format (kind, heavy_frac, rel_err_vs_dense_bf16),
    # training rows in the notebooks/README.md format (mode, gated, pattern "heavy")
    rows = []
    for m in (1, 16, 64, 16384, 65536):
        for act in (0.0025, 0.005, 0.01, 0.02, 0.05, 0.1):
            for heavy in (0.0, 0.01):
                nnz = act * 5632
                sp = 2.345 if (m, act, heavy) == (65536, 0.005, 0.0) else max(0.98, 2.5 - 20 * act)
                rows.append(dict(kind="gated", M=m, K=2048, N=5632, pattern="uniform", activity=act, heavy_frac=heavy,
                                 nnz_mean=nnz, nnz_max=nnz * (40 if heavy else 2), overflow_rows=0, path="sparse" if sp > 1 else "dense",
                                 rel_err_vs_dense_bf16=3e-3, dense_ms=7.5, ours_ms=7.5 / sp, speedup=sp, provenance=PROV))
    rows.append(dict(kind="nongated", M=65536, K=2048, N=8192, pattern="uniform", activity=0.005, heavy_frac=0.0, nnz_mean=41.0,
                     nnz_max=90.0, overflow_rows=0, path="sparse", rel_err_vs_dense_bf16=3e-3, dense_ms=9.0, ours_ms=5.0, speedup=1.8,
                     provenance=PROV))
    _jsonl(root / "kernel_bench" / "bench.jsonl", rows)
    rows = []
    for m in (4096, 16384):
        for act in (0.005, 0.01, 0.05):
            for pattern in ("uniform", "heavy"):
                sp = 1.876 if (m, act, pattern) == (16384, 0.005, "uniform") else 1.2
                rows.append(dict(mode="training", M=m, K=2048, N=5632, gated=True, pattern=pattern, activity=act,
                                 nnz_mean=act * 5632, nnz_max=act * 5632 * 3, overflow_rows=3 if pattern == "heavy" else 0,
                                 dense_ms=6.8, ours_ms=6.8 / sp, speedup=sp, rel_err=2e-3, path="hybrid", provenance=PROV))
    _jsonl(root / "kernel_bench" / "train_bench.jsonl", rows)
    # activation analysis
    rows, tok, pos = [], [], []
    for model, l1, base in (("l1_sweep/relu_l1_0", 0.0, 40.0), ("l1_sweep/relu_l1_3e-2", 3e-2, 1.3), ("l1_sweep/relu_l1_1e-1", 1e-1, 0.2)):
        for layer in range(6):
            nnz = base * (1 + layer * (5 - layer) / 4)
            rows.append(dict(model=model, l1_coeff=l1, layer=layer, nnz_mean=nnz, nnz_max=nnz * 15,
                             dense_ms=1.0, sparse_ms=0.9 + nnz / 100, n_tokens=1 << 16, provenance=PROV))
        for k in range(30):
            tok.append(dict(model=model, l1_coeff=l1, token=f"tok{k}", token_id=k, count=1000 + k, nnz_mean=base * (0.5 + k / 30)))
        for p in (0, 1, 2, 4, 8, 16, 32, 64, 128, 255):
            pos.append(dict(model=model, l1_coeff=l1, position=p, nnz_mean=base * (3.0 if p == 0 else 1 + 2 / (1 + p)), n=256))
    _jsonl(root / "activation_analysis" / "per_layer.jsonl", rows)
    _jsonl(root / "activation_analysis" / "tokens.jsonl", tok)
    _jsonl(root / "activation_analysis" / "position.jsonl", pos)
    # ablations
    for name, gated, l1, nnz in (("gated_l1_0", True, 0.0, 40.0), ("gated_l1_3e-2", True, 3e-2, 1.3),
                                 ("nongated_l1_0", False, 0.0, 60.0), ("nongated_l1_3e-2", False, 3e-2, 2.0)):
        d = root / "ablations" / "gating" / name
        train_log(d / "train_log.jsonl", l1=l1, final_nnz=nnz, gated=gated, n=256 if gated else 384)
        eval_json(d / "eval.json", base_acc, nnz=nnz)
    for name, l1, nnz, dead in (("dense", 0.0, 40.0, 0.01), ("standard", 3e-2, 1.3, 0.42), ("reinit", 3e-2, 1.35, 0.033),
                                ("sparsity_warmup", 1e-1, 4.4, 0.2)):
        d = root / "ablations" / "dead_neurons" / name
        train_log(d / "train_log.jsonl", l1=l1, final_nnz=nnz, dead=dead)
        eval_json(d / "eval.json", base_acc, nnz=nnz)
    write_manifest(root)
    return root


def _synthetic_training_speed(d: Path) -> None:
    """experiments/speed/train_throughput.py and memory_breakdown.py rows (flat provenance, as they write it)."""
    flat = {"git_commit": PROV["git_commit"], "time_utc": PROV["time_utc"], "gpu": PROV["gpu"]}
    rows = []
    for scale, layers, tps in (("0.5B", 8, 80000.0), ("1.5B", 28, 25000.0)):
        for ck, policy, mb_d, mb_s in ((0, "equal", 4, 4), (0, "largest that fits (searched up to 64)", 8, 11), (1, "equal", 4, 4)):
            for side, mb, f, mem in (("dense L1=0", mb_d, 1.0, 50.0), ("dense L1", mb_d, 0.91, 50.0),
                                     ("sparse", mb_s, 1.137, 42.0), ("sparse forced", mb_s, 1.13, 42.0)):
                row = {"model": f"paper-shape {scale}", "num_hidden_layers": layers, "activation_checkpointing": ck,
                       "micro_batch_policy": policy, "side": side, "micro_batch": mb, "tokens_per_s": tps * f,
                       "peak_mem_gb": mem, **flat}
                if side.startswith("sparse"):
                    row |= {"sparse_layers": layers, "ffn_paths": ["sparse"] * layers}
                rows.append(row)
    _jsonl(d / "train_throughput_synthetic.jsonl", rows)
    rows = []
    for mb in (4, 8):
        for nnz in (10.0, 29.0, 120.0):
            rows.append({"micro_batch": mb, "target_nnz_mean": nnz, "side": "dense L1=0", "tokens_per_s": 25000.0,
                         "peak_mem_gb": 80.0, **flat})
            rows.append({"micro_batch": mb, "target_nnz_mean": nnz, "side": "sparse", "tokens_per_s": 25000.0 * (1.3 - nnz / 400),
                         "peak_mem_gb": 64.0, "sparse_layers": 28, "ffn_paths": ["sparse"] * 28, **flat})
    _jsonl(d / "train_nnz_sweep_synthetic.jsonl", rows)
    cats = ("ffn", "attention", "norm", "embedding", "lm_head+loss", "parameters")
    rows = [{"layers": 28, "micro_batch": 4, "side": side, "ffn_paths": [path] * 28,
             **{f"saved_{c}_bytes": (ffn if c == "ffn" else 2 ** 30) for c in cats},
             "saved_activation_bytes": ffn + 3 * 2 ** 30, "peak_over_start_bytes": ffn + 6 * 2 ** 30, **flat}
            for side, path, ffn in (("dense L1=0", "dense", 10 * 2 ** 30), ("sparse forced", "sparse", 5 * 2 ** 30))]
    _jsonl(d / "memory_breakdown_synthetic.jsonl", rows)


def _synthetic_paper_scale(d: Path) -> None:
    """experiments/paper_scale/throughput_rows.py rows: 1.5B on one GPU, every arm twice (REPEATS=2: `_rN` runs), then
    on two GPUs of the same machine twice more (runs of one name, repeats by log order) at 0.95x the per-GPU tokens/s;
    sparse is 1.10x and 1.12x its repeat's dense run."""
    rows = []
    for n, eff, named in ((1, 1.0, True), (2, 0.95, False)):
        for rep, dense_tps in ((1, 24000.0), (2, 24200.0)):
            for arm, f, mem in (("dense_l1_0", 1.0, 40.0), ("dense_l1", 0.96, 40.0), ("sparse", 1.10 + 0.02 * (rep - 1), 38.0)):
                rows.append({"run": f"1p5b_{arm}_actrue_mpfalse_n{n}" + (f"_r{rep}" if named else ""),
                             "num_hidden_layers": 28, "world_size": n,
                             "activation_checkpointing": True, "fsdp_mixed_precision": False,
                             "tokens_per_s_per_gpu": dense_tps * f * eff, "peak_mem_gib_per_gpu": mem / n,
                             "nnz_mean_steps": [30.0, 32.0], "provenance": PROV})
    _jsonl(d / "throughput_synthetic.jsonl", rows)


def write_manifest(root: Path) -> None:
    """List every synthetic file in root/MANIFEST.csv: the notebooks read only manifest-listed logs."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "MANIFEST.csv")
    with open(root / "MANIFEST.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["path", "experiment", "what", "used_by", "seed", "status", "pending"])
        w.writerows([path, path.split("/")[0], "synthetic", "tests/test_notebooks.py", "", "record", ""] for path in files)
