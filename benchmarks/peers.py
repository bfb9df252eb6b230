"""Training step time of automodel against NeMo AutoModel, torchtitan and a hand-written loop.

One model, one batch shape, one machine, four trainers, on CPU with gloo:

* **automodel**: this repository's ``train.py`` with Hydra overrides.
* **nemo**: NeMo AutoModel 0.7.0, its fine-tuning recipe
  (``TrainFinetuneRecipeForNextTokenPrediction``) started through its CLI under torchrun,
  with ``benchmarks/peers/nemo_automodel_llama.yaml``.
* **torchtitan**: torchtitan 0.3.0, its ``Trainer`` under torchrun, with the config function
  ``llama_bench`` in ``benchmarks/peers/torchtitan_llama.py``.
* **fsdp2**: a hand-written loop (``fsdp2_worker`` below, the FSDP2 branch of
  ``compare_baseline.py`` on its own): Hugging Face ``LlamaForCausalLM``, ``fully_shard`` on
  each decoder layer and then the root with torch's defaults, cross-entropy, ``backward``,
  ``clip_grad_norm_``, AdamW.

Common conditions: a Llama built from config (hidden 256, FFN 768, 4 layers, 8 heads, 8 KV
heads, vocabulary 32000, untied embeddings), sequences of 256 random tokens, 2 sequences per
rank per step on 2 ranks (global batch 4, no gradient accumulation), gloo, fp32 parameters,
compute and gradient reduction, FSDP2 (``fully_shard``), AdamW (lr 3e-3, betas 0.9/0.95,
eps 1e-8, no weight decay, constant learning rate), gradient clipping at norm 1.0, one thread
per rank (``OMP_NUM_THREADS=1``; each side also calls ``torch.set_num_threads``), no
activation checkpointing, no torch.compile, no checkpoints, no validation.

Usage (from the repository root; the peers live in their own venv, see below)::

    .venv/bin/python benchmarks/peers.py                       # 3 rounds x 30 steps each
    .venv/bin/python benchmarks/peers.py --rounds 1 --steps 5 --warmup 2   # smoke test
    .venv/bin/python benchmarks/peers.py --frameworks automodel fsdp2 --json out.json

The rounds are interleaved (round 1: automodel, nemo, torchtitan, fsdp2; round 2: the same
again, ...), so that slow drifts of the machine hit every side alike. Each run is a fresh
launch. Reported, per side:

* **s/step**: the median time of one training step, leaving out each run's first
  ``--warmup`` steps, over all rounds together (and each round's median). Every side measures
  the same interval: rank 0's wall time from the end of one step to the end of the next, which
  includes fetching the batch and the side's own per-step logging. Where it comes from:
  automodel: ``global batch x seq_len / tokens_per_second`` of each ``metrics.jsonl`` record
  (``trainer.log_every=1``); NeMo: ``num_tokens_per_step / tps`` of each ``training.jsonl``
  record (its own step-to-step clock); torchtitan and fsdp2: ``PEERS_STEP`` lines printed by
  rank 0 (``TimedTrainer`` in torchtitan_llama.py wraps torchtitan's ``train_step``).
* **launch -> 1st step**: wall time from starting the launch command to the end of the first
  training step (imports, process start-up, rendezvous, model build and sharding, the first
  step). The end of step 1 is the arrival of automodel's ``step 1/N`` log line, the timestamp
  of NeMo's first ``training.jsonl`` record, and the Unix time in the first ``PEERS_STEP``.

What differs between the sides (each runs its own model code and training step):

* Model code. automodel and fsdp2: Hugging Face ``LlamaForCausalLM`` (separate q/k/v
  projections, SDPA attention; transformers from automodel's venv). NeMo: its own Llama
  implementation (``nemo_automodel.components.models.llama``, chosen as for any Llama
  checkpoint because the config names ``LlamaForCausalLM``; separate q/k/v, SDPA, RMSNorm
  computed in fp32, its CPU defaults for kernels). torchtitan: its own llama3 model (fused QKV
  projection, complex-number RoPE); attention is torchtitan's ``ScaledDotProductAttention``
  module (causal SDPA) instead of its llama3 default, FlexAttention compiled with inductor
  max-autotune (GPU-tuned, and a long compile on CPU); varlen attention is CUDA only.
  Weight initialisation differs between the sides (it does not change the step's work).
* Loss. automodel: its fused LM head + cross-entropy in chunks of 1024 tokens
  (``trainer.loss=auto``). torchtitan: its llama3 default, ``ChunkedLossWrapper`` around
  cross-entropy (the LM head runs inside the loss, chunk by chunk), normalised by the global
  token count. NeMo: ``MaskedCrossEntropy`` over the full logits; its mock data set masks the
  last label of each sequence, so it trains on 255 of 256 positions (1020 label tokens a step
  instead of 1024). fsdp2: ``F.cross_entropy`` over the full logits.
* FSDP2 units and prefetching. automodel: a unit per decoder layer plus the root, explicit
  forward (depth 1) and backward (depth 2) prefetch, last layer not resharded after forward.
  NeMo: a unit per decoder layer (the last not resharded), separate units for the input
  embedding and the LM head, then the root; no explicit prefetch (its default). torchtitan:
  units for the embedding, each layer, and norm + LM head together (not resharded), then the
  root; FSDP's gradient averaging off (the loss is already divided by the global token count),
  with plain SUM reductions because gloo has no PREMUL_SUM. fsdp2: a unit per layer plus the
  root with torch's defaults.
* Per-step bookkeeping. automodel, NeMo and torchtitan reduce the loss (and more) over the
  ranks every step for their log line (NeMo also all-reduces the step's token counts before
  the step and its FLOPs for an MFU figure after it); fsdp2 prints rank 0's local loss only.
* Other framework defaults kept as they are: torchtitan runs Python's garbage collector by
  hand every 50 steps; automodel reads micro-batches one step ahead in a background thread.
  Activation checkpointing is off everywhere (torchtitan's default is selective, turned off
  here to match).

CPU adaptations of the peers (both target CUDA): ``benchmarks/peers/nemo_automodel_cpu.py``
and ``benchmarks/peers/torchtitan_cpu.py`` start them under torchrun and patch the few device
calls that assume a GPU (their docstrings list each one); none of them changes the arithmetic
of a step. torchtitan also runs with ``parallelism.spmd_backend=partial_dtensor`` (plain FSDP2
on the data-parallel mesh): its default ``spmd_types`` backend does not work with torch
2.13.0's ``fully_shard``.

The peers' venv (``--peers-venv``, default ``/tmp/peers-venv``), as it was built::

    python3 -m venv /tmp/peers-venv
    echo torch==2.13.0 > /tmp/peers-constraints.txt
    /tmp/peers-venv/bin/pip install torch==2.13.0
    /tmp/peers-venv/bin/pip install -c /tmp/peers-constraints.txt torchtitan==0.3.0 triton==3.9.0
    /tmp/peers-venv/bin/pip install -c /tmp/peers-constraints.txt --no-deps \\
        nemo-automodel==0.7.0 flashoptim==0.1.4
    /tmp/peers-venv/bin/pip install -c /tmp/peers-constraints.txt transformers==5.18.0 \\
        "datasets>=4.0.0,<4.8.0" megatron-fsdp==0.5.0 pyyaml tiktoken torchdata \\
        "torchao>=0.16.0" "mistral-common[hf-hub,sentencepiece]" ninja

(NeMo without its GPU-only ``quack-kernels`` / CUTLASS DSL dependencies; torchtitan imports
Triton unconditionally, so Triton is installed even though nothing here runs it.)
"""

from __future__ import annotations

# Only the standard library at module level: the driver may run under any Python, and the
# fsdp2 worker ranks (which re-import this file) import torch themselves.
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"

NPROC = 2
SEQ_LEN = 256
LOCAL_BATCH = 2
GLOBAL_BATCH = NPROC * LOCAL_BATCH
SEED = 1234
MODEL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": SEQ_LEN, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
OPTIM = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
MAX_NORM = 1.0

AUTOMODEL_OVERRIDES = [
    "parallelism=fsdp2", "mesh.dp_size=2", "data=synthetic", f"trainer.seq_len={SEQ_LEN}",
    f"trainer.global_batch_size={GLOBAL_BATCH}", "model.config.hidden_size=256",
    "model.config.intermediate_size=768", "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8",
    "model.config.vocab_size=32000", "model.config.tie_word_embeddings=false",
    "parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
    "param_dtype:float32,reduce_dtype:float32}",
    "trainer.log_every=1", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
]

FRAMEWORKS = ("automodel", "nemo", "torchtitan", "fsdp2")
STEP_MARK = "PEERS_STEP "


# --------------------------------------------------------------------------- the fsdp2 side
def fsdp2_worker(steps: int) -> None:
    """One rank of the hand-written FSDP2 loop (started by torchrun, like the peers)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")  # rank, world size and address come from torchrun
    try:
        # The model lives only inside the loop function, so it is gone before the process
        # group is destroyed.
        _fsdp2_loop(steps, dist.get_rank())
    finally:
        dist.destroy_process_group()


def _fsdp2_loop(steps: int, rank: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL)).to(torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    tokens = torch.Generator().manual_seed(SEED + rank)

    last = time.perf_counter()
    for step in range(1, steps + 1):
        ids = torch.randint(0, MODEL["vocab_size"], (LOCAL_BATCH, SEQ_LEN + 1), generator=tokens)
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()  # FSDP2 averages the gradients over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if rank == 0:
            record = {"step": step, "seconds": now - last, "unix_time": time.time(),
                      "loss": loss.item()}
            print(STEP_MARK + json.dumps(record), flush=True)
        last = now


# --------------------------------------------------------------------------- launching
def run_logged(cmd: list, cwd: Path, env: dict, log_path: Path, timeout: float) -> dict:
    """Run ``cmd`` with stdout and stderr merged into ``log_path``; return the launch time,
    each output line with its arrival time, the exit code and the wall time."""
    start = time.time()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    killed = []

    def stop() -> None:  # the whole process group of this launch: torchrun and its ranks
        killed.append(True)
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, stop)
    timer.start()
    lines = []
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        for line in proc.stdout:  # universal newlines: tqdm's carriage returns split too
            lines.append((time.time(), line.rstrip("\n")))
            log.write(line)
    rc = proc.wait()
    timer.cancel()
    return {"start": start, "lines": lines, "rc": rc, "timed_out": bool(killed),
            "wall_s": time.time() - start}


def _torchrun(python: Path) -> list:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]


def command(name: str, steps: int, run_dir: Path, args) -> list:
    peers_python = Path(args.peers_venv) / "bin" / "python"
    if name == "automodel":
        return [args.automodel_python, ROOT / "train.py", *AUTOMODEL_OVERRIDES,
                f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    if name == "nemo":
        return [*_torchrun(peers_python), PEERS / "nemo_automodel_cpu.py",
                PEERS / "nemo_automodel_llama.yaml", "--step_scheduler.max_steps", str(steps),
                "--checkpoint.checkpoint_dir", run_dir / "nemo"]
    if name == "torchtitan":
        return [*_torchrun(peers_python), PEERS / "torchtitan_cpu.py",
                "--module", "torchtitan_llama", "--config", "llama_bench",
                "--training.steps", str(steps), "--dump_folder", run_dir / "titan"]
    if name == "fsdp2":
        return [*_torchrun(Path(args.automodel_python)), Path(__file__).resolve(),
                "--fsdp2-worker", "--steps", str(steps)]
    raise ValueError(name)


def environment() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", AUTOMODEL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # each side runs in its own interpreter
        env.pop(key, None)
    return env


# --------------------------------------------------------------------------- reading results
def _read_jsonl(path: Path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _marked(lines: list) -> list:
    return [json.loads(text[text.index(STEP_MARK) + len(STEP_MARK):])
            for _, text in lines if STEP_MARK in text]


def parse(name: str, out: dict, run_dir: Path) -> tuple[list, float]:
    """(seconds of each step in order, Unix time at which step 1 ended)."""
    if name == "automodel":
        records = sorted(_read_jsonl(run_dir / "metrics.jsonl"), key=lambda r: r["step"])
        times = [GLOBAL_BATCH * SEQ_LEN / r["tokens_per_second"] for r in records]
        first = next(t for t, text in out["lines"] if "step 1/" in text)
        return times, first
    if name == "nemo":
        records = sorted(_read_jsonl(run_dir / "nemo" / "training.jsonl"),
                         key=lambda r: r["step"])
        times = [r["num_tokens_per_step"] / r["tps"] for r in records]
        stamp = records[0]["timestamp"].replace("Z", "+00:00")
        return times, datetime.fromisoformat(stamp).timestamp()
    records = sorted(_marked(out["lines"]), key=lambda r: r["step"])
    return [r["seconds"] for r in records], records[0]["unix_time"]


def measure(name: str, args, round_no: int, logs: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-r{round_no}-", dir=logs))
    log_path = logs / f"{name}-round{round_no}.log"
    out = run_logged(command(name, args.steps, run_dir, args), run_dir, environment(),
                     log_path, args.timeout)
    if out["rc"] != 0:
        why = "timed out" if out["timed_out"] else f"exit code {out['rc']}"
        raise RuntimeError(f"{name} (round {round_no}) failed: {why}; see {log_path}")
    try:
        times, first_end = parse(name, out, run_dir)
    except (OSError, StopIteration, KeyError, IndexError, ValueError) as err:
        raise RuntimeError(f"{name} (round {round_no}): could not read its step times "
                           f"({err!r}); see {log_path}") from None
    if len(times) != args.steps:
        raise RuntimeError(f"{name} (round {round_no}): {len(times)} step times for "
                           f"{args.steps} steps; see {log_path}")
    measured = times[args.warmup:]
    return {"step_times_s": times, "median_step_s": statistics.median(measured),
            "first_step_s": first_end - out["start"], "wall_s": out["wall_s"],
            "log": str(log_path)}


# --------------------------------------------------------------------------- report
def summarize(runs: dict, warmup: int) -> dict:
    summary = {}
    for name, rounds in runs.items():
        pooled = [t for r in rounds for t in r["step_times_s"][warmup:]]
        summary[name] = {
            "median_step_s": statistics.median(pooled),
            "round_median_step_s": [r["median_step_s"] for r in rounds],
            "first_step_s": statistics.median(r["first_step_s"] for r in rounds),
            "round_first_step_s": [r["first_step_s"] for r in rounds],
        }
    return summary


def print_table(summary: dict, args) -> None:
    base = summary.get("automodel")
    print(f"\n{args.rounds} round(s) x {args.steps} steps, first {args.warmup} of each run left "
          f"out of the step medians; {NPROC} gloo ranks x 1 thread, batch {GLOBAL_BATCH} x "
          f"seq {SEQ_LEN}")
    head = (f"{'framework':<11} {'s/step':>8} {'vs automodel':>12} {'per round':>24} "
            f"{'launch->1st step s':>18} {'per round':>20}")
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        ratio = f"{s['median_step_s'] / base['median_step_s']:.2f}x" if base else "-"
        rounds = " ".join(f"{t:.3f}" for t in s["round_median_step_s"])
        firsts = " ".join(f"{t:.1f}" for t in s["round_first_step_s"])
        print(f"{name:<11} {s['median_step_s']:>8.3f} {ratio:>12} {rounds:>24} "
              f"{s['first_step_s']:>18.1f} {firsts:>20}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5,
                   help="first steps of each run left out of the step-time medians")
    p.add_argument("--peers-venv", default="/tmp/peers-venv",
                   help="venv with nemo-automodel 0.7.0 and torchtitan 0.3.0")
    p.add_argument("--automodel-python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="interpreter for automodel and the fsdp2 loop")
    p.add_argument("--logs", help="keep each run's log and output here (default: a temporary "
                                  "folder, removed unless a run fails)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="also write every number here")
    p.add_argument("--fsdp2-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fsdp2_worker:
        fsdp2_worker(args.steps)
        return
    if args.steps <= args.warmup or args.rounds < 1:
        p.error("need --steps > --warmup and --rounds >= 1")

    logs = Path(args.logs or tempfile.mkdtemp(prefix="peers-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = {name: [] for name in args.frameworks}
    for round_no in range(1, args.rounds + 1):
        for name in args.frameworks:
            r = measure(name, args, round_no, logs)
            runs[name].append(r)
            print(f"round {round_no} {name:<10} {r['median_step_s']:.3f} s/step  launch->1st "
                  f"step {r['first_step_s']:.1f} s  (run {r['wall_s']:.0f} s)", flush=True)
    summary = summarize(runs, args.warmup)
    print_table(summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "summary": summary, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    if not args.logs:
        import shutil

        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
