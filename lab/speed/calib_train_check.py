"""Does the paper-shape calibration (bench.calibrate_paper_model) hold in training mode on the GPU? Per layer mean
non-zeros per token and the fraction of rows above the ELL width (128), measured by the model's dense MLP (plain
torch ops) in: bf16 eval, fp32+autocast eval, fp32+autocast train (grad); then the training op's own counts."""
import sys
import torch
from sfl.experiments.speed.bench import build_paper_model, calibrate_paper_model, paper_profile
from sfl.experiments.speed.train_throughput import Trainer, ffn_dispatch

L = int(sys.argv[1]) if len(sys.argv) > 1 else 8
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 2
dev = torch.device("cuda")
m = build_paper_model(L, dev, torch.bfloat16)
g = torch.Generator().manual_seed(0)
V = m.config.vocab_size
heavy = torch.randperm(V, generator=g)[: V // 100]
ids = torch.randint(0, V, (mb, 2049), generator=g).to(dev)
ach = calibrate_paper_model(m, paper_profile(L, 39.0 if L == 8 else 29.0), ids[:, :-1], heavy_ids=heavy)
print("calibrated", [round(a, 1) for a in ach])
rows = {}
F = torch.nn.functional
@torch.no_grad()
def hook(mod, inp, out):
    """(mean nnz, % rows > 128, input dtype, mean x[:,0], rel. error of the layer's output against fp32 math on
    the bf16-rounded input and weights)"""
    x = inp[0].reshape(-1, inp[0].shape[-1]).to(torch.bfloat16).float()
    w = [t.weight.to(torch.bfloat16).float() for t in (mod.gate_proj, mod.up_proj, mod.down_proj)]
    a = torch.relu(F.linear(x, w[0]))
    n = (a != 0).sum(1)
    ref = F.linear(a * F.linear(x, w[1]), w[2])
    err = ((out.reshape(ref.shape).float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    rows[mod.layer_idx] = (round(n.float().mean().item(), 1), round((n > 128).float().mean().item() * 100, 2),
                           str(inp[0].dtype)[6:], round(x[:, 0].mean().item(), 2), f"{err:.1e}")
hs = [mlp.register_forward_hook(hook) for mlp in m.sparse_mlps()]
def show(tag):
    print(tag, [rows[i] for i in sorted(rows)], flush=True); rows.clear()
with torch.no_grad():
    m.eval(); m(input_ids=ids[:, :-1]); show("bf16 eval")
    m.float()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(input_ids=ids[:, :-1]); show("fp32+autocast eval")
        m.train(); m(input_ids=ids[:, :-1]); show("fp32+autocast train no_grad")
m.train()
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = m(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], l1_coeff=2e-5)
show("fp32+autocast train grad l1")
out.loss.backward(); m.zero_grad(set_to_none=True)
tr = Trainer(m, ids, dev)
for side in ("dense L1=0", "dense L1", "sparse", "sparse", "sparse forced", "sparse forced"):
    tr.step(side, mb)
    show("trainer step " + side)
    print("  dispatch", [(d["path"][0], d["activity"] and round(d["activity"] * 100, 3), d["backup_frac"] and round(d["backup_frac"] * 100, 2), d["backup_rows"]) for d in ffn_dispatch(m)], flush=True)
for h in hs: h.remove()
