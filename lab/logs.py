"""The trial logs under lab/ are kept as one xz tar archive per topic (e.g. lab/results/kernel_bench.tar.xz).
A document names a log as `ARCHIVE: MEMBER`; this reads, unpacks and (re)packs them.

    python lab/logs.py list lab/results/kernel_bench.tar.xz [PATTERN]    # member names (fnmatch PATTERN)
    python lab/logs.py show lab/results/kernel_bench.tar.xz bench_h100_r24.jsonl
    python lab/logs.py extract lab/results/kernel_bench.tar.xz            # unpacked beside it (git-ignored)
    python lab/logs.py pack FOLDER                                        # FOLDER's files -> FOLDER.tar.xz

`pack` adds the folder's files to the archive's members (a file with a member's name replaces it) and writes the
archive byte for byte the same for the same members, so that an unchanged log set leaves git with nothing to do.
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import os
import sys
import tarfile
from pathlib import Path


def members(archive: Path) -> dict[str, bytes]:
    """Member name -> content, for every file in the archive."""
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def member_names(archive: Path) -> list[str]:
    with tarfile.open(archive, "r:xz") as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


def write_archive(archive: Path, files: dict[str, bytes]) -> None:
    """Sorted members, fixed owner, mode and time: the same files give the same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=9, format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    archive.write_bytes(buf.getvalue())


def pack(folder: Path) -> Path:
    archive = folder.with_name(folder.name + ".tar.xz")
    files = members(archive) if archive.exists() else {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[path.relative_to(folder).as_posix()] = path.read_bytes()
    write_archive(archive, files)
    return archive


def _folder_of(archive: Path) -> Path:
    if not archive.name.endswith(".tar.xz"):
        sys.exit(f"{archive}: not a .tar.xz archive; `python lab/logs.py list` lists them")
    return archive.with_name(archive.name[:-len(".tar.xz")])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["list", "show", "extract", "pack"])
    p.add_argument("path", type=Path, nargs="?", help="an archive (a folder for pack); list: every archive if left out")
    p.add_argument("member", nargs="?", help="show: the member's name; list: an fnmatch pattern")
    a = p.parse_args(argv)
    if a.command == "list" and a.path is None:
        print("\n".join(os.path.relpath(x) for x in sorted(Path(__file__).parent.rglob("*.tar.xz"))))
        return
    if a.path is None or not a.path.exists():
        sys.exit(f"{a.path}: no such {'folder' if a.command == 'pack' else 'archive'}")
    if a.command == "pack":
        print(pack(a.path))
        return
    folder = _folder_of(a.path)
    if a.command == "list":
        print("\n".join(n for n in member_names(a.path) if fnmatch.fnmatch(n, a.member or "*")))
    elif a.command == "show":
        files = members(a.path)
        if a.member not in files:
            sys.exit(f"{a.member}: not in {a.path}; `python lab/logs.py list {a.path}` lists its members")
        sys.stdout.buffer.write(files[a.member])
    else:
        with tarfile.open(a.path, "r:xz") as tar:
            # the "data" filter (no absolute paths or links out of the folder) where this Python has it
            tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        print(folder)


if __name__ == "__main__":
    main()
