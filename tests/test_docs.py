"""The docs stand alone and agree with the generated tables (CPU, no GPU, a few seconds).

1. No tracked text file points outside the repository or uses tracker/process words; run histories live in
   lab/HISTORY.md only. Recorded logs (their raw output, e.g. absolute paths of the machine that wrote them) are
   left as recorded.
2. README.md's claims and paper-scale blocks equal paper_tables/claims.md and paper_scale_readme.md, which
   notebooks/claims.py writes.
3. Every lab/ log a document names (`lab/<topic>.tar.xz: MEMBER`, the logs being kept compressed) is there.
"""
from __future__ import annotations

import fnmatch
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "path outside the repository": re.compile(r"\.\./shared|/work/"),
    "tracker reference": re.compile(r"\bissues? #?\d+|\bissue-\d+|#\d+ (?:inference|training)", re.IGNORECASE),
    "process word": re.compile(r"\bround[ -]\d+|\brounds \d+|\bteam brief|\bsession\b|\bsuite-r1\b", re.IGNORECASE),
}
HISTORY = "lab/HISTORY.md"
# Recorded outputs: written by runs, kept byte for byte (their provenance is what they recorded).
LOG_SUFFIXES = (".jsonl", ".json", ".log", ".txt", ".csv", ".png", ".ipynb_checkpoints")
LOG_DIRS = ("results/", "lab/results/", "lab/speed/")
THIS_FILE = "tests/test_docs.py"
# `lab/x.tar.xz` or `lab/x.tar.xz: MEMBER` (a glob, {a,b} alternatives, a trailing / for a folder of members)
LAB_ARCHIVE_REF = re.compile(r"(?<![\w/.])(lab/[\w./-]+\.tar\.xz)(?::\s+((?:\{[^{}\s]*\}|[^\s`'\")\],;|{])+))?")
LAB_PLAIN_REF = re.compile(r"(?<![\w/.])lab/(?:\{[^{}\s]*\}|[^\s`'\")\],;|{:])+")
LAB_LOG_SUFFIXES = (".jsonl", ".json", ".log", ".txt", ".csv", ".env", ".*")


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
    keep = []
    for f in files:
        if f in (HISTORY, THIS_FILE):
            continue
        if f.startswith(LOG_DIRS) and f.endswith(LOG_SUFFIXES) and not f.startswith("results/published/"):
            continue
        path = ROOT / f
        if not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head:  # binary
            continue
        keep.append(f)
    return keep


def find_violations(files: list[str]) -> list[str]:
    """'path:line: kind: text' for every forbidden pattern in the given repository-relative files."""
    found = []
    for f in files:
        text = (ROOT / f).read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for kind, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{f}:{n}: {kind}: {line.strip()[:120]}")
    return found


def test_patterns_catch_what_they_should(tmp_path):
    bad = ["see ../shared/reference/x.md", "kept in round 14", "issue 12's rows", "as in the team brief",
           "this session", "the tag suite-r1", "/work/main/.data"]
    good = ["rounding before writing", "the background", "groundtruth", "tissue 3", "sessions_dir_x"]
    for line in bad:
        assert any(p.search(line) for p in FORBIDDEN.values()), line
    for line in good:
        assert not any(p.search(line) for p in FORBIDDEN.values()), line


def test_no_outside_paths_or_process_words():
    violations = find_violations(_tracked_text_files())
    assert not violations, (f"{len(violations)} lines point outside the repository or use tracker/process words "
                            f"(move history to {HISTORY}, reword the rest):\n" + "\n".join(violations[:60]))


def _block(text: str, begin: str, end: str) -> str:
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        pytest.fail(f"README.md markers missing: {begin} ... {end}")
    return text[start:stop + len(end)] + "\n"


@pytest.mark.parametrize("name", ["claims.md", "paper_scale_readme.md"])
def test_readme_blocks_equal_generated_tables(name):
    from sfl.notebooks.claims import BLOCKS

    begin, end, _ = BLOCKS[name]
    generated = (ROOT / "paper_tables" / name).read_text()
    assert _block((ROOT / "README.md").read_text(), begin, end) == generated, (
        f"README.md's block differs from paper_tables/{name}: run `python -m sfl.notebooks.claims` and paste the "
        "file between the markers")


@pytest.mark.parametrize("name", ["claims.md", "paper_scale_readme.md"])
def test_claims_generator_reproduces_committed_tables(name):
    from sfl.notebooks.claims import BLOCKS

    assert BLOCKS[name][2]() == (ROOT / "paper_tables" / name).read_text(), (
        f"paper_tables/{name} is stale against paper_tables/*.csv: run `python -m sfl.notebooks.claims`")


def _alternatives(path: str) -> list[str]:
    """{a,b} alternatives expanded, <placeholders> as wildcards."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [re.sub(r"<[^<>]*>", "*", path)]
    return [x for alt in m.group(1).split(",") for x in _alternatives(path[:m.start()] + alt + path[m.end():])]


def _matches(names: list[str], pattern: str) -> bool:
    pattern = pattern.rstrip(".").rstrip("/")
    return any(fnmatch.fnmatch(n, pattern) or n.startswith(pattern + "/") for n in names)


def _unresolved_lab_refs(doc: str, text: str, tracked: list[str], members: dict[str, list[str]]) -> list[str]:
    archive_dirs = tuple(a[:-len(".tar.xz")] + "/" for a in members)
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in LAB_ARCHIVE_REF.finditer(line):
            archive, member = m.group(1), m.group(2)
            if archive not in members:
                bad.append(f"{doc}:{n}: no archive {archive}")
            elif member and not all(_matches(members[archive], p) for p in _alternatives(member)):
                bad.append(f"{doc}:{n}: {archive} has no member {member}")
        for m in LAB_PLAIN_REF.finditer(line):
            ref = m.group(0).rstrip(".")
            names_a_log = ref.endswith(LAB_LOG_SUFFIXES) or ref.startswith(archive_dirs)
            if ".tar.xz" in ref or not names_a_log:
                continue
            if not all(_matches(tracked, p) for p in _alternatives(ref)):
                bad.append(f"{doc}:{n}: {ref} is not tracked (logs under lab/ live in archives: `ARCHIVE: MEMBER`)")
    return bad


def test_lab_logs_named_by_docs_resolve():
    tracked = [f for f in subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                         check=True).stdout.decode().split("\0") if f]
    members = {}
    for archive in (f for f in tracked if f.startswith("lab/") and f.endswith(".tar.xz")):
        with tarfile.open(ROOT / archive, "r:xz") as tar:
            members[archive] = [m.name for m in tar.getmembers() if m.isfile()]
    assert members, "no lab/**/*.tar.xz archives tracked: where did the trial logs go?"
    docs = [f for f in tracked if f.endswith(".md") and not f.startswith("results/")]
    bad = [b for doc in docs for b in _unresolved_lab_refs(doc, (ROOT / doc).read_text(), tracked, members)]
    assert not bad, f"{len(bad)} lab/ log references do not resolve:\n" + "\n".join(bad[:40])


def test_lab_ref_check_catches_a_missing_member():
    members = {"lab/results/x.tar.xz": ["a.jsonl", "d/b.txt"]}
    ok = "`lab/results/x.tar.xz: a.jsonl`, `lab/results/x.tar.xz: d/`, `lab/results/x.tar.xz: {a.jsonl,d/b.txt}`"
    assert _unresolved_lab_refs("doc.md", ok, [], members) == []
    for line in ("`lab/results/x.tar.xz: c.jsonl`", "`lab/results/y.tar.xz`", "`lab/results/x/a.jsonl`",
                 "`lab/results/x.tar.xz: {a,c}.jsonl`"):
        assert _unresolved_lab_refs("doc.md", line, [], members), line
