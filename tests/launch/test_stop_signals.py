"""A stop signal saves and exits cleanly: local launcher, one process, torchrun.

The run is a real ``python train.py`` (or ``torchrun train.py``) process. Once metrics show a
few steps, it gets SIGTERM (or SIGUSR1); it must finish the step, write a checkpoint, exit
with 128 + the signal number and no traceback. Resumed with ``checkpoint.resume=auto`` it
must end exactly where an uninterrupted run ends (fp32 on CPU: bit-for-bit).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from automodel.checkpoint.paths import complete_checkpoints
from tests.cli.test_cli import ROOT, TRAIN
from tests.helpers import BASE, ON_CPU, train

STEPS = 12
RUN = BASE[:] + ON_CPU + [f"trainer.max_steps={STEPS}", "trainer.log_every=1"]


def _steps_done(out) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def _signal_midway(cmd, out, sig, env_extra=None, at_step=4, faults="sleep@0.25"):
    env = dict(os.environ, AUTOMODEL_FAULTS=faults, **(env_extra or {}))
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while _steps_done(out) < at_step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # (poll: until at_step steps are logged)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    return proc.returncode, stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = {}

    def get(layout):
        key = tuple(layout)
        if key not in cache:
            cache[key] = train(layout + [f"trainer.max_steps={STEPS}"],
                               tmp_path_factory.mktemp("full"))
        return cache[key]
    return get


# a background save in flight when the signal comes (each write held back 1.5 s): the stop's
# save waits for it, then saves
ASYNC = ["checkpoint.every_steps=2", "checkpoint.async_mode=thread"]


@pytest.mark.parametrize("name,layout,sig", [
    ("local_ranks_sigterm", ["parallelism=ddp"], signal.SIGTERM),
    ("local_ranks_sigusr1", ["parallelism=ddp"], signal.SIGUSR1),
    ("one_process_sigterm", ["parallelism=none"], signal.SIGTERM),
    ("local_ranks_sigterm_async_save", ["parallelism=ddp"] + ASYNC, signal.SIGTERM),
])
def test_signal_saves_exits_and_resume_matches(name, layout, sig, uninterrupted, tmp_path):
    out = tmp_path / "run"
    args = RUN + layout + [f"hydra.run.dir={out}"]
    background = "checkpoint.async_mode=thread" in layout
    code, stderr = _signal_midway([sys.executable, TRAIN] + args, out, sig,
                                  faults="sleep@0.25" + (",slow_save@1.5" if background else ""))
    assert code == 128 + sig, stderr
    assert "Traceback" not in stderr, stderr
    ckpt = complete_checkpoints(str(out / "checkpoints"))[-1]
    step = int(ckpt.rsplit("_", 1)[1])
    if background:
        assert re.search(r"checkpoint of step \d+ still being written: the save of step "
                         f"{step} waits for it", stderr), stderr[-3000:]
    assert 4 <= step < STEPS
    assert f"stopped by {signal.Signals(sig).name} after step {step}; checkpoint saved: " \
           f"{ckpt}" in stderr
    again = subprocess.run([sys.executable, TRAIN] + args + ["checkpoint.resume=auto"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    full = uninterrupted([a for a in layout if a not in ASYNC])
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in full]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in full]


def test_torchrun_sigterm_saves_and_resumes(uninterrupted, tmp_path):
    out = tmp_path / "run"
    layout = ["parallelism=ddp"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--standalone"]
    args = RUN + layout + [f"hydra.run.dir={out}"]
    code, stderr = _signal_midway(torchrun + [TRAIN] + args, out, signal.SIGTERM,
                                  {"PYTHONPATH": str(ROOT)})
    assert code != 0  # torchrun reports the signal it got
    [ckpt] = complete_checkpoints(str(out / "checkpoints"))
    assert "stopped by SIGTERM after step" in stderr
    again = subprocess.run(torchrun + [TRAIN] + args + ["checkpoint.resume=auto"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert again.returncode == 0, again.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    full = uninterrupted([a for a in layout if a not in ASYNC])
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in full]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in full]


def test_local_launcher_module_sigterm_saves_and_resumes(uninterrupted, tmp_path):
    out = tmp_path / "run"
    layout = ["parallelism=ddp"]
    cmd = [sys.executable, "-m", "launchers.local", "--output-dir", str(out)] + RUN + layout
    env = {"PYTHONPATH": str(ROOT)}
    code, stderr = _signal_midway(cmd, out, signal.SIGTERM, env)
    assert code == 143, stderr
    [ckpt] = complete_checkpoints(str(out / "checkpoints"))
    assert f"checkpoint saved: {ckpt}" in stderr and "Traceback" not in stderr
    again = subprocess.run(cmd + ["checkpoint.resume=auto"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, **env))
    assert again.returncode == 0, again.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    full = uninterrupted([a for a in layout if a not in ASYNC])
    assert [r["step"] for r in records] == [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in full]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in full]
