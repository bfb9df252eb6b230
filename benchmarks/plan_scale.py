"""How long ``plan.py`` takes, and how much host memory it uses, on jobs of hundreds of ranks.

Issue 27 asks that the plan of Llama 3.1 70B on 512 ranks (dp 16 x tp 8 x pp 4) and of a
mixture-of-experts preset on 256 ranks with expert parallelism each finish in under 60 s and
use under 8 GB of host memory on the 2-core CPU machine. This script runs each ``plan.py``
command as a user would (a fresh process, its own simulation workers) and reports:

* ``wall``: seconds from the command's start to its exit (imports, the config checks, the
  simulations, writing plan.json);
* ``tree peak``: the peak of the resident memory of the whole process tree (``plan.py``, its
  simulation workers and their fork server), summed over the processes alive at each sample
  (``/proc/<pid>/status`` VmRSS every 0.2 s). Pages the workers share with the fork server
  count once per process, so this over-counts shared memory;
* ``tree peak pss``: the same with each process's proportional share (``smaps_rollup`` Pss):
  shared pages split between their sharers, the machine's real cost (every 1 s);
* ``sum of peaks``: every process's own peak (VmHWM) added up, an upper bound that no sampling
  interval can miss (processes that never ran at the same time are added too);
* ``largest``: the largest single process's own peak (VmHWM);
* ``cpu s``: the CPU seconds of the tree (user + system, sampled) and the machine's 1-minute
  load average before and after: the machine is shared, so a wall time means little without
  them (``cpu s`` / cores is about the wall time on an idle machine).

The memory bound is checked against the sampled RSS sum (``tree peak``, conservative) of every
run, the time bound against each case's median wall time over ``--repeat`` runs. Exit status 1
when a figure is over its bound or a plan fails.

    python benchmarks/plan_scale.py --repeat 3            # every case, median of 3 runs
    python benchmarks/plan_scale.py --cases llama70b_512 --json scale.json --keep /tmp/plans
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

# (what the case is, the plan.py overrides). Full activation checkpointing on both: without
# it the 70B job's activations (seq 8192) do not fit an 80 GB GPU.
CASES = {
    "llama70b_512": (
        "Llama 3.1 70B, 512 ranks: pp 4 (interleaved, 2 stages per rank) x dp 16 x tp 8, "
        "seq 8192, micro-batch 1, global batch 128 (8 micro-batches), full AC, H100",
        ["model=llama3_1_70b", "parallelism=fsdp2", "mesh.dp_size=16", "mesh.tp_size=8",
         "mesh.pp_size=4", "pipeline=interleaved", "trainer.seq_len=8192",
         "trainer.local_batch_size=1", "trainer.global_batch_size=128",
         "parallelism.activation_checkpointing=full", "plan.gpu=h100_80gb"]),
    "llama70b_512_gbs64": (
        "the same with global batch 64 (4 micro-batches for 8 virtual stages: a larger "
        "bubble, half the simulated micro-batches)",
        ["model=llama3_1_70b", "parallelism=fsdp2", "mesh.dp_size=16", "mesh.tp_size=8",
         "mesh.pp_size=4", "pipeline=interleaved", "trainer.seq_len=8192",
         "trainer.local_batch_size=1", "trainer.global_batch_size=64",
         "parallelism.activation_checkpointing=full", "plan.gpu=h100_80gb"]),
    # the same at more micro-batches a step (a pipeline of many is planned from short runs of
    # its schedule, planning/microbatches.py): 16, 24, 28 and 128
    **{f"llama70b_512_gbs{g}": (
        f"the same with global batch {g} ({g // 16} micro-batches)",
        ["model=llama3_1_70b", "parallelism=fsdp2", "mesh.dp_size=16", "mesh.tp_size=8",
         "mesh.pp_size=4", "pipeline=interleaved", "trainer.seq_len=8192",
         "trainer.local_batch_size=1", f"trainer.global_batch_size={g}",
         "parallelism.activation_checkpointing=full", "plan.gpu=h100_80gb"])
       for g in (256, 384, 448, 2048)},
    "llama70b_512_1f1b": (
        "the same with pipeline=1f1b (one stage of 20 layers per rank: simulated as 4 and 5 "
        "layers, extended)",
        ["model=llama3_1_70b", "parallelism=fsdp2", "mesh.dp_size=16", "mesh.tp_size=8",
         "mesh.pp_size=4", "pipeline=1f1b", "trainer.seq_len=8192",
         "trainer.local_batch_size=1", "trainer.global_batch_size=128",
         "parallelism.activation_checkpointing=full", "plan.gpu=h100_80gb"]),
    "moe_256": (
        "Qwen3-30B-A3B, 256 ranks: dp_shard 256 with ep 8 (ep_shard 32), seq 4096, "
        "micro-batch 1, global batch 256, full AC, H100",
        ["model=qwen3_30b_a3b", "parallelism=fsdp2", "plan.gpus=256", "mesh.ep_size=8",
         "trainer.seq_len=4096", "trainer.local_batch_size=1",
         "trainer.global_batch_size=256", "parallelism.activation_checkpointing=full",
         "plan.gpu=h100_80gb"]),
}


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (from each thread's /proc/<pid>/task/<tid>/children)."""
    tree, i = [root], 0
    while i < len(tree):
        try:
            tasks = os.listdir(f"/proc/{tree[i]}/task")
        except OSError:
            tasks = []
        for tid in tasks:
            try:
                with open(f"/proc/{tree[i]}/task/{tid}/children") as f:
                    tree += [int(c) for c in f.read().split()]
            except OSError:
                pass
        i += 1
    return tree


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _field(pid: int, path: str, key: str) -> int:
    """A ``key: N kB`` line of /proc/<pid>/<path>, in bytes (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/{path}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Samples the memory of ``root`` and its descendants until ``stop``."""

    def __init__(self, root: int, interval: float = 0.2, pss_every: int = 5):
        super().__init__(daemon=True)
        self.root, self.interval, self.done = root, interval, threading.Event()
        self.pss_every = pss_every
        self.peak_rss = self.peak_pss = 0
        self.hwm: dict = {}  # pid -> its own peak (VmHWM), the last seen
        self.cpu: dict = {}  # pid -> its CPU seconds, the last seen
        self.processes = 0

    def run(self):
        sample = 0
        while not self.done.is_set():
            pids = _tree(self.root)
            rss = pss = 0
            with_pss = sample % self.pss_every == 0  # (smaps_rollup costs more to read)
            sample += 1
            for pid in pids:
                rss += _field(pid, "status", "VmRSS")
                pss += _field(pid, "smaps_rollup", "Pss") if with_pss else 0
                hwm = _field(pid, "status", "VmHWM")
                if hwm:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), hwm)
                    self.cpu[pid] = max(self.cpu.get(pid, 0.0), _cpu_seconds(pid))
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.processes = max(self.processes, len(pids))
            self.done.wait(self.interval)

    def stop(self):
        self.done.set()
        self.join()


def run_case(name: str, overrides: list, out_dir: str, extra: list) -> dict:
    """Run ``plan.py`` on ``overrides`` once; its wall time, memory figures and plan."""
    cmd = [sys.executable, str(ROOT / "plan.py"), *overrides, *extra,
           f"hydra.run.dir={out_dir}"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    output = proc.communicate()[0]
    wall = time.perf_counter() - start
    sampler.stop()
    row = {"case": name, "command": " ".join(cmd), "returncode": proc.returncode,
           "wall_s": wall, "cpu_s": sum(sampler.cpu.values()),
           "load_before": load, "load_after": os.getloadavg()[0],
           "tree_peak_rss_bytes": sampler.peak_rss,
           "tree_peak_pss_bytes": sampler.peak_pss,
           "sum_of_process_peaks_bytes": sum(sampler.hwm.values()),
           "processes": sampler.processes,
           "largest_process_bytes": max(sampler.hwm.values(), default=0)}
    plan_file = Path(out_dir) / "plan.json"
    if proc.returncode == 0 and plan_file.exists():
        plan = json.loads(plan_file.read_text())
        row["plan"] = {k: plan[k] for k in ("world_size", "layout", "step_time_s", "bubble",
                                            "fits", "warnings")}
        row["plan"]["peak_bytes"] = {r["name"]: r["peak_bytes"] for r in plan["ranks"]}
        row["summary"] = [line for line in output.splitlines()
                          if line.startswith(("plan:", "  "))]
    else:
        row["error"] = output[-12000:]
    return row


def verdict(row: dict, max_s: float, max_gb: float) -> bool:
    return (row["returncode"] == 0 and row["wall_s"] < max_s
            and row["tree_peak_rss_bytes"] < max_gb * GB)


def print_table(rows: list, max_s: float, max_gb: float) -> None:
    print(f"\n| case | wall s (< {max_s:g}) | cpu s | load | tree peak GB (< {max_gb:g}) "
          "| tree peak pss GB | sum of peaks GB | largest GB | processes | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
              f"{r['load_before']:.1f}-{r['load_after']:.1f} | "
              f"{r['tree_peak_rss_bytes'] / GB:.2f} | "
              f"{r['tree_peak_pss_bytes'] / GB:.2f} | "
              f"{r['sum_of_process_peaks_bytes'] / GB:.2f} | "
              f"{r['largest_process_bytes'] / GB:.2f} | {r['processes']} | "
              f"{'yes' if verdict(r, max_s, max_gb) else 'NO'} |")
    for r in rows:
        if r["returncode"] != 0:
            print(f"\n{r['case']} FAILED (exit {r['returncode']}):\n{r['error']}")
        else:
            print("\n" + "\n".join(r["summary"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--max-gb", type=float, default=8.0, help="host memory bound (1e9 bytes)")
    p.add_argument("--override", action="append", default=[],
                   help="extra plan.py override for every case (e.g. plan.workers=1)")
    p.add_argument("--keep", help="write each case's plan into KEEP/<case> (default: a "
                   "temporary folder)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case (the machine's "
                   "speed varies by a fifth between runs: the median decides)")
    args = p.parse_args(argv)
    base = args.keep or tempfile.mkdtemp(prefix="plan-scale-")
    rows = []
    for name in args.cases:
        what, overrides = CASES[name]
        print(f"{name}: {what}", flush=True)
        for i in range(args.repeat):
            rows.append(run_case(name, overrides, os.path.join(base, f"{name}-{i}"),
                                 args.override))
            print(f"  {rows[-1]['wall_s']:.1f} s, tree peak "
                  f"{rows[-1]['tree_peak_rss_bytes'] / GB:.2f} GB", flush=True)
    print_table(rows, args.max_seconds, args.max_gb)
    medians = {name: statistics.median(r["wall_s"] for r in rows if r["case"] == name)
               for name in args.cases}
    print("\nmedian wall s: " + ", ".join(f"{n} {t:.1f}" for n, t in medians.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cases": {
            n: CASES[n][0] for n in args.cases}, "rows": rows, "median_wall_s": medians},
            indent=1))
    ok = all(r["returncode"] == 0 and r["tree_peak_rss_bytes"] < args.max_gb * GB
             for r in rows) and all(t < args.max_seconds for t in medians.values())
    if not ok:
        print("OVER A BOUND (or a plan failed): see the table")
        sys.exit(1)


if __name__ == "__main__":
    main()
