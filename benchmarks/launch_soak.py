"""Launch a multi-process test worker many times in a row and count the ranks that die.

Each launch runs a worker of ``tests/fsdp_workers.py`` (default ``errors_worker``: FSDP2 on a tiny
transformer, one 4-bit step, a gather, two errors raised and caught on every rank) in ``--world`` spawned gloo processes through ``launch``, which
ends every rank with ``destroy_process_group()``, flushed output and ``os._exit`` (pytorch
issue 190489; design.md). ``--plain`` uses a copy of the old entry instead, which returns
normally and so goes through interpreter shutdown: the comparison shows what the exit does.

    python benchmarks/launch_soak.py --launches 50
    python benchmarks/launch_soak.py --launches 20 --plain
    python benchmarks/launch_soak.py --launches 50 --worker dcp_cycles_worker

``dcp_cycles_worker`` is the FSDP2 + DCP flow that aborted about one launch in 7 while a
quantized state's codes and scales were gathered with both all-gathers in flight (design.md,
"One collective in flight").

Prints one line per launch and a summary; exits 1 if any launch failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import fsdp_workers as W  # noqa: E402


def _plain_entry(rank, fn, world, store_file, args):
    """The entry the tests used before: returns normally (interpreter shutdown follows)."""
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=W.PG_TIMEOUT_S))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch_plain(fn, world, *args):
    with tempfile.TemporaryDirectory(prefix="lowbit_fsdp_") as tmp:
        mp.start_processes(_plain_entry, args=(fn, world, os.path.join(tmp, "store"), args), nprocs=world,
                           join=True, start_method="spawn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--worker", default="errors_worker",
                    help="a worker of tests/fsdp_workers.py taking (rank, world) or (rank, world, workdir)")
    ap.add_argument("--plain", action="store_true", help="the old entry (normal interpreter shutdown)")
    args = ap.parse_args(argv)
    launch = launch_plain if args.plain else W.launch
    fn = getattr(W, args.worker)
    extra = (lambda d: (d,)) if args.worker in ("mesh_worker", "dcp_cycles_worker") else (lambda d: ())
    by_signal, by_status, ok = {}, 0, 0
    t0 = time.perf_counter()
    for i in range(args.launches):
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="launch_soak_") as workdir:
            try:
                launch(fn, args.world, *extra(workdir))
                outcome = "ok"
                ok += 1
            except mp.ProcessExitedException as e:
                if e.signal_name is not None:
                    by_signal[e.signal_name] = by_signal.get(e.signal_name, 0) + 1
                    outcome = f"rank {e.error_index} died by {e.signal_name}"
                else:
                    by_status += 1
                    outcome = f"rank {e.error_index} exited with status {e.exit_code}"
            except Exception as e:  # noqa: BLE001 - a rank raised (counted, reported)
                by_status += 1
                outcome = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"launch {i + 1:3d}/{args.launches}: {outcome} ({time.perf_counter() - t:.1f} s)", flush=True)
    deaths = sum(by_signal.values())
    print(f"{'plain exit' if args.plain else 'os._exit'}: {args.launches} launches at world {args.world}: "
          f"{ok} ok, {deaths} rank deaths by signal {by_signal or ''}, {by_status} other failures "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0 if ok == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())
