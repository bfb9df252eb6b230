"""A Hydra sweep's measurements beside the plan's predictions:
``python -m automodel.sweep_report SWEEP_DIR [--gpu PROFILE] [--calibrate JOB]``.

Each job folder of ``python train.py -m ...`` (``<sweep>/<job number>/`` with
``.hydra/overrides.yaml`` and ``metrics.jsonl``) is planned from its own recorded overrides,
resolved as ``plan.py`` resolves them for the job's world size (the ranks it ran on), and its
measured peak of live tensor bytes (``peak_tensor_bytes``, each rank's, from step 2 on) and
tokens/s are set beside the plan's. Writes ``sweep_report.md``, ``sweep_report.json`` and
``sweep_report.png`` (docs/planning.md, "Sweep report").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from automodel.config.build import ConfigError

GiB, MiB = 1024**3, 1024**2
_HEADER = re.compile(r"automodel: \S+ on (\d+) rank\(s\) .*, device (\w+)")


# ----------------------------------------------------------------------------- reading a sweep
def read_sweep(sweep_dir: str) -> list[dict]:
    """Every job folder of ``sweep_dir`` (a number holding ``.hydra/overrides.yaml``), in job
    order, with what it measured (``read_job``)."""
    if not os.path.isdir(sweep_dir):
        raise ConfigError(f"sweep report: {sweep_dir!r} is not a folder (pass the sweep's "
                          "folder: multirun/<date>/<time>, or hydra.sweep.dir)")
    numbers = sorted(int(n) for n in os.listdir(sweep_dir) if n.isdigit() and os.path.isfile(
        os.path.join(sweep_dir, n, ".hydra", "overrides.yaml")))
    if not numbers:
        raise ConfigError(f"sweep report: {sweep_dir!r} holds no job folders (<number>/.hydra/"
                          "overrides.yaml): is it the folder of a `train.py -m` sweep?")
    return [read_job(os.path.join(sweep_dir, str(n)), n) for n in numbers]


def read_job(job_dir: str, number: int) -> dict:
    """A job's overrides, world size and device (its train.log's start line, else the ranks
    its metrics name), and its measurements; ``status`` says what is missing."""
    import yaml

    with open(os.path.join(job_dir, ".hydra", "overrides.yaml")) as f:
        overrides = [str(o) for o in yaml.safe_load(f) or []]
    job = {"number": number, "dir": job_dir, "overrides": overrides, "status": "ok",
           "error": None, "world_size": None, "device": None, "measured": None}
    log = os.path.join(job_dir, "train.log")
    if os.path.isfile(log):
        with open(log) as f:
            found = _HEADER.search(f.read())
        if found:
            job["world_size"], job["device"] = int(found.group(1)), found.group(2)
    path = os.path.join(job_dir, "metrics.jsonl")
    records = []
    if os.path.isfile(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    if not records:
        job["status"] = "no metrics"
        job["error"] = "no metrics.jsonl records: the job failed or did not finish"
        return job
    job["measured"] = measurements(records)
    job["world_size"] = job["world_size"] or len(job["measured"]["peak_bytes_by_rank"] or [])
    if job["measured"]["peak_tensor_bytes"] is None:
        job["status"] = "no peak_tensor_bytes"
        job["error"] = ("metrics.jsonl has no peak_tensor_bytes from step 2 on (on the CPU, "
                        "run with trainer.track_tensor_memory=true)")
    return job


def measurements(records: list[dict]) -> dict:
    """tokens/s: the mean of the records after the first (whose window holds step 1's
    start-up), else the first's; peak_tensor_bytes: the largest of the records of step 2 on,
    for each rank and over the ranks."""
    timed = records[1:] or records
    later = [r for r in records if r.get("step", 0) >= 2 and r.get("peak_tensor_bytes")]
    by_rank = None
    for r in later:
        ranks = r.get("peak_tensor_bytes_by_rank") or [r["peak_tensor_bytes"]]
        by_rank = ranks if by_rank is None else [max(a, b) for a, b in zip(by_rank, ranks)]
    return {"steps": max(r.get("step", 0) for r in records),
            "tokens_per_s": sum(r["tokens_per_second"] for r in timed) / len(timed),
            "tokens_per_s_includes_step_1": len(records) == 1,
            "peak_tensor_bytes": max((r["peak_tensor_bytes"] for r in later), default=None),
            "peak_bytes_by_rank": by_rank}


# ----------------------------------------------------------------------------- planning the jobs
def resolve_job(job: dict, planned: bool = True):
    """The job's ``TrainConfig`` as ``plan.py`` resolves it with ``plan.gpus`` = the ranks
    the job ran on (``planned=False``: as a launch here would), the model's layout checked."""
    from automodel.checks.preflight import check_model_layout
    from automodel.config.compose import load_config
    from automodel.config.plan_schema import PlanConfig
    from automodel.planning.job_env import planning_env

    if planned and not job["world_size"]:
        raise ConfigError("its ranks are unknown: no start line in train.log ('... on N "
                          "rank(s) ...') and no peak_tensor_bytes_by_rank in metrics.jsonl")
    env = planning_env(PlanConfig(gpus=job["world_size"]), None) if planned else None
    cfg = load_config(job["overrides"], output_dir=job["dir"], env=env)
    check_model_layout(cfg)
    return cfg


def simulate_jobs(cfgs: dict, workers: int | None = None) -> dict:
    """job number -> its rank classes' simulations: every class of every job simulated in
    one pool of fresh processes (each simulation starts its own fake process group)."""
    from automodel.planning.plan import rank_classes, simulate_configs

    tasks = [(n, cfg, c.rank) for n, cfg in cfgs.items() for c in rank_classes(cfg)]
    sims = simulate_configs([t[1] for t in tasks], [t[2] for t in tasks], workers=workers) \
        if tasks else []
    out: dict = {n: [] for n in cfgs}
    for (n, _, _), sim in zip(tasks, sims):
        out[n].append(sim)
    return out


def calibrated_efficiency(plan: dict, tokens_per_s: float, profile) -> float:
    """The ``compute_efficiency`` at which ``plan``'s job runs at the measured
    ``tokens_per_s`` on ``profile`` (the rest of the cost model as it is): bisection, as the
    step time falls when the efficiency rises."""
    from automodel.costing import cost
    from automodel.costing.calibrate import bisect_efficiency, predicted_step

    check = {"gpu": profile.as_dict(), "calibration": plan["calibration"],
             "bubble": plan["bubble"], "sizes": cost.mesh_sizes(plan["layout"]),
             "ranks": plan["ranks"]}
    target = plan["batch"]["global_batch_size"] * plan["batch"]["seq_len"] / tokens_per_s
    if predicted_step(check, {**plan["calibration"], "compute_efficiency": 1.0}) > target:
        raise ConfigError(f"sweep report --calibrate: the measured {tokens_per_s:.0f} tokens/s "
                          f"is faster than {profile.name} at its full peak FLOP/s predicts; "
                          "is --gpu the GPU the sweep ran on?")
    return bisect_efficiency(check, target, "compute_efficiency", plan["calibration"])[0]


def plan_jobs(jobs: list[dict], profile, calibrate: int | None = None,
              workers: int | None = None) -> tuple[dict, dict | None]:
    """(job number -> plan, the calibration used): the jobs with measurements planned; a job
    whose config no longer resolves gets its error instead."""
    from hydra.errors import HydraException

    from automodel.planning.plan import make_plan

    cfgs = {}
    for job in jobs:
        try:
            if job["measured"] is not None:
                cfgs[job["number"]] = resolve_job(job)
            else:  # (a sweep's job refused by its checks leaves no other trace of why)
                resolve_job(job, planned=False)
        except (ConfigError, HydraException) as err:  # (HydraException: an override gone)
            if job["measured"] is None:
                job["error"] += f"; its config is refused: {err}"
            else:
                job["status"], job["error"] = "not planned", str(err)
    sims = simulate_jobs(cfgs, workers)
    plans = {n: make_plan(cfg, profile, None, simulations=sims[n]) for n, cfg in cfgs.items()}
    if calibrate is None:
        return plans, None
    if calibrate not in plans:
        raise ConfigError(f"sweep report --calibrate {calibrate}: job {calibrate} has no plan "
                          f"and measurement; planned jobs: {sorted(plans) or 'none'}")
    ref = next(j for j in jobs if j["number"] == calibrate)
    calibration = {"compute_efficiency": calibrated_efficiency(
        plans[calibrate], ref["measured"]["tokens_per_s"], profile)}
    return {n: make_plan(cfg, profile, calibration, simulations=sims[n])
            for n, cfg in cfgs.items()}, calibration


# ----------------------------------------------------------------------------- the report
def report(sweep_dir: str, gpu: str | None = None, gpu_spec: dict | None = None,
           calibrate: int | None = None, workers: int | None = None) -> dict:
    """The sweep report (``sweep_report.json``'s content; ``picture.draw_sweep`` draws it)."""
    from automodel.costing.gpus import profile

    jobs = read_sweep(sweep_dir)
    prof = profile(gpu or "h100_80gb", **(gpu_spec or {}))
    plans, calibration = plan_jobs(jobs, prof, calibrate, workers)
    on_gpus = any(j["device"] == "cuda" for j in jobs)
    timed = gpu is not None or on_gpus or calibration is not None
    swept = swept_keys(jobs)
    rows = [job_row(j, plans.get(j["number"]), swept, timed) for j in jobs]
    return {"sweep_dir": os.path.abspath(sweep_dir), "gpu": prof.as_dict(),
            "device": "cuda" if on_gpus else "cpu", "planned_time_shown": timed,
            "calibration": calibration, "compared": compared_text(prof.name, on_gpus, timed,
                                                                  calibrate),
            "common_overrides": [o for o in jobs[0]["overrides"] if _key(o) not in swept],
            "jobs": rows}


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def swept_keys(jobs: list[dict]) -> set:
    """The override keys whose values differ between jobs (the sweep's axes)."""
    import yaml

    values: dict = {}
    for j in jobs:
        for o in j["overrides"]:  # (a -m job records `true` as `True`)
            key, _, value = o.partition("=")
            try:
                value = repr(yaml.safe_load(value))
            except yaml.YAMLError:
                pass
            values.setdefault(key, set()).add(value)
    keys = set().union(*[{_key(o) for o in j["overrides"]} for j in jobs])
    return {k for k in keys if len(values[k]) > 1 or any(
        k not in {_key(o) for o in j["overrides"]} for j in jobs)}


def job_row(job: dict, plan: dict | None, swept: set, timed: bool) -> dict:
    """One job of the report: its swept overrides, what it measured and what its plan
    predicts, per rank class (measured: the largest of the class's ranks)."""
    m = job["measured"] or {}
    row = {"job": job["number"], "layout": " ".join(o for o in job["overrides"]
                                                     if _key(o) in swept) or "(defaults)",
           "overrides": job["overrides"], "status": job["status"], "error": job["error"],
           "world_size": job["world_size"], "device": job["device"],
           "measured_tokens_per_s": m.get("tokens_per_s"),
           "measured_tokens_per_s_includes_step_1": m.get("tokens_per_s_includes_step_1"),
           "measured_peak_tensor_bytes": m.get("peak_tensor_bytes"), "steps": m.get("steps"),
           "planned_tokens_per_s": None, "planned_step_time_s": None, "classes": []}
    if plan is None:
        return row
    row.update(plan_command=plan["command"], planned_peak_bytes=max(
        r["peak_bytes"] for r in plan["ranks"]), warnings=plan["warnings"])
    if timed:
        row.update(planned_tokens_per_s=plan["tokens_per_s"],
                   planned_step_time_s=plan["step_time_s"])
    by_rank = m.get("peak_bytes_by_rank") or []
    for r in plan["ranks"]:
        ranks = by_rank[r["example_rank"]:r["example_rank"] + r["count"]]
        measured = max(ranks) if ranks else None
        # a CPU rank's memory is its device's and its host's (CPU offload) at once
        planned = r["peak_bytes"] if job["device"] == "cuda" else \
            r.get("peak_bytes_device_and_host", r["peak_bytes"])
        row["classes"].append({
            "name": r["name"], "ranks": [r["example_rank"], r["example_rank"] + r["count"] - 1],
            "planned_peak_bytes": planned, "measured_peak_bytes": measured,
            "error": None if not measured else planned / measured - 1})
    return row


def compared_text(gpu: str, on_gpus: bool, timed: bool, calibrate: int | None) -> str:
    text = ("Memory: the plan's peak of live tensor bytes per rank class against the largest "
            "peak_tensor_bytes of the class's ranks from step 2 on (" +
            ("the CUDA allocator's" if on_gpus else "counted on the CPU") + "). Time: ")
    if not timed:
        return text + ("not compared: the sweep ran on CPU ranks and the cost model is for "
                       "GPUs (--gpu PROFILE, or --calibrate JOB for predictions relative to "
                       "one job).")
    if calibrate is not None:
        return text + (f"predicted on {gpu} with compute_efficiency calibrated so that job "
                       f"{calibrate}'s prediction equals its measured tokens/s: the other "
                       "jobs' predictions are relative to it.")
    return text + (f"predicted on the {gpu} profile; the sweep ran on "
                   f"{'GPUs' if on_gpus else 'CPU ranks, not on that GPU'}.")


def _size(n) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def _pct(e) -> str:
    return "-" if e is None else f"{100 * e:+.1f}%"


def _num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def markdown(rep: dict) -> str:
    """The report's table, one row per rank class of each job; then why jobs are missing."""
    head = ["job", "layout", "ranks", "rank class", "measured peak", "planned peak", "error",
            "measured tokens/s"] + (["planned tokens/s"] if rep["planned_time_shown"] else [])
    lines = [f"# Sweep report: {rep['sweep_dir']}", "", rep["compared"], "",
             "Common overrides: `" + (" ".join(rep["common_overrides"]) or "(none)") + "`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for row in rep["jobs"]:
        lines += _table_rows(row, rep["planned_time_shown"])
        if row["error"]:
            notes.append(f"- #{row['job']} ({row['status']}): {row['error']}")
    lines += ["", "error = planned / measured - 1. Measured tokens/s: the mean of the "
              "metrics.jsonl records after the first (step 1's start-up)."]
    if rep["calibration"]:
        lines.append(f"Calibration: {json.dumps(rep['calibration'])}.")
    lines += ["", "Jobs not compared in full:", *notes] if notes else []
    return "\n".join(lines) + "\n"


def _table_rows(row: dict, timed: bool) -> list[str]:
    first = [f"#{row['job']}", f"`{row['layout']}`", str(row["world_size"] or "?")]
    out = []
    for i, c in enumerate(row["classes"] or [None]):
        cells = first if i == 0 else ["", "", ""]
        if c is None:
            cells += [f"**{row['status']}** (below)", _size(row["measured_peak_tensor_bytes"]),
                      "-", "-"]
        else:
            a, b = c["ranks"]
            cells += [f"{c['name']} ({f'ranks {a}-{b}' if b > a else f'rank {a}'})",
                      _size(c["measured_peak_bytes"]), _size(c["planned_peak_bytes"]),
                      _pct(c["error"])]
        cells += [_num(row["measured_tokens_per_s"]) if i == 0 else ""]
        cells += [_num(row["planned_tokens_per_s"]) if i == 0 else ""] if timed else []
        out.append("| " + " | ".join(cells) + " |")
    return out


def write_report(rep: dict, out: str) -> list[str]:
    from automodel.planning.picture import draw_sweep

    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"sweep_report.{ext}") for ext in ("md", "json", "png")]
    with open(paths[0], "w") as f:
        f.write(markdown(rep))
    with open(paths[1], "w") as f:
        json.dump(rep, f, indent=1)
    draw_sweep(rep, paths[2])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m automodel.sweep_report",
        description="A train.py -m sweep's measured peak memory and tokens/s beside the plan's.")
    parser.add_argument("sweep_dir", help="the sweep's folder (multirun/<date>/<time>)")
    parser.add_argument("--gpu", help="GPU profile for predicted times (default: times shown "
                        "only for a GPU sweep, on h100_80gb)")
    parser.add_argument("--gpu-spec", action="append", default=[], metavar="FIELD=VALUE",
                        help="a field of the GPU profile replaced (repeatable)")
    parser.add_argument("--calibrate", type=int, metavar="JOB",
                        help="set compute_efficiency from this job's measured tokens/s")
    parser.add_argument("--out", help="folder for the report (default: the sweep's)")
    parser.add_argument("--workers", type=int, help="simulation processes (default: CPUs)")
    args = parser.parse_args(argv)
    try:
        spec = dict(s.split("=", 1) for s in args.gpu_spec)
        rep = report(args.sweep_dir, args.gpu, spec, args.calibrate, args.workers)
    except (ConfigError, ValueError) as err:
        print(f"automodel: sweep report: {err}", file=sys.stderr)
        return 2
    paths = write_report(rep, args.out or args.sweep_dir)
    print(markdown(rep))
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
