"""CPU reproduction: an out-of-memory error raised inside the sparse op's backward under non-reentrant activation
checkpointing leaves every checkpointed layer's input alive, held from C++ (no Python referrer; gc does not help).
The same failure inside a dense op's recompute frees everything. `python lab/speed/ckpt_oom_leak_repro.py sparse`
prints "live: 3" (one per layer), `... dense` prints "live: 0". On the H100 the same happened for real
(logs/ckpt_memory_check_oom_h100.txt: 10 GiB kept after a sparse step at 80 x 2048 ran out of memory), which is why
train_throughput's largest-micro-batch timing with checkpointing fails after the sparse side's search. Compare
pytorch/pytorch#161186 (custom Function + checkpoint early stop) and #82218 (OOM in backward leaks)."""
import gc, torch, sys, types
from sfl.experiments.speed.train_throughput import Trainer
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM
import sfl.kernels.train_ffn as tf
torch.manual_seed(0)
m = SparseLlamaForCausalLM(SparseLlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
m.train(); m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
tr = Trainer(m, torch.randint(0, 64, (8, 33)), torch.device("cpu"))
def boom_b(ctx, *g):
    raise torch.OutOfMemoryError("fake")
if sys.argv[1] == "sparse":
    tf._SparseFFN.backward = staticmethod(boom_b)
    side = "sparse forced"
else:
    side = "dense L1=0"
    import torch.nn.functional as F
    orig = F.linear
    n = {"k": 0}
    # fail inside the backward recompute: the first linear called while autograd runs backward
    def lin(*a, **k):
        if torch._C._current_graph_task_id() != -1:
            raise torch.OutOfMemoryError("fake")
        return orig(*a, **k)
    F.linear = lin
print("fits:", tr.fits(side, 8))
def chain(obj, depth, seen, pad=""):
    if depth == 0: return
    for r in gc.get_referrers(obj):
        if id(r) in seen or isinstance(r, types.FrameType) and r.f_code.co_name == "chain": continue
        if r is globals(): continue
        seen.add(id(r))
        desc = type(r).__name__
        if isinstance(r, types.FrameType): desc += f" {r.f_code.co_name} {r.f_code.co_filename}:{r.f_lineno}"
        elif isinstance(r, dict): desc += f" keys {list(r)[:6]}"
        elif isinstance(r, (list, tuple)): desc += f" len {len(r)}"
        elif hasattr(r, "__qualname__"): desc += f" {r.__qualname__}"
        else: desc += " " + repr(r)[:120].replace("\n", " ")
        print(pad + desc)
        chain(r, depth - 1, seen, pad + "  ")
def find():
    gc.collect()
    ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 3 and o.shape[0] == 8 and o.shape[-1] == 48]
    print("live:", len(ts))
    if ts:
        t = ts[0]; del ts
        chain(t, 6, set())
find()
