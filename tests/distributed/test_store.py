"""The rendezvous store of ranks started without torch's agent (SLURM tasks): rank 0 serves it
on MASTER_ADDR's address alone, never on the wildcard address, and when the job ends no
process of it listens on any port (store, gloo, DCP and its writer process for
``checkpoint.async_mode=process``: nothing left open, no process left running)."""

import os
import pickle
import socket
import sys

import pytest
import torch.multiprocessing as mp

from automodel.distributed.store import bind_address
from tests.helpers import BASE, ON_CPU, listening_sockets


@pytest.mark.fast
def test_bind_address_prefers_a_routable_address_and_never_binds_loopback_across_nodes():
    assert bind_address("node1", ["10.0.0.5"], spans_nodes=True) == ("10.0.0.5", "")
    assert bind_address("node1", ["127.0.1.1", "10.0.0.5"], spans_nodes=True) == ("10.0.0.5", "")
    assert bind_address("localhost", ["127.0.0.1", "::1"], spans_nodes=False) == ("127.0.0.1", "")
    address, warning = bind_address("node1", ["127.0.1.1"], spans_nodes=True)
    assert address == ""  # (every interface, as torch's default)
    assert "MASTER_ADDR=node1 resolves to 127.0.1.1 (loopback)" in warning
    assert "make node1 resolve to the node's cluster address" in warning


def _rank(rank, world, port, out, path):
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    import torch.distributed as dist

    from automodel.api import load_config
    from automodel.distributed.init import destroy_distributed, init_distributed
    from automodel.recipes.train import run_rank

    init_distributed("gloo", 1, need_group=True)
    dist.barrier()
    during = listening_sockets()
    destroy_distributed()
    after_group = listening_sockets()
    cfg = load_config(BASE + ON_CPU + ["parallelism=fsdp2", "trainer.max_steps=2",
                                       "checkpoint.every_steps=1",
                                       "checkpoint.async_mode=process"],
                      out, env=dict(os.environ))
    records = run_rank(cfg)  # a whole job: meshes, FSDP2, checkpoints written by DCP's
    # writer process (its own process group and store)
    after_job = listening_sockets() + [f"child {pid}: {sock}" for pid in _children()
                                       for sock in listening_sockets(pid)]
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump((during, after_group, after_job, _children(), records), f)


def _children() -> list[str]:
    """The pids of this process's live children."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += f.read().split()
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def _reserved_port() -> int:
    """A port for rank 0 to serve the store on itself (the test's point: its own socket on
    MASTER_ADDR), kept from every other process until then. Binding a free port and closing it
    would leave it to the next ``bind(port 0)`` of a parallel launch. Instead the port is left in
    TIME_WAIT (a connection to it accepted and closed by this side): the kernel gives no
    ``bind(port 0)`` a port in TIME_WAIT for a minute, while an explicit bind with
    SO_REUSEADDR, which rank 0's store socket sets, takes it at once."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the TIME_WAIT end too)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # (the accepting side closes first: its end goes to TIME_WAIT)
            client.recv(1)
    return port


@pytest.mark.timeout(300)
def test_store_listens_on_master_addr_only_and_nothing_listens_after_the_job(tmp_path):
    port = _reserved_port()
    mp.start_processes(_rank, args=(2, port, str(tmp_path), list(sys.path)), nprocs=2,
                       join=True, start_method="spawn")
    results = [pickle.load(open(tmp_path / f"{r}.pkl", "rb")) for r in range(2)]
    during, after_group, after_job, _, records = results[0]
    assert f"127.0.0.1:{port}" in during, during  # rank 0 serves the store there
    wildcard = [a for a in during if a.rsplit(":", 1)[0] in ("0.0.0.0", "[::]")]
    assert not wildcard, f"listening on every interface: {during}"
    for rank, (_, after_group, after_job, children, _) in enumerate(results):
        assert after_group == [], f"rank {rank} after destroy_distributed: {after_group}"
        assert after_job == [], f"rank {rank} after a whole job: {after_job}"
        assert children == [], f"rank {rank}: processes left after the job: {children}"
    assert len(records) == 2 and results[1][4] is None
