"""Sparse training op for the ReLU FFN block: torch.library custom ops (with fake impls) for the forward and
the backward, two backends, and the extension loader.

Ops (namespace ``sfl_train``):
- ``ffn_fwd(x, w_gate?, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last, backend)
      -> (y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last)``
- ``ffn_bwd(dy, gl1, x, w_gate?, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, scale,
            dw_nb, backup_cap, backend) -> (dx, dw_gate, dw_up, dw_down)``  (dw_gate is empty for the non-gated block)

What the forward keeps for the backward is the Hybrid form of a = relu(gate) (FORMAT.md): ELL rows of `width`
slots (the caller picks it, kernels/train_ffn.py from the layer's history), plus ell_u = x . W_u[j] (fp32, gated
only) for every stored entry. A row is a backup row (`flag`) when nnz > width (Hybrid rule) or when its gate
pre-activation has a non-finite value (so NaN/Inf propagate as in dense). Backup rows have no capacity: however
many, all are computed exactly with dense math. Nothing is ever dropped.

No host synchronisation on the "cuda" backend: every output shape is known before the call, forward and backward, so
a training step can be captured in a CUDA graph. The first `backup_cap` backup rows (the caller's estimate) take dense
cuBLAS math on a gathered block, any beyond it exact dense kernels on CUDA cores (dense_rows_fwd, dense_rows_bwd);
the backward recomputes those rows' activations from x (the forward keeps no [R, N] tensor; "cuda" returns
backup_rows and backup empty) and takes the same block size. `last` (want_last): per neuron the last row where it fired, the model's dead-neuron tracker, computed inside.
`host`: int64 [4] on the CPU (pinned on "cuda", final once count_event(host) has completed): the backup-row count,
then against `measure_width` (the configured width, >= width) the widest light row, the light rows' non-zeros and
the other rows: the dispatch's measurement, with no reduction of its own.

Backends: "cuda" = the kernels of train_kernels.cu (bf16, CUDA) + cuBLAS for the gate GEMM and backup rows, each
half one or two calls into the extension (binding.cpp: ffn_fwd_gate + ffn_fwd_rows, ffn_bwd; from Python the glue
was ~30 torch calls per half); "torch" = the pure-PyTorch reference itself (kernels/reference.py:
train_ffn_forward / train_ffn_backward; any device and dtype; the CPU tests and a slow fallback; its backup_rows
and backup are the Hybrid's, exact). The dense-row math (backup rows, forward and backward) is the reference's
dense_rows_forward / dense_rows_backward, whose ATen ops binding.cpp runs one for one; the CSR-by-neuron transpose
is the reference's csr_by_neuron on "torch" and counting-sort kernels on "cuda", GPU-tested to give the same perm
and colptr (the reference's sort where the kernel's shared memory does not fit).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import reference as ref
from ..device import kernels_supported
from ..loader import load_train
from ..reference import Hybrid, _acc_dtype

# ----------------------------------------------------------------------------------------------- loader
load_ext = load_train  # the training extension, through the one loader (kernels/loader.py)


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
    unused: the backup rows are exact here, computed on the host's knowledge)."""
    y, l1, saved = ref.train_ffn_forward(x, w_gate, w_up, w_down, width, scale)
    hy = saved.hy
    flag = hy.backup_mask().to(torch.int32)
    host = host_summary(hy.nnz, flag, width, measure_width)
    last = _last_active_reference(hy, x.device) if want_last else torch.empty(0, dtype=torch.int64, device=x.device)
    return y, l1, hy.ell_col, hy.ell_val, saved.ell_u, hy.nnz, flag, hy.backup_rows, hy.backup, host, last


def host_summary(nnz: Tensor, flag: Tensor, width: int, measure_width: int) -> Tensor:
    """The compact kernel's summary computed by torch (CPU int64 [4]): backup rows, and against measure_width the
    widest light row, the light rows' non-zeros and the other rows (a non-finite row is never light)."""
    nonfinite = (flag != 0) & (nnz <= width)
    light = ~((nnz > max(width, measure_width)) | nonfinite)
    lit = nnz[light].to(torch.int64)
    return torch.tensor([int((flag != 0).sum()), int(lit.max()) if lit.numel() else 0, int(lit.sum()),
                         int((~light).sum())], dtype=torch.int64)


def count_event(host: Tensor) -> "torch.cuda.Event | None":
    """The event after which the forward's pinned summary `host` holds its values (None: already final; the torch
    backend's summary is a plain CPU tensor, whose address no pinned buffer shares)."""
    return _COUNT_READY.get(host.data_ptr())


# The backward sizes its partial sums by the forward's count of light entries when that count is on the host. The
# forward copies its summary to pinned memory and records an event; the backward, which runs much later, waits on
# that event (complete by then: no stall) instead of a stream synchronisation, which would drain everything queued
# before it. Keyed by the pinned buffer's address (a freed buffer's key is overwritten when the allocator hands the
# address out again). While a CUDA graph is captured nothing is read: the backward takes the capacity, M x W.
_COUNT_READY: dict[int, torch.cuda.Event] = {}


def _light_entries(host: Tensor) -> int:
    """The forward's bound on the light entries (its summary), or -1 (the capacity) while capturing."""
    ev = _COUNT_READY.pop(host.data_ptr(), None)  # is_pinned() only when no event is known: it costs host time
    if torch.cuda.is_current_stream_capturing():
        return -1
    if ev is not None:
        ev.synchronize()
    elif host.is_pinned():  # no event known for this buffer: wait for everything queued (exact, slower)
        torch.cuda.current_stream().synchronize()
    return int(host[2])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ffn_fwd_impl(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, width: int, measure_width: int,
                  scale: float, chunk_rows: int, backup_cap: int, want_last: bool, backend: str):
    """The forward. "cuda": two calls into the extension (binding.cpp), with no host sync:
    1. ffn_fwd_gate: the gate GEMM (cuBLAS, in chunks of chunk_rows rows into one reused scratch) and `compact` per
       chunk: ELL, nnz, flag and the device summary, copied to pinned memory (`host`, final once the event recorded
       right after has completed: the backward's backup-row count and the dispatch's measurement; nothing waits for
       it here, and the backward's launches wait only for this part of the forward);
    2. ffn_fwd_rows: the light rows, fwd_block (u, h = a u, the L1 row sums) and dx_slices over W_d^T (y,
       slice-major); the tracker (want_last); the flagged rows, exactly: the first backup_cap (the layer's history)
       by cuBLAS on a gathered block (reference.dense_rows_forward's ops), any others by dense_rows_fwd on CUDA cores
       (with no block, its CTAs find the flagged rows themselves); l1 = the row sums' sum x scale."""
    if backend != "cuda":
        return _ffn_fwd_torch(x, w_gate, w_up, w_down, width, measure_width, scale, want_last)
    ext = load_ext()
    capturing = torch.cuda.is_current_stream_capturing()  # a captured forward's summary is read by no one
    ell_col, ell_a, nnz, flag, summary, host = ext.ffn_fwd_gate(w_up if w_gate is None else w_gate, x, width,
                                                                max(width, measure_width), max(1, int(chunk_rows)),
                                                                not capturing)
    if not capturing:
        ready = torch.cuda.Event()
        ready.record()
        _COUNT_READY[host.data_ptr()] = ready
    y, l1, ell_u, backup_rows, backup, last = ext.ffn_fwd_rows(w_gate, x, w_up, w_down, ell_col, ell_a, nnz, flag,
                                                              summary, scale, int(backup_cap), want_last,
                                                              _sm_count(x.device))
    return y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last


@torch.library.custom_op("sfl_train::ffn_fwd", mutates_args=())
def ffn_fwd(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, width: int, measure_width: int,
            scale: float, chunk_rows: int, backup_cap: int, want_last: bool, backend: str
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _ffn_fwd_impl(x, w_gate, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last,
                         backend)


@ffn_fwd.register_fake
def _(x, w_gate, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last, backend):
    M, K = x.shape
    N = w_up.shape[0]
    gated = w_gate is not None
    acc = _acc_dtype(x.dtype)
    # cuda: every shape is known before the call (no host sync inside); torch: the backup rows are data-dependent
    R = torch.library.get_ctx().new_dynamic_size() if backend == "torch" else 0
    return (x.new_empty(M, K), x.new_empty((), dtype=acc if backend == "torch" else torch.float32),
            x.new_empty(M, width, dtype=torch.int32), x.new_empty(M, width),
            x.new_empty(M if gated else 0, width if gated else 0, dtype=acc if backend == "torch" else torch.float32),
            x.new_empty(M, dtype=torch.int32), x.new_empty(M, dtype=torch.int32), x.new_empty(R, dtype=torch.int64),
            x.new_empty(R, N), torch.empty(4, dtype=torch.int64, device="cpu"),
            x.new_empty(N if want_last else 0, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------- backward
def dw_chunks(rows: int) -> int:
    """dw's 16-byte chunks per lane per K slice (nb) for `rows` tokens: the widest K slice whose gathered working
    set (rows x 256 nb bf16 of x or of dy; dw walks one slice at a time) stays within 16 MiB of L2. Measured at
    M 16384 / 65536, 0.5%: nb 2 / 1 fastest, 0.54 / 2.53 ms against 0.56 / 3.66 ms one step wider."""
    for nb in (8, 4, 2):
        if rows * 256 * nb * 2 <= 16 << 20:
            return nb
    return 1


def _ffn_bwd_impl(dy: Tensor, gl1: Tensor, x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor,
                  ell_col: Tensor, ell_a: Tensor, ell_u: Tensor, nnz: Tensor, flag: Tensor, backup_rows: Tensor,
                  backup: Tensor, host: Tensor, scale: float, dw_nb: int, backup_cap: int, backend: str):
    gated = w_gate is not None
    M, K = x.shape
    N = w_up.shape[0]
    if backend != "cuda":  # the reference backward (dW_d comes back in nn.Linear layout [K, N])
        hy = saved_hybrid(ell_col, ell_a, nnz, backup_rows, backup, N)
        dx, dwg, dwu, dwd = ref.train_ffn_backward(dy, gl1, x, w_gate, w_up, w_down, ref.TrainSaved(hy, ell_u),
                                                   scale)
        return dx, (dwg if gated else x.new_empty(0, K)), dwu, dwd
    # "cuda": one call into the extension (binding.cpp, ffn_bwd) that reads nothing on the host: the first backup_cap
    # flagged rows (the forward's block) by dense autograd's ops (reference.dense_rows_backward's, their activations
    # recomputed from x: no [R, N] tensor was kept), any past them by dense_rows_bwd on CUDA cores, the CSR by neuron,
    # dwd_dh (dW_dT and the light entries' dh dot products, over dy slices), dh_coef (their coefficients), dx
    # (dx_slices), dw's part 0 (dW_g, dW_u; the weight-gradient addends included) and the W_d gradient's transpose
    ext = load_ext()
    entries = _light_entries(host)
    perm = colptr = None
    if not ext.csr_supported(N, ell_col.shape[1]):  # the counting sort's shared memory does not fit: torch's sort
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"a captured backward needs the CSR kernel, which does not fit N={N} at ELL width "
                             f"{ell_col.shape[1]}: lower KernelConfig.train_width, or run this step eagerly")
        rows = torch.nonzero(flag).squeeze(1)
        perm, colptr = ref.csr_by_neuron(saved_hybrid(ell_col, ell_a, nnz, rows, x.new_empty(rows.numel(), N), N))
    dx, dwg, dwu, dwd = ext.ffn_bwd(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag,
                                    int(backup_cap), entries, scale, int(dw_nb) or dw_chunks(M), _sm_count(x.device),
                                    perm, colptr)
    return dx, dwg, dwu, dwd


@torch.library.custom_op("sfl_train::ffn_bwd", mutates_args=())
def ffn_bwd(dy: Tensor, gl1: Tensor, x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor,
            ell_col: Tensor, ell_a: Tensor, ell_u: Tensor, nnz: Tensor, flag: Tensor, backup_rows: Tensor,
            backup: Tensor, host: Tensor, scale: float, dw_nb: int, backup_cap: int, backend: str
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_gate [N, K] (empty if non-gated), dw_up [N, K], dw_down [K, N]): nn.Linear layouts."""
    return _ffn_bwd_impl(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup,
                         host, scale, dw_nb, backup_cap, backend)


@ffn_bwd.register_fake
def _(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, scale, dw_nb,
      backup_cap, backend):
    M, K = x.shape
    N = w_up.shape[0]
    return (x.new_empty(M, K), x.new_empty(N if w_gate is not None else 0, K), x.new_empty(N, K),
            x.new_empty(K, N))


__all__ = ["ffn_fwd", "ffn_bwd", "load_ext", "cuda_backend_supported", "saved_hybrid"]
