"""Rendezvous ports cannot collide: the store the ranks meet at binds a port that the OS picks,
and holds it from that moment until the ranks are done.

Before, a launcher found a free port by binding port 0 and closing the socket, handed the
number on, and the rendezvous bound it again later. In between, anything else (another launch:
a suite runs hundreds; a rank's gloo connections) could take that port, and the launch failed.
These tests play that other launch: right before the ranks start, they bind the port the
launcher has named for them (the local launcher names port 0, so they get some other port).
"""

import errno
import os
import socket

import torch.multiprocessing as mp

from automodel.launch import local
from tests.helpers import run_on_ranks


def _take(port: int):
    """Bind ``port``, as another launch's store would; None if it is held already. (Bound, not
    listening: a launcher that lost its port then fails within its connect timeout, where a
    listening thief would keep it waiting.)"""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as err:
        sock.close()
        if err.errno != errno.EADDRINUSE:
            raise
        return None
    return sock


def _master_port(*_):
    """In a rank: the port it was told to meet at, and whether that port is held now."""
    port = int(os.environ["MASTER_PORT"])
    sock = _take(port)
    if sock is not None:
        sock.close()
    return port, sock is None


def test_a_local_launch_holds_its_port_from_the_start(monkeypatch):
    taken = []

    def another_launch_first(config, entry):
        taken.append(_take(int(config.rdzv_endpoint.rsplit(":", 1)[1])))
        return elastic_launch(config, entry)

    elastic_launch = local.elastic_launch
    monkeypatch.setattr(local, "elastic_launch", another_launch_first)
    try:
        results = local.run_on_local_ranks(_master_port, 2, name="ports")
    finally:
        for sock in taken:
            if sock is not None:
                sock.close()
    assert len(taken) == 1
    # both ranks met at one port, held (by the launcher's store) while they ran
    assert results[0] == results[1] == (results[0][0], True)


def _rank(rank, world):
    return _master_port()


def test_run_on_ranks_holds_its_port_from_the_start(monkeypatch, tmp_path):
    taken = []

    def another_launch_first(fn, args, **kwargs):
        taken.append(_take(args[1]))  # (tests.helpers._worker's arguments: world, port, ...)
        return start_processes(fn, args, **kwargs)

    start_processes = mp.start_processes
    monkeypatch.setattr(mp, "start_processes", another_launch_first)
    try:
        results = run_on_ranks(_rank, 2, tmp_path=tmp_path)
    finally:
        for sock in taken:
            if sock is not None:
                sock.close()
    assert taken == [None]  # the port was held before the ranks started
    assert results[0] == results[1] == (results[0][0], True)
