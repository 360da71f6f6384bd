"""The one JIT loader for our CUDA extensions (torch.utils.cpp_extension.load + ninja): the inference kernels
("twell": kernels/twell/, the TwELL ops) and the training kernels ("train": kernels/train/), `load(name)`.

- arch is taken from the device (sm_90 -> "9.0a" so Hopper-only instructions are allowed);
- builds are cached in $SFL_KERNEL_BUILD_DIR or ~/.cache/sfl_kernels/<name>-<hash>, the hash covering the
  sources, the arch and the torch version, so an edited kernel never loads a stale library;
- $SFL_PREBUILT may list already built libraries (os.pathsep-separated .so paths, e.g. carried to a fresh GPU
  machine); an extension takes the one named after it (sfl_twell_*, sfl_train_*) only if it was built from the
  same sources (its source_hash() matches), otherwise it rebuilds with a warning;
- without CUDA / nvcc the error says what is missing and names the pure-PyTorch path (kernels.reference);
- on a GPU that is not sm_90 nothing is built: the error gives kernels.device's reason (the entry points take the
  dense path there before they reach the loader).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

from .device import kernels_supported

_HERE = Path(__file__).resolve().parent
_COMMON_SOURCES = [_HERE / "common" / "backup_rows.cu", _HERE / "common" / "slices.cu"]
TWELL_SOURCES = [_HERE / "twell" / "binding.cpp", _HERE / "twell" / "runtime.cpp", _HERE / "twell" / "twell_kernels.cu",
                 _HERE / "twell" / "d2t_gemm.cu", *_COMMON_SOURCES]
TRAIN_SOURCES = [_HERE / "train" / "binding.cpp", _HERE / "train" / "train_kernels.cu", *_COMMON_SOURCES]
_LOCK = threading.Lock()
_CACHE: dict[str, ModuleType] = {}

REFERENCE_HINT = ("the pure-PyTorch path sfl.kernels.reference (gated_ffn_twell / nongated_ffn_twell) "
                  "or mlp_impl='reference'/'dense' works on any device")


@dataclass(frozen=True)
class Extension:
    """One CUDA extension: its sources (one binding.cpp, then plain-CUDA .cu files), what an error calls it, and what
    to use instead when it cannot be built."""

    sources: tuple[Path, ...]
    what: str
    hint: str


EXTENSIONS = {
    "twell": Extension(tuple(TWELL_SOURCES), "the TwELL extension", REFERENCE_HINT),
    "train": Extension(tuple(TRAIN_SOURCES), "the sparse training extension",
                       "use backend='torch' or mode='dense'; " + REFERENCE_HINT),
}


class KernelUnavailableError(RuntimeError):
    """Raised when the CUDA extension cannot be built or loaded here."""


# device helpers included by every .cu (not compiled on their own, but part of what a build is made from)
COMMON_HEADERS = sorted((_HERE / "common").glob("*.cuh")) + sorted((_HERE / "common").glob("*.h")) + sorted(
    (_HERE / "twell").glob("*.h"))


def source_hash(sources: list[Path] | None = None) -> str:
    """Hash of an extension's sources plus the shared headers: the build cache and prebuilt-library check key."""
    h = hashlib.sha1()
    for p in list(sources or TWELL_SOURCES) + COMMON_HEADERS:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def require_supported_gpu(hint: str) -> None:
    """Raise KernelUnavailableError (why, then `hint`) unless the current GPU runs the kernels: nothing is built."""
    ok, why = kernels_supported()
    if not ok:
        raise KernelUnavailableError(f"{why}; {hint}")


def _arch_for_device() -> str:
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    return arch + "a" if (major, minor) == (9, 0) else arch


def _find_cuda_home() -> str | None:
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    real = Path(nvcc).resolve()
    return str(real.parent.parent)


def _load_prebuilt(path: str, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise KernelUnavailableError(f"cannot load prebuilt library {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def build_extension(name: str, sources: list[Path], arch: str, *, define: str, what: str, hint: str,
                    verbose: bool = False) -> ModuleType:
    """JIT-build `sources` (one binding.cpp + plain-CUDA .cu files) as extension `name` for `arch`.

    Shared by every extension of the project: same flags, build cache under $SFL_KERNEL_BUILD_DIR, the
    nvidia-wheel include folders (torch's headers pull in cuBLAS/cuSPARSE headers that live there), and a
    KernelUnavailableError naming `hint` when nvcc is missing or the build fails (never exit()).
    """
    if name in _BUILD_ERRORS:  # a failed build is not retried on every call (each try runs ninja)
        raise _BUILD_ERRORS[name]
    try:
        return _build(name, sources, arch, define, what, hint, verbose)
    except KernelUnavailableError as e:
        _BUILD_ERRORS[name] = e
        raise


_BUILD_ERRORS: dict[str, KernelUnavailableError] = {}


def _build(name: str, sources: list[Path], arch: str, define: str, what: str, hint: str, verbose: bool) -> ModuleType:
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        raise KernelUnavailableError("nvcc not found: install the CUDA toolkit matching torch.version.cuda or set "
                                     "CUDA_HOME; " + hint)
    os.environ.setdefault("CUDA_HOME", cuda_home)
    build_dir = Path(os.environ.get("SFL_KERNEL_BUILD_DIR", Path.home() / ".cache" / "sfl_kernels")) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    extra_inc = []
    try:  # optional: the CUDA headers of the pip nvidia-* wheels, where torch was installed with them
        import nvidia  # type: ignore

        for root in nvidia.__path__:
            for sub in ("cu13/include", "cu12/include"):
                if (Path(root) / sub).is_dir():
                    extra_inc.append(str(Path(root) / sub))
    except ImportError:
        pass
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    try:
        return cpp_extension.load(name=name, sources=[str(p) for p in sources], extra_cflags=["-O3", f"-D{define}"],
                    extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"], extra_include_paths=extra_inc,
                    build_directory=str(build_dir), verbose=verbose)
    except Exception as e:  # compiler missing/broken: say so, never exit
        raise KernelUnavailableError(f"building {what} failed: {e}; " + hint) from e
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch


def prebuilt_for(name: str, listed: str | None) -> str | None:
    """The library $SFL_PREBUILT (`listed`) names for extension `name`: the path whose file is called sfl_<name>_*."""
    for path in filter(None, (listed or "").split(os.pathsep)):
        if Path(path).name.startswith(f"sfl_{name}_"):
            return path
    return None


def _try_prebuilt(path: str, src_hash: str) -> ModuleType | None:
    """The prebuilt library at `path` if it was built from these sources, else None (with a warning: rebuilt)."""
    if not os.path.isfile(path):
        raise KernelUnavailableError(f"SFL_PREBUILT names {path}, which does not exist; fix or unset it to JIT-build")
    try:
        mod = _load_prebuilt(path, Path(path).stem.split(".")[0])
    except ImportError as e:  # built for another python/torch
        warnings.warn(f"prebuilt {path} cannot be imported ({e}); rebuilding", stacklevel=3)
        return None
    if mod.source_hash() != src_hash:
        warnings.warn(f"prebuilt {path} was built from other sources ({mod.source_hash()} != {src_hash}); rebuilding",
                      stacklevel=3)
        return None
    return mod


def load(name: str, verbose: bool = False) -> ModuleType:
    """Build (once per source version, arch and torch version; cached on disk) and return extension `name`
    ("twell" or "train"). Without a CUDA GPU that runs the kernels a KernelUnavailableError says why and what to use."""
    mod = _CACHE.get(name)
    if mod is not None:  # every call after the first: no lock (host time on each op call)
        return mod
    ext = EXTENSIONS[name]
    with _LOCK:
        if name in _CACHE:
            return _CACHE[name]
        if not torch.cuda.is_available():
            raise KernelUnavailableError(f"{ext.what} needs a CUDA GPU (torch.cuda.is_available() is False); "
                                         + ext.hint)
        require_supported_gpu(ext.hint)
        src_hash = source_hash(list(ext.sources))
        arch = _arch_for_device()
        pre = prebuilt_for(name, os.environ.get("SFL_PREBUILT"))
        mod = _try_prebuilt(pre, src_hash) if pre else None
        if mod is None:
            tag = hashlib.sha1(f"{src_hash}-{arch}-{torch.__version__}".encode()).hexdigest()[:10]
            mod = build_extension(f"sfl_{name}_{tag}", list(ext.sources), arch, define=f"SFL_SRC_HASH={src_hash}",
                                  what=ext.what, hint=ext.hint, verbose=verbose)
        _CACHE[name] = mod
        return mod


def loaded(name: str) -> ModuleType | None:
    """Extension `name` if it is loaded, else None (nothing is built: one dict lookup)."""
    return _CACHE.get(name)


def load_twell(verbose: bool = False) -> ModuleType:
    """The TwELL (inference) extension: load("twell")."""
    return load("twell", verbose)


def load_train(verbose: bool = False) -> ModuleType:
    """The training extension: load("train")."""
    return load("train", verbose)
