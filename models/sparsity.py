"""L1 penalty and activation-sparsity statistics (pure functions, shared by the model and tests).

Conventions (project convention): for a token matrix x [M, K] the MLP activation is a = relu(x Wg^T)
(non-gated: relu(x Wu^T)); an entry is *active* iff a != 0, and NaN counts as active. The L1
penalty is taken on h, the tensor fed into down_proj (gated: a * (x Wu^T); non-gated: h = a).
"""
from __future__ import annotations

import torch


def l1_penalty(h: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """One layer's L1 term of paper Eq. 2, as a 0-dim fp32 tensor.

    reduction="mean": mean |h| over tokens x neurons, (1/(M N)) sum_{m,n} |h[m, n]| (paper Eq. 2).
    reduction="sum":  sum over neurons, mean over tokens, (1/M) sum_{m,n} |h[m, n]| (the official
                      code); exactly N = h.shape[-1] times the "mean" value.
    The model averages this over layers and multiplies by l1_coeff.
    """
    h2 = h.reshape(-1, h.shape[-1])
    # fp32 accumulation: bf16 sums over ~10^7 entries lose most of their digits.
    total = h2.abs().sum(dtype=torch.float32)
    if reduction == "mean":
        return total / h2.numel()
    if reduction == "sum":
        return total / h2.shape[0]
    raise ValueError(f"l1 reduction must be 'mean' or 'sum', got {reduction!r}")


def active_mask(a: torch.Tensor) -> torch.Tensor:
    """Bool mask of active entries (a != 0; NaN != 0 is True, so NaN counts as active)."""
    return a != 0


def nnz_per_token(a: torch.Tensor) -> torch.Tensor:
    """Float32 [M]: number of active neurons of every token row of a [..., N] (flattened)."""
    return active_mask(a.reshape(-1, a.shape[-1])).sum(dim=-1, dtype=torch.int32).float()


@torch.no_grad()
def update_tokens_since_fire(tokens_since_fire: torch.Tensor, active: torch.Tensor) -> None:
    """Advance the per-neuron 'tokens since last firing' counters in place over a block of tokens.

    tokens_since_fire: int64 [N]; active: bool [M, N] in token order. A neuron that fired at row m
    of this block ends with M - 1 - m (its last firing); one that did not fire gains M. So a value
    of 0 means "fired on the most recent token", and a neuron is dead for a window W iff its
    counter is >= W (it fired in none of the last W tokens).
    """
    m = active.shape[0]
    fired = active.any(dim=0)
    # argmax over the row-reversed mask gives the distance of the last firing from the end
    # (first maximum wins); uint8 keeps the temporary at one byte per entry.
    since_last = active.flip(0).to(torch.uint8).argmax(dim=0).to(tokens_since_fire.dtype)
    tokens_since_fire.copy_(torch.where(fired, since_last, tokens_since_fire + m))


def dead_fraction(tokens_since_fire: torch.Tensor, window: int) -> torch.Tensor:
    """Fraction of neurons (0-dim fp32) that have not fired in the last `window` tokens."""
    return (tokens_since_fire >= window).float().mean()


@torch.no_grad()
def reinit_dead_rows(weight: torch.Tensor, tokens_since_fire: torch.Tensor, window: int, lam: float, std: float,
                     generator: torch.Generator) -> int:
    """Paper Eq. 6: w_j <- (1 - lam) w_j + lam * N(0, std^2) for every dead neuron j; returns their number.

    weight is the activation's input projection in nn.Linear layout [N, K] (gate_proj, or up_proj for a
    non-gated FFN), so neuron j is row j. Dead = not fired within the last `window` tokens. The noise is drawn
    on the CPU from `generator` so that a resumed run draws exactly the same numbers.
    """
    dead = (tokens_since_fire >= window).nonzero().flatten()
    if dead.numel() == 0:
        return 0
    noise = torch.randn((dead.numel(), weight.shape[1]), generator=generator, dtype=torch.float32)
    rows = weight.index_select(0, dead).float()
    new = (1.0 - lam) * rows + lam * std * noise.to(weight.device)
    weight.index_copy_(0, dead, new.to(weight.dtype))
    return int(dead.numel())


__all__ = ["l1_penalty", "active_mask", "nnz_per_token", "update_tokens_since_fire", "dead_fraction",
           "reinit_dead_rows"]
