"""Does torch's sdpa under a dense mask read the right rows of it at long lengths? A check for a GPU box.

sdpa with a mask (packed rows, padded rows, a sliding window the rows reach: planning/attention.py dense_mask) runs
torch's memory-efficient kernel on CUDA (flash takes no mask). Its forward finds a query block's rows of the mask at
`attn_bias_ptr + query_start * bias_strideM` (aten/src/ATen/native/transformers/cuda/mem_eff_attention/
kernel_forward.h, attention_kernel: query_start a uint32, bias_strideM an int32, so the product is 32-bit and wraps
once it passes 2^32: past about 65,536 tokens a row, where the mask is [S x S]). Read off the source of the two
versions stored here, not run: whether torch as installed wraps, and which kernel it takes, only a GPU can say.

Each length: one head, a sliding-window mask (so a row read from the wrong place shows), sdpa's output and its
query gradient for the last block of queries against fp32 math on those rows alone, under the kernel torch picks and
under the memory-efficient one named. A wrap reads another row's window: errors of order 1, not bf16's 1e-2.

    python benchmarks/mask_rows.py                    # CUDA: 32K (control) and 72K tokens
    python benchmarks/mask_rows.py --cpu --tokens 2048   # the script itself, on torch's CPU kernel
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEAD_DIM, WINDOW, ROWS = 64, 512, 128


def reference(q, k, v, mask, grad):
    """fp32 attention of the last ROWS queries over every key, and their query gradient: what the kernel must give."""
    rows = q[:, :, -ROWS:].float().detach().requires_grad_()
    scores = rows @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, :, -ROWS:], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()
    out.backward(grad[:, :, -ROWS:].float())
    return out.detach(), rows.grad


def check(tokens: int, device: str, backend: SDPBackend | None) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 1, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    grad = torch.randn(1, 1, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g)
    i = torch.arange(tokens, device=device)
    mask = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - WINDOW))[None, None]  # transformers' sliding window
    q.requires_grad_()
    with sdpa_kernel([backend]) if backend is not None else torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(grad)
    want, want_dq = reference(q, k, v, mask, grad)
    err = (out[:, :, -ROWS:].float() - want).abs().max().item()
    err_dq = (q.grad[:, :, -ROWS:].float() - want_dq).abs().max().item()
    scale = max(want.abs().max().item(), want_dq.abs().max().item())
    return {"tokens": tokens, "kernel": "as torch picks" if backend is None else backend.name,
            "output_error": err, "dq_error": err_dq, "scale": scale,
            "right": bool(err < 0.05 * scale and err_dq < 0.05 * scale)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768,73728", help="row lengths, comma-separated")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (the script's own check; no wrap there)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU box, or with --cpu")
    backends = [None] if args.cpu else [None, SDPBackend.EFFICIENT_ATTENTION]
    rows = []
    print(f"{'tokens':>8}  {'kernel':<20} {'output err':>10} {'dq err':>10} {'scale':>8}  right")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for backend in backends:
            try:
                row = check(tokens, device, backend)
            except RuntimeError as e:  # (a kernel that cannot take this shape says so: recorded, not fatal)
                row = {"tokens": tokens, "kernel": backend.name if backend else "as torch picks",
                       "error": " ".join(str(e).split())[:200]}
            rows.append(row)
            if "error" in row:
                print(f"{tokens:>8}  {row['kernel']:<20} {row['error']}")
            else:
                print(f"{tokens:>8}  {row['kernel']:<20} {row['output_error']:>10.4f} {row['dq_error']:>10.4f} "
                      f"{row['scale']:>8.3f}  {'yes' if row['right'] else 'NO'}")
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
