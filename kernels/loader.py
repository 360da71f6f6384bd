"""The one JIT loader for our CUDA extensions (torch.utils.cpp_extension.load + ninja).

- arch is taken from the device (sm_90 -> "9.0a" so Hopper-only instructions are allowed);
- builds are cached in $SFL_KERNEL_BUILD_DIR or ~/.cache/sfl_kernels/<name>-<hash>, the hash covering the
  sources, the arch and the torch version, so an edited kernel never loads a stale library;
- $TWELL_PREBUILT may name an already built .so (e.g. carried to a fresh GPU machine); it is used only if it
  was built from the same sources (its source_hash() matches), otherwise we rebuild with a warning;
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
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import load

from .device import kernels_supported

_HERE = Path(__file__).resolve().parent
TWELL_SOURCES = [_HERE / "twell" / "binding.cpp", _HERE / "twell" / "runtime.cpp", _HERE / "twell" / "twell_kernels.cu",
                 _HERE / "twell" / "d2t_gemm.cu", _HERE / "common" / "backup_rows.cu", _HERE / "common" / "slices.cu"]
_LOCK = threading.Lock()
_CACHE: dict[str, ModuleType] = {}

REFERENCE_HINT = ("the pure-PyTorch path sfl.kernels.reference (gated_ffn_twell / nongated_ffn_twell) "
                  "or mlp_impl='reference'/'dense' works on any device")


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
        return load(name=name, sources=[str(p) for p in sources], extra_cflags=["-O3", f"-D{define}"],
                    extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"], extra_include_paths=extra_inc,
                    build_directory=str(build_dir), verbose=verbose)
    except Exception as e:  # compiler missing/broken: say so, never exit
        raise KernelUnavailableError(f"building {what} failed: {e}; " + hint) from e
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch


def load_twell(verbose: bool = False) -> ModuleType:
    """Build (once per source version) and return the TwELL extension module."""
    mod = _CACHE.get("twell")
    if mod is not None:  # every call after the first: no lock (the fused dense path asks on each call)
        return mod
    with _LOCK:
        if "twell" in _CACHE:
            return _CACHE["twell"]
        if not torch.cuda.is_available():
            raise KernelUnavailableError(
                "the TwELL CUDA kernels need a CUDA GPU (torch.cuda.is_available() is False); " + REFERENCE_HINT)
        require_supported_gpu(REFERENCE_HINT)
        src_hash = source_hash()
        arch = _arch_for_device()
        tag = hashlib.sha1(f"{src_hash}-{arch}-{torch.__version__}".encode()).hexdigest()[:10]
        name = f"sfl_twell_{tag}"
        pre = os.environ.get("TWELL_PREBUILT")
        if pre:
            if not os.path.isfile(pre):
                raise KernelUnavailableError(f"TWELL_PREBUILT={pre} does not exist; unset it to JIT-build")
            try:
                mod = _load_prebuilt(pre, Path(pre).stem.split(".")[0])
                if mod.source_hash() == src_hash:
                    _CACHE["twell"] = mod
                    return mod
                warnings.warn(f"TWELL_PREBUILT={pre} was built from other sources "
                              f"({mod.source_hash()} != {src_hash}); rebuilding", stacklevel=2)
            except ImportError as e:  # built for another python/torch
                warnings.warn(f"TWELL_PREBUILT={pre} cannot be imported ({e}); rebuilding", stacklevel=2)
        mod = build_extension(name, TWELL_SOURCES, arch, define=f"TWELL_SRC_HASH={src_hash}",
                              what="the TwELL extension", hint=REFERENCE_HINT, verbose=verbose)
        _CACHE["twell"] = mod
        return mod
