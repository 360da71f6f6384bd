"""Sparse training op for the ReLU FFN block: the forward and the backward as registered ops (schemas and fakes
here, CUDA implementations in binding.cpp, as the inference op's are in runtime.cpp), two backends, the loader.

    ffn_fwd(x, w_gate?, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last, backend)
        -> (y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last)
    ffn_bwd(dy, gl1, x, w_gate?, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, scale,
            dw_nb, backup_cap, backend) -> (dx, dw_gate, dw_up, dw_down)   (dw_gate is empty for the non-gated block)

"cuda" runs the ops sfl_train::ffn_fwd / ffn_bwd (the same arguments without backend; ffn_bwd without backup_rows
and backup), one C++ call per half: torch.compile traces the registered ops; eager calls their C++ functions
directly (through the dispatcher the forward took ~0.14 ms more host time per call, lab/HISTORY.md section 9);
"torch" runs the reference.

What the forward keeps for the backward is the Hybrid form of a = relu(gate) (FORMAT.md): ELL rows of `width`
slots (the caller picks it, kernels/train_ffn.py from the layer's history), plus ell_u = x . W_u[j] (fp32, gated
only) for every stored entry. A row is a backup row (`flag`) when nnz > width (Hybrid rule) or when its gate
pre-activation has a non-finite value (so NaN/Inf propagate as in dense). Backup rows have no capacity: however
many, all are computed exactly with dense math. Nothing is ever dropped.

No host synchronisation on the "cuda" backend: every output shape is known before the call, forward and backward, so
a training step can be captured in a CUDA graph. The first `backup_cap` backup rows (the caller's estimate) take dense
cuBLAS math on a gathered block, any beyond it exact dense kernels on CUDA cores (dense_rows_fwd, dense_rows_bwd);
the backward recomputes those rows' activations from x (the forward keeps no [R, N] tensor; "cuda" returns
backup_rows and backup empty) and takes the same block size. `last` (want_last): per neuron the last row where it
fired, the model's dead-neuron tracker, computed inside.
`host`: int64 [4] on the CPU (on "cuda" pinned, final once the work queued before the op returned is done): the
backup-row count, then against `measure_width` (the configured width, >= width) the widest light row, the light
rows' non-zeros and the other rows: the dispatch's measurement, with no reduction of its own.

Backends: "cuda" = the kernels of train_kernels.cu (bf16, CUDA) + cuBLAS for the gate GEMM and backup rows, each
half one op (binding.cpp: ffn_fwd_op runs ffn_fwd_gate + ffn_fwd_rows, ffn_bwd_op runs ffn_bwd; from Python the
glue was ~30 torch calls per half); "torch" = the pure-PyTorch reference itself (kernels/reference.py:
train_ffn_forward / train_ffn_backward; any device and dtype; the CPU tests and a slow fallback; its backup_rows
and backup are the Hybrid's, exact). The dense-row math (backup rows, forward and backward) is the reference's
dense_rows_forward / dense_rows_backward, whose ATen ops binding.cpp runs one for one; the CSR-by-neuron transpose
is the reference's csr_by_neuron on "torch" and counting-sort kernels on "cuda", GPU-tested to give the same perm
and colptr (the reference's sort where the kernel's shared memory does not fit).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import reference as ref
from ..device import kernels_supported
from ..loader import load_train
from ..reference import Hybrid

# ----------------------------------------------------------------------------------------------- loader
load_ext = load_train  # the training extension, through the one loader (kernels/loader.py)

# The ops' schemas (their CUDA implementations register when the extension loads: binding.cpp, as runtime.cpp does
# for the inference op) and, below, their fake implementations for torch.compile.
_lib = torch.library.Library("sfl_train", "DEF")
_lib.define("ffn_fwd(Tensor x, Tensor? w_gate, Tensor w_up, Tensor w_down, int width, int measure_width, "
            "float scale, int chunk_rows, int backup_cap, bool want_last) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("ffn_bwd(Tensor dy, Tensor gl1, Tensor x, Tensor? w_gate, Tensor w_up, Tensor w_down, Tensor ell_col, "
            "Tensor ell_a, Tensor ell_u, Tensor nnz, Tensor flag, Tensor host, float scale, int dw_nb, "
            "int backup_cap) -> (Tensor, Tensor, Tensor, Tensor)")


def cuda_backend_supported(x: Tensor, w_up: Tensor) -> str | None:
    """None if the CUDA kernels take these inputs, else the reason (the caller falls back / errors)."""
    if x.device.type != "cuda":
        return f"x is on {x.device}"
    ok, why = kernels_supported(x.device)
    if not ok:
        return why
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype} (the kernels take bf16; use autocast or cast)"
    K, N = x.shape[-1], w_up.shape[0]
    if K % 8 != 0 or K > 3072:
        return f"K={K} (need K % 8 == 0 and K <= 3072)"
    if N % 8 != 0:
        return f"N={N} (need N % 8 == 0)"
    return None


# ----------------------------------------------------------------------------------------------- helpers
def saved_hybrid(ell_col: Tensor, ell_a: Tensor, nnz: Tensor, backup_rows: Tensor, backup: Tensor,
                 n_cols: int) -> Hybrid:
    """The op's saved tensors as the reference's Hybrid (no copy, no host sync). `flag` is its backup_mask()."""
    return Hybrid(ell_col, ell_a, nnz, backup_rows, backup, n_cols, ell_col.shape[1])


# ----------------------------------------------------------------------------------------------- forward
def _last_active_reference(hy: Hybrid, dev: torch.device) -> Tensor:
    """Per neuron the last row where a = relu(g) is active (-1 if none), from a Hybrid: the reference tracker."""
    r, s = hy.valid_mask().nonzero(as_tuple=True)
    last = torch.full((hy.n_cols,), -1, dtype=torch.int64, device=dev)
    last.scatter_reduce_(0, hy.ell_col[r, s].long(), r, reduce="amax")
    if hy.backup_rows.numel():
        last = torch.maximum(last, torch.where(hy.backup != 0, hy.backup_rows.unsqueeze(1), -1).amax(0))
    return last


def _ffn_fwd_torch(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, width: int, measure_width: int,
                   scale: float, want_last: bool):
    """The torch backend: the reference forward, its state unpacked into the op's tensors (chunk_rows, backup_cap
    unused: the backup rows are exact here, computed on the host's knowledge). The ELL kept for the backward is the
    narrowest that holds every light row of this call (the host knows their counts here; the "cuda" backend takes
    its width from the layer's history instead)."""
    y, l1, saved = ref.train_ffn_forward(x, w_gate, w_up, w_down, width, scale)
    hy = saved.hy
    flag = hy.backup_mask().to(torch.int32)
    host = host_summary(hy.nnz, flag, width, measure_width)
    last = _last_active_reference(hy, x.device) if want_last else torch.empty(0, dtype=torch.int64, device=x.device)
    light = hy.nnz[flag == 0]
    fit = max(1, int(light.max())) if light.numel() else 1
    ell_col, ell_val, ell_u = (t[:, :fit].contiguous() if t.dim() == 2 and t.shape[1] == width else t
                               for t in (hy.ell_col, hy.ell_val, saved.ell_u))
    return y, l1, ell_col, ell_val, ell_u, hy.nnz, flag, hy.backup_rows, hy.backup, host, last


def host_summary(nnz: Tensor, flag: Tensor, width: int, measure_width: int) -> Tensor:
    """The compact kernel's summary computed by torch (CPU int64 [4]): backup rows, and against measure_width the
    widest light row, the light rows' non-zeros and the other rows (a non-finite row is never light)."""
    nonfinite = (flag != 0) & (nnz <= width)
    light = ~((nnz > max(width, measure_width)) | nonfinite)
    lit = nnz[light].to(torch.int64)
    return torch.tensor([int((flag != 0).sum()), int(lit.max()) if lit.numel() else 0, int(lit.sum()),
                         int((~light).sum())], dtype=torch.int64)


@torch.compiler.disable
def _ffn_fwd_torch_eager(*args):
    return _ffn_fwd_torch(*args)


def ffn_fwd(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, width: int, measure_width: int,
            scale: float, chunk_rows: int, backup_cap: int, want_last: bool, backend: str):
    """The forward (its outputs: the module docstring). "cuda": the op sfl_train::ffn_fwd (binding.cpp,
    ffn_fwd_op), with no host sync:
    1. the gate GEMM (cuBLAS, in chunks of chunk_rows rows into one reused scratch) and `compact` per chunk: ELL, nnz,
       flag and the device summary, copied to pinned memory (`host`, final once the event recorded right after has
       completed: the backward's light-entry bound and the dispatch's measurement; nothing waits for it here, and the
       backward's launches wait only for this part of the forward; while a graph is captured, no copy and no event);
    2. the light rows, fwd_block (u, h = a u, the L1 row sums) and dx_slices over W_d^T (y, slice-major); the tracker
       (want_last); the flagged rows, exactly: the first backup_cap (the layer's history) by cuBLAS on a gathered
       block (reference.dense_rows_forward's ops), any others by dense_rows_fwd on CUDA cores (with no block, its
       CTAs find the flagged rows themselves); l1 = the row sums' sum x scale.
    "torch": the reference (eager under torch.compile: its backup rows are data-dependent)."""
    if backend != "cuda":
        return _ffn_fwd_torch_eager(x, w_gate, w_up, w_down, width, measure_width, scale, want_last)
    args = (x, w_gate, w_up, w_down, int(width), int(measure_width), float(scale), max(1, int(chunk_rows)),
            int(backup_cap), bool(want_last))
    if torch.compiler.is_compiling():  # traced through the fake (below), which loads the extension
        return torch.ops.sfl_train.ffn_fwd(*args)
    # eager: the op's C++ function itself, without the dispatcher's argument parsing and boxed autograd fallback
    return load_ext().ffn_fwd_op(*args)


@torch.library.register_fake("sfl_train::ffn_fwd")
def _(x, w_gate, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last):
    if kernels_supported()[0]:  # a model traced before its first eager call still finds the kernels at run time
        load_ext()
    M, K = x.shape
    N = w_up.shape[0]
    gated = w_gate is not None
    f32, i32 = torch.float32, torch.int32
    return (x.new_empty(M, K), x.new_empty((), dtype=f32), x.new_empty(M, width, dtype=i32), x.new_empty(M, width),
            x.new_empty(M if gated else 0, width if gated else 0, dtype=f32), x.new_empty(M, dtype=i32),
            x.new_empty(M, dtype=i32), x.new_empty(0, dtype=torch.int64), x.new_empty(0, N),
            torch.empty(4, dtype=torch.int64, device="cpu"), x.new_empty(N if want_last else 0, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------- backward
def dw_chunks(rows: int) -> int:
    """dw's 16-byte chunks per lane per K slice (nb) for `rows` tokens: the widest K slice whose gathered working
    set (rows x 256 nb bf16 of x or of dy; dw walks one slice at a time) stays within 16 MiB of L2. Measured at
    M 16384 / 65536, 0.5%: nb 2 / 1 fastest, 0.54 / 2.53 ms against 0.56 / 3.66 ms one step wider."""
    for nb in (8, 4, 2):
        if rows * 256 * nb * 2 <= 16 << 20:
            return nb
    return 1


@torch.compiler.disable
def _ffn_bwd_torch(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, backup_rows, backup, scale):
    """The reference backward (dW_d comes back in nn.Linear layout [K, N]); eager under torch.compile."""
    hy = saved_hybrid(ell_col, ell_a, nnz, backup_rows, backup, w_up.shape[0])
    dx, dwg, dwu, dwd = ref.train_ffn_backward(dy, gl1, x, w_gate, w_up, w_down, ref.TrainSaved(hy, ell_u), scale)
    return dx, (dwg if w_gate is not None else x.new_empty(0, x.shape[1])), dwu, dwd


def ffn_bwd(dy: Tensor, gl1: Tensor, x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor,
            ell_col: Tensor, ell_a: Tensor, ell_u: Tensor, nnz: Tensor, flag: Tensor, backup_rows: Tensor,
            backup: Tensor, host: Tensor, scale: float, dw_nb: int, backup_cap: int, backend: str
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_gate [N, K] (empty if non-gated), dw_up [N, K], dw_down [K, N]): nn.Linear layouts.

    "cuda": the op sfl_train::ffn_bwd (binding.cpp, ffn_bwd_op), which reads nothing on the host while a graph is
    captured: the first backup_cap flagged rows (the forward's block) by dense autograd's ops
    (reference.dense_rows_backward's, their activations recomputed from x: no [R, N] tensor was kept), any past them
    by dense_rows_bwd on CUDA cores, the CSR by neuron, dwd_dh (dW_dT and the light entries' dh dot products, over dy
    slices; their partial sums sized by the forward's summary once its event completed, by their capacity while
    capturing), dh_coef (their coefficients), dx (dx_slices), dw's part 0 (dW_g, dW_u; the weight-gradient addends
    included) and the W_d gradient's transpose."""
    if backend != "cuda":
        return _ffn_bwd_torch(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, backup_rows, backup, scale)
    args = (dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, host, float(scale),
            int(dw_nb) or dw_chunks(x.shape[0]), int(backup_cap))
    if torch.compiler.is_compiling():
        return torch.ops.sfl_train.ffn_bwd(*args)
    return load_ext().ffn_bwd_op(*args)   # eager: the op's C++ function itself, as for the forward


@torch.library.register_fake("sfl_train::ffn_bwd")
def _(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, host, scale, dw_nb, backup_cap):
    M, K = x.shape
    N = w_up.shape[0]
    return (x.new_empty(M, K), x.new_empty(N if w_gate is not None else 0, K), x.new_empty(N, K),
            x.new_empty(K, N))


__all__ = ["ffn_fwd", "ffn_bwd", "load_ext", "cuda_backend_supported", "saved_hybrid"]
