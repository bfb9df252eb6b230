"""What a user sees when a rank fails: the root cause and where (for local ranks, one process
and torchrun), and a full disk during a checkpoint (a real small tmpfs where the test runs as
root, else an injected ENOSPC in the writer)."""

import contextlib
import errno
import os
import re
import subprocess
import sys

import pytest

from automodel.checkpoint.paths import checkpoint_path, complete_checkpoints
from automodel.errors import LaunchError, describe
from automodel.runtime.failure import launcher_message
from automodel.tracking.metrics import read_metrics
from tests.cli.test_cli import QUICK, ROOT, TRAIN, metrics_files
from tests.cli.test_cli import run as cli
from tests.helpers import BASE, train

ROOT_CAUSE = (r"ValueError: injected root cause at step 2 \(raised as RuntimeError: injected "
              r"wrapper\)")


@pytest.mark.fast
def test_the_summary_names_the_root_cause_of_a_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("PytorchStreamWriter failed writing file data") from cause
    except RuntimeError as err:
        text = describe(err)
    assert text == ("OSError: [Errno 28] No space left on device (raised as RuntimeError: "
                    "PytorchStreamWriter failed writing file data)")

    class Wrapper(Exception):  # like torch.distributed.checkpoint's: per-rank failures
        failures = {1: KeyError("lost")}

    assert describe(Wrapper("collective failed")).startswith("KeyError: 'lost' (raised as")
    message = launcher_message(
        {0: (1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"),
         1: (-15, ""), 2: (-9, "")}, {0: ("step 3", "OSError: boom")})
    assert message.splitlines() == [  # own cause, killed, (consequences,) stopped by the agent
        "rank 0 failed (exit code 1) during step 3: OSError: boom",
        "rank 2 failed (exit code -9): killed by SIGKILL, with no error report (out of memory, "
        "or stopped from outside?)",
        "rank 1 failed (exit code -15): stopped by SIGTERM after rank 0 failed"]
    assert "To enable traceback" not in launcher_message({0: (1, "To enable traceback x")}, {})
    # the rank with the cause reported it, but its peer's exit (a consequence) was the one the
    # agent counted before stopping it: the cause still comes first
    assert launcher_message({0: (1, "")}, {1: ("step 2", "ValueError: cause"),
                                           0: ("step 2", "Connection closed by peer")}) == (
        "rank 1 failed during step 2: ValueError: cause\n"
        "rank 0 failed (exit code 1) during step 2: Connection closed by peer")
    # a killed rank (no report) comes before the peer that only saw its connection close
    assert launcher_message({1: (-9, ""), 0: (1, "")},
                            {0: ("step 3", "Connection reset by peer")}).splitlines()[0] == (
        "rank 1 failed (exit code -9): killed by SIGKILL, with no error report (out of memory, "
        "or stopped from outside?)")


@pytest.mark.parametrize("layout", [["parallelism=ddp"],
                                    pytest.param(["parallelism=none"], marks=pytest.mark.fast)],
                         ids=["local_ranks", "one_process"])
def test_a_chained_error_in_a_rank_is_summarized(layout, monkeypatch, tmp_path):
    rank = 1 if layout == ["parallelism=ddp"] else 0
    monkeypatch.setenv("AUTOMODEL_FAULTS", f"raise@2:{rank}")
    with pytest.raises(LaunchError) as err:
        train(layout + ["trainer.max_steps=3"], tmp_path)
    # the rank with the cause comes first (its peer only saw the connection close); its
    # whole traceback is in the run's folder, and the message names the file
    file = tmp_path / f"traceback_rank{rank}.txt"
    assert re.match(rf"rank {rank} failed( \(exit code 1\))? during step 2: {ROOT_CAUSE} "
                    rf"\(traceback: {file}\)", str(err.value)), str(err.value)
    assert "To enable traceback" not in str(err.value)
    text = file.read_text()
    assert text.startswith(f"rank {rank} failed during step 2\n")
    assert "Traceback (most recent call last)" in text and "in before_step" in text  # (its frames)
    assert "ValueError: injected root cause at step 2" in text


def test_torchrun_ranks_summarize_their_failure(tmp_path):
    # --standalone: a rendezvous port the OS picks (not a fixed one such as 29500)
    out = cli(["--standalone", "--nproc_per_node", "2", TRAIN, "parallelism=ddp"] + QUICK,
              tmp_path,
              {"AUTOMODEL_FAULTS": "raise@2:1"},
              cmd=[sys.executable, "-m", "torch.distributed.run"])
    assert out.returncode != 0
    # the rank's own line, and torchrun's summary carries the same text
    assert re.search(rf"automodel: rank 1 failed during step 2: {ROOT_CAUSE} \(traceback: "
                     r"\S+/traceback_rank1.txt\)", out.stderr)
    assert re.search(rf"traceback : automodel: rank 1 failed during step 2: {ROOT_CAUSE}",
                     out.stderr), out.stderr[-3000:]


@contextlib.contextmanager
def small_file_system(path, megabytes: int):
    """A tmpfs of ``megabytes`` at ``path`` (root only); None where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


FULL = BASE + ["parallelism=fsdp2", "mesh.dp_size=2", "trainer.max_steps=6",
               "checkpoint.every_steps=2", "checkpoint.keep_last=2"]


def test_a_full_disk_during_a_checkpoint(monkeypatch, tmp_path):
    # one checkpoint of this llama_tiny run is 3.7 MiB on disk: 9 MiB hold two, not the
    # third one, written (at step 6) before the oldest is pruned
    with small_file_system(tmp_path / "small", 9) as small:
        ckpt = small if small is not None else tmp_path / "ckpt"
        if small is None:  # (no tmpfs here: the writer's ENOSPC is injected)
            monkeypatch.setenv("AUTOMODEL_FAULTS", "enospc_in_save@6:0")
        out = cli(FULL + [f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'run'}"],
                  ROOT, dict(os.environ))
        assert out.returncode == 1, out.stderr
        summary = out.stderr[out.stderr.index("automodel: job failed"):]
        assert re.search(rf"during checkpoint save \(step 6, {ckpt}/step_00000006\): "
                         rf"CheckpointWriteError: cannot write the checkpoint of step 6 to "
                         rf"{ckpt}/step_00000006: no space left on the device \(ENOSPC: ",
                         summary), summary
        assert re.search(r"it needs about \d+\.\d MiB, \d+\.\d MiB free there; the "
                         rf"unfinished {ckpt}/.tmp-step_00000006 was removed; the last complete "
                         rf"checkpoint is {ckpt}/step_00000004", summary), summary
        assert "To enable traceback" not in summary
        assert [os.path.basename(p) for p in complete_checkpoints(str(ckpt))] == \
            ["step_00000002", "step_00000004"]
        assert not (ckpt / ".tmp-step_00000006").exists()
        [metrics] = metrics_files(tmp_path / "run")
        assert [r["step"] for r in read_metrics(str(metrics))] == [1, 2, 3, 4, 5, 6]
        log = (tmp_path / "run" / "train.log").read_text()
        assert "step 6/6" in log
        # free space (drop the oldest) and resume: the run ends as an uninterrupted one does
        import shutil

        shutil.rmtree(checkpoint_path(str(ckpt), 2))
        monkeypatch.delenv("AUTOMODEL_FAULTS", raising=False)
        again = train(FULL + [f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"],
                      tmp_path / "again")
    whole = train(FULL, tmp_path / "whole")
    assert [r["step"] for r in again] == [5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in again] == \
        [(r["loss"], r["grad_norm"]) for r in whole[-2:]]


@pytest.mark.fast
def test_start_up_warns_when_the_checkpoints_will_not_fit(tmp_path, caplog):
    import shutil

    from automodel.checkpoint.manager import warn_if_short_of_space
    from automodel.config.schema import CheckpointConfig

    free = shutil.disk_usage(tmp_path).free
    ckpt = CheckpointConfig(every_steps=10, keep_last=2)
    warn_if_short_of_space(str(tmp_path / "checkpoints"), free // 4, ckpt, max_steps=100)
    assert not caplog.records  # three of a quarter of the free space fit
    warn_if_short_of_space(str(tmp_path / "checkpoints"), free // 2, ckpt, max_steps=100)
    [record] = caplog.records
    assert f"checkpoint.dir: {tmp_path} has" in record.getMessage()
    assert "(2 kept of about" in record.getMessage() and "may stop at a save" in \
        record.getMessage()
