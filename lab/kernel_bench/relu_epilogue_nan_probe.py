import torch, torch.nn.functional as F
torch.manual_seed(0)
for M,K,N in ((16384,2048,8192),(3000,2048,8192),(64,2048,5632),(1,2048,8192)):
    x=torch.randn(M,K,device='cuda',dtype=torch.bfloat16); w=torch.randn(N,K,device='cuda',dtype=torch.bfloat16)/45
    x[0,5]=float('nan')
    if M>2: x[1,7]=float('inf'); x[2,:]=3e38
    z=torch.zeros(N,device='cuda',dtype=torch.bfloat16)
    hf=F.relu(F.linear(x,w)); ep=torch._addmm_activation(z,x,w.t())
    print(M, "nan rows hf/ep", torch.isnan(hf).any(1)[:3].tolist(), torch.isnan(ep).any(1)[:3].tolist(),
          "isfinite equal", torch.equal(torch.isfinite(hf),torch.isfinite(ep)),
          "finite-row bits equal", torch.equal(hf[3:],ep[3:]) if M>3 else torch.equal(hf[1:],ep[1:]),
          "nan count", torch.isnan(hf).sum().item(), torch.isnan(ep).sum().item())
