"""The house as imports: which package folder imports which, any import cycle, and the imports hidden in function
bodies. Parses (ast, nothing imported) every module under the package folders; notebooks' code cells count too.

    python lab/house.py > lab/house.txt

(a) edges between rooms from module-level imports (what a reader of a file's head sees), with the module pairs;
(b) import cycles between modules (module level, then with function-body imports as well) and between rooms;
(c) imports inside function bodies with no comment on the same line or right above it (a comment above a run of
    consecutive imports covers the run), per folder, then each one.
"""
from __future__ import annotations

import ast
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("kernels", "models", "data", "experiments", "notebooks")
# The kernels' layers, in the order a newcomer meets them: spec (FORMAT.md) -> reference -> kernel -> op.
KERNEL_ROOMS = {
    "kernels.reference": "kernels:reference",
    "kernels.loader": "kernels:kernel",  # builds/loads the .cu/.cpp sources
    "kernels.twell.ops": "kernels:op", "kernels.train.ops": "kernels:op",
    "kernels.ffn": "kernels:op", "kernels.train_ffn": "kernels:op", "kernels.sparse_llama_mlp": "kernels:op",
    "kernels.config": "kernels:config", "kernels.tables": "kernels:config",  # the settings and dispatch tables
    "kernels.calibrate": "kernels:calibrate",  # a program that measures the GPU and writes the dispatch tables
    "kernels.timing": "kernels:calibrate",  # its timing, which the benchmarks use too: above the ops it times
}


@dataclass(frozen=True)
class Import:
    source: str  # dotted module that imports
    target: str  # dotted module imported: one of ours, or the outside name (torch, transformers, ...)
    ours: bool
    line: int
    in_function: bool
    commented: bool
    type_only: bool = False  # under `if TYPE_CHECKING:`: never executed, no edge


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room(module: str) -> str:
    """kernels:<layer> (support: the rest of kernels/), models, data, experiments:<folder> (experiments:trainer is
    the trainer every experiment shares), notebooks."""
    top, _, rest = module.partition(".")
    if top == "kernels":
        return KERNEL_ROOMS.get(module, "kernels:support")
    if top == "experiments" and rest:
        return f"experiments:{rest.split('.')[0]}"
    return top


def _sources() -> dict[str, tuple[Path, str]]:
    """Dotted name -> (path, Python source) of every module and notebook under FOLDERS."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[module_name(path)] = (path, path.read_text())
        for path in sorted((ROOT / folder).rglob("*.ipynb")):
            if ".ipynb_checkpoints" in path.parts:
                continue
            cells = json.loads(path.read_text())["cells"]
            code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
            # IPython magics and shell lines are not Python: blank them, keeping line numbers
            lines = [("" if ln.lstrip().startswith(("%", "!")) else ln) for ln in "\n".join(code).splitlines()]
            out[module_name(path)] = (path, "\n".join(lines))
    return out


def _resolve(name: str, level: int, importer: str, is_package: bool, known: set[str]) -> str | None:
    """The imported dotted name, relative to the repository root, if it is one of ours."""
    if level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - (level - 1)]
        name = ".".join(base + ([name] if name else []))
    elif name.startswith("sfl."):
        name = name[len("sfl."):]
    elif name.split(".")[0] not in FOLDERS:
        return None
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _commented(lines: list[str], node: ast.stmt) -> bool:
    if any("#" in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
        return True
    i = node.lineno - 1
    while i >= 1 and lines[i - 1].strip().startswith(("import ", "from ")):  # a run of imports shares one comment
        i -= 1
    return i >= 1 and lines[i - 1].strip().startswith("#")


def imports_of(module: str, path: Path, source: str, known: set[str]) -> list[Import]:
    tree = ast.parse(source, str(path))
    lines = source.splitlines()
    is_package = path.name == "__init__.py"
    found = []

    def visit(node: ast.AST, in_function: bool, type_only: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
                continue
            if isinstance(child, ast.Import):
                names = [(a.name, 0) for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                names = [(f"{base}.{a.name}" if base else a.name, child.level) for a in child.names]
            else:
                visit(child, inside, type_only)
                continue
            targets = {(_resolve(n, lvl, module, is_package, known) or n, bool(_resolve(n, lvl, module, is_package,
                                                                                      known))) for n, lvl in names}
            if not any(ours for _, ours in targets):  # an outside import: one entry, named by its package
                targets = {(names[0][0].split(".")[0], False)}
            for target, ours in sorted(t for t in targets if t[0] != module):
                found.append(Import(module, target, ours, child.lineno, in_function, _commented(lines, child),
                                    type_only))
    visit(tree, False)
    return found


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def kernel_layers(sources: dict[str, tuple[Path, str]]) -> list[str]:
    """Which kernels/ modules cite the spec (FORMAT.md) and which name the C++/CUDA sources they build."""
    out = ["(a) kernels' layers: spec (FORMAT.md) -> reference -> kernel (.cu/.cpp) -> op"]
    for module, (path, text) in sorted(sources.items()):
        if not module.startswith("kernels"):
            continue
        built = sorted({Path(c.value).name for c in ast.walk(ast.parse(text)) if isinstance(c, ast.Constant)
                        and isinstance(c.value, str) and c.value.endswith((".cu", ".cpp"))})
        notes = (["cites FORMAT.md"] if "FORMAT.md" in text else []) + ([f"builds {', '.join(built)}"] if built else [])
        if notes or module in KERNEL_ROOMS:
            out.append(f"  {module:28s} {room(module):18s} {'; '.join(notes)}")
    return out + [""]


def report(imports: list[Import], sources: dict[str, tuple[Path, str]]) -> str:
    out = kernel_layers(sources)
    ours = [i for i in imports if i.ours and not i.type_only]
    top = [i for i in ours if not i.in_function]
    pairs = defaultdict(set)
    for i in top:
        if room(i.source) != room(i.target):
            pairs[(room(i.source), room(i.target))].add((i.source, i.target))
    out.append("(a) module-level imports between rooms: FROM -> TO  (module pairs)")
    for (a, b), mods in sorted(pairs.items()):
        shown = ", ".join(f"{s}->{t}" for s, t in sorted(mods)[:4]) + (" ..." if len(mods) > 4 else "")
        out.append(f"  {a:26s} -> {b:24s} {len(mods):3d}  {shown}")
    folder_pairs = sorted({(a.split(':')[0], b.split(':')[0]) for a, b in pairs if a.split(':')[0] != b.split(':')[0]})
    out.append("  top-level folders: " + "; ".join(f"{a} -> {b}" for a, b in folder_pairs))
    typed = sorted(f"{i.source}->{i.target}" for i in imports if i.type_only)
    out.append("  type-only (`if TYPE_CHECKING:`, no edge): " + (", ".join(typed) or "none"))
    out.append("")
    out.append("(b) import cycles")
    for label, subset in (("modules, module level", top), ("modules, with function-body imports", ours)):
        found = cycles({(i.source, i.target) for i in subset})
        out.append(f"  {label}: " + ("none" if not found else "; ".join(" <-> ".join(c) for c in found)))
    for name, key in (("rooms", room), ("folders", lambda m: m.split(".")[0])):
        for label, subset in (("module level", top), ("with function-body imports", ours)):
            found = cycles({(key(i.source), key(i.target)) for i in subset if key(i.source) != key(i.target)})
            out.append(f"  {name}, {label}: " + ("none" if not found else "; ".join(" <-> ".join(c) for c in found)))
    out.append("")
    hidden = [i for i in imports if i.in_function]
    bare = [i for i in hidden if not i.commented]
    out.append("(c) import statements inside function bodies (ours and outside packages): folder  total  "
               "without a comment  (of them ours)")
    for folder in FOLDERS:
        n = sum(i.source.split(".")[0] == folder for i in hidden)
        m = sum(i.source.split(".")[0] == folder for i in bare)
        k = sum(i.source.split(".")[0] == folder and i.ours for i in bare)
        out.append(f"  {folder:12s} {n:5d} {m:5d} {k:5d}")
    out.append(f"  {'all':12s} {len(hidden):5d} {len(bare):5d} {sum(i.ours for i in bare):5d}")
    out.append("  without a comment (module:line -> imported):")
    out.extend(f"    {i.source}:{i.line} -> {i.target}" for i in sorted(bare, key=lambda i: (i.source, i.line)))
    return "\n".join(out) + "\n"


def main() -> None:
    sources = _sources()
    known = set(sources) | set(FOLDERS)
    imports = [imp for mod, (path, src) in sources.items() for imp in imports_of(mod, path, src, known)]
    sys.stdout.write(report(imports, sources))


if __name__ == "__main__":
    main()
