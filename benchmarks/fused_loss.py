"""The LM head and the loss: plain (the head's logits, an fp32 copy, cross-entropy) against
fused (``automodel.loss.linear_cross_entropy``: chunked, gradients per chunk), forward and
backward, one process, fp32 or bf16 parameters.

For each vocabulary size it runs both ways on the same hidden states, head and labels and
reports the peak memory above the inputs (resident memory on CPU, the allocator's peak on a
GPU), the median time of forward + backward, their ratios (fused / plain), and the largest
relative difference of the loss and of the gradients' norms.

    python benchmarks/fused_loss.py                        # vocab 32k and 128k, 4096 tokens
    python benchmarks/fused_loss.py --vocab 32000 128256 --tokens 8192 --hidden 2048
    python benchmarks/fused_loss.py --dtype bfloat16 --chunk 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(kind: str, vocab: int, args) -> dict:
    """One way, in this process: peak memory above the inputs, times, loss, gradient norms."""
    import torch

    from automodel.loss import linear_cross_entropy, summed_cross_entropy
    from benchmarks.common import reset_peak, status

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head = torch.nn.Linear(args.hidden, vocab, bias=False).to(device, dtype)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype,
                         requires_grad=True)
    labels = torch.randint(0, vocab, (args.tokens,), device=device)

    def step():
        hidden.grad = None
        head.weight.grad = None
        if kind == "plain":
            loss = summed_cross_entropy(head(hidden).unsqueeze(0), labels.unsqueeze(0))
        else:
            loss = linear_cross_entropy(hidden, head.weight, None, labels, args.chunk)
        loss.backward()
        return loss

    step()  # warm up (allocations, kernels)
    times, peaks = [], []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak()
            base = status("VmRSS")
        start = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            peaks.append(status("VmHWM") - base)
        times.append(time.perf_counter() - start)
    return {"kind": kind, "vocab": vocab, "seconds": statistics.median(times),
            "peak_bytes": max(peaks), "loss": float(loss),
            "grad_norms": [float(hidden.grad.float().norm()),
                           float(head.weight.grad.float().norm())]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="trainer.loss_chunk_tokens")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (kind, vocab): a child run
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args)))
        return
    rows = []
    child = list(sys.argv[1:])
    for vocab in args.vocab:
        for kind in ("plain", "fused"):  # each in a fresh process: peaks do not mix
            out = subprocess.run([sys.executable, __file__, *child, "--one", kind, str(vocab)],
                                 check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"tokens {args.tokens}, hidden {args.hidden}, chunk {args.chunk}, {args.dtype}, "
          f"{args.threads} thread(s); peak = memory above the inputs during forward+backward")
    print(f"{'vocab':>7} {'plain MiB':>10} {'fused MiB':>10} {'x':>6} {'plain s':>8} "
          f"{'fused s':>8} {'x':>6} {'loss rel d':>11} {'gnorm rel d':>12}")
    ok = True
    for vocab in args.vocab:
        plain, fused = [r for r in rows if r["vocab"] == vocab]
        d_loss = abs(fused["loss"] - plain["loss"]) / abs(plain["loss"])
        d_norm = max(abs(a - b) / b for a, b in zip(fused["grad_norms"], plain["grad_norms"]))
        ok &= d_loss < 1e-5 and d_norm < 1e-5 if args.dtype == "float32" else True
        mib = [r["peak_bytes"] / 2**20 for r in (plain, fused)]
        print(f"{vocab:>7} {mib[0]:>10.0f} {mib[1]:>10.0f}"
              f" {fused['peak_bytes'] / plain['peak_bytes']:>6.2f} {plain['seconds']:>8.3f}"
              f" {fused['seconds']:>8.3f} {fused['seconds'] / plain['seconds']:>6.2f}"
              f" {d_loss:>11.1e} {d_norm:>12.1e}")
    print("numerics ok" if ok else "NUMERICS DIFFER")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
