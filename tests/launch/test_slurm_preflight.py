"""SLURM refuses at submit time what the preflight refuses (``automodel.checks.preflight``): a
TP plan the model cannot take and a dataset that is not there exit 2 with the preflight's
message, and nothing is queued, neither through ``python -m launchers.slurm`` nor through a
``hydra/launcher=slurm`` sweep (where a valid job of the same sweep is not queued either).
Needs the local cluster, as test_slurm.py (a missing cluster fails these tests under CI)."""

import subprocess

import pytest

from tests.cli.test_cli import QUICK, run
from tests.launch.test_slurm import LAUNCHER, require_cluster

BAD_PLAN = "parallelism.tp_plan={model.layers.*.mlp.no_such_proj:colwise}"
NO_SUCH_MODULE = "pattern 'model.layers.*.mlp.no_such_proj' matches no module"
TRAINER = [o for o in QUICK if not o.startswith("data")]


@pytest.fixture(scope="module", autouse=True)
def _slurm_cluster():
    require_cluster()


def jobs_started_in(workdir) -> list:
    """SLURM jobs, queued, running or ended, whose working directory is ``workdir`` (each test
    submits from its own tmp_path)."""
    def rows(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return [line.split("|") for line in out.splitlines() if "|" in line]

    queued = rows(["squeue", "-h", "-a", "-o", "%i|%Z"])
    ended = rows(["sacct", "-n", "-X", "-a", "-P", "-S", "now-1days", "-o", "JobID,WorkDir"])
    return [job for job, wd in queued + ended if wd.rstrip("/") == str(workdir)]


def refused(out, *messages):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "automodel: configuration error:" in out.stderr
    for message in messages:
        assert message in out.stderr, out.stderr
    assert "submitted SLURM job" not in out.stdout


def test_submitter_refuses_a_bad_tp_plan_and_a_missing_dataset(tmp_path):
    out = run(["--tasks-per-node", "2", "--output-dir", str(tmp_path / "tp"), "parallelism=fsdp2",
               "mesh.tp_size=2", BAD_PLAN] + QUICK, tmp_path, cmd=LAUNCHER)
    refused(out, NO_SUCH_MODULE)
    empty = tmp_path / "dataset"  # a data=hf folder that holds no dataset
    empty.mkdir()
    out = run(["--output-dir", str(tmp_path / "hf"), "parallelism=none", "data=hf",
               f"data.path={empty}", f"data.cache_dir={tmp_path / 'cache'}"] + TRAINER,
              tmp_path, cmd=LAUNCHER)
    refused(out, f"data=hf: data.path='{empty}': neither a dataset saved with save_to_disk")
    assert not any(tmp_path.rglob(".submitit"))
    assert jobs_started_in(tmp_path) == []


def test_sweep_refuses_before_any_job_is_queued(tmp_path):
    # job 0 (tp_size=1: the plan is not used) is valid; job 1's plan names no module
    sweep = tmp_path / "sweep"
    out = run(["-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
               "parallelism=fsdp2", "mesh.tp_size=1,2", BAD_PLAN, f"hydra.sweep.dir={sweep}"]
              + QUICK, tmp_path)
    refused(out, "sweep job #1 (", "refused before anything was submitted", NO_SUCH_MODULE)
    out = run(["-m", "hydra/launcher=slurm", "parallelism=none", "data=files",
               f"data.paths=[{tmp_path / 'missing.txt'}]", f"hydra.sweep.dir={sweep}"]
              + TRAINER, tmp_path)
    refused(out, "sweep job #0 (", f"data.paths contains '{tmp_path / 'missing.txt'}': no "
            "such file")
    assert not (sweep / ".submitit").exists()
    assert jobs_started_in(tmp_path) == []
