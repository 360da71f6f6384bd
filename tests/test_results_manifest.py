"""results/ holds logs of record only, each listed in results/MANIFEST.csv, and every results/ path that a README,
a notebook or a generated table cites is in that manifest.

Fails when: a manifest row points to a missing file; a file in results/ has no manifest row; a row is malformed;
or a document cites a results/ file (or glob) that the manifest does not list."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from sfl.notebooks import nbutil

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "results"
STATUSES = {"record"}
# Documents whose results/ citations must resolve to manifest rows (lab/ cites lab/results/, not results/).
CITING = ["README.md", "results/**/*.md", "experiments/**/README.md", "kernels/**/README.md", "notebooks/README.md",
          "notebooks/*.ipynb", "notebooks/*.py", "paper_tables/*.md", "paper_tables/*.csv"]
# "results/..." not preceded by a word character or '/' (so lab/results/... and SFL_RESULTS_DIR are not citations).
CITATION = re.compile(r"(?<![\w/.])results/[\w.*/<>{},+-]*[\w*>}]")


def _manifest() -> list[dict[str, str]]:
    rows = nbutil.manifest_rows(RESULTS)
    assert rows, "results/MANIFEST.csv is missing or empty"
    return rows


def _citation_to_pattern(cited: str) -> list[str]:
    """A cited path as manifest globs: <run>/<time> placeholders and {a,b} alternatives become wildcards."""
    rel = cited[len("results/"):]
    alts = [rel]
    m = re.search(r"\{([^{}]*)\}", rel)
    if m:
        alts = [rel[:m.start()] + a + rel[m.end():] for a in m.group(1).split(",")]
    return [re.sub(r"<[^<>]*>", "*", a) for a in alts]


def _resolves(cited: str, paths: list[str]) -> bool:
    for pat in _citation_to_pattern(cited):
        pat = pat.rstrip("/")
        if any(nbutil._path_matches(p, pat) for p in paths):
            return True
        # a folder (or folder glob) resolves when the manifest lists a file under it
        if any(nbutil._path_matches("/".join(p.split("/")[:pat.count("/") + 1]), pat) for p in paths if "/" in p):
            return True
        # 'bench_h100_r14.*' style: stem with any suffix
        if pat.endswith(".*") and any(nbutil._path_matches(p, pat[:-2] + ".*") for p in paths):
            return True
    return False


def test_manifest_rows_are_well_formed():
    rows = _manifest()
    seen = set()
    for r in rows:
        assert set(nbutil.MANIFEST_COLUMNS) <= set(r), f"row {r} lacks columns"
        assert r["path"] not in seen, f"{r['path']} listed twice"
        seen.add(r["path"])
        assert r["status"] in STATUSES, f"{r['path']}: status {r['status']!r} not in {sorted(STATUSES)}"
        assert r["what"].strip() and r["used_by"].strip(), f"{r['path']}: say what it is and what uses it ('-' if nothing)"


def test_every_manifest_entry_exists():
    missing = [r["path"] for r in _manifest() if not (RESULTS / r["path"]).is_file()]
    assert not missing, f"MANIFEST.csv lists files that are not in results/: {missing}"


def test_every_results_file_is_in_the_manifest():
    listed = {r["path"] for r in _manifest()}
    on_disk = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
               if p.is_file() and p.name != nbutil.MANIFEST_NAME and "__pycache__" not in p.parts}
    extra = sorted(on_disk - listed)
    assert not extra, (f"files in results/ without a MANIFEST.csv row: {extra}. results/ holds logs of record only: "
                       "add a row, or move trials/diagnostics to lab/results/")


def _citations() -> list[tuple[str, str]]:
    out = []
    for pattern in CITING:
        for doc in sorted(REPO.glob(pattern)):
            if ".venv" in doc.parts or not doc.is_file():
                continue
            for cited in CITATION.findall(doc.read_text(errors="replace")):
                # a comma ends a path unless it separates {a,b} alternatives (CSV cells follow a path)
                cut = re.match(r"(?:[^,{]|\{[^{}]*\})*", cited).group(0)
                out.append((doc.relative_to(REPO).as_posix(), cut.rstrip(".")))
    return out


def test_every_cited_results_path_is_in_the_manifest():
    paths = [r["path"] for r in _manifest()]
    cites = _citations()
    assert len(cites) > 50, "the citation scan found almost nothing: is CITATION still matching?"
    bad = sorted({f"{doc}: {cited}" for doc, cited in cites
                  if cited.rstrip("/") not in ("results", "results/" + nbutil.MANIFEST_NAME)
                  and not _resolves(cited, paths)})
    assert not bad, "cited results/ paths with no manifest row (fix the path or the manifest):\n" + "\n".join(bad)


def test_citation_check_catches_a_missing_file():
    paths = ["kernel_bench/bench_h100_r14.jsonl", "l1_sweep/relu_l1_0/train_log.jsonl"]
    assert _resolves("results/kernel_bench/bench_h100_r14.jsonl", paths)
    assert _resolves("results/kernel_bench/bench_h100_r14.*", paths)
    assert _resolves("results/l1_sweep/<run>/train_log.jsonl", paths)
    assert _resolves("results/l1_sweep/", paths)
    assert not _resolves("results/kernel_bench/bench_h100_final.jsonl", paths)
    assert not _resolves("results/speed/paper_shapes.jsonl", paths)


def test_notebook_readers_see_only_listed_files(tmp_path, monkeypatch):
    """A log in the results dir that the manifest does not list is never read (no glob-and-keep-newest)."""
    (tmp_path / "speed").mkdir()
    (tmp_path / "speed" / "listed.jsonl").write_text('{"model": "m", "mode": "inference"}\n')
    (tmp_path / "speed" / "new_run.jsonl").write_text('{"model": "m", "mode": "training"}\n')
    with open(tmp_path / nbutil.MANIFEST_NAME, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=nbutil.MANIFEST_COLUMNS)
        w.writeheader()
        w.writerow(dict(path="speed/listed.jsonl", experiment="speed", what="x", used_by="-", seed="", status="record",
                        pending=""))
    monkeypatch.setenv("SFL_RESULTS_DIR", str(tmp_path))
    df = nbutil.load_jsonl_dir(tmp_path / "speed")
    assert list(df["mode"]) == ["inference"]
    (tmp_path / "speed" / "listed.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="MANIFEST.csv lists speed/listed.jsonl"):
        nbutil.record_paths("speed/*.jsonl")


def _used_by_outputs(rows: list[dict[str, str]]) -> set[str]:
    """'paper_tables/<name>' and 'figures/<name>' entries named in the used_by column."""
    out = set()
    for r in rows:
        for item in r["used_by"].split(";"):
            m = re.match(r"\s*((?:paper_tables|figures)/[\w.-]+)", item)
            if m:
                out.add(m.group(1))
    return out


def test_used_by_names_real_outputs_and_every_output_has_a_log():
    """Each table and figure maps to manifest rows, and every table/figure a row names exists."""
    named = _used_by_outputs(_manifest())
    missing = sorted(n for n in named if not ((REPO / f"{n}.md").is_file() or (REPO / f"{n}.png").is_file()))
    assert not missing, f"MANIFEST.csv used_by names outputs that do not exist: {missing}"
    outputs = {f"paper_tables/{p.stem}" for p in (REPO / "paper_tables").glob("*.md") if p.stem != "INDEX"}
    outputs |= {f"figures/{p.stem}" for p in (REPO / "figures").glob("*.png")}
    orphans = sorted(outputs - named)
    assert not orphans, f"tables/figures that no MANIFEST.csv row names in used_by (which logs feed them?): {orphans}"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces -> -."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def _heading_anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings."""
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", markdown, re.MULTILINE)}


def test_used_by_readme_anchors_are_sections_that_cite_the_log():
    """A row whose used_by names README.md#section points at a heading the README has, and that section cites the
    log (its path or a folder above it under results/)."""
    readme = (REPO / "README.md").read_text()
    anchors = _heading_anchors(readme)
    sections = dict(zip(re.findall(r"^## (.+)$", readme, re.MULTILINE), re.split(r"^## .+$", readme, flags=re.MULTILINE)[1:]))
    text_of = {_slug(h): t for h, t in sections.items()}
    bad = []
    for r in _manifest():
        cites = _cites(r["path"])
        for item in r["used_by"].split(";"):
            m = re.match(r"\s*README\.md#([\w-]+)", item)
            if m and (m.group(1) not in anchors or not cites.search(text_of[m.group(1)])):
                bad.append(f"{r['path']}: {item.strip()}")
    assert not bad, "used_by names README sections that do not exist or do not cite the log:\n" + "\n".join(bad)


def _cites(path: str) -> re.Pattern:
    """A citation of results/<path>, or of a folder above it standing alone (results/speed/ cites nothing below it
    when it is only the start of a longer path)."""
    parts = path.split("/")
    folders = [re.escape(f"results/{'/'.join(parts[:k])}/") + r"(?![\w.*{-])" for k in range(1, len(parts))]
    stem = re.escape(f"results/{path.rsplit('.', 1)[0]}") + r"\.\*"  # results/x/log.* names log.jsonl and log.txt
    return re.compile("|".join([re.escape(f"results/{path}"), stem] + folders))


def test_citation_of_a_folder_stands_alone():
    c = _cites("speed/training/x.jsonl")
    assert c.search("see `results/speed/training/x.jsonl`") and c.search("logs in results/speed/training/ (all)")
    assert not c.search("results/speed/training/other.jsonl") and not c.search("results/speed/ffn.jsonl")
    assert c.search("`results/speed/training/x.*`")


def test_heading_anchors_follow_github():
    assert _heading_anchors("## Speed where users run it\n### Kernels (vs. official)\n") == {
        "speed-where-users-run-it", "kernels-vs-official"}


def _clean(dirty: object) -> bool:
    return dirty is False or str(dirty).strip().lower() in ("0", "false")


def test_clean_logs_of_record_verify_against_their_commit():
    """A log that says it came from a clean tree (git_dirty false) carries the source_tree_hash of its commit's code:
    `python -m sfl.experiments.trainer.provenance verify` recomputes it from git. Logs that say dirty are what they say;
    commits this clone lacks (a shallow clone) are skipped, not passed."""
    from sfl.experiments.trainer.provenance import log_provenance, verify

    paths = [RESULTS / r["path"] for r in _manifest() if r["path"].endswith((".json", ".jsonl"))]
    claimed_clean = [p for p in paths if (prov := log_provenance(p)) and prov.get("source_tree_hash")
                     and _clean(prov.get("git_dirty"))]
    assert claimed_clean, "no log of record carries a clean provenance"
    results = verify(claimed_clean)
    unknown = [p for p, v in results if "unknown to this clone" in v]
    if len(unknown) == len(results):
        pytest.skip("none of the logs' commits is in this clone (shallow clone?)")
    bad = [f"{p.relative_to(RESULTS)}: {v}" for p, v in results if v != "verifies" and p not in unknown]
    assert not bad, "logs that claim a clean tree but do not match their commit's code:\n" + "\n".join(bad)


def test_verify_tells_a_matching_hash_from_a_wrong_one(tmp_path):
    import json
    import subprocess

    from sfl.experiments.trainer.provenance import tree_hash_at, verify

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    good = tree_hash_at(head)
    assert good and len(good) == 16
    logs = {}
    for name, h, commit in (("good", good, head), ("wrong", "0" * 16, head), ("nocommit", good, "f" * 40)):
        logs[name] = tmp_path / f"{name}.jsonl"
        logs[name].write_text(json.dumps({"type": "header", "provenance": {"git_commit": commit, "git_dirty": False,
                                                                           "source_tree_hash": h}}) + "\n")
    (tmp_path / "none.json").write_text("{}")
    got = dict(verify([logs["good"], logs["wrong"], logs["nocommit"], tmp_path / "none.json"]))
    assert got[logs["good"]] == "verifies"
    assert got[logs["wrong"]].startswith("DOES NOT VERIFY")
    assert "unknown to this clone" in got[logs["nocommit"]]
    assert got[tmp_path / "none.json"] == "no provenance"
