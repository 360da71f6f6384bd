"""One row per throughput.sh run: tokens/s and peak memory per GPU (medians over the steps after the warm-up), the
measured activity of every step, the run's config, kernel settings and provenance (its log's header). A run that
failed gives a row with its error."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def row(run: Path, warm: int) -> dict:
    log = run / "train_log.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    header = next((x for x in lines if x["type"] == "header"), None)
    steps = [x for x in lines if x["type"] == "step"]
    if header is None or len(steps) <= warm:
        return {"run": run.name, "error": f"{len(steps)} step rows in {log}: the run did not finish"}
    cfg, world = header["config"], header["world_size"]
    timed = steps[warm:]
    tps = statistics.median(x["tokens_per_s"] for x in timed)
    return {"run": run.name, "n_params": header["n_params"], "num_hidden_layers": header["model"]["num_hidden_layers"],
            "world_size": world, "mlp_impl": cfg["mlp_impl"], "l1_coeff": cfg["l1_coeff"],
            "activation_checkpointing": cfg["activation_checkpointing"],
            "fsdp_mixed_precision": cfg["fsdp_mixed_precision"], "parallel": cfg["parallel"],
            "micro_batch_size": cfg["micro_batch_size"], "grad_accum": cfg["grad_accum"], "seq_len": cfg["seq_len"],
            "global_batch_size": cfg["global_batch_size"], "steps_timed": len(timed),
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
            "tokens_per_s_steps": [x["tokens_per_s"] for x in timed],
            "peak_mem_gib_per_gpu": max(x.get("peak_mem_gib", float("nan")) for x in steps),
            "nnz_mean_steps": [x["nnz_mean"] for x in steps], "nnz_max_steps": [x["nnz_max"] for x in steps],
            "loss_steps": [x["loss"] for x in steps], "lr": cfg["lr"], "init_from": cfg["init_from"],
            "tokens_subdir": cfg["tokens_subdir"], "kernel_config": header.get("kernel_config"),
            **init_activity(cfg["init_from"]), "provenance": header["provenance"]}


def init_activity(init_from: str | None) -> dict:
    """The starting checkpoint's activity as paper_init measured it (calibration tokens, and held-out ones where it
    recorded them), beside which the run's own measured activity is read; empty for another init."""
    info = Path(init_from) / "paper_init.json" if init_from else None
    if info is None or not info.is_file():
        return {}
    d = json.loads(info.read_text())
    return {"init_target_nnz_mean": d["target_nnz_mean"], "init_calibration_nnz_mean": d["achieved_nnz_mean"],
            "init_held_out_nnz_mean": d.get("held_out_nnz_mean"), "init_calibration_seqs": d["calibration_seqs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for run in a.runs:
            r = row(run, a.warm)
            f.write(json.dumps(r) + "\n")
            print(f"{r['run']}: " + (r.get("error") or f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak "
                  f"{r['peak_mem_gib_per_gpu']:.1f} GiB, non-zeros {r['nnz_mean_steps'][-1]:.1f}"))


if __name__ == "__main__":
    main()
