"""experiments/trainer/distributed.py: 2 CPU processes with gloo.

FSDP2 (fully_shard runs on CPU with gloo in torch 2.13) and DDP against one process on the same global batch:
same loss, CE, L1, grad norm, non-zeros per token, dead-neuron fraction, re-initialised neurons and val CE.
A DCP checkpoint resumes exactly on 2 processes and continues on 1 process; the consolidated final model loads
in one process. One module-scoped fixture trains everything once, every multi-process run through torchrun (the launcher
users run). Not processes forked from pytest: a fork after this process has run torch's OpenMP pool can hang
a rank (it did once on CI).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sfl.experiments.trainer import train as train_mod
from sfl.experiments.trainer.checkpoint import find_latest, load_checkpoint
from sfl.experiments.trainer.config import ConfigError, load_config
from sfl.experiments.trainer.data_loader import TokenData
from sfl.experiments.trainer.distributed import Dist, resolve_grad_accum, restore_trackers, resume_config_view

REPO = Path(__file__).resolve().parents[1]
VOCAB = 61
# One global batch of 8 sequences x 16 tokens, split three ways.
ONE_PROC = {"micro_batch_size": 4, "grad_accum": 2}
FSDP = {"parallel": "fsdp", "micro_batch_size": 2, "grad_accum": 2, "activation_checkpointing": True}
DDP = {"parallel": "ddp", "micro_batch_size": 4, "grad_accum": 1}
COMPARED = ["loss", "ce", "l1", "grad_norm", "nnz_mean", "nnz_max", "dead_frac", "reinit_neurons"]


def base_sets(data_dir: Path, init: Path, out: Path) -> dict:
    # min_lr = lr: constant LR after warm-up, so a run cut at max_steps=2 and resumed to 4 follows the 4-step one.
    # dead window = 2 optimizer steps of all ranks (2 x 128 tokens). eval_batches=100 > the 121 val windows: every
    # run evaluates all of them (61 micro-batches of 2 under FSDP: uneven over 2 ranks, one padding forward).
    return {"data_dir": str(data_dir), "out_dir": str(out), "init_from": str(init), "seq_len": 16,
            "max_steps": 4, "warmup_steps": 1, "lr": 3e-3, "min_lr": 3e-3, "l1_coeff": 1e-2, "log_every": 1,
            "eval_every": 2, "eval_batches": 100, "ckpt_every": 2, "device": "cpu", "progress": False,
            "dead_window_tokens": 256, "dead_reinit_lambda": 0.1, "data_order": "disjoint"}


def as_sets(d: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in d.items()]


def torchrun(sets: dict, nproc: int = 2, resume: bool = False) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "sfl.experiments.trainer.train"]
    for s in as_sets(sets):
        cmd += ["--set", s]
    cmd += ["--resume"] if resume else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def rewound_copy(run: Path, dest: Path) -> None:
    """A copy of a finished 4-step run that a resume continues from its step-2 checkpoint (kept beside step 4)."""
    shutil.copytree(run, dest)
    shutil.rmtree(dest / "checkpoints" / "step_0000004")
    (dest / "checkpoints" / "latest.json").unlink()


def read_log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def lines(out: Path, kind: str) -> list[dict]:
    return [x for x in read_log(out) if x["type"] == kind]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two train files (561 non-overlapping 17-token windows), one val file of 121 windows."""
    data = tmp_path_factory.mktemp("data")
    tok = data / "tokens"
    tok.mkdir(parents=True)
    rng = np.random.default_rng(0)
    meta = {"vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "train": [], "val": []}
    for name, n, split in [("train_000.bin", 6000, "train"), ("train_001.bin", 3000, "train"),
                           ("val_000.bin", 1940, "val")]:
        base = (np.arange(n) * 5) % VOCAB
        np.where(rng.random(n) < 0.1, rng.integers(0, VOCAB, n), base).astype(np.uint16).tofile(tok / name)
        meta[split].append({"file": name, "tokens": n})
    (tok / "meta.json").write_text(json.dumps(meta))
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    # The start model has 8 dead gate rows per layer (zero rows never fire), so Eq. 6 re-initialises some
    # rows at step 1 -- under FSDP each rank writes those of its own shard.
    from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM
    torch.manual_seed(0)
    init = SparseLlamaForCausalLM(SparseLlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0))
    with torch.no_grad():
        for mlp in init.sparse_mlps():
            mlp.gate_proj.weight[20:28] = 0.0
    init.save_pretrained(root / "init")

    # The TwELL layout: the reference path keeps W_d neuron-major, as the CUDA kernels do, and the trainer makes it
    # one contiguous [N, K] parameter that FSDP2 shards by neuron (N a multiple of the TwELL tile, 256).
    init_twell = SparseLlamaForCausalLM(SparseLlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0))
    init_twell.save_pretrained(root / "init_twell")

    out = {k: root / k for k in ("one", "fsdp", "ddp", "resumed", "resumed_one", "fsdp_bf16", "one_twell",
                                  "fsdp_twell", "fsdp_twell_one", "fsdp_twell_group_of_one")}
    out.update(data=data, init=root / "init")
    sets = {k: base_sets(data, root / "init", out[k]) for k in out}
    for k in ("one_twell", "fsdp_twell", "fsdp_twell_one", "fsdp_twell_group_of_one"):
        sets[k].update(init_from=str(root / "init_twell"), mlp_impl="reference")
    train_mod.train(load_config(None, as_sets({**sets["one"], **ONE_PROC})))
    torchrun({**sets["fsdp"], **FSDP})
    torchrun({**sets["ddp"], **DDP})
    # The FSDP run rewound to its step-2 checkpoint (kept beside step 4), resumed on 2 processes and on 1.
    for k in ("resumed", "resumed_one"):
        rewound_copy(out["fsdp"], out[k])
    torchrun({**sets["resumed"], **FSDP}, resume=True)
    train_mod.train(load_config(None, as_sets({**sets["resumed_one"], **ONE_PROC, "parallel": "fsdp"})), resume=True)
    torchrun({**sets["fsdp_bf16"], **FSDP, "fsdp_mixed_precision": True, "max_steps": 2, "eval_every": 0,
            "save_final": False})
    train_mod.train(load_config(None, as_sets({**sets["one_twell"], **ONE_PROC})))
    torchrun({**sets["fsdp_twell"], **FSDP})
    rewound_copy(out["fsdp_twell"], out["fsdp_twell_one"])
    train_mod.train(load_config(None, as_sets({**sets["fsdp_twell_one"], **ONE_PROC, "parallel": "fsdp"})),
                    resume=True)
    torchrun({**sets["fsdp_twell_group_of_one"], **ONE_PROC, "parallel": "fsdp", "activation_checkpointing": True},
             nproc=1)  # FSDP2 over a process group of one (NPROC=1): the 1-GPU point of a scaling measurement
    return out


def close(a: float, b: float, rel: float = 2e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.parametrize("run", ["fsdp", "ddp"])
def test_two_processes_match_one_process(runs, run) -> None:
    one, other = lines(runs["one"], "step"), lines(runs[run], "step")
    assert [x["step"] for x in other] == [1, 2, 3, 4]
    assert one[1]["reinit_neurons"] >= 2 * 8  # the zeroed rows died within the 2-step window, then moved
    for a, b in zip(one, other):
        for k in COMPARED:
            assert close(a[k], b[k]), (run, a["step"], k, a[k], b[k])
        for k in ("nnz_mean_per_layer", "dead_frac_per_layer"):
            assert all(close(x, y) for x, y in zip(a[k], b[k])), (run, a["step"], k)
        assert a["tokens"] == b["tokens"]
    for a, b in zip(lines(runs["one"], "eval"), lines(runs[run], "eval")):
        assert a["step"] == b["step"] and close(a["val_ce"], b["val_ce"])
        assert close(a["val_nnz_mean"], b["val_nnz_mean"])


def test_sharded_checkpoint_resumes_exactly_on_two_processes(runs) -> None:
    full, cut = lines(runs["fsdp"], "step"), lines(runs["resumed"], "step")
    assert [x["step"] for x in cut] == [1, 2, 3, 4]
    assert [x["step"] for x in lines(runs["resumed"], "resume")] == [2]
    for a, b in zip(full, cut):
        for k in COMPARED + ["nnz_mean_per_layer", "nnz_max_per_layer", "dead_frac_per_layer"]:
            assert a[k] == b[k], (a["step"], k)
    pf, pc = load_checkpoint(find_latest(runs["fsdp"])), load_checkpoint(find_latest(runs["resumed"]))
    assert pf["step"] == pc["step"] == 4
    for k in pf["model"]:
        assert torch.equal(pf["model"][k], pc["model"][k]), k
    for a, b in zip(pf["trackers"], pc["trackers"]):
        assert a.shape[0] == 2 and torch.equal(a, b)


def test_sharded_checkpoint_resumes_on_one_process(runs) -> None:
    full, one = lines(runs["fsdp"], "step"), lines(runs["resumed_one"], "step")
    assert [x["step"] for x in one] == [1, 2, 3, 4]
    for a, b in zip(full[2:], one[2:]):
        for k in COMPARED:
            assert close(a[k], b[k]), (a["step"], k, a[k], b[k])
    pf, po = load_checkpoint(find_latest(runs["fsdp"])), load_checkpoint(find_latest(runs["resumed_one"]))
    for k in pf["model"]:
        assert torch.allclose(pf["model"][k], po["model"][k], rtol=1e-4, atol=1e-6), k


def test_fsdp_mixed_precision_trains_close_to_fp32(runs) -> None:
    """bf16 parameters in forward/backward, fp32 reduction: the same steps to bf16 rounding."""
    one, bf16 = lines(runs["one"], "step")[:2], lines(runs["fsdp_bf16"], "step")
    assert [x["step"] for x in bf16] == [1, 2]
    for a, b in zip(one, bf16):
        assert close(a["loss"], b["loss"], rel=2e-2) and close(a["nnz_mean"], b["nnz_mean"], rel=0.1), (a, b)
        assert a["loss"] != b["loss"]  # it did run in bf16


def test_consolidated_final_model_loads_in_one_process(runs) -> None:
    from transformers import AutoModelForCausalLM

    import sfl.models  # noqa: F401
    final = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final")
    ckpt = load_checkpoint(find_latest(runs["fsdp"]))["model"]
    for k, v in final.state_dict().items():
        assert torch.equal(v, ckpt[k]), k
    x = torch.arange(16).unsqueeze(0) % VOCAB
    assert torch.isfinite(final(input_ids=x).logits).all()


def test_neuron_major_down_proj_shards_resumes_and_saves(runs) -> None:
    """The TwELL layout under FSDP2: W_d sharded by neuron trains as one process does, its DCP checkpoint resumes
    on one process, and checkpoints and the final model hold down_proj.weight in nn.Linear's [K, N]."""
    from transformers import AutoModelForCausalLM

    import sfl.models  # noqa: F401
    one, fsdp, resumed, group_of_one = (lines(runs[k], "step") for k in ("one_twell", "fsdp_twell", "fsdp_twell_one",
                                                                          "fsdp_twell_group_of_one"))
    for run in (fsdp, resumed, group_of_one):
        assert [x["step"] for x in run] == [1, 2, 3, 4]
    for a, b, c in zip(one, fsdp, group_of_one):
        for k in COMPARED:
            assert close(a[k], b[k]), ("fsdp", a["step"], k, a[k], b[k])
            assert close(a[k], c[k]), ("fsdp over one process", a["step"], k, a[k], c[k])
    for a, b in zip(fsdp[2:], resumed[2:]):
        for k in COMPARED:
            assert close(a[k], b[k]), ("resumed", a["step"], k, a[k], b[k])
    ckpt = load_checkpoint(find_latest(runs["fsdp_twell"]))["model"]
    assert ckpt["model.layers.0.mlp.down_proj.weight"].shape == (32, 256)
    assert not any(k.endswith("weight_t") for k in ckpt)
    final = AutoModelForCausalLM.from_pretrained(runs["fsdp_twell"] / "final")
    for k, v in final.state_dict().items():
        assert torch.equal(v, ckpt[k]), k


# ----------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("order", ["random", "disjoint"])
def test_global_batch_is_split_over_ranks(data, order) -> None:
    """Rank r reads the r-th block of the step's global batch: 2 ranks x 4 = 1 rank x 8, at every step."""
    one = TokenData(data / "tokens", 16, order, world=1)
    two = TokenData(data / "tokens", 16, order, world=2)
    for step in (0, 3, 70, 71):
        whole = one.train_batch(5, step, 0, 8)
        parts = [two.train_batch(5, step, r, 4) for r in range(2)]
        assert torch.equal(whole, torch.cat(parts)), (order, step)
        assert not torch.equal(parts[0], parts[1])
    assert not torch.equal(one.train_batch(5, 0, 0, 8), one.train_batch(6, 0, 0, 8))


def test_disjoint_order_reads_every_window_once_per_epoch(data) -> None:
    tok = data / "tokens"
    meta = json.loads((tok / "meta.json").read_text())
    windows = []  # every non-overlapping window of the train files: starts at multiples of seq_len
    for e in meta["train"]:
        arr = np.fromfile(tok / e["file"], dtype=np.uint16).astype(np.int64)
        windows += [tuple(arr[i * 16:i * 16 + 17]) for i in range((len(arr) - 1) // 16)]
    assert len(windows) == 561 == 3 * 11 * 17
    d = TokenData(tok, 16, "disjoint", world=3)
    epoch = [tuple(row) for s in range(17) for r in range(3) for row in d.train_batch(1, s, r, 11).tolist()]
    assert sorted(epoch) == sorted(windows)  # each window once (rank blocks disjoint, steps disjoint)
    nxt = [tuple(row) for r in range(3) for row in d.train_batch(1, 17, r, 11).tolist()]
    assert nxt != epoch[:33]  # the next epoch is reshuffled
    with pytest.raises(ValueError, match="rank"):
        d.train_batch(1, 0, 3, 11)


def test_global_batch_size_and_resume_onto_other_world_size() -> None:
    cfg = load_config(None, ["global_batch_size=512", "micro_batch_size=8"])
    assert resolve_grad_accum(cfg, 8) == 8 and resolve_grad_accum(cfg, 2) == 32 and resolve_grad_accum(cfg, 1) == 64
    with pytest.raises(ConfigError, match="global_batch_size"):
        resolve_grad_accum(cfg, 3)
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(None, ["global_batch_size=12", "micro_batch_size=8"])
    saved = dict(cfg, grad_accum=8)  # as written by 8 ranks
    view = resume_config_view(saved, 8, dict(cfg, grad_accum=32), 2)  # resumed on 2 ranks: same global batch
    assert view["grad_accum"] == 8
    with pytest.raises(ConfigError, match="global batch"):
        resume_config_view(saved, 8, dict(cfg, grad_accum=8), 2)


def test_dead_counters_restore_onto_other_world_size(monkeypatch) -> None:
    class MLP:
        def __init__(self) -> None:
            self.tokens_since_fire = torch.zeros(4, dtype=torch.int64)

    class Model:
        mlps = [MLP()]

        def sparse_mlps(self) -> list:
            return self.mlps

    # 2 ranks x 128 tokens per step. Neuron 0 fired in the last step (on rank 1), neuron 1 one step earlier
    # (rank 0), neuron 2 never within 3 steps, neuron 3 at the very last token of rank 0.
    saved = [torch.tensor([[200, 130, 384, 0], [5, 300, 390, 128]])]
    model = Model()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    restore_trackers(model, saved, Dist())  # one process: 256 tokens per step
    since = model.mlps[0].tokens_since_fire
    assert since.tolist() == [10, 260, 768, 0]
    steps_since_fire = (since // 256).tolist()  # whole steps, as on 2 ranks: (min over ranks) // 128
    assert steps_since_fire == (saved[0].min(0).values // 128).tolist() == [0, 1, 3, 0]


def test_checkpoint_from_before_dcp_still_resumes(runs, tmp_path) -> None:
    """A checkpoint in the earlier format (model and AdamW state inside state.pt, one process, no DCP, config
    without the newer keys) resumes exactly."""
    from sfl.experiments.trainer.distributed import load_checkpoint_dcp

    out = tmp_path / "legacy"
    rewound_copy(runs["one"], out)
    ck = out / "checkpoints" / "step_0000002"
    state = load_checkpoint(ck)
    cfg = load_config(None, as_sets({**base_sets(runs["data"], runs["init"], out), **ONE_PROC}))
    model = train_mod.build_model(cfg, VOCAB, 0, 256)
    opt = torch.optim.AdamW(train_mod.param_groups(model, cfg["weight_decay"]), lr=cfg["lr"])
    load_checkpoint_dcp(ck, model, opt)
    state["optimizer"] = opt.state_dict()
    state["trackers"] = [t[0] for t in state["trackers"]]  # one [N] tensor per layer
    for k in ("global_batch_size", "parallel", "fsdp_mixed_precision", "activation_checkpointing"):
        del state["config"][k]  # keys newer than that format, at their defaults in this run
    shutil.rmtree(ck / "dcp")
    # A key newer than the checkpoint set to a non-default value is a change: refused (legacy runs were random).
    torch.save({**state, "config": {k: v for k, v in state["config"].items() if k != "data_order"}}, ck / "state.pt")
    with pytest.raises(ConfigError, match="data_order"):
        train_mod.train(cfg, resume=True)
    torch.save(state, ck / "state.pt")
    train_mod.train(cfg, resume=True)
    want, got = lines(runs["one"], "step"), lines(out, "step")
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    for a, b in zip(want, got):
        for k in COMPARED:
            assert a[k] == b[k], (a["step"], k)


# ----------------------------------------------------------------------------- CUDA GPUs: torchrun + NCCL
# The same comparisons on GPUs with the CUDA training op (forced through its sparse path at these tiny shapes) and
# the dense FFN: FSDP2 (over every visible GPU, at most 2; over one GPU it shards across a group of one) and DDP
# against one process without torchrun, a DCP resume under torchrun and in one process, the consolidated model.
GPU_SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16, tie_word_embeddings=True,
                 eos_token_id=0, bos_token_id=0)
GPU_FORCED_SPARSE = {"mode": "sparse", "train_mode": "sparse", "train_sparse_min_m": 1}  # the run's kernel: block
GPU_COMPARED = ["loss", "ce", "l1", "grad_norm", "nnz_mean", "nnz_max", "dead_frac"]


def gpu_train(sets: dict, nproc: int | None, resume: bool = False) -> None:
    """One training run on CUDA: under torchrun with nproc processes, or a plain process (nproc None)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", "sfl.experiments.trainer.train"]
    for s in as_sets(sets):
        cmd += ["--set", s]
    cmd += ["--resume"] if resume else []
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory, data) -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM
    nproc = min(2, torch.cuda.device_count())
    root = tmp_path_factory.mktemp("dist_gpu")
    torch.manual_seed(0)
    SparseLlamaForCausalLM(SparseLlamaConfig(**GPU_SHAPE)).save_pretrained(root / "init")
    out: dict[str, Any] = {"nproc": nproc}

    def sets(impl: str, run: Path, **extra: Any) -> dict:
        return {**base_sets(data, root / "init", run), "device": "cuda", "precision": "bf16", "mlp_impl": impl,
                "kernel": GPU_FORCED_SPARSE, "global_batch_size": 8, "micro_batch_size": 2,
                "dead_reinit_lambda": 0.0, "activation_checkpointing": True, **extra}

    for impl in ("cuda", "dense"):
        for name, nprocs, extra in (("one", None, {}), ("fsdp", nproc, {"parallel": "fsdp"}),
                                    ("ddp", nproc, {"parallel": "ddp"})):
            out[f"{name}_{impl}"] = root / f"{name}_{impl}"
            gpu_train(sets(impl, out[f"{name}_{impl}"], **extra), nprocs)
    for k, nprocs in (("resumed_cuda", nproc), ("resumed_one_cuda", None)):
        out[k] = root / k
        rewound_copy(out["fsdp_cuda"], out[k])
        base = sets("cuda", out[k], parallel="fsdp")
        gpu_train(base, nprocs, resume=True)
    return out


def gpu_close(a: float, b: float) -> bool:
    # bf16 autocast: the sharded and the one-process step round differently (reduction order, the op's atomics)
    return math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-4)


@pytest.mark.parametrize("run", ["fsdp_cuda", "ddp_cuda", "fsdp_dense", "ddp_dense"])
def test_gpu_processes_match_one_process(gpu_runs, run) -> None:
    impl = run.split("_")[1]
    one, other = lines(gpu_runs[f"one_{impl}"], "step"), lines(gpu_runs[run], "step")
    assert [x["step"] for x in other] == [1, 2, 3, 4]
    for a, b in zip(one, other):
        for k in GPU_COMPARED:
            assert gpu_close(a[k], b[k]), (run, a["step"], k, a[k], b[k])
    for a, b in zip(lines(gpu_runs[f"one_{impl}"], "eval"), lines(gpu_runs[run], "eval")):
        assert gpu_close(a["val_ce"], b["val_ce"]), (run, a, b)


def test_gpu_sharded_checkpoint_resumes(gpu_runs) -> None:
    full = lines(gpu_runs["fsdp_cuda"], "step")
    for k in ("resumed_cuda", "resumed_one_cuda"):
        cut = lines(gpu_runs[k], "step")
        assert [x["step"] for x in cut] == [1, 2, 3, 4] and lines(gpu_runs[k], "resume")[0]["step"] == 2
        for a, b in zip(full[2:], cut[2:]):
            for key in GPU_COMPARED:
                assert gpu_close(a[key], b[key]), (k, a["step"], key, a[key], b[key])


def test_gpu_consolidated_model_loads_in_one_process(gpu_runs) -> None:
    from transformers import AutoModelForCausalLM

    import sfl.models  # noqa: F401
    final = AutoModelForCausalLM.from_pretrained(gpu_runs["fsdp_cuda"] / "final")
    ckpt = load_checkpoint(find_latest(gpu_runs["fsdp_cuda"]))["model"]
    for k, v in final.state_dict().items():
        assert torch.equal(v, ckpt[k]), k
    assert final.model.layers[0].mlp.down_proj.weight.shape == (256, 1024)


def test_gpu_fsdp_evaluation_runs_the_sparse_op_on_current_weights(gpu_runs) -> None:
    """Under FSDP2 the CUDA inference op serves the weights FSDP2 gathered now, not those of an earlier step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpu_runs['nproc']}",
           str(REPO / "tests" / "fsdp_eval_check.py")]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    report = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("FSDP_EVAL "))[len("FSDP_EVAL "):])
    assert len(report["checks"]) == 2
    for c in report["checks"]:
        assert c["sparse_calls"] >= 2 and c["rel_err"] < 2e-2, report
