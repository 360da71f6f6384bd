"""Run by tests/test_distributed.py under torchrun on CUDA GPUs: evaluation of an FSDP2 model through the CUDA
inference op (forced sparse) gives the unsharded model's logits, before and after an optimizer step changes the
weights (FSDP2 refills gathered weights in place; the op's per-weight caches must not serve the old ones)."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sfl.experiments.trainer.distributed import eval_path
from sfl.kernels.config import KernelConfig
from sfl.kernels.layout import make_down_shardable_
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM


def build() -> SparseLlamaForCausalLM:
    torch.manual_seed(0)
    cfg = SparseLlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                            tie_word_embeddings=True, mlp_impl="cuda")
    model = SparseLlamaForCausalLM(cfg)
    model.set_kernel_config(KernelConfig(mode="sparse"))
    return model.cuda()


def sparse_calls(model: SparseLlamaForCausalLM) -> int:
    return sum(int(m.plan.info().get("sparse_calls", 0)) for m in model.sparse_mlps())


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    plain = build()
    sharded = copy.deepcopy(plain)
    for m in sharded.sparse_mlps():
        m.refresh_plan()  # a plan of its own (deepcopy shares the plan object)
    make_down_shardable_(sharded.sparse_mlps())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    report = {"world": dist.get_world_size(), "checks": []}
    for step in range(2):
        plain.eval(), sharded.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            want = plain(input_ids=ids).logits.float()
            before = sparse_calls(sharded)
            with eval_path(sharded):
                got = sharded(input_ids=ids).logits.float()
            calls = sparse_calls(sharded) - before
        err = float((got - want).norm() / want.norm())
        report["checks"].append({"step": step, "rel_err": err, "sparse_calls": calls})
        # the same update on both (FSDP2 writes its shards in place): every weight + 1e-2 * a fixed sign pattern
        sharded.reshard()  # the root keeps its gathered parameters after a forward: back to the shards
        with torch.no_grad():
            plain_params = dict(plain.named_parameters())
            for name, q in sharded.named_parameters():
                transposed = name.endswith(".weight_t")  # the shardable W_d: [N, K], the plain model's [K, N]
                p = plain_params[name[:-2] if transposed else name]
                n = torch.arange(p.numel(), device=p.device, dtype=torch.float32)
                delta = (1e-2 * torch.sign(torch.sin(n))).view(p.shape).to(p.dtype)
                p.add_(delta)
                full = delta.t().contiguous() if transposed else delta
                local = q.to_local()
                start = dist.get_rank() * -(-q.shape[0] // dist.get_world_size())  # FSDP2's dim-0 chunks
                local.add_(full[start:start + local.shape[0]])
    if rank == 0:
        print("FSDP_EVAL " + json.dumps(report))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
