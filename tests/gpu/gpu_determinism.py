"""Is the bf16 attention backward run-to-run reproducible on this GPU? (tests/gpu/gpu_check.sh)

For the attention shapes of gpt-tiny and gpt-small, each of LibTorch's fused attention
backends (and the default choice) runs the same causal forward and backward REPEATS times
while another stream keeps the GPU busy (as the other stage actors of a one-process job
do), with torch.use_deterministic_algorithms off and then on (strict, what Troupe's
`deterministic = true` sets). It prints, per case, how many repeats gave other gradient
bits than the first.

Exits 1 when the default backend is not reproducible with deterministic algorithms on
(what `deterministic = true` promises), 0 otherwise; 77 without a GPU.

    gpu_determinism.py [REPEATS]
"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    print("gpu_determinism: no GPU", file=sys.stderr)
    sys.exit(77)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 12
shapes = {"gpt-tiny": (2, 4, 128, 32), "gpt-small": (4, 12, 1024, 64)}  # micro-batch, heads, seq, head dim
backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def grads(q, k, v, g, backend):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    return [t.grad.clone() for t in (q, k, v)]


def differing(shape, backend):
    """Repeats whose dq, dk or dv differ from the first run's bits (None: no such kernel)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    load = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    try:
        first = grads(q, k, v, g, backend)
    except RuntimeError as e:
        return None, str(e).splitlines()[0][:100]
    n = 0
    for _ in range(repeats):
        with torch.cuda.stream(load):  # the other stages' work, at the same time
            for _ in range(4):
                a = (a @ a).tanh_()
        got = grads(q, k, v, g, backend)
        n += any(not torch.equal(x, y) for x, y in zip(first, got))
    torch.cuda.synchronize()
    return n, ""


failed = False
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: bf16 causal attention backward, "
      f"{repeats} repeats against the first, another stream busy")
print(f"{'shape':10} {'backend':10} {'deterministic':13} differing repeats")
for name, shape in shapes.items():
    for strict in (False, True):
        torch.use_deterministic_algorithms(strict)
        for bname, backend in backends.items():
            n, why = differing(shape, backend)
            print(f"{name:10} {bname:10} {str(strict).lower():13} " + (f"{n} of {repeats}" if n is not None else f"- ({why})"))
            if strict and bname == "default" and n:
                failed = True
torch.use_deterministic_algorithms(False)
if failed:
    print("FAIL: the default attention backward is not reproducible with deterministic algorithms on")
sys.exit(1 if failed else 0)
