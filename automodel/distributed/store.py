"""The rendezvous store of a job whose ranks were started without torch's elastic agent (SLURM
tasks, or ranks given MASTER_ADDR/MASTER_PORT by hand).

torch's ``env://`` start lets rank 0 serve its TCP store on every interface of its node (the
wildcard address). Here rank 0 serves it on the address MASTER_ADDR names and nowhere else: on a
node with a public and a cluster interface, only the cluster's hears it. Under torchrun (and
automodel's local launcher) the agent serves the store and the ranks are its clients; nothing
changes there.

The store closes with the process group that holds it (``destroy_distributed``); nothing of it
stays open after a job.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket

import torch.distributed as dist

log = logging.getLogger(__name__)


def agent_serves_store() -> bool:
    """True under torch's elastic agent (torchrun, the local launcher): its store is the job's."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def bind_address(master_addr: str, resolved: list[str], spans_nodes: bool) -> tuple[str, str]:
    """(the address rank 0's store listens on, a warning or ""). ``resolved``: the addresses
    MASTER_ADDR resolves to on rank 0's node, in the resolver's order. A loopback address
    cannot be reached from another node: when the job spans nodes and MASTER_ADDR resolves
    only to loopback here (a node whose /etc/hosts maps its own name to 127.0.1.1), the store
    listens on every interface, as torch's default does, and says so."""
    routable = [a for a in resolved if not ipaddress.ip_address(a).is_loopback]
    if routable or not spans_nodes:
        return (routable or resolved)[0], ""
    return "", (f"MASTER_ADDR={master_addr} resolves to {', '.join(resolved)} (loopback) on "
                "rank 0's node, which other nodes cannot reach: the rendezvous store listens on "
                "every interface of this node instead. To restrict it to the cluster network, "
                f"make {master_addr} resolve to the node's cluster address (DNS or /etc/hosts)")


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def _listening_socket(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"rank 0 cannot serve the rendezvous store on {address}:{port} "
                                 f"(MASTER_ADDR, MASTER_PORT): {err.strerror}") from err
    sock.listen(1024)
    return sock


def rendezvous_store(rank: int, world: int, timeout: datetime.timedelta):
    """The job's store. Rank 0 serves it on MASTER_ADDR's own address (``bind_address``), the
    other ranks connect to MASTER_ADDR:MASTER_PORT; under torch's agent every rank is a client
    of the agent's store, under a prefix of the attempt (``distributed.max_restarts``)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if agent_serves_store():  # (the agent keeps one store over its restarts: each attempt's
        # keys under their own prefix, or a restarted rank reads the last attempt's addresses)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"automodel/attempt_{attempt}",
                                dist.TCPStore(host, port, world, False, timeout))
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    address, warning = bind_address(host, _resolve(host, port), spans_nodes=local < world)
    if warning:
        log.warning(warning)
        return dist.TCPStore(host, port, world, True, timeout)
    sock = _listening_socket(address, port)
    return dist.TCPStore(host, port, world, True, timeout, master_listen_fd=sock.detach())
