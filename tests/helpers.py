"""Shared test helpers: run jobs as the CLI would, run functions on real gloo ranks."""

import json
import os
import pickle
import sys

import torch.multiprocessing as mp

from automodel.api import run
from automodel.config.launch_env import usable_cpus
from automodel.runtime import forkserver
from automodel.tracking.metrics import read_metrics

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")
# Small, but the loss moves a lot in 5 steps, so a wrong gradient cannot hide.
TRAINER = ["trainer.max_steps=5", "trainer.log_every=1", "trainer.global_batch_size=8",
           "trainer.seq_len=32", "optim.warmup_steps=0", "optim.lr=0.01"]
BASE = ["data=corpus", "data.num_documents=400"] + TRAINER
# Every job the tests start runs its ranks on the CPU under gloo, also on a machine with GPUs,
# where the default backend (null) means nccl and one rank per GPU on cuda:LOCAL_RANK: a 1-GPU
# machine has no device for rank 1, and the stored numbers (tests/golden) are CPU numbers.
# Tests about GPUs are marked `gpu` (tests/test_gpu.py); tests/test_cpu_pin.py checks the pin.
ON_CPU = ["distributed.backend=gloo"]
# The CPUs of one pytest-xdist worker: the workers share the machine's, so each of a worker's
# processes (its jobs' ranks, its own single-process runs) runs this many threads at most
# (tests/conftest.py). torch's default, every core in every process, costs 2.7x the CPU time
# in spinning threads once the processes share cores.
WORKER_CPUS = max(1, usable_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))


def job_overrides(overrides, base=BASE):
    """What ``train`` runs: ``base``, the CPU pin, then the test's own overrides (so a test
    may still name another backend)."""
    return list(base) + ON_CPU + list(overrides)


def train(overrides, output_dir, base=BASE):
    """Run a job as the CLI would (spawning its ranks); check metrics.jsonl; return records."""
    records = run(job_overrides(overrides, base), output_dir=str(output_dir))
    on_disk = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    # (a resumed run appends to the same file)
    # (compared as JSON text: a skipped step's NaN loss is not equal to itself)
    assert json.dumps(on_disk[len(on_disk) - len(records):]) == json.dumps(records), \
        "metrics.jsonl must end with exactly what rank 0 logged"
    return records


def rendezvous_store():
    """A TCP store served by this process on a port the OS picks (port 0) and keeps bound."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _worker(rank, world, port, fn, args, result_dir, path, timeout=None, environ=None):
    sys.path[:] = path
    if environ is not None:
        forkserver.adopt_environment(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, WORKER_CPUS // world))  # (forked: the server's count)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    # a client of the parent's store, as env:// would make it (its timeout, its key prefix)
    timeout = timeout if timeout is not None else dist.constants.default_pg_timeout
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        import gc

        gc.collect()  # free DDP/FSDP objects before their process group goes away
        dist.destroy_process_group()


def run_on_ranks(fn, world, *args, tmp_path, timeout=None):
    """Run top-level ``fn(rank, world, *args)`` on ``world`` gloo ranks; return per-rank results.
    ``timeout`` (a timedelta): the process group's, else torch's default.

    The ranks meet at a store this process serves, on a port the OS picks when the store binds
    it and that stays bound until the ranks are done: no other launch can take it in between
    (as it could a port found free, released, and bound again later by rank 0)."""
    store = rendezvous_store()
    forkserver.context()  # ranks forked from the pre-imported server the launcher uses
    mp.start_processes(_worker, args=(world, store.port, fn, args, str(tmp_path),
                                      list(sys.path), timeout, forkserver.launcher_environment()),
                       nprocs=world, join=True, start_method="forkserver")
    out = []
    for rank in range(world):
        with open(tmp_path / f"{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def write_schedule_csv(path, pp: int, n_microbatches: int, stages_per_rank: int = 1,
                       comms: bool = False) -> str:
    """A looped breadth-first schedule as CSV: compute-only, or lowered to compute+comms by
    torch's own passes (FSDP unshard/reshard, gradient reduce, send/recv)."""
    num_stages = pp * stages_per_rank
    rows = []
    for rank in range(pp):
        mine = list(range(rank, num_stages, pp))
        fwd = [f"{s}F{m}" for s in mine for m in range(n_microbatches)]
        bwd = [f"{s}B{m}" for s in reversed(mine) for m in range(n_microbatches)]
        rows.append(fwd + bwd)
    if comms:
        from torch.distributed.pipelining import schedules as S

        actions = {r: S._add_reduce_grad(S._add_unshard_reshard(
            [S._Action.from_str(a) for a in row]), n_microbatches) for r, row in enumerate(rows)}
        lowered = S._add_send_recv(actions, stage_to_rank=lambda s: s % pp,
                                   num_stages=num_stages)
        rows = [[str(a) for a in lowered[r]] for r in range(pp)]
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(",".join(row) + "\n")
    return str(path)


def read_wandb_records(path):
    """Records of a W&B run file (``run-<id>.wandb``): a LevelDB-style log of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, block, chunks, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full record
            chunks.append(payload)
        elif kind == 2:  # first fragment
            partial = payload
        elif kind == 3:  # middle
            partial += payload
        elif kind == 4:  # last
            chunks.append(partial + payload)
    return [pb.Record.FromString(c) for c in chunks]


def listening_sockets(pid: str = "self") -> list[str]:
    """``address:port`` of each TCP socket process ``pid`` holds in the listening state
    (``[::]``/``0.0.0.0``: every interface)."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.append(f"[{ipaddress.IPv6Address(raw)}]:{int(hex_port, 16)}")
            else:
                found.append(f"{ipaddress.IPv4Address(raw[::-1])}:{int(hex_port, 16)}")
    return sorted(found)


def chat_records(n: int = 64) -> list:
    """Chat records (a ``messages`` list each) of a tiny arithmetic dialogue."""
    return [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                          {"role": "assistant", "content": f"it is {2 * i}"}]} for i in range(n)]


def save_chat_tokenizer(path, records):
    """A word-level tokenizer of ``records``' words with a chat template (what a ``-Instruct``
    checkpoint carries), saved to ``path``."""
    from tests.data.test_data import _save_word_tokenizer

    words = [" ".join(m["content"] for m in r["messages"]) for r in records]
    tok = _save_word_tokenizer(path, words + ["user assistant system"])
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    tok.save_pretrained(path)
    return tok
