"""``python plan.py`` as a user runs it (a subprocess, its own Hydra output folder): plan.json
against stored values (``tests/golden/plan_<name>.json``), the picture, the summary lines; and
the refusals that come before any simulation, and a simulation that fails.

Stored: per rank class its peak (device), host bytes (CPU offload), FLOPs and bytes per mesh
axis and kind, and the job's bubble and FLOPs. Bytes on the wire, FLOPs and the bubble are
compared exactly; memory within 2% (the simulated peak has varied by a few percent between
processes once, docs/planning.md "Accuracy"). Regenerate after a deliberate change (say why in
the commit)::

    .venv/bin/python -m tests.planning.test_plan_cli            # every layout
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
OFFLOAD = "parallelism.offload_policy={_target_:torch.distributed.fsdp.CPUOffloadPolicy}"
# name -> plan.py's overrides (data=synthetic: the plan reads no data either way)
LAYOUTS = {
    # FSDP2 x TP on 8 ranks, parameters, gradients and optimizer states offloaded to the host
    "plan_fsdp2_dp4_tp2_offload": ["parallelism=fsdp2", "mesh.dp_size=4", "mesh.tp_size=2",
                                   OFFLOAD, "data=synthetic"],
    # a zero-bubble pipeline (split backward) of 2 ranks x dp 2: one class per pipeline rank
    "plan_pp2_zero_bubble_dp2": ["parallelism=fsdp2", "mesh.dp_size=2", "mesh.pp_size=2",
                                 "pipeline=zero_bubble", "data=synthetic"],
}
MEMORY_RTOL = 0.02


def plan_cli(args: list[str], out: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, str(ROOT / "plan.py"), *args,
                           f"hydra.run.dir={out}"], cwd=out, env=env, capture_output=True,
                          text=True, timeout=timeout)


def expected_values(plan: dict) -> dict:
    """What the golden file stores of a plan."""
    return {"world_size": plan["world_size"], "bubble": plan["bubble"],
            "flops_per_step": plan["flops_per_step"],
            "ranks": [{k: r[k] for k in ("name", "count", "peak_bytes", "host_bytes", "flops",
                                         "comm_bytes_per_step")} for r in plan["ranks"]]}


def compare_plan(name: str, plan: dict, stored: dict) -> None:
    got, want = expected_values(plan), stored["expected"]
    hint = (f"{name}: plan.json moved away from tests/golden/{name}.json (generated with "
            f"{stored['generated_with']}); after a deliberate change: "
            "python -m tests.planning.test_plan_cli")
    assert {k: got[k] for k in ("world_size", "bubble", "flops_per_step")} == \
        {k: want[k] for k in ("world_size", "bubble", "flops_per_step")}, hint
    assert len(got["ranks"]) == len(want["ranks"]), hint
    for g, w in zip(got["ranks"], want["ranks"]):
        exact = ("name", "count", "flops", "comm_bytes_per_step")
        assert {k: g[k] for k in exact} == {k: w[k] for k in exact}, (hint, g["name"])
        for key in ("peak_bytes", "host_bytes"):
            assert g[key] == pytest.approx(w[key], rel=MEMORY_RTOL), (hint, g["name"], key)


def _run_layout(name: str, out: Path) -> tuple[dict, str]:
    res = plan_cli(LAYOUTS[name], out)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads((out / "plan.json").read_text()), res.stdout


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_cli_matches_golden(name, tmp_path):
    plan, stdout = _run_layout(name, tmp_path)
    compare_plan(name, plan, json.loads((GOLDEN / f"{name}.json").read_text()))
    assert (tmp_path / "plan.png").stat().st_size > 0
    lines = stdout.splitlines()
    assert lines[0].startswith("plan: llama_tiny (") and f"on {plan['world_size']} x " \
        "h100_80gb" in lines[0]
    for r in plan["ranks"]:
        assert any(line.strip().startswith(f"{r['name']} (x{r['count']}): peak ")
                   for line in lines), r["name"]
    assert [line.strip()[len("note: "):] for line in lines
            if line.strip().startswith("note: ")] == plan["notes"]
    assert lines[-1].strip() == f"run it: {plan['command']}"
    if name.endswith("offload"):
        _check_offload(plan, lines)
    else:
        assert all(r["host_bytes"] == 0 for r in plan["ranks"])
        assert plan["bubble"] > 0 and plan["pipeline"]["schedule"] == "zero_bubble"


def _check_offload(plan: dict, lines: list[str]) -> None:
    """What moves to the host under CPU offload: the sharded parameters (all of the rank's),
    their reduced gradients and the optimizer's states; the device keeps the gathered
    parameters, activations and buffers."""
    r = plan["ranks"][0]
    dev, host = r["memory"], r["host_memory"]
    params = plan["model"]["parameters"]
    shard = params * 4 // plan["world_size"]  # fp32, sharded over dp 4 x tp 2
    assert dev["parameters_sharded"] == dev["optimizer_states"] == 0, dev
    assert dev["parameters_unsharded"] > 0 and dev["activations"] > 0, dev
    assert host["parameters_sharded"] == pytest.approx(shard, rel=0.05), (host, shard)
    assert host["gradients"] == host["parameters_sharded"], host  # (every one reduced)
    assert host["optimizer_states"] >= 2 * host["parameters_sharded"], host  # AdamW's two
    assert r["host_bytes"] == sum(host.values())
    assert r["peak_bytes"] == sum(dev.values()) < r["peak_bytes_device_and_host"]
    assert r["peak_bytes_device_and_host"] <= r["peak_bytes"] + r["host_bytes"]
    assert any("offloaded to the host" in line for line in lines)
    assert any("offload_policy" in n for n in plan["notes"])


# ------------------------------------------------------------------ refused before simulating
# (a strategy or a family the planner cannot simulate: test_make_plan_refuses_before_simulating,
# in one process; the CLI turns every ConfigError into the same exit)
REFUSED = {
    "gpus_vs_mesh": (["parallelism=fsdp2", "mesh.dp_size=4", "mesh.tp_size=2", "plan.gpus=16"],
                     ["plan.gpus=16 but the mesh has 8 ranks", "set plan.gpus=8",
                      "mesh.dp_size=null"]),
    "gpus_zero": (["parallelism=fsdp2", "plan.gpus=0"],
                  ["plan.gpus=0", ">= 1", "null to plan the mesh's ranks"]),
    "unknown_key": (["parallelism=fsdp2", "mesh.dp_size=2", "+plan.foo=1"],
                    ["'plan.foo' is not an option", "Allowed keys under 'plan'"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_plan_cli_refuses_before_simulating(case, tmp_path):
    args, phrases = REFUSED[case]
    res = plan_cli([*args, "plan.picture=false"], tmp_path, timeout=300)
    assert res.returncode == 2, (res.stdout, res.stderr[-3000:])
    assert "configuration error" in res.stderr
    for phrase in phrases:
        assert phrase in res.stderr, (phrase, res.stderr[-3000:])
    # nothing simulated: no worker's traceback, no plan
    assert "Traceback" not in res.stderr and "concurrent.futures" not in res.stderr
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.fast  # one process, no process group
def test_make_plan_refuses_before_simulating(tmp_path, monkeypatch):
    """``make_plan`` refuses what cannot be simulated before it starts a worker."""
    from automodel.api import load_config
    from automodel.config.build import ConfigError
    from automodel.costing.gpus import profile
    from automodel.planning import plan as plan_module

    def no_simulation(*args, **kwargs):
        raise AssertionError("a simulation started")

    monkeypatch.setattr(plan_module, "simulate_classes", no_simulation)
    for overrides, phrases in (
            (["parallelism=megatron_fsdp"], ["parallelism=megatron_fsdp cannot be planned",
                                             "parallelism=fsdp2"]),
            (["model=qwen2_vl_tiny"], ["model=qwen2_vl_tiny", "cannot be planned",
                                       "get_rope_index"])):
        cfg = load_config([*overrides, "mesh.dp_size=2"], str(tmp_path))
        with pytest.raises(ConfigError) as err:
            plan_module.make_plan(cfg, profile("h100_80gb"))
        assert all(phrase in str(err.value) for phrase in phrases), str(err.value)


def test_failed_simulation_names_class_and_layout(tmp_path):
    """A worker whose simulation raises: the error names the rank class and the layout and
    shows the worker's own exception, not the process pool's traceback."""
    from automodel.api import load_config
    from automodel.planning.plan import (
        RankClass,
        SimulationError,
        simulate_classes,
        simulate_configs,
    )

    cfg = load_config(["parallelism=fsdp2", "mesh.dp_size=2", "data=synthetic"], str(tmp_path))
    # rank 5 of a world of 2: its mesh coordinates do not exist
    with pytest.raises(SimulationError) as err:
        simulate_classes(cfg, [RankClass("every rank", 0, 1), RankClass("rank five", 5, 1)])
    text = str(err.value)
    assert text.startswith("the simulation of rank five (rank 5) failed, layout "
                           "parallelism=fsdp2 pipeline=none dp_shard 2:"), text
    assert "Traceback (most recent call last)" in text and "simulate_rank" in text, text
    assert "concurrent.futures" not in text and "_RemoteTraceback" not in text
    # two simulations sharing a process: the one that failed is named
    with pytest.raises(SimulationError) as err:
        simulate_configs([cfg, cfg], [0, 5], workers=1, names=["first", "second"], together=2)
    assert str(err.value).startswith("the simulation of second (rank 5) failed"), str(err.value)


def regenerate(names=None) -> None:
    import tempfile

    from tests.golden.regenerate import environment

    for name in names or LAYOUTS:
        plan, _ = _run_layout(name, Path(tempfile.mkdtemp(prefix=name)))
        data = {"overrides": LAYOUTS[name], "generated_with": environment(),
                "expected": expected_values(plan)}
        (GOLDEN / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote tests/golden/{name}.json")


if __name__ == "__main__":
    regenerate(sys.argv[1:])


@pytest.mark.fast
def test_the_plan_takes_the_jobs_size_as_train_py_does():
    """plan.gpus; else the mesh's or the local ranks' (distributed.nproc_per_node, as
    ``train.py distributed.nproc_per_node=2 mesh.tp_size=2`` takes it); else the SLURM
    allocation's tasks or the torchrun world it runs in; else a refusal naming each way."""
    from automodel.api import compose
    from automodel.config.build import ConfigError
    from automodel.config.plan_schema import PlanConfig
    from automodel.config.resolve import resolve
    from automodel.planning.job_env import planning_env

    none = PlanConfig()
    assert planning_env(PlanConfig(gpus=8), None)["WORLD_SIZE"] == "8"
    env = planning_env(none, None, nproc_per_node=2, env={})
    cfg = resolve(compose(["distributed.nproc_per_node=2", "mesh.tp_size=2"]), env=env)
    assert (cfg.layout.world_size, cfg.layout.tp, cfg.layout.dp) == (2, 2, 1)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert planning_env(none, None, env=slurm)["WORLD_SIZE"] == "4"
    assert planning_env(none, None, env=slurm)["LOCAL_WORLD_SIZE"] == "2"
    torchrun = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert planning_env(none, None, env=torchrun)["LOCAL_WORLD_SIZE"] == "8"
    with pytest.raises(ConfigError, match="distributed.nproc_per_node .* SLURM allocation"):
        planning_env(none, None, env={})
