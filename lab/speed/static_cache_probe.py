"""Which compiled static-cache generate() runs fail with cuDNN's STREAM_MISMATCH (torch 2.11)? Each case in a fresh
process, then the test's order in one process: python lab/speed/static_cache_probe.py [CASE...]"""
import subprocess
import sys

import torch

sys.path.insert(0, "tests")


def one(impl: str, mode: str, batch: int) -> str:
    import torch._dynamo
    from test_model_cuda import VOCAB, small_model

    model = small_model(impl, mode)
    prompt = torch.randint(1, VOCAB, (batch, 12), device="cuda")
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            for _ in range(3):
                model.generate(prompt, **kw)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch._dynamo.reset()


if __name__ == "__main__":
    cases = sys.argv[1:]
    if cases:
        for c in cases:
            impl, mode, b = c.split(":")
            print(c, one(impl, mode, int(b)), flush=True)
    else:
        for c in ("dense:auto:1", "cuda:auto:1", "cuda:sparse:1", "cuda:dense:1"):
            subprocess.run([sys.executable, __file__, c])
        print("-- the test's order in one process", flush=True)
        subprocess.run([sys.executable, __file__, "cuda:sparse:1", "cuda:sparse:3", "cuda:auto:1", "dense:auto:1"])
