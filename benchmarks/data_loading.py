"""Data loading with ``data=hf``: building the token cache, starting a training job on it, a
rank's resident memory, and the loader's speed against the training step's, for generated
corpora of growing size.

For each corpus size (``--sizes``, default 10M 100M 1G: MiB and GiB of UTF-8 text):

1. **corpus**: parquet files of documents (one ``text`` column, files of about
   ``--file-mib`` MiB of text each) in ``--dir``. The text is made quickly: a few thousand
   documents of the toy language (``automodel.data.corpus.generate_documents``) repeated with a
   running number in front, so every document differs; about 190 bytes a document.
2. **cold build**: the token cache alone, in a fresh cache folder, in a subprocess of its own
   (``token_cache.hf_stream(HFDataConfig(...), "train")``, byte-level tokens): its wall time
   (imports left out), MiB of text and documents per second, the peak resident memory of the
   builder process (``VmHWM``, reset after its imports) and its growth above the resident
   memory after the imports, and the cache's size on disk.
3. **training**: ``python train.py data=hf ... parallelism=fsdp2 mesh.dp_size=2`` (2 local
   ranks, gloo) as a subprocess, ``--steps`` steps of ``--batch`` x ``--seq`` tokens, twice:
   *cold* (a fresh cache folder: the launcher builds the cache before it starts the ranks)
   and *warm* (the cache of step 2). **Time to first step** is the wall time from starting the
   subprocess until ``metrics.jsonl`` holds its first record (it is flushed at every record;
   the file is polled every 20 ms): interpreter start, Hydra, preflight (the cache), spawning
   the ranks, building the model, step 1. **Rank peak**: the largest rank's own peak
   resident memory (``VmHWM`` of each spawned rank process, read every 0.1 s while it runs:
   imports, model, data, steps; the pages of the memory-mapped token file it touched count
   too); **launcher**: the same for the ``train.py`` process, which builds the cache on a cold
   run. **recorded**: the last record's ``peak_memory_bytes``, the largest rank's
   ``ru_maxrss``. It is not the rank's own peak: Linux carries a process's ``ru_maxrss``
   across ``exec``, so a spawned rank starts with the launcher's high-water mark. **step
   tok/s** is the median of the records' ``tokens_per_second`` after step 1 (all ranks'
   tokens). The cold run's cache is deleted after it (a copy of step 2's). With
   ``--repeats N`` each kind runs N times, cold and warm alternating, and the fastest first
   step counts (and the largest rank peak): on a shared machine start-up times vary a lot.
4. **loader**: in this process, on the warm cache, ``BatchPlan(TokenRows(stream, seq)).
   micro_batches(step, 0, 2, batch / 2)`` for ``--loader-steps`` steps: what one of 2
   data-parallel ranks reads per step. Step 0 is timed apart (it draws the epoch's
   permutation of all rows); the rate is over the others. **loader / step** compares it with
   what a rank consumes: ``loader tok/s / (step tok/s / 2)``; above 1, the loader keeps up.
   **faults/step** and **major**: this process's page faults per step (minor: a page of the
   token file already in the page cache mapped in; major: read from disk).

    python benchmarks/data_loading.py                         # 10M 100M 1G: ~6 min, 2 cores
    python benchmarks/data_loading.py --quick                 # 1M 10M: ~1.5 min
    python benchmarks/data_loading.py --sizes 100M --keep --dir /tmp/dl --json dl.json
    python benchmarks/data_loading.py --repeats 2 --json dl.json   # ~10 min, 2 busy cores
    python benchmarks/data_loading.py --quick --pack-boundaries

``--dir`` keeps the corpora and caches (default: a temporary folder); everything this script
made there is removed at the end unless ``--keep``; with ``--keep`` a later run reuses a
corpus of the same size (never a cache: the builds are always cold).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import reset_peak as _reset_peak  # noqa: E402
from benchmarks.common import status as _status  # noqa: E402

KiB, MiB, GiB = 2**10, 2**20, 2**30
BASE_DOCUMENTS = 4096
ROWS_PER_WRITE = 65536  # documents per parquet row group
DONE = "COMPLETE"  # marker of a finished corpus folder (not a data file: no known suffix)


def parse_size(text: str) -> int:
    units = {"K": KiB, "M": MiB, "G": GiB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_name(size: int) -> str:
    for unit, name in ((GiB, "G"), (MiB, "M"), (KiB, "K")):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{name}"
    return str(size)


# -- 1. corpus ------------------------------------------------------------------------------

def write_corpus(folder: Path, size: int, file_bytes: int, seed: int = 0) -> dict:
    """Parquet files of documents holding ``size`` bytes of text (at least; whole documents)
    in ``folder``, reused if a previous run finished it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from automodel.data.corpus import generate_documents

    marker = folder / DONE
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("size") == size and info.get("file_bytes") == file_bytes:
            return {**info, "seconds": 0.0, "reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    base = generate_documents(BASE_DOCUMENTS, seed)
    text_bytes = docs = files = in_file = 0
    writer = None
    schema = pa.schema([("text", pa.string())])
    while text_bytes < size:
        batch = [f"{n} {base[n % BASE_DOCUMENTS]}" for n in range(docs, docs + ROWS_PER_WRITE)]
        keep, total = len(batch), 0
        for i, doc in enumerate(batch):  # ASCII: characters are bytes
            total += len(doc)
            if text_bytes + total >= size:
                keep = i + 1
                break
        batch = batch[:keep]
        if writer is None:
            writer = pq.ParquetWriter(folder / f"part-{files:05d}.parquet", schema)
            files += 1
        writer.write_table(pa.table({"text": batch}, schema=schema))
        text_bytes, docs, in_file = text_bytes + total, docs + keep, in_file + total
        if in_file >= file_bytes:
            writer.close()
            writer, in_file = None, 0
    if writer is not None:
        writer.close()
    info = {"size": size, "file_bytes": file_bytes, "text_bytes": text_bytes, "docs": docs,
            "files": files,
            "disk_bytes": sum(f.stat().st_size for f in folder.glob("*.parquet"))}
    marker.write_text(json.dumps(info))
    return {**info, "seconds": time.perf_counter() - started, "reused": False}


# -- 2. cold build, in a process of its own -------------------------------------------------

def build_child(path: str, cache_dir: str) -> None:
    """(The subprocess.) Build the cache, print what it measured as one JSON line."""
    import datasets  # noqa: F401  imports are not the build: measured after them
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from automodel.config.schema import HFDataConfig
    from automodel.data import token_cache

    after_imports = _status("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    cpu = time.process_time()
    stream = token_cache.hf_stream(HFDataConfig(path=path, cache_dir=cache_dir,
                                                text_field="text"), "train")
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_bytes": _status("VmHWM"),
                      "after_imports_bytes": after_imports, "num_tokens": stream.num_tokens,
                      "num_docs": int(len(stream.doc_starts))}))


def cold_build(corpus: Path, cache_dir: Path) -> dict:
    shutil.rmtree(cache_dir, ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--build-child", str(corpus),
                          str(cache_dir)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building the cache of {corpus} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    entries = [d for d in (cache_dir / "tokens").iterdir() if d.is_dir()]
    result["cache_bytes"] = sum(f.stat().st_size for d in entries for f in d.iterdir())
    result["cache_blocks_bytes"] = sum(f.stat().st_blocks * 512 for d in entries
                                       for f in d.iterdir())
    return result


# -- 3. training ----------------------------------------------------------------------------

def _hwm(pid: int) -> int | None:
    """The peak resident memory (VmHWM) of process ``pid``, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        return None
    return None


def _ranks(launcher: int) -> list[int]:
    """The ranks under ``launcher``: its descendants started by multiprocessing's spawn."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat[stat.rfind(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {launcher}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - found
        found |= frontier
    ranks = []
    for pid in found:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline:
            ranks.append(pid)
    return sorted(ranks)


def train(corpus: Path, cache_dir: Path, out: Path, args) -> dict:
    """``python train.py`` on the corpus: the time until its first record, the peak resident
    memory of the launcher and of each rank (their own ``VmHWM``, sampled every 0.1 s while
    they run), and its records."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = ["data=hf", f"data.path={corpus}", f"data.cache_dir={cache_dir}",
                 "data.text_field=text",
                 f"data.pack_boundaries={str(args.pack_boundaries).lower()}",
                 "parallelism=fsdp2", "mesh.dp_size=2", f"trainer.max_steps={args.steps}",
                 f"trainer.seq_len={args.seq}", f"trainer.global_batch_size={args.batch}",
                 "trainer.log_every=1", f"hydra.run.dir={out}", *args.override]
    metrics = out / "metrics.jsonl"
    launcher_peak, rank_peaks = 0, {}
    with open(out / "stdout.log", "w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "train.py", *overrides], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        first, polls, ranks = None, 0, []
        while proc.poll() is None:
            if first is None and metrics.exists() and b"\n" in metrics.read_bytes():
                first = time.perf_counter() - started
            if polls % 5 == 0:  # every 0.1 s: the peaks; every 0.5 s: which ranks
                if polls % 25 == 0:
                    ranks = _ranks(proc.pid)
                launcher_peak = max(launcher_peak, _hwm(proc.pid) or 0)
                for pid in ranks:
                    rank_peaks[pid] = max(rank_peaks.get(pid, 0), _hwm(pid) or 0)
            polls += 1
            time.sleep(0.02)
        wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"training on {corpus} failed (exit {proc.returncode}):\n"
                           f"{(out / 'stdout.log').read_text()[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = [r["tokens_per_second"] for r in records if r["step"] > 1] or \
        [records[-1]["tokens_per_second"]]
    return {"first_step_seconds": first if first is not None else wall, "wall_seconds": wall,
            "rank_peak_bytes": max(rank_peaks.values(), default=0),
            "rank_peaks_bytes": [rank_peaks[p] for p in sorted(rank_peaks)],
            "launcher_peak_bytes": launcher_peak,
            "metrics_peak_bytes": records[-1]["peak_memory_bytes"],
            "step_tokens_per_second": statistics.median(steady),
            "final_loss": records[-1]["loss"]}


def fastest(runs: list) -> dict:
    """The run with the fastest first step; the rank peak is the largest of all runs."""
    best = dict(min(runs, key=lambda r: r["first_step_seconds"]))
    best["rank_peak_bytes"] = max(r["rank_peak_bytes"] for r in runs)
    best["first_step_all_seconds"] = [r["first_step_seconds"] for r in runs]
    return best


# -- 4. loader alone ------------------------------------------------------------------------

def loader(corpus: Path, cache_dir: Path, args) -> dict:
    from automodel.config.schema import HFDataConfig
    from automodel.data.batches import BatchPlan
    from automodel.data.token_cache import hf_stream
    from automodel.data.token_rows import TokenRows

    stream = hf_stream(HFDataConfig(path=str(corpus), cache_dir=str(cache_dir),
                                    text_field="text", pack_boundaries=args.pack_boundaries),
                       "train")
    rows = TokenRows(stream, args.seq, args.pack_boundaries)
    dp, per_rank = 2, args.batch // 2
    started = time.perf_counter()
    plan = BatchPlan(rows, args.batch, seed=0)
    plan.micro_batches(0, 0, dp, per_rank)
    first = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    for step in range(1, args.loader_steps + 1):
        plan.micro_batches(step, 0, dp, per_rank)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"rows": len(rows), "first_batch_seconds": first,
            "loader_tokens_per_second": args.loader_steps * per_rank * args.seq / seconds,
            "minor_faults_per_step": (after.ru_minflt - faults.ru_minflt) / args.loader_steps,
            "major_faults_per_step": (after.ru_majflt - faults.ru_majflt) / args.loader_steps,
            "permutation_bytes": 8 * len(rows)}


# -- main -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--build-child"]:
        return build_child(*argv[1:3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10M", "100M", "1G"],
                   help="corpus sizes in bytes of text (K, M, G: KiB, MiB, GiB)")
    p.add_argument("--quick", action="store_true", help="sizes 1M 10M")
    p.add_argument("--dir", help="where the corpora and caches go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep what was made in --dir")
    p.add_argument("--file-mib", type=int, default=100, help="MiB of text per parquet file")
    p.add_argument("--steps", type=int, default=5, help="training steps per run")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--loader-steps", type=int, default=200)
    p.add_argument("--pack-boundaries", action="store_true",
                   help="data.pack_boundaries=true (rows carry document starts)")
    p.add_argument("--repeats", type=int, default=1,
                   help="training runs of each kind; the fastest first step counts")
    p.add_argument("--no-cold-run", action="store_true",
                   help="skip the cold training runs (they rebuild the cache)")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = ["1M", "10M"]
    sizes = [parse_size(s) for s in args.sizes]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="data-loading-"))
    work.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    rows = []
    try:
        for size in sizes:
            name = size_name(size)
            corpus, build_cache = work / f"corpus-{name}", work / f"cache-build-{name}"
            cold_cache, runs = work / f"cache-cold-{name}", work / f"runs-{name}"
            made += [corpus, build_cache, cold_cache, runs]
            print(f"[{name}] corpus ...", flush=True)
            row = {"size": name, "corpus": write_corpus(corpus, size, args.file_mib * MiB)}
            print(f"[{name}] cold build ...", flush=True)
            row["build"] = cold_build(corpus, build_cache)
            runs_of = {"cold": [], "warm": []}
            for repeat in range(args.repeats):  # alternating, so both see the same noise
                for kind in ("cold", "warm"):
                    if kind == "cold" and args.no_cold_run:
                        continue
                    print(f"[{name}] training, {kind} cache ({repeat + 1}/{args.repeats}) ...",
                          flush=True)
                    cache = cold_cache if kind == "cold" else build_cache
                    runs_of[kind].append(train(corpus, cache, runs / f"{kind}-{repeat}", args))
                    if kind == "cold":
                        shutil.rmtree(cold_cache, ignore_errors=True)  # a copy of build_cache
            for kind, done in runs_of.items():
                if done:
                    row[kind] = fastest(done)
            print(f"[{name}] loader ...", flush=True)
            row["loader"] = loader(corpus, build_cache, args)
            rows.append(row)
    finally:
        if not args.keep:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
            if not args.dir:
                shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def report(rows: list, args) -> None:
    print("\ncorpus and cold build of the token cache (byte-level tokens, one process)")
    print(f"{'size':>5} {'text MiB':>9} {'docs':>9} {'files':>5} {'gen s':>6} {'build s':>8} "
          f"{'cpu s':>6} {'MiB/s':>6} {'kdoc/s':>7} {'cache MiB':>9} {'builder peak MiB':>16} "
          f"{'growth MiB':>10}")
    for r in rows:
        c, b = r["corpus"], r["build"]
        print(f"{r['size']:>5} {c['text_bytes'] / MiB:>9.1f} {c['docs']:>9} {c['files']:>5} "
              f"{c['seconds']:>6.1f}{'*' if c['reused'] else ' '}{b['seconds']:>7.1f} "
              f"{b['cpu_seconds']:>6.1f} "
              f"{c['text_bytes'] / MiB / b['seconds']:>6.1f} "
              f"{c['docs'] / 1e3 / b['seconds']:>7.0f} {b['cache_bytes'] / MiB:>9.1f} "
              f"{b['peak_bytes'] / MiB:>16.1f} "
              f"{(b['peak_bytes'] - b['after_imports_bytes']) / MiB:>10.1f}")
    if any(r["corpus"]["reused"] for r in rows):
        print("*: corpus reused from an earlier --keep run")
    print(f"\ntraining: 2 ranks (fsdp2, gloo), {args.steps} steps of {args.batch} x {args.seq} "
          "tokens; first step = from starting train.py until its first metrics record"
          + (f" (fastest of {args.repeats})" if args.repeats > 1 else ""))
    print(f"{'size':>5} {'first cold s':>12} {'first warm s':>12} {'cold-warm s':>11} "
          f"{'build s':>7} {'wall cold s':>11} {'wall warm s':>11} {'step tok/s':>10}")
    for r in rows:
        w, cold = r["warm"], r.get("cold")
        dash = "-"
        print(f"{r['size']:>5} "
              + (f"{cold['first_step_seconds']:>12.1f} " if cold else f"{dash:>12} ")
              + f"{w['first_step_seconds']:>12.1f} "
              + (f"{cold['first_step_seconds'] - w['first_step_seconds']:>11.1f} " if cold
                 else f"{dash:>11} ")
              + f"{r['build']['seconds']:>7.1f} "
              + (f"{cold['wall_seconds']:>11.1f} " if cold else f"{dash:>11} ")
              + f"{w['wall_seconds']:>11.1f} {w['step_tokens_per_second']:>10.0f}")
    base = rows[0]["warm"]["rank_peak_bytes"]
    print("\nresident memory (MiB): rank = the largest rank's own VmHWM; launcher = train.py's "
          "process; recorded = metrics.jsonl's peak_memory_bytes (ru_maxrss, which a spawned "
          "rank inherits from the launcher); perm = the epoch permutation, 8 bytes a row")
    print(f"{'size':>5} {'rank warm':>9} {'vs first':>8} {'rank cold':>9} {'launcher warm':>13} "
          f"{'launcher cold':>13} {'recorded warm':>13} {'recorded cold':>13} {'perm':>6}")
    for r in rows:
        w, cold = r["warm"], r.get("cold")

        def mib(run, key):
            return f"{run[key] / MiB:.1f}" if run else "-"

        print(f"{r['size']:>5} {w['rank_peak_bytes'] / MiB:>9.1f} "
              f"{(w['rank_peak_bytes'] - base) / MiB:>+8.1f} {mib(cold, 'rank_peak_bytes'):>9} "
              f"{w['launcher_peak_bytes'] / MiB:>13.1f} {mib(cold, 'launcher_peak_bytes'):>13} "
              f"{w['metrics_peak_bytes'] / MiB:>13.1f} {mib(cold, 'metrics_peak_bytes'):>13} "
              f"{r['loader']['permutation_bytes'] / MiB:>6.1f}")
    print(f"\nloader alone: one of 2 data-parallel ranks, {args.loader_steps} steps of "
          f"{args.batch // 2} x {args.seq} tokens"
          + (" (pack_boundaries)" if args.pack_boundaries else ""))
    print(f"{'size':>5} {'rows':>9} {'first batch ms':>14} {'loader tok/s':>12} "
          f"{'step tok/s/rank':>15} {'loader/step':>11} {'faults/step':>11} {'major':>6}")
    for r in rows:
        ld, w = r["loader"], r["warm"]
        per_rank = w["step_tokens_per_second"] / 2
        print(f"{r['size']:>5} {ld['rows']:>9} {ld['first_batch_seconds'] * 1e3:>14.1f} "
              f"{ld['loader_tokens_per_second']:>12.0f} {per_rank:>15.0f} "
              f"{ld['loader_tokens_per_second'] / per_rank:>11.0f} "
              f"{ld['minor_faults_per_step']:>11.1f} {ld['major_faults_per_step']:>6.1f}")


if __name__ == "__main__":
    main()
