"""Every entry point runs the one preflight (``automodel.checks.preflight``): the CLI,
``automodel.api.run``, the benchmarks' rank runner, the SLURM submitter and each SLURM task.
The check list is replaced by recorders, the last of which refuses; each entry point must run
the whole list, in order, and stop before anything starts. (The submit-time refusals on a real
cluster, and those of ``hydra/launcher=slurm``, are in test_slurm_preflight.py.)"""

import pytest

from automodel.config.build import ConfigError

OVERRIDES = ["parallelism=none", "data=synthetic", "trainer.max_steps=1",
             "distributed.backend=gloo"]
NAMES = ["runtime support", "model layout", "data"]
REFUSAL = "the last check refuses, a recorder"


@pytest.fixture
def checks(monkeypatch):
    """Recorders in place of the preflight's checks: ``checks`` lists (name, cfg) as they
    run; the last raises ``ConfigError``. Whatever starts ranks or submits fails the test."""
    import submitit

    import automodel.checks.preflight as pf
    import automodel.launch.local

    calls = []

    def recorder(name, refuse):
        def check(cfg):
            calls.append((name, cfg))
            if refuse:
                raise ConfigError(REFUSAL)
        return check

    monkeypatch.setattr(pf, "PREFLIGHT_CHECKS", tuple(
        (name, recorder(name, name == NAMES[-1])) for name in NAMES))

    def started(*args, **kwargs):
        raise AssertionError("ranks started or a job was submitted before the preflight ran")

    monkeypatch.setattr(automodel.launch.local, "launch", started)
    monkeypatch.setattr(automodel.launch.local, "run_on_local_ranks", started)
    monkeypatch.setattr(submitit, "AutoExecutor", started)
    return calls


def ran_the_whole_list(calls):
    assert [name for name, _ in calls] == NAMES
    assert len({id(cfg) for _, cfg in calls}) == 1  # one config, checked once
    return calls[0][1]


@pytest.mark.fast
def test_api_run_and_benchmarks_run_the_preflight(checks, tmp_path):
    from automodel.api import run
    from benchmarks.common import run_ranks

    with pytest.raises(ConfigError, match=REFUSAL):
        run(OVERRIDES, output_dir=str(tmp_path))
    assert ran_the_whole_list(checks).output_dir == str(tmp_path)
    checks.clear()
    with pytest.raises(ConfigError, match=REFUSAL):  # (it skipped the data check before)
        run_ranks(OVERRIDES, print, name="bench")
    ran_the_whole_list(checks)


@pytest.mark.fast
def test_cli_runs_the_preflight(checks, tmp_path, capsys, monkeypatch):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from automodel.api import compose
    from automodel.cli import run_from_hydra

    cfg = compose(OVERRIDES)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.mode = RunMode.RUN
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)  # (restored)
    HydraConfig.instance().set_config(cfg)  # as hydra.main does before calling the task
    with pytest.raises(SystemExit) as exit_info:
        run_from_hydra(cfg)
    assert exit_info.value.code == 2 and REFUSAL in capsys.readouterr().err
    assert ran_the_whole_list(checks).launch.gpus == 0  # this (CPU) machine's


@pytest.mark.fast
def test_slurm_submitter_and_task_run_the_preflight(checks, tmp_path, capsys):
    from launchers.slurm import TrainJob, main

    out, overrides = str(tmp_path / "job"), ["parallelism=ddp"] + OVERRIDES[1:]
    # submit time: the job's world (2 tasks), its GPUs as it asks SLURM for them
    assert main(["--tasks-per-node", "2", "--gpus-per-node", "4", "--output-dir", out]
                + overrides) == 2
    assert REFUSAL in capsys.readouterr().err
    cfg = ran_the_whole_list(checks)
    assert (cfg.launch.world_size, cfg.launch.gpus, cfg.output_dir) == (2, 4, out)
    checks.clear()
    assert main(["--tasks-per-node", "2", "--output-dir", out] + overrides) == 2
    assert ran_the_whole_list(checks).launch.gpus is None  # unknown: the tasks check
    checks.clear()
    with pytest.raises(ConfigError, match=REFUSAL):  # each task, again, before its rank
        TrainJob()(overrides, out)
    ran_the_whole_list(checks)


@pytest.mark.fast
def test_submit_time_gpus_reach_the_runtime_check(monkeypatch):
    """The runtime check at submit time reads the job's GPUs, not the submitting machine's:
    megatron_fsdp is refused for a job that asks for no GPU (``gpus_per_node=0``), passes
    for one that asks for some or whose GPUs are unknown, and is refused on this CPU machine
    when it would run here. (Only the first check, the runtime's, runs: the model and data
    checks are tested with their own options.) The submitter's torch is taken for a CUDA
    build, then a CPU build (mocked both ways: which one is installed here depends on the
    install; a CPU build is refused for a job with GPUs: tests/launch/test_slurm_env.py)."""
    import automodel.checks.preflight as pf
    from automodel.api import load_config
    from automodel.checks.preflight import preflight
    from automodel.launch.slurm import submit_env

    assert pf.PREFLIGHT_CHECKS[0][0] == "runtime support"
    monkeypatch.setattr(pf, "PREFLIGHT_CHECKS", pf.PREFLIGHT_CHECKS[:1])

    cfg = load_config(["parallelism=megatron_fsdp", "data=synthetic"], env=submit_env(1, 2))
    with monkeypatch.context() as cuda:
        cuda.setattr("automodel.checks.support.torch_build", lambda: ("2.13.0+cu128", True))
        preflight(cfg, gpus=2)
    with monkeypatch.context() as cpu:  # (setup.sh's build here; newest.sh's is a CUDA one)
        cpu.setattr("automodel.checks.support.torch_build", lambda: ("2.13.0+cpu", False))
        with pytest.raises(ConfigError, match="is a CPU build"):
            preflight(cfg, gpus=2)
    preflight(cfg, gpus=None)
    for gpus in ({"gpus": 0}, {}):
        with pytest.raises(ConfigError, match="runs on NVIDIA GPUs only"):
            preflight(cfg, **gpus)
