"""Soak: thousands of steps of the demo model per low-bit format, checking the states as it goes.

For each format (8bit, 4bit, fp8, and fp32 as the reference) the demo's byte-level GPT
(``bridge/tools/demo.py``) trains from the same initial weights on the same batches with the demo's
schedule (linear warm-up, cosine decay to 10%) and gradient clipping. Every ``--check-every``
steps, and at the end, it checks:

- every param and every state tensor (dequantized for quantized states) is finite;
- no second-moment (``exp_avg_sq``) element is 0 where that element's gradient has ever
  been non-zero (a flushed second moment turns the next step into m / eps), and no state
  block has scale 0 while its gradient block was non-zero at this step;
- the loss of every step is finite.

At the end the held-out loss of each format must be within ``--bound`` (relative) of fp32's.
Prints a table; exits 1 if any check failed.

    python benchmarks/soak.py                      # 5000 steps x 4 runs of the demo model
    python benchmarks/soak.py --steps 200 --d-model 32 --layers 1   # a quick look
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch

from bridge import QState
from bridge.tools.demo import Batches, CharGPT, eval_batches, evaluate, load_corpus, loss_fn, lr_at, make_optimizer

SECOND_MOMENT = "exp_avg_sq"


def check_states(opt, seen_grad: dict, grads: dict) -> tuple[int, int, int]:
    """(non-finite values, flushed second-moment elements, zero-scale blocks under a non-zero
    gradient block) over every state of ``opt``; ``seen_grad[p]`` marks elements whose
    gradient was ever non-zero, ``grads[p]`` is this step's gradient."""
    nonfinite = flushed = dead_blocks = 0
    for group in opt.param_groups:
        for p in group["params"]:
            nonfinite += int((~torch.isfinite(p.detach())).sum())
            for name, v in opt.state[p].items():
                if name == "step":
                    continue
                if isinstance(v, QState):
                    x = v.dequantize()
                    g = grads[p]
                    if g is not None:
                        # blocks of the (rows, R) view, as the record cuts them
                        rows = v.scale.shape[0]
                        gr = g.reshape(rows, -1).abs()
                        nb, bs = v.scale.shape[1], v.block_size
                        pad = nb * bs - gr.shape[1]
                        gb = torch.nn.functional.pad(gr, (0, pad)).reshape(rows, nb, bs).amax(-1)
                        dead_blocks += int(((v.scale == 0) & (gb > 0)).sum())
                else:
                    x = v
                nonfinite += int((~torch.isfinite(x)).sum())
                if name == SECOND_MOMENT:
                    flushed += int(((x == 0) & seen_grad[p]).sum())
    return nonfinite, flushed, dead_blocks


def run(fmt: str, init: torch.nn.Module, batches: Batches, held_out: torch.Tensor, args) -> dict:
    model = copy.deepcopy(init)
    opt = make_optimizer(fmt, model.parameters(), args.lr, args.weight_decay, args.min_quant_size)
    params = list(model.parameters())
    seen = {p: torch.zeros(p.shape, dtype=torch.bool) for p in params}
    warmup = max(1, args.steps // 10)
    bad_loss = nonfinite = flushed = dead = checks = 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        loss = loss_fn(model, batches(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for p in params:
            seen[p] |= p.grad != 0
        grads = {p: p.grad.detach().clone() for p in params} if (step + 1) % args.check_every == 0 else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        bad_loss += not math.isfinite(loss.item())
        if grads is not None or step + 1 == args.steps:
            grads = grads or {p: None for p in params}
            n, f, d = check_states(opt, seen, grads)
            nonfinite, flushed, dead, checks = nonfinite + n, flushed + f, dead + d, checks + 1
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  {fmt} step {step + 1}/{args.steps} loss {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    held = evaluate(model, held_out, args.batch)
    return {"format": fmt, "held_out": held, "bad_loss": bad_loss, "nonfinite": nonfinite, "flushed": flushed,
            "dead_blocks": dead, "checks": checks, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--formats", default="8bit,4bit,fp8")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--min-quant-size", type=int, default=1024)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--bound", type=float, default=0.03, help="allowed |held-out / fp32 - 1| (default 3%%)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_data, held_data, _ = load_corpus()
    batches = Batches(train_data, args.seq_len, args.batch, args.seed)
    held_out = eval_batches(held_data, args.seq_len, args.eval_windows)
    init = CharGPT(256, args.d_model, args.layers, args.heads, args.seq_len)
    n = sum(p.numel() for p in init.parameters())
    print(f"soak: {n:,}-param demo GPT (d_model {args.d_model}, {args.layers} layers), {args.steps} steps, "
          f"cosine schedule, checks every {args.check_every} steps", flush=True)
    results = [run(fmt, init, batches, held_out, args) for fmt in ["fp32"] + args.formats.split(",")]
    base = results[0]["held_out"]
    ok = True
    print(f"{'format':7s} {'held-out':>9s} {'vs fp32':>8s} {'non-finite':>10s} {'bad loss':>8s} "
          f"{'v flushed':>9s} {'dead blocks':>11s} {'checks':>6s} {'s':>6s}")
    for r in results:
        rel = r["held_out"] / base - 1
        fail = r["nonfinite"] or r["bad_loss"] or r["flushed"] or r["dead_blocks"] or abs(rel) > args.bound
        ok &= not fail
        print(f"{r['format']:7s} {r['held_out']:9.4f} {100 * rel:+7.2f}% {r['nonfinite']:10d} {r['bad_loss']:8d} "
              f"{r['flushed']:9d} {r['dead_blocks']:11d} {r['checks']:6d} {r['seconds']:6.0f}"
              + ("  FAIL" if fail else ""))
    print("PASS" if ok else "FAIL", f"(bound {100 * args.bound:.0f}% of fp32's held-out loss)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
