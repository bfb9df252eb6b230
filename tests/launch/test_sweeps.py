"""Hydra multirun sweeps of multi-rank jobs, as a user types them."""

import glob
import re

from tests.cli.test_cli import QUICK, run
from tests.helpers import read_wandb_records


def test_local_sweep_runs_every_job_and_reports_the_failing_one(tmp_path):
    out = run(["-m", "parallelism=ddp,fsdp2", "mesh.tp_size=1,2", "logger=wandb",
               "logger.wandb.mode=offline", f"hydra.sweep.dir={tmp_path}/sweep"] + QUICK,
              tmp_path, env_extra={"WANDB_DIR": str(tmp_path / "wb")})
    assert out.returncode != 0  # one job failed, so the sweep fails
    # ddp with tp_size=2 is job #1; it is named, with its overrides
    assert "sweep job #1 (parallelism=ddp mesh.tp_size=2" in out.stderr
    assert "parallelism=ddp only replicates data" in out.stderr
    jobs = sorted(glob.glob(f"{tmp_path}/sweep/*/metrics.jsonl"))
    assert [j.split("/")[-2] for j in jobs] == ["0", "2", "3"]  # the others still ran
    ports = []
    for job in ("0", "2", "3"):
        log = open(f"{tmp_path}/sweep/{job}/train.log").read()
        ports += re.findall(r"rendezvous at 127\.0\.0\.1:(\d+)", log)
        assert log.count("step 3/3") == 1
    assert len(ports) == 3 and len(set(ports)) == 3  # a fresh port per job
    # one finished W&B run per successful job, grouped by the sweep
    runs = glob.glob(f"{tmp_path}/wb/wandb/offline-run-*/run-*.wandb")
    assert len(runs) == 3
    groups = set()
    for path in runs:
        records = read_wandb_records(path)
        [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        groups.add(run_record.run_group)
        assert any(r.WhichOneof("record_type") == "exit" for r in records), "finish() each run"
    assert groups == {"sweep"}
