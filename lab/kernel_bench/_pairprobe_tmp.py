import torch, sys
sys.path.insert(0, '.')
from sfl.experiments.kernel_bench.bench_inference import BF, DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.kernels.loader import load_twell
ext = load_twell(); timer = Timer()
K, N, S, M = 2048, 5632, 32, 65536
wg32, wu32, wd32 = make_weights(K, N)
x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=1)
T = N // 256
packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32); counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
flag = torch.zeros(M, device=DEV, dtype=torch.int32)
ext.d2t_gemm(x, wg, packed, counts, flag, False, 0, 2); torch.cuda.synchronize()
print("grid info", ext.d2t_grid_info())
fns = {"cl1": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0, 1),
       "cl2": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0, 2)}
for c in (96, 112, 120, 128, 132):
    fns[f"cl1_{c}"] = (lambda c=c: ext.d2t_gemm(x, wg, packed, counts, flag, False, c, 1))
    fns[f"cl2_{c}"] = (lambda c=c: ext.d2t_gemm(x, wg, packed, counts, flag, False, c, 2))
ms = rotate(timer, fns, 9)
print({k: round(v, 3) for k, v in ms.items()})
