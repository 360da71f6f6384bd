"""`python -m sfl.data.prepare --corpus`: local parquet / jsonl files through `datasets`, tokenised in worker
processes into the uint16 shards + meta.json training reads; the budget, the val split, resume after an
interruption, the manifest, and errors that say what to do. A tiny self-made tokenizer, no downloads."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from sfl import data
from sfl.data import corpus as C
from sfl.data import prepare as P
from sfl.data import tokens as T
from sfl.data.manifest import Manifest
from sfl.data.sources import is_val
from sfl.experiments.trainer.data_loader import DataError, TokenData
from test_data import _fake_upstream, make_tokenizer_dir

WORDS = "sparse dense relu neuron layer token model weight kernel memory the of and to a in".split()
VAL_PERMILLE = 200  # a fifth of the documents: every small file has some


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Two parquet files (column 'content'), two jsonl files (field 'text'), and a data dir whose tokenizer step
    is recorded (so prepare fetches nothing)."""
    root = tmp_path_factory.mktemp("corpus")
    texts = _texts(240, 0)
    src = root / "src"
    src.mkdir()
    for i in range(2):
        part = texts[i * 120:(i + 1) * 120]
        pq.write_table(pa.table({"content": part, "n": list(range(len(part)))}), src / f"part-{i}.parquet")
        with open(src / f"part-{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
    d = data.paths(root / "data")
    make_tokenizer_dir(d.tokenizer, WORDS)
    ctx = P.Ctx(p=d, man=Manifest(d.root), max_train_tokens=None, shard_tokens=1, log=print)
    ctx.man.record("tokenizer", P.VERSIONS["tokenizer"], P.step_params("tokenizer", ctx), list(d.tokenizer.iterdir()))
    return {"texts": texts, "src": src, "data": d.root}


def prepare(data_dir: Path, source: str, *extra: str) -> int:
    """The command line."""
    return P.main(["--data-dir", str(data_dir), "--corpus", source, "--val-permille", str(VAL_PERMILLE),
                   "--workers", "1", *extra])


def build(data_dir: Path, source: str, out: str, workers: int = 1, **spec: object) -> Path:
    """The builder with small document batches (shards hold whole batches: several shards from a small corpus)."""
    spec = {"val_permille": VAL_PERMILLE, "batch_docs": 16, **spec}
    return C.build_corpus(C.CorpusSpec(source=source, **spec), data.paths(data_dir), out, workers, print)


def docs_of(tokens_dir: Path, split: str) -> list[str]:
    """The documents of a split, decoded (they are joined by EOS = 0)."""
    tok = Tokenizer.from_file(str(tokens_dir.parent / "tokenizer" / "tokenizer.json"))
    meta = json.loads((tokens_dir / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(tokens_dir / e["file"], dtype="<u2") for e in meta[split]]).tolist()
    docs, cur = [], []
    for t in ids:
        if t == 0:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def test_parquet_round_trips_with_checksums_manifest_and_val_split(corpus, capsys) -> None:
    d = corpus["data"]
    out = build(d, str(corpus["src"] / "*.parquet"), "tokens-src", workers=2, text_field="content", shard_tokens=400)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 0 and meta["vocab_size"] == 300
    assert len(meta["train"]) > 2  # several shards, numbered on
    assert [e["file"] for e in meta["train"]] == [f"train_{i:03d}.bin" for i in range(len(meta["train"]))]
    for e in meta["train"] + meta["val"]:
        assert T.scan_shard(out / e["file"])[0] == e["sha1"] and (out / e["file"]).stat().st_size == 2 * e["tokens"]
    texts = corpus["texts"]
    assert docs_of(out, "train") == [t for t in texts if not is_val(t, VAL_PERMILLE)]  # every id, in source order
    assert docs_of(out, "val") == [t for t in texts if is_val(t, VAL_PERMILLE)]
    assert 0 < len(docs_of(out, "val")) < len(texts) / 2
    TokenData(out, seq_len=8).verify()  # what training checks at start
    rec = json.loads((d / "manifest.json").read_text())["steps"]["corpus:tokens-src"]
    assert sorted(rec["files"]) == sorted([f"tokens-src/{e['file']}" for e in meta["train"] + meta["val"]] + [
        "tokens-src/meta.json"])
    assert not (d / ".tokens-src.partial").exists() and not (out / C.PROGRESS).exists()
    capsys.readouterr()
    build(d, str(corpus["src"] / "*.parquet"), "tokens-src", text_field="content", shard_tokens=400)
    assert "up to date" in capsys.readouterr().out  # idempotent: checksums verified, nothing rebuilt


def test_jsonl_budget_is_exact_and_a_prefix(corpus) -> None:
    d = corpus["data"]
    assert prepare(d, str(corpus["src"] / "part-0.jsonl"), "--out-subdir", "full") == 0  # the command line
    build(d, str(corpus["src"] / "part-0.jsonl"), "capped", max_tokens=500, shard_tokens=200)
    full, capped = (json.loads((d / s / "meta.json").read_text()) for s in ("full", "capped"))
    assert sum(e["tokens"] for e in capped["train"]) == 500 < sum(e["tokens"] for e in full["train"])
    whole = np.fromfile(d / "full" / "train_000.bin", dtype="<u2")
    cut = np.concatenate([np.fromfile(d / "capped" / e["file"], dtype="<u2") for e in capped["train"]])
    assert np.array_equal(cut, whole[:500])
    shard = d / "capped" / "train_000.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))  # changed after preparation: training refuses it, a rerun rebuilds it
    with pytest.raises(DataError, match="prepare --corpus SOURCE --out-subdir capped"):
        TokenData(d / "capped", seq_len=8).verify()
    build(d, str(corpus["src"] / "part-0.jsonl"), "capped", max_tokens=500, shard_tokens=200)
    TokenData(d / "capped", seq_len=8).verify()


def test_interrupted_run_resumes_from_its_finished_shards(corpus, monkeypatch, capsys) -> None:
    d, src = corpus["data"], str(corpus["src"] / "*.jsonl")
    writes = {"n": 0}
    real_write = C.write_shards

    def write_then_die(*a, **k):  # killed while writing the third shard file
        writes["n"] += 1
        if writes["n"] == 3:
            raise KeyboardInterrupt
        return real_write(*a, **k)

    monkeypatch.setattr(C, "write_shards", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        build(d, src, "resumed", shard_tokens=300)
    monkeypatch.setattr(C, "write_shards", real_write)
    partial = d / ".resumed.partial"
    prog = json.loads((partial / C.PROGRESS).read_text())
    assert len(prog["train"]) == 1 and prog["stream_state"] is not None and not prog["complete"]
    (partial / ".train_001.bin.tmp12345").write_bytes(b"torn")  # what a kill mid-write leaves
    capsys.readouterr()
    build(d, src, "resumed", shard_tokens=300)
    assert "resuming" in capsys.readouterr().out
    assert not partial.exists()
    build(d, src, "straight", shard_tokens=300)
    a, b = (json.loads((d / s / "meta.json").read_text()) for s in ("resumed", "straight"))
    assert a["train"] == b["train"] and a["val"] == b["val"]  # same files, sizes and checksums
    n_val = sum(is_val(t, VAL_PERMILLE) for t in corpus["texts"])
    assert a["stats"]["docs"] == b["stats"]["docs"] == {"train": len(corpus["texts"]) - n_val, "val": n_val,
                                                        "val_dropped": 0}


def test_bad_inputs_say_what_to_do(corpus, tmp_path, capsys, monkeypatch) -> None:
    d, src = corpus["data"], corpus["src"]
    assert prepare(d, str(src / "part-0.parquet")) == 2  # its column is 'content'
    assert "no field 'text'" in capsys.readouterr().err and not (d / ".tokens-part-0.partial").exists()
    assert prepare(d, str(src)) == 2
    assert "mixes json and parquet" in capsys.readouterr().err
    assert prepare(d, "./no/such.jsonl") == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert prepare(d, "someone/some-corpus") == 2
    assert "HF_HUB_OFFLINE=0" in capsys.readouterr().err
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    big.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(C.CorpusError, match="uint16"):
        C.check_tokenizer(tmp_path / "tokenizer.json")


def test_a_dead_tokenising_process_raises_instead_of_hanging(corpus, tmp_path, monkeypatch) -> None:
    """A worker that cannot start (here: its tokenizer file is unreadable to it) ends the run with a CorpusError that
    says what to do; before, the pool's result stayed pending forever."""
    p = data.paths(tmp_path / "data")
    p.tokenizer.mkdir(parents=True)
    (p.tokenizer / "tokenizer.json").write_text("{ not json")
    monkeypatch.setattr(C, "check_tokenizer", lambda f: (len(WORDS) + 1, 0))  # the parent's check passes
    with pytest.raises(C.CorpusError, match="rerun the same command"):
        C.build_corpus(C.CorpusSpec(source=str(corpus["src"] / "part-0.jsonl"), val_permille=VAL_PERMILLE,
                                    batch_docs=16), p, "broken", 2, print)
    assert not (p.root / "broken").exists()


def test_killed_offline_prepare_leaves_no_staging_dir(tmp_path, monkeypatch) -> None:
    root = tmp_path / "d"
    dead = root / f".tokens-{2**22 + 12345}-abcd_123"
    live = root / f".tokens-{os.getpid()}-abcd_123"
    for x in (dead, live):
        x.mkdir(parents=True)
    P.remove_stale_staging(root, print)
    assert not dead.exists() and live.exists()  # a running prepare's dir is kept

    live.rmdir()
    _fake_upstream(root)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "encode_stream", interrupted)
    with pytest.raises(KeyboardInterrupt):
        P.main(["--data-dir", str(root), "--only", "tokens"])
    assert not [x.name for x in root.iterdir() if x.name.startswith(".tokens")]
