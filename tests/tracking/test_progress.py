"""The progress display: a live bar on a terminal, plain log lines otherwise."""

import os
import pty
import sys

from tests.cli.test_cli import QUICK, TRAIN, run
from tests.helpers import ON_CPU


def test_non_terminal_output_gets_plain_log_lines(tmp_path):
    out = run(["parallelism=ddp"] + QUICK, tmp_path)  # stdout and stderr are pipes
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "step 1/3" in text and "step 3/3" in text
    assert "\r" not in text and "step/s" not in text and "s/step" not in text


def test_terminal_gets_a_live_bar_with_eta(tmp_path):
    pid, fd = pty.fork()
    if pid == 0:  # child: train.py on a pseudo-terminal
        os.chdir(tmp_path)
        os.execv(sys.executable, [sys.executable, TRAIN, "parallelism=ddp"] + QUICK + ON_CPU)
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-2000:]
    assert "train:" in text and "3/3" in text and "\r" in text  # redrawn in place
    assert "loss=" in text and "tok/s=" in text and "mem=" in text
    assert "<" in text  # tqdm's elapsed<remaining (ETA)
    assert "step 3/3" in text  # log lines still printed above the bar
