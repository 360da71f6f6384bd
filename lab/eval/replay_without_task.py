"""Trial (lab): per-document scores for eval.json files written before evaluate.py kept them, by replaying their
scores.npz through lm-eval with one task left out (a task whose definition changed since the export: the replay
asks lm-eval for today's requests, which must all be in the scored table). CPU.

    python lab/eval/replay_without_task.py SCORES.npz REQUESTS.npz OUT_DIR --drop commonsense_qa

REQUESTS.npz must be the very export that was scored (its digest is checked): for the SmolLM2 runs, an export made
with the code of their commit (efbb3bd). Writes OUT_DIR/eval.json (with per_doc) as evaluate.py --replay does.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from sfl.experiments.trainer import evaluate, loglik


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scores")
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--drop", nargs="+", default=["commonsense_qa"])
    ap.add_argument("--eval-data", required=True, help="the prepared eval data dir (<data_dir>/eval)")
    a = ap.parse_args()
    load = loglik.load_requests

    def load_without(path):
        reqs = load(path)
        reqs.meta["tasks"] = [t for t in reqs.meta["tasks"] if t not in a.drop]
        return reqs

    loglik.load_requests = load_without
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result, _ = evaluate.replay(Path(a.scores), Path(a.requests), None, Path(a.eval_data))
    result["replay_note"] = f"replayed without {a.drop} (lab/eval/replay_without_task.py)"
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({t: v["acc"] for t, v in result["tasks"].items()}))


if __name__ == "__main__":
    main()
