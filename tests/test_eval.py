"""experiments/trainer/evaluate.py end to end on a tiny random ReLU Llama and two tiny tasks written to tmp,
through the same YAML templating path as real runs; plus the non-zero counting with padding."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from sfl.data.lm_tasks import TEMPLATE_DIR, parse_tasks, write_tasks  # noqa: E402
from sfl.experiments.trainer.evaluate import NnzRecorder, main, valid_mask_right_padded  # noqa: E402

PIQA = [
    {"id": str(i), "question": q, "choices": c, "gold": g}
    for i, (q, c, g) in enumerate([
        ("How do you open a jar?", ["Twist the lid.", "Paint the lid."], 0),
        ("How do you cool tea?", ["Boil it longer.", "Let it stand."], 1),
        ("How to dry a shirt?", ["Hang it in the sun.", "Put it in water."], 0),
        ("How to light a room?", ["Close the curtains.", "Switch on a lamp."], 1),
        ("How to keep bread fresh?", ["Seal it in a bag.", "Leave it open."], 0),
    ])
]
WINO = [
    {"id": str(i), "question": s, "choices": c, "gold": g}
    for i, (s, c, g) in enumerate([
        ("The cup fell off the table because _ was wobbly.", ["the cup", "the table"], 1),
        ("Anna gave Maria a gift because _ was kind.", ["Anna", "Maria"], 0),
        ("The ball broke the window because _ was fast.", ["the ball", "the window"], 0),
        ("Tom asked Bill for help because _ knew the way.", ["Tom", "Bill"], 1),
        ("The dog chased the cat until _ got tired.", ["the dog", "the cat"], 0),
    ])
]


def _tiny_model_dir(tmp: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [json.dumps(r) for r in PIQA + WINO]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      hidden_act="relu", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    d = tmp / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def test_parse_tasks_and_templates(tmp_path):
    assert len(parse_tasks("all")) == 7 and parse_tasks("sfl_piqa, arc_easy") == ["piqa", "arc_easy"]
    with pytest.raises(ValueError):
        parse_tasks("lambada")
    assert len(list(TEMPLATE_DIR.glob("sfl_*.yaml"))) == 7
    with pytest.raises(FileNotFoundError, match="--only eval"):
        write_tasks(tmp_path, tmp_path / "inc", ["piqa"])


def test_valid_mask_and_recorder_ignore_padding(tmp_path):
    from transformers import AutoModelForCausalLM

    inps = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 8, 9, 0], [3, 4, 5, 6, 7]])
    assert valid_mask_right_padded(inps).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    model = AutoModelForCausalLM.from_pretrained(str(_tiny_model_dir(tmp_path))).eval()
    rec = NnzRecorder(model)
    assert rec.kind == "act_fn_output" and len(rec.sources) == 2
    ids = torch.randint(1, 100, (3, 5))
    lens = [3, 4, 5]
    padded = ids.clone()
    for r, n in enumerate(lens):
        padded[r, n:] = 0
    with torch.no_grad():
        rec.set_valid(valid_mask_right_padded(padded))
        model(padded)
    rec.remove()
    got = rec.per_layer_mean()
    # reference: each sequence alone, unpadded, counting ReLU outputs directly
    acts: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    hooks = [model.model.layers[i].mlp.act_fn.register_forward_hook(
        lambda m, a, o, i=i: acts[i].append((o != 0).sum(-1).flatten().float())) for i in range(2)]
    with torch.no_grad():
        for r, n in enumerate(lens):
            model(ids[r:r + 1, :n])
    for h in hooks:
        h.remove()
    for i in range(2):
        assert got[i] == pytest.approx(torch.cat(acts[i]).mean().item())
        assert 0 < got[i] < 128  # random ReLU: roughly half active
    assert rec.count[0] == sum(lens)


def test_evaluate_end_to_end_tiny(tmp_path):
    model_dir = _tiny_model_dir(tmp_path)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name, rows in (("piqa", PIQA), ("winogrande", WINO)):
        (eval_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    limit = 4
    assert main(["--model", str(model_dir), "--tasks", "piqa,winogrande", "--limit", str(limit),
                 "--batch-size", "4", "--device", "cpu", "--out", str(out), "--eval-dir", str(eval_dir)]) == 0
    res = json.loads((out / "eval.json").read_text())
    assert set(res["tasks"]) == {"piqa", "winogrande"}
    for name, v in res["tasks"].items():
        assert v["n"] == limit and 0.0 <= v["acc"] <= 1.0
    assert 0.0 <= res["tasks"]["piqa"]["acc_norm"] <= 1.0 and res["tasks"]["winogrande"]["acc_norm"] is None
    for name, v in res["tasks"].items():  # lm-eval's closed-form standard error of a mean of 0/1 scores
        p = v["acc"]
        assert abs(v["acc_stderr"] - (p * (1 - p) / (limit - 1)) ** 0.5) < 1e-9, name
    assert res["tasks"]["piqa"]["acc_norm_stderr"] is not None and res["tasks"]["winogrande"]["acc_norm_stderr"] is None
    assert res["limit"] == limit and "git_commit" in res["provenance"]
    assert res["nnz_source"] == "act_fn_output" and len(res["nnz_per_token_per_layer"]) == 2
    assert 0 < res["nnz_per_token_mean"] < 128 and res["nnz_tokens_counted"] > 0
    assert res["num_fewshot"] == 0 and res["log_samples"] is False and not list(out.glob("samples_*"))
    for name, v in res["tasks"].items():  # per-document 0/1 scores, one per doc, that average to the task's acc
        pd = res["per_doc"][name]
        assert len(pd["acc"]) == limit and set(pd["acc"]) <= {"0", "1"} and len(pd["docs_sha256"]) == 64
        assert pd["acc"].count("1") / limit == pytest.approx(v["acc"])
    assert res["per_doc"]["piqa"]["acc_norm"].count("1") / limit == pytest.approx(res["tasks"]["piqa"]["acc_norm"])
    assert res["per_doc"]["winogrande"]["acc_norm"] is None


def test_num_fewshot_and_log_samples_reach_lm_eval(tmp_path):
    model_dir = _tiny_model_dir(tmp_path)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PIQA))
    common = ["--model", str(model_dir), "--tasks", "piqa", "--limit", "3", "--device", "cpu",
              "--eval-dir", str(eval_dir)]
    assert main([*common, "--out", str(tmp_path / "zero")]) == 0
    assert main([*common, "--num-fewshot", "2", "--log-samples", "--out", str(tmp_path / "two")]) == 0
    res = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert res["num_fewshot"] == 2 and res["log_samples"] is True
    rows = [json.loads(line) for line in (tmp_path / "two" / "samples_sfl_piqa.jsonl").read_text().splitlines()]
    assert [r["doc_id"] for r in rows] == [0, 1, 2]
    for r in rows:  # the context holds two solved examples (never the document itself) before the question
        context = r["arguments"][0][0]
        assert context.count("Question: ") == 3 and context.endswith(f"Question: {r['doc']['question']}\nAnswer:")
        assert context.count(r["doc"]["question"]) == 1
    assert "".join(str(int(r["acc"])) for r in rows) == res["per_doc"]["piqa"]["acc"]
    zero = json.loads((tmp_path / "zero" / "eval.json").read_text())
    # other prompts, other requests: a paired comparison of these two must refuse
    assert zero["per_doc"]["piqa"]["docs_sha256"] != res["per_doc"]["piqa"]["docs_sha256"]
    with pytest.raises(SystemExit, match="num-fewshot"):
        main(["--replay", "x.npz", "--requests", "r.npz", "--num-fewshot", "1", "--out", str(tmp_path / "r")])


def test_commonsense_qa_is_cloze(tmp_path):
    """The CSQA task scores each answer text after the question (the paper's cloze form), not letters A-E."""
    from lm_eval.tasks import TaskManager

    rows = [{"id": "q1", "question": "Where would you put a plate after washing it?",
             "choices": ["cupboard", "oven", "garden", "river", "shoe"], "gold": 0},
            {"id": "q2", "question": "What do people use to cut paper?",
             "choices": ["spoon", "scissors", "pillow", "cloud", "bucket"], "gold": 1}]
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "commonsense_qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    inc = write_tasks(eval_dir, tmp_path / "inc", ["commonsense_qa"])
    task = TaskManager(include_path=str(inc), include_defaults=False).load("sfl_commonsense_qa")["tasks"][
        "sfl_commonsense_qa"]
    task.build_all_requests(limit=2, rank=0, world_size=1)
    by_doc: dict[int, list] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst.args)
    assert sorted(by_doc) == [0, 1]
    for i, r in enumerate(rows):
        assert [cont for _, cont in by_doc[i]] == [" " + c for c in r["choices"]]  # the answer texts themselves
        assert {ctx for ctx, _ in by_doc[i]} == {f"Question: {r['question']}\nAnswer:"}
        assert task.doc_to_target(task.dataset["validation"][i]) == r["gold"]


def test_recorder_uses_sparse_mlp_stats_when_present(tmp_path):
    """With our sparse model (models/ by the models helper) the recorder reads last_nnz_per_token;
    on a ReLU-fied copy of a ReLU Llama it must count exactly what the act_fn hook counts."""
    try:
        from sfl.models.convert import relufy
    except Exception as e:  # noqa: BLE001 - models/ is developed concurrently
        pytest.skip(f"models package not importable: {e}")
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(_tiny_model_dir(tmp_path))).eval()
    sparse = relufy(dense).eval()
    padded = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    stats = []
    for m in (dense, sparse):
        rec = NnzRecorder(m)
        with torch.no_grad():
            rec.set_valid(valid_mask_right_padded(padded))
            m(padded)
        rec.remove()
        stats.append(rec)
    assert stats[0].kind == "act_fn_output" and stats[1].kind == "last_nnz_per_token"
    assert stats[1].count == stats[0].count == [10, 10]
    assert stats[1].per_layer_mean() == pytest.approx(stats[0].per_layer_mean())


def test_split_eval_matches_direct_lm_eval(tmp_path):
    """export -> score (no lm-eval) -> replay gives exactly the direct lm-eval accuracies, and the scorer's
    loglikelihoods equal HFLM's own on the same requests."""
    from sfl.experiments.trainer.evaluate import load_model
    from sfl.experiments.trainer.loglik import load_requests, load_scores, score_requests

    model_dir = _tiny_model_dir(tmp_path)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name, rows in (("piqa", PIQA), ("winogrande", WINO)):
        (eval_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--tasks", "piqa,winogrande", "--eval-dir", str(eval_dir)]
    assert main(["--model", str(model_dir), *common, "--batch-size", "3", "--device", "cpu",
                 "--out", str(tmp_path / "direct")]) == 0
    req = tmp_path / "req.npz"
    assert main(["--model", str(model_dir), *common, "--export-requests", str(req), "--out", str(tmp_path)]) == 0
    reqs = load_requests(req)
    assert len(reqs) == 2 * len(PIQA) + 2 * len(WINO)  # every (context, choice) pair is distinct here
    assert main(["--model", str(model_dir), "--score", str(req), "--device", "cpu", "--max-tokens", "40",
                 "--out", str(tmp_path / "scored")]) == 0
    assert main(["--replay", str(tmp_path / "scored" / "scores.npz"), "--requests", str(req), *common,
                 "--out", str(tmp_path / "replayed")]) == 0
    direct = json.loads((tmp_path / "direct" / "eval.json").read_text())
    rep = json.loads((tmp_path / "replayed" / "eval.json").read_text())
    for t in ("piqa", "winogrande"):
        for k in ("acc", "acc_norm", "n", "acc_stderr", "acc_norm_stderr"):
            assert rep["tasks"][t][k] == direct["tasks"][t][k], (t, k)
        assert rep["per_doc"][t] == direct["per_doc"][t], t  # the same documents scored the same, one by one
    assert rep["nnz_tokens_counted"] > 0 and rep["split_eval"]["n_requests"] == len(reqs)
    # the scorer against HFLM's _loglikelihood_tokens on the exported token pairs
    from lm_eval.models.huggingface import HFLM

    model, tok, _ = load_model(model_dir, "cpu", torch.float32, None)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")
    ours, greedy_ours, _ = load_scores(tmp_path / "scored" / "scores.npz")
    theirs = lm._loglikelihood_tokens([(("", ""), *reqs.pair(i)) for i in range(len(reqs))], disable_tqdm=True)
    assert ours == pytest.approx([x[0] for x in theirs], abs=1e-4)
    assert list(greedy_ours) == [x[1] for x in theirs]
    # left truncation as HFLM's: a max_length just above the longest continuation cuts most contexts
    ml = int(reqs.cont_len.max()) + 2
    assert ((reqs.offsets[1:] - reqs.offsets[:-1]) > ml + 1).sum() >= len(reqs) // 2
    ll_t, _ = score_requests(model, reqs, "cpu", max_length=ml, progress=False)
    lm_t = HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu", max_length=ml)
    theirs_t = lm_t._loglikelihood_tokens([(("", ""), *reqs.pair(i)) for i in range(len(reqs))], disable_tqdm=True)
    assert ll_t == pytest.approx([x[0] for x in theirs_t], abs=1e-4)
    assert not ll_t == pytest.approx(list(ours), abs=1e-3)  # the truncation changed the scores
    # a replay against another export is refused
    export2 = tmp_path / "req2.npz"
    assert main(["--model", str(model_dir), "--tasks", "piqa", "--eval-dir", str(eval_dir),
                 "--export-requests", str(export2), "--out", str(tmp_path)]) == 0
    with pytest.raises(SystemExit, match="another requests file"):
        main(["--replay", str(tmp_path / "scored" / "scores.npz"), "--requests", str(export2),
              "--out", str(tmp_path / "bad")])


def test_requests_file_roundtrip_and_checks(tmp_path):
    from sfl.experiments.trainer.loglik import load_requests, save_requests

    pairs = [([1, 2, 3], [4]), ([1, 2, 3], [4]), ([5], [6, 7]), ([60000, 1], [2])]
    r = save_requests(tmp_path / "r.npz", pairs, {"tasks": ["x"]})
    assert len(r) == 3 and r.meta["n_tokens"] == 4 + 3 + 3
    back = load_requests(tmp_path / "r.npz")
    assert back.keys() == [((1, 2, 3), (4,)), ((5,), (6, 7)), ((60000, 1), (2,))]
    with pytest.raises(ValueError, match="empty"):
        save_requests(tmp_path / "e.npz", [([], [1])], {})
    import numpy as np

    with np.load(tmp_path / "r.npz") as z:  # tamper with one token: the digest check must notice
        d = {k: z[k] for k in z.files}
    d["tokens"] = d["tokens"].copy()
    d["tokens"][0] += 1
    with open(tmp_path / "bad.npz", "wb") as fh:
        np.savez(fh, **d)
    with pytest.raises(ValueError, match="digest"):
        load_requests(tmp_path / "bad.npz")


# ----------------------------------------------------------------------------------------- refusing what cannot be trusted

def _eval_args(model_dir: Path, tmp: Path, *extra: str) -> list[str]:
    """main()'s arguments for a 2-document piqa run of model_dir (writing piqa.jsonl under tmp once)."""
    eval_dir = tmp / "eval"
    if not eval_dir.is_dir():
        eval_dir.mkdir()
        (eval_dir / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PIQA))
    return ["--model", str(model_dir), "--tasks", "piqa", "--limit", "2", "--batch-size", "2", "--device", "cpu",
            "--out", str(tmp / "out"), "--eval-dir", str(eval_dir), *extra]


def _edited_copy(src: Path, dest: Path, config: dict | None = None, drop: str | None = None) -> Path:
    """A copy of a model folder with config.json keys changed and/or one tensor removed from its weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        tensors = load_file(str(dest / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_evaluate_refuses_a_partly_loaded_model(tmp_path):
    """Weights that do not fit config.json (fewer layers: UNEXPECTED tensors; untied lm_head: MISSING; a tensor
    dropped from the file; another intermediate_size) would leave parts of the model random: refused, unless
    --allow-partial."""
    from transformers import AutoModelForCausalLM

    src = _tiny_model_dir(tmp_path)
    tied = tmp_path / "tied"  # saved with tied embeddings: no lm_head.weight in the file
    model = AutoModelForCausalLM.from_pretrained(str(src))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(str(tied))
    cases = {"9 unexpected": _edited_copy(src, tmp_path / "layers", config={"num_hidden_layers": 1}),
             "1 missing (lm_head.weight)": _edited_copy(tied, tmp_path / "untied",
                                                      config={"tie_word_embeddings": False}),
             "1 missing (model.norm.weight)": _edited_copy(src, tmp_path / "dropped", drop="model.norm.weight"),
             "6 of another shape": _edited_copy(src, tmp_path / "shape", config={"intermediate_size": 64})}
    for what, model_dir in cases.items():
        with pytest.raises(SystemExit, match=r"--allow-partial") as e:
            main(_eval_args(model_dir, tmp_path))
        assert what in str(e.value) and "\n" not in str(e.value), what
    assert not (tmp_path / "out" / "eval.json").exists()
    assert main(_eval_args(cases["9 unexpected"], tmp_path, "--allow-partial")) == 0  # the deliberate case
    assert (tmp_path / "out" / "eval.json").is_file()


def test_evaluate_checks_the_weights_sha256(tmp_path, capsys):
    """write_pretrained (the trainer's hf/ and final/ copies) records each weight file's SHA-256; evaluate refuses
    a file with flipped exponent bits or a truncated one, and loads a folder without the record with a notice."""
    import shutil

    from transformers import AutoModelForCausalLM

    from sfl.experiments.trainer.checkpoint import write_pretrained
    from sfl.experiments.trainer.weight_hashes import HASH_FILE, verify_weight_hashes

    src = _tiny_model_dir(tmp_path)
    saved = tmp_path / "saved"
    write_pretrained(AutoModelForCausalLM.from_pretrained(str(src)), saved, src)
    assert json.loads((saved / HASH_FILE).read_text())["files"].keys() == {"model.safetensors"}
    assert verify_weight_hashes(saved) and main(_eval_args(saved, tmp_path)) == 0

    flipped = tmp_path / "flipped"
    shutil.copytree(saved, flipped)
    blob = bytearray((flipped / "model.safetensors").read_bytes())
    for i in range(64):  # the top exponent bit of 64 float32 values near the end (the data, not the header)
        blob[len(blob) - 1 - 4 * i] ^= 0x40
    (flipped / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(SystemExit, match="SHA-256"):
        main(_eval_args(flipped, tmp_path))
    (flipped / "model.safetensors").write_bytes(bytes(blob[:len(blob) // 2]))
    with pytest.raises(SystemExit, match="truncated"):
        main(_eval_args(flipped, tmp_path))

    capsys.readouterr()
    (saved / HASH_FILE).unlink()
    assert main(_eval_args(saved, tmp_path)) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if HASH_FILE in line]
    assert len(notes) == 1 and "unchecked" in notes[0]


def test_evaluate_unreadable_model_folders_give_one_line_errors(tmp_path):
    """Missing or truncated weights (no SHA-256 record) and a torn config.json: a one-line error, no traceback."""
    src = _tiny_model_dir(tmp_path)
    missing = _edited_copy(src, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    truncated = _edited_copy(src, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 3])
    bad_config = _edited_copy(src, tmp_path / "bad_config")
    (bad_config / "config.json").write_text('{"model_type": "llama", "hidden_')
    for model_dir in (missing, truncated, bad_config):
        with pytest.raises(SystemExit, match="cannot load the model") as e:
            main(_eval_args(model_dir, tmp_path))
        assert str(model_dir) in str(e.value) and "\n" not in str(e.value)


def test_evaluate_refuses_a_tokenizer_larger_than_the_embedding(tmp_path):
    """A tokenizer whose ids run past the model's embedding (another model's tokenizer, e.g. the prepared
    49,152-token one beside a small-vocab model) is refused before lm-eval runs, not an IndexError inside it."""
    small = _edited_copy(_tiny_model_dir(tmp_path), tmp_path / "small", config={"vocab_size": 64})
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(small / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:64].contiguous()
    save_file(tensors, str(small / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"has 320 tokens, but the model's embedding has 64 rows"):
        main(_eval_args(small, tmp_path))


def test_evaluate_refuses_mlp_impl_cuda_on_a_cpu_up_front(tmp_path, monkeypatch):
    """mlp_impl cuda with --device cpu fails before lm-eval's loop, saying what to pass instead."""
    pytest.importorskip("sfl.models")
    from transformers import AutoModelForCausalLM

    from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM

    src = _tiny_model_dir(tmp_path)
    dense = AutoModelForCausalLM.from_pretrained(str(src))
    cfg = SparseLlamaConfig(**{k: v for k, v in dense.config.to_dict().items()
                               if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                        "bos_token_id", "eos_token_id", "pad_token_id")}, twell_tile_n=64)
    sparse = tmp_path / "sparse"
    SparseLlamaForCausalLM(cfg).save_pretrained(str(sparse))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sparse / name).write_bytes((src / name).read_bytes())
    import lm_eval

    def no_lm_eval(*a, **k):
        raise AssertionError("lm-eval was started")

    monkeypatch.setattr(lm_eval, "simple_evaluate", no_lm_eval)
    with pytest.raises(SystemExit, match="--mlp-impl reference"):
        main(_eval_args(sparse, tmp_path, "--mlp-impl", "cuda"))


def test_eval_json_is_replaced_atomically(tmp_path, monkeypatch):
    """A kill while eval.json is being written leaves the previous eval.json whole (temp file + rename)."""
    import os

    model_dir = _tiny_model_dir(tmp_path)
    assert main(_eval_args(model_dir, tmp_path)) == 0
    before = (tmp_path / "out" / "eval.json").read_text()

    def killed(fd):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(os, "fsync", killed)  # the new file's bytes are written, not yet renamed into place
    with pytest.raises(KeyboardInterrupt):
        main(_eval_args(model_dir, tmp_path, "--limit", "1"))
    assert (tmp_path / "out" / "eval.json").read_text() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.json"]
