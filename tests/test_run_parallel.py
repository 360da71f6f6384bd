"""experiments/run_parallel.sh: every job runs once, on the GPUs it was given, several at a time; a failing job makes
the whole run fail and is named. Pure bash (no GPU needed: CUDA_VISIBLE_DEVICES lists the 'GPUs')."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "run_parallel.sh"


def _run(jobs: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text("# a comment line\n\n" + "\n".join(jobs) + "\n")
    return subprocess.run(["bash", str(SCRIPT), str(jobs_file)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LOG_DIR": str(tmp_path / "logs"), **env})


def test_each_job_runs_once_on_the_given_gpus_in_parallel(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # each job records its GPU, then waits until at least two jobs have started (fails after 20 s alone)
    jobs = [f'echo "$CUDA_VISIBLE_DEVICES" > {out}/{i}; touch {out}/started_{i}; '
            f'for t in $(seq 200); do [ $(ls {out}/started_* | wc -l) -ge 2 ] && exit 0; sleep 0.1; done; exit 9'
            for i in range(6)]
    r = _run(jobs, tmp_path, CUDA_VISIBLE_DEVICES="3,5", WORKERS_PER_GPU="2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6 jobs on GPU(s) 3 5, 2 worker(s) each" in r.stdout
    gpus = [(out / str(i)).read_text().strip() for i in range(6)]
    assert set(gpus) <= {"3", "5"} and len(set(gpus)) == 2, gpus
    assert r.stdout.count(" start: ") == 6 and r.stdout.count(" end rc=0") == 6
    assert sorted(p.name for p in (tmp_path / "logs").glob("job_*.log")) == [f"job_{i}.log" for i in range(6)]


def test_a_failing_job_fails_the_run_and_is_named(tmp_path):
    r = _run(["true", "echo boom; exit 3", "true"], tmp_path, CUDA_VISIBLE_DEVICES="0", WORKERS_PER_GPU="1")
    assert r.returncode == 1
    assert "job 1 end rc=3" in r.stdout and "FAILED jobs: 1 " in r.stderr
    assert (tmp_path / "logs" / "job_1.log").read_text().strip() == "boom"
