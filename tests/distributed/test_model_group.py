"""A job whose model holds only some of its ranks (issue 23, item 12).

Three gloo ranks: the model trains on global ranks 1 and 2 (FSDP2, dp=2, a mesh built with
``build_mesh(ranks=[1, 2])``), while rank 0 stands for a second model of the job (a frozen
reference, a teacher): it only runs collectives on a group of its own and never joins the
world group until the model is done. Any collective of the recipe on the world group (the
per-step read, a barrier, a save or load, the evaluation, the stop signal, the start-up
broadcasts) would wait for rank 0 and fail at the 1-minute collective timeout. The model's
first rank is global rank 1: files that "rank 0" writes (metrics, the checkpoint's rename)
must come from it.

The run evaluates, saves, stops on a signal that reaches one model rank only, then resumes
from that checkpoint, and must match the single-process run throughout. The same job checks
that a pipeline's tied-embedding group (created while the model is parallelized, after the
meshes) is made by the model's ranks alone.
"""

import datetime
import json
import os
import signal

import torch

from automodel.checkpoint.paths import complete_checkpoints
from automodel.tracking.metrics import read_metrics
from tests.distributed.test_parity import assert_matches
from tests.helpers import BASE, FP32, ON_CPU, run_on_ranks

MODEL_RANKS = [1, 2]
EVAL = ["data.eval_fraction=0.1", "trainer.eval_every=2"]
RUN = BASE + ON_CPU + EVAL + [
    "parallelism=fsdp2", FP32, "distributed.nproc_per_node=2", "checkpoint.every_steps=2",
    # a collective on the world group would hang: fail in a minute, not in half an hour
    "distributed.timeout_minutes=1", "distributed.startup_timeout_minutes=1"]
STOP_AFTER = 3  # the model's second rank alone receives SIGUSR1 during this step
DONE = "model_group_test/done"


def _job(rank, world, out):
    import torch.distributed as dist

    from automodel.api import load_config
    from automodel.distributed.init import init_distributed
    from automodel.distributed.mesh import build_mesh
    from automodel.errors import TrainingStopped
    from automodel.recipes import components
    from automodel.recipes import train as runner

    cfg = load_config(RUN, out, env={})  # (env: not the 3-rank job's torchrun variables)
    # every rank creates every group of the job, in the same order (torch's rule)
    mesh = build_mesh("cpu", "gloo", cfg.distributed.startup_timeout_minutes, pp=1,
                      dp_replicate=1, dp_shard=2, cp=1, tp=1, ranks=MODEL_RANKS)
    pp_mesh = build_mesh("cpu", "gloo", 1, pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1,
                         ranks=MODEL_RANKS)
    teacher = dist.new_group([0])
    store = dist.distributed_c10d._get_default_store()
    if rank not in MODEL_RANKS:  # the other model: its own collectives only
        t = torch.ones(1)
        for _ in range(3):
            dist.all_reduce(t, group=teacher)
        store.wait([DONE], datetime.timedelta(minutes=10))
        return None

    class SignalOneRank(components.Faults):
        def before_step(self, step):
            super().before_step(step)
            if step == STOP_AFTER and self.rank == 1:  # (the rank within the model's group)
                os.kill(os.getpid(), signal.SIGUSR1)

    components.Faults = SignalOneRank
    tied = _tied_grads(pp_mesh, dist.get_rank(pp_mesh.group))
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes,
                            need_group=True)
    try:
        runner.train(cfg, info, mesh=mesh)
        stopped = None
    except TrainingStopped as err:
        stopped = (err.signum, err.step)
    resumed = runner.train(load_config(RUN + ["checkpoint.resume=auto"], out, env={}), info,
                           mesh=mesh)
    if dist.get_rank(mesh.group) == 0:
        store.set(DONE, "1")
    return {"stopped": stopped, "resumed": resumed, "tied": tied}


class _Ends(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def _tied_grads(pp_mesh, stage: int) -> list:
    """Stage ``stage`` of two holds one copy of a tied weight; the copies' gradients sum."""
    from automodel.distributed.pipelining.tied import TiedEmbeddingSync

    part = _Ends()
    sync = TiedEmbeddingSync([part], [stage], [[0], [1]], pp_mesh, datetime.timedelta(minutes=1))
    weight = part.embed.weight if stage == 0 else part.head.weight
    weight.grad = torch.full_like(weight, float(stage + 1))
    sync.sync_grads()
    return weight.grad.flatten().tolist()


def test_model_on_some_ranks_trains_saves_stops_and_resumes(reference, tmp_path):
    out = tmp_path / "out"
    results = run_on_ranks(_job, 3, str(out), tmp_path=tmp_path,
                           timeout=datetime.timedelta(minutes=1))
    assert results[0] is None
    assert results[1]["tied"] == results[2]["tied"] == [3.0] * 6  # 1 + 2 on both stages
    # one rank received the signal; both stopped after the same step
    assert [r["stopped"] for r in results[1:]] == [(signal.SIGUSR1, STOP_AFTER)] * 2
    # metrics.jsonl: written by the model's first rank (global rank 1), both runs
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-2:] == results[1]["resumed"]
    assert_matches(records, reference(*EVAL))
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    ref_evals = {r["step"]: r["eval_loss"] for r in reference(*EVAL) if "eval_loss" in r}
    assert set(evals) == {2, 4, 5} == set(ref_evals)
    for step, loss in evals.items():
        assert abs(loss - ref_evals[step]) <= 1e-5 * abs(loss)
    # checkpoints: complete (renamed by the model's first rank), model-local rank files
    found = [os.path.basename(p) for p in complete_checkpoints(str(out / "checkpoints"))]
    assert found == ["step_00000003", "step_00000004", "step_00000005"]  # (keep_last=3)
    step3 = out / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in step3.glob("rng_rank*.pt")) == ["rng_rank0.pt",
                                                                   "rng_rank1.pt"]
    assert json.loads((step3 / "trainer.json").read_text())["world_size"] == 2
