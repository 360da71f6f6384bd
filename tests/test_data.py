"""Data preparation on small, self-made inputs: cleaning, the document split, tokenising/sharding and
the manifest (checksums, stale detection, idempotent re-runs). No downloads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sfl import data
from sfl.data import manifest as M
from sfl.data import prepare as P
from sfl.data import sources as S
from sfl.data import tokens as T
from sfl.data.eval_data import _strip_qa, convert_rows, hellaswag_preprocess

# ----------------------------------------------------------------------------------------- cleaning


def test_clean_gcide_removes_markup():
    raw = ('Arrive \\Ar*rive"\\, v. i. [OE. arriven, F. arriver; s[aum]ga, sag[=e]n. See {Arrogant}.]\n'
           "   1. To come to the shore.\n      [1913 Webster]\n\n"
           "            Happy! to whom this glorious death arrives.\n"
           "                                                  --Waller.\n      [1913 Webster]\n")
    out = S.clean_gcide(raw)
    assert "[1913 Webster]" not in out and "\\" not in out and "{" not in out and "*" not in out
    assert out.startswith("Arrive, v. i. [OE. arriven")
    assert "saga, sagen. See Arrogant." in out
    assert "Happy! to whom this glorious death arrives. --Waller." in out  # wrapped lines joined


def test_dictd_b64_and_gcide_docs_dedupe():
    assert S.dictd_b64("A") == 0 and S.dictd_b64("B") == 1 and S.dictd_b64("BA") == 64
    body = "Cat \\Cat\\, n.\n   A small animal.\n   [1913 Webster]\n"
    text = "header\n" + body
    off = len("header\n")
    b64 = lambda n: S._B64[n // 64] + S._B64[n % 64]  # noqa: E731
    index = f"00-database-info\tA\tH\ncat\t{b64(off)}\t{b64(len(body))}\nCat\t{b64(off)}\t{b64(len(body))}\n"
    docs = list(S.gcide_docs(text, index))
    assert docs == [(f"gcide:{off}", "Cat, n. A small animal.")]


def test_clean_rst_roles_directives_and_headings():
    raw = """:mod:`functools` --- Higher-order functions
============================================

.. module:: functools
   :synopsis: Higher-order functions.

.. moduleauthor:: Someone <x@y.z>

.. _label-target:

The :func:`~functools.cache` decorator, see :ref:`the docs <lru>` and ``lru_cache(maxsize=None)``.
Read `"memoize" <https://en.wikipedia.org/wiki/Memoization>`_ for more.

.. decorator:: cache(user_function)

   Simple cache.  Example::

      @cache
      def f(n): return n
"""
    out = S.clean_rst(raw)
    for junk in (":mod:", ":func:", "``", "====", ".. module", "moduleauthor", ":synopsis:", "_label-target",
                 "https://"):
        assert junk not in out, junk
    assert out.startswith("functools --- Higher-order functions")
    assert "The cache decorator, see the docs and lru_cache(maxsize=None)." in out
    assert '"memoize" for more.' in out
    assert "cache(user_function)" in out and "   Simple cache.  Example:" in out
    assert "      def f(n): return n" in out  # code kept with its indentation


def test_clean_brown_strips_tags_and_detokenises():
    raw = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, it/pps didn't/dod* "
           "matter/vb ;/. ;/. ok/uh ./.\n\n\n\tSecond/od paragraph/nn ./.\n")
    assert S.clean_brown(raw) == 'The jury said "no evidence", it didn\'t matter; ok.\n\nSecond paragraph.'


def test_kjv_chapters_fortunes_gutenberg():
    kjv = ("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
           "  2 And the earth was without form, and void; and darkness was upon the face of\n"
           "the deep.\n\nGenesis 2\n\n  1 Thus the heavens were finished.\n")
    docs = list(S.kjv_chapters(kjv))
    assert [d[0] for d in docs] == ["kjv:Genesis 1", "kjv:Genesis 2"]
    assert docs[0][1].endswith("upon the face of the deep.") and "  2 " not in docs[0][1]
    f = list(S.fortune_docs("wisdom", "A clash.\n\t\t-- X\n%\n\n%\nSecond one.\n"))
    assert f == [("fortunes:wisdom:0", "A clash.\n\t\t-- X"), ("fortunes:wisdom:2", "Second one.")]
    g = "licence\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nBody text.\n*** END OF THIS PROJECT\nlicence"
    assert S.strip_gutenberg(g) == "Body text."


def test_chunk_paragraphs_bounds():
    paras = [f"p{i} " + "x" * 90 for i in range(50)]
    chunks = S.chunk_paragraphs("\n\n".join(paras), 1000)
    assert "\n\n".join(chunks) == "\n\n".join(paras)  # nothing lost or reordered
    assert all(len(c) <= 1000 for c in chunks) and len(chunks) > 4


def test_doc_split_is_deterministic_and_about_one_percent():
    ids = [f"src:doc{i}" for i in range(20000)]
    a = [S.is_val(i) for i in ids]
    assert a == [S.is_val(i) for i in ids]
    assert 0.007 < sum(a) / len(a) < 0.013
    assert sum(S.is_val(i, 0) for i in ids) == 0


def test_eval_conversion_native_rows():
    hs = convert_rows("hellaswag", [{"ind": 3, "source_id": "wikihow~1", "activity_label": "Cooking",
                                     "ctx_a": "He takes a pan.", "ctx_b": "he", "label": "1",
                                     "endings": ["burns it [title] badly.", "cooks an egg."]}])
    assert hs[0] == {"id": "wikihow~1:3", "question": "Cooking: He takes a pan. He",
                     "choices": ["burns it. badly.", "cooks an egg."], "gold": 1}
    assert hellaswag_preprocess(" a [header] b  ") == "a b"
    wg = convert_rows("winogrande", [{"sentence": "A beat B so _ won.", "option1": "A", "option2": "B",
                                      "answer": "1"}])
    assert wg[0]["gold"] == 0 and wg[0]["choices"] == ["A", "B"]
    cq = convert_rows("commonsense_qa", [{"id": "q", "question": " Where? ", "answerKey": "C",
                                          "choices": {"label": list("ABCDE"), "text": list("abcde")}}])
    assert cq[0]["gold"] == 2 and cq[0]["question"] == "Where?"
    arc = convert_rows("arc_easy", [{"id": "m1", "query": "Question: Why?\nAnswer:", "choices": ["a", "b"],
                                     "gold": 1}])
    assert arc[0] == {"id": "m1", "question": "Why?", "choices": ["a", "b"], "gold": 1}
    with pytest.raises(ValueError):
        _strip_qa("Why?")
    with pytest.raises(ValueError):
        convert_rows("piqa", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 2}])


# ----------------------------------------------------------------------------------------- tokens

def make_tokenizer_dir(path: Path, corpus: list[str]) -> Path:
    """A tiny byte-level BPE with <|endoftext|> at id 0, saved like the real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=[P.ENDOFTEXT],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=P.ENDOFTEXT, bos_token=P.ENDOFTEXT,
                                   unk_token=P.ENDOFTEXT, pad_token=P.ENDOFTEXT)
    fast.save_pretrained(str(path))
    return path


DOCS = [("a:1", "The quick brown fox jumps over the lazy dog."), ("a:2", "Hello world, hello tokens."),
        ("b:1", "Sparse activations are mostly zero."), ("b:2", "ReLU and L1 make FFNs sparse."),
        ("c:1", "One more small document.")]


def test_encode_stream_and_shards(tmp_path):
    make_tokenizer_dir(tmp_path / "tok", [t for _, t in DOCS])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tok.convert_tokens_to_ids(P.ENDOFTEXT) == 0
    be = tok.backend_tokenizer
    arr, used = T.encode_stream(be, DOCS, 0, None, batch_docs=2)
    expect = []
    for _, t in DOCS:
        expect += be.encode(t, add_special_tokens=False).ids + [0]
    assert used == len(DOCS) and arr.dtype == np.uint16 and arr.tolist() == expect
    entries = T.write_shards(arr, tmp_path / "out", "train", shard_tokens=10)
    assert [e["tokens"] for e in entries][:-1] == [10] * (len(entries) - 1) and sum(e["tokens"] for e in entries) == arr.size
    T.write_meta(tmp_path / "out", {"vocab_size": len(tok), "eos_id": 0, "dtype": "uint16", "train": entries, "val": []})
    back = np.concatenate([np.asarray(m) for m in T.load_split(tmp_path / "out", "train")])
    assert back.tolist() == expect
    capped, used2 = T.encode_stream(be, DOCS, 0, 7)
    assert capped.tolist() == expect[:7] and used2 >= 1
    assert tok.decode(arr[:arr.tolist().index(0)].tolist()) == DOCS[0][1]


# ----------------------------------------------------------------------------------------- manifest

def _ctx(root: Path, max_train_tokens=None) -> P.Ctx:
    return P.Ctx(p=data.paths(root), man=M.Manifest(root), max_train_tokens=max_train_tokens,
                 shard_tokens=1 << 20, log=lambda s: None)


def _fake_upstream(root: Path) -> None:
    """Real tokenizer + text outputs recorded as the 'tokenizer' and 'text' steps."""
    p = data.paths(root)
    make_tokenizer_dir(p.tokenizer, [t for _, t in DOCS])
    p.text.mkdir(parents=True)
    lines = [json.dumps({"id": i, "split": "val" if i == "c:1" else "train", "text": t}) for i, t in DOCS]
    (p.text / "toy.jsonl").write_text("\n".join(lines) + "\n")
    ctx = _ctx(root)
    ctx.man.record("tokenizer", P.VERSIONS["tokenizer"], P.step_params("tokenizer", ctx), list(p.tokenizer.iterdir()))
    ctx.man.record("text", P.VERSIONS["text"], P.step_params("text", ctx), [p.text / "toy.jsonl"])


def test_manifest_check_detects_every_kind_of_staleness(tmp_path):
    f = tmp_path / "out" / "a.bin"
    M.atomic_write_bytes(f, b"abcdef")
    man = M.Manifest(tmp_path)
    man.record("s", 1, {"k": 1}, [f])
    assert M.Manifest(tmp_path).check("s", 1, {"k": 1}) == (True, "ok")  # persisted
    assert not man.check("s", 2, {"k": 1})[0]
    assert not man.check("s", 1, {"k": 2})[0]
    f.write_bytes(b"abcdeX")  # same size, different content
    assert man.check("s", 1, {"k": 1}) == (False, "checksum mismatch for out/a.bin")
    f.write_bytes(b"abc")
    assert "size mismatch" in man.check("s", 1, {"k": 1})[1]
    f.unlink()
    assert "missing file" in man.check("s", 1, {"k": 1})[1]
    assert man.check("other", 1, {})[1] == "not built yet"


def test_tokens_step_build_skip_corrupt_rebuild(tmp_path):
    _fake_upstream(tmp_path)
    ctx = _ctx(tmp_path)
    assert P.run_step("tokens", ctx) == "built"
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 0 and meta["vocab_size"] == 300
    assert meta["val"][0]["tokens"] > 0 and meta["train"][0]["file"] == "train_000.bin"
    good = (tmp_path / "tokens" / "train_000.bin").read_bytes()
    assert P.run_step("tokens", _ctx(tmp_path)) == "skipped"  # idempotent
    # corrupt one byte: detected via sha256 and rebuilt to the same content
    bad = bytearray(good)
    bad[3] ^= 0xFF
    (tmp_path / "tokens" / "train_000.bin").write_bytes(bytes(bad))
    assert P.run_step("tokens", _ctx(tmp_path)) == "built"
    assert (tmp_path / "tokens" / "train_000.bin").read_bytes() == good
    # changed params -> rebuilt with the cap applied
    assert P.run_step("tokens", _ctx(tmp_path, max_train_tokens=5)) == "built"
    assert json.loads((tmp_path / "tokens" / "meta.json").read_text())["train"][0]["tokens"] == 5
    # an upstream file changed behind the manifest's back -> tokens refuses and names the command
    (tmp_path / "text" / "toy.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="--only text"):
        P.run_step("tokens", _ctx(tmp_path))


def test_upstream_rebuild_makes_tokens_stale_and_cli_is_idempotent(tmp_path, capsys):
    _fake_upstream(tmp_path)
    assert P.main(["--data-dir", str(tmp_path), "--only", "tokens"]) == 0
    assert P.main(["--data-dir", str(tmp_path), "--only", "tokens"]) == 0
    assert "[tokens] up to date" in capsys.readouterr().out
    # re-record text with different content (as a rebuild would): its digest changes -> tokens stale
    p = data.paths(tmp_path)
    with open(p.text / "toy.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "d:1", "split": "train", "text": "Added later."}) + "\n")
    ctx = _ctx(tmp_path)
    ctx.man.record("text", P.VERSIONS["text"], P.step_params("text", ctx), [p.text / "toy.jsonl"])
    ok, why = ctx.man.check("tokens", P.VERSIONS["tokens"], P.step_params("tokens", ctx))
    assert not ok and why == "params changed"
    assert P.run_step("tokens", ctx) == "built"


def test_require_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SFL_DATA_DIR", str(tmp_path))
    assert data.paths().root == tmp_path.resolve()
    with pytest.raises(data.DataNotPrepared, match="python -m sfl.data.prepare --only tokens"):
        data.require("tokens")
    _fake_upstream(tmp_path)
    assert data.require("text").text == tmp_path.resolve() / "text"
    (tmp_path / "text" / "toy.jsonl").write_text("x")
    with pytest.raises(data.DataNotPrepared, match="incomplete"):
        data.require("text")
    with pytest.raises(ValueError):
        data.require("nope")


# ----------------------------------------------------------------------------------------- lm-eval task YAMLs

def _fake_eval_step(root: Path) -> None:
    """Every task's eval jsonl (2 rows each) recorded as the 'eval' step, as build_eval would."""
    p = data.paths(root)
    p.eval.mkdir(parents=True)
    files = []
    for t in data.EVAL_TASKS:
        rows = [{"id": f"{t}{i}", "question": f"Q{i} _ x", "choices": ["a", "b"], "gold": i} for i in range(2)]
        p.eval_file(t).write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(p.eval_file(t))
    ctx = _ctx(root)
    ctx.man.record("eval", P.VERSIONS["eval"], P.step_params("eval", ctx), files,
                   info={"tasks": {t: {"n": 2} for t in data.EVAL_TASKS}})


def test_prepare_writes_resolved_task_yamls_and_follows_a_moved_data_dir(tmp_path, capsys):
    import shutil

    _fake_eval_step(tmp_path / "d1")
    assert P.main(["--data-dir", str(tmp_path / "d1"), "--only", "eval"]) == 0
    assert "[eval] up to date" in capsys.readouterr().out  # nothing rebuilt, the YAMLs written anyway
    inc = tmp_path / "d1" / "lm_tasks"
    assert sorted(f.name for f in inc.iterdir()) == sorted([f"sfl_{t}.yaml" for t in data.EVAL_TASKS] + ["utils.py"])
    for t in data.EVAL_TASKS:
        text = (inc / f"sfl_{t}.yaml").read_text()
        assert "@SFL_EVAL_DIR@" not in text and f'"{(tmp_path / "d1" / "eval" / t).resolve()}.jsonl"' in text
    shutil.copytree(tmp_path / "d1", tmp_path / "d2")  # a moved data dir: a re-run points the YAMLs at it
    assert P.main(["--data-dir", str(tmp_path / "d2"), "--only", "eval"]) == 0
    assert str((tmp_path / "d2" / "eval").resolve()) in (tmp_path / "d2" / "lm_tasks" / "sfl_piqa.yaml").read_text()
    assert str(tmp_path / "d1") not in (tmp_path / "d2" / "lm_tasks" / "sfl_piqa.yaml").read_text()


def test_write_tasks_cli_refuses_missing_or_cut_eval_files(tmp_path, capsys):
    from sfl.data import lm_tasks as L

    assert L.main(["write-tasks", "--out", str(tmp_path / "inc"), "--data-dir", str(tmp_path)]) == 2
    assert "--only eval" in capsys.readouterr().err and not (tmp_path / "inc").exists()
    _fake_eval_step(tmp_path)
    with open(data.paths(tmp_path).eval_file("piqa"), "a") as fh:  # a row appended after preparation
        fh.write(json.dumps({"id": "x", "question": "q", "choices": ["a", "b"], "gold": 0}) + "\n")
    assert L.main(["write-tasks", "--out", str(tmp_path / "inc"), "--data-dir", str(tmp_path), "--tasks", "piqa"]) == 2
    assert "has 3 rows but" in capsys.readouterr().err
    assert L.main(["write-tasks", "--out", str(tmp_path / "inc"), "--data-dir", str(tmp_path),
                   "--tasks", "arc_easy,winogrande"]) == 0
    assert sorted(f.name for f in (tmp_path / "inc").iterdir()) == ["sfl_arc_easy.yaml", "sfl_winogrande.yaml", "utils.py"]
    assert "--include_path" in capsys.readouterr().out
