"""The registry of strategies (automodel/config/strategies.py): a strategy added from outside
automodel trains with parity through the real job path; an unknown name never reaches
``parallelize``; a strategy that does not declare its gradient sync cannot be registered; and
nothing in automodel compares strategy names."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from automodel.config.build import ConfigError
from automodel.config.schema import DDPConfig
from automodel.config.strategies import (
    ONE_PROCESS,
    SHIPPED,
    STRATEGIES,
    GradSync,
    Reduce,
    Strategy,
    strategy,
)
from tests.distributed.test_parity import assert_matches
from tests.distributed.toy_strategy import TOY, AllReduceConfig
from tests.helpers import FP32, run_on_ranks, train

ROOT = Path(__file__).resolve().parents[2]
TOY_OVERRIDES = [f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]",
                 "parallelism=ddp_via_allreduce"]
ALLOWED = "Allowed: ddp, ddp_via_allreduce, fsdp2, hsdp, megatron_fsdp, none"


def test_a_registered_strategy_trains_with_parity(reference, tmp_path):
    # The toy strategy is 3 files (tests/distributed/toy_strategy.py, its option file
    # tests/conf/parallelism/ddp_via_allreduce.yaml, and no line of automodel): 2 ranks with
    # 2 micro-batches each match one process (its hooks all-reduce every gradient; without
    # them each rank would step on its own gradients and the losses would part).
    from automodel.api import load_config

    cfg = load_config(["distributed.backend=gloo", *TOY_OVERRIDES], env={})
    assert (cfg.strategy.name, type(cfg.parallelism), cfg.world_size) == (
        "ddp_via_allreduce", AllReduceConfig, 2)  # (2 ranks by default, as every DP strategy)
    records = train([*TOY_OVERRIDES, "trainer.local_batch_size=2"], tmp_path)
    assert_matches(records, reference())


def _toy_accumulates(rank, world):
    """Two micro-batches under the toy through ``parallelize``'s wrap and the step's
    grad_sync_context: nothing reduced after the first, every gradient once after the last."""
    from automodel.distributed.init import DistInfo
    from automodel.distributed.mesh import build_mesh
    from automodel.distributed.setup import DistributedSetup
    from automodel.parallelize import apply_data_parallel
    from automodel.recipes.step import grad_sync_context

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1)
    setup = DistributedSetup("ddp_via_allreduce", AllReduceConfig(),
                             DistInfo("gloo", torch.device("cpu"), rank, world, rank), mesh)
    torch.manual_seed(0)
    model = apply_data_parallel(nn.Linear(4, 3), [], setup, [])
    torch.manual_seed(100 + rank)  # different data on each rank
    counts = []
    for is_last in (False, True):
        with grad_sync_context(model, setup, is_last):
            model(torch.randn(5, 4)).pow(2).sum().backward()
        counts.append(model.reduces)
    return counts, [p.grad for p in model.parameters()]


def test_the_toy_strategy_defers_its_reduce_to_the_last_micro_batch(tmp_path):
    (counts0, grads0), (counts1, grads1) = run_on_ranks(_toy_accumulates, 2, tmp_path=tmp_path)
    assert counts0 == counts1 == [0, 2]  # (weight and bias, in the last backward only)
    for g0, g1 in zip(grads0, grads1):
        torch.testing.assert_close(g0, g1)


@pytest.mark.fast
def test_an_unknown_strategy_is_refused_with_the_allowed_names(tmp_path):
    from automodel.api import compose
    from automodel.config.resolve import resolve
    from automodel.distributed.init import DistInfo
    from automodel.distributed.setup import DistributedSetup

    info = DistInfo("gloo", torch.device("cpu"), 0, 1, 0)
    for refuse in (lambda: strategy("fsdp"),
                   lambda: DistributedSetup("fsdp", DDPConfig(), info, None)):
        with pytest.raises(ConfigError) as err:  # (so no setup can reach parallelize)
            refuse()
        assert str(err.value) == ("parallelism='fsdp': no such strategy. Did you mean "
                                  f"'fsdp2'? {ALLOWED}")
    cfg = compose(["parallelism=ddp"])
    cfg.parallelism = {"bucket_cap_mb": 4}  # a parallelism node no registered schema types
    with pytest.raises(ConfigError, match="'parallelism' has no strategy schema .*"
                       "- /schema/parallelism@_here_: NAME.*"
                       + ALLOWED.replace("Allowed: ", "")):
        resolve(cfg, output_dir=str(tmp_path))


@pytest.mark.fast
def test_a_strategy_without_gradient_sync_cannot_be_registered():
    with pytest.raises(TypeError, match="grad_sync"):
        Strategy("quiet", AllReduceConfig)  # no declaration at all
    with pytest.raises(TypeError, match="declare how its gradients are synchronized"):
        Strategy("quiet", AllReduceConfig, None, wrap=TOY.wrap)
    with pytest.raises(TypeError, match="IN_BACKWARD.* needs a wrap"):
        Strategy("quiet", AllReduceConfig, GradSync(Reduce.IN_BACKWARD))  # says, but no wrap
    with pytest.raises(TypeError, match="IN_FINISH.* needs the finish hook"):
        GradSync(Reduce.IN_FINISH)
    with pytest.raises(TypeError, match="Reduce"):
        GradSync("allreduce")
    with pytest.raises(TypeError, match="runs one process .* nothing to wrap"):
        Strategy("quiet", AllReduceConfig, ONE_PROCESS, wrap=TOY.wrap)
    with pytest.raises(ValueError, match="'ddp_via_allreduce' is already registered"):
        STRATEGIES.register(TOY)
    with pytest.raises(ValueError, match="AllReduceConfig is already 'ddp_via_allreduce'"):
        STRATEGIES.register(Strategy("toy2", AllReduceConfig, TOY.grad_sync, wrap=TOY.wrap))
    assert "quiet" not in STRATEGIES and "toy2" not in STRATEGIES
    # every shipped strategy declares its sync, and each of its hooks imports
    hooks = ("wrap", "wrap_optimizer", "materialize", "ac_blocks", "backward_error", "refusal")
    for entry in SHIPPED:
        assert isinstance(entry.grad_sync, GradSync), entry.name
        assert entry.one_process == (entry.name == "none"), entry.name
        for which in hooks + ("defer", "finish", "average_size"):
            owner = entry.grad_sync if which in ("defer", "finish", "average_size") else entry
            assert getattr(owner, which) is None or callable(entry.hook(which)), which


@pytest.mark.fast
def test_nothing_in_automodel_compares_strategy_names():
    # Code asks the entry for a capability or a hook (config/strategies.py) instead.
    # ("none" alone is also an AC mode and a pipeline choice: compared as a strategy's name)
    compare = re.compile(r"strategy\)?\s*(==|!=|\bin\b|\bnot in\b)|"
                         r"parallelism['\"]\]\s*(==|!=)|"
                         r"(==|!=)\s*['\"](ddp|fsdp2|hsdp|megatron_fsdp)['\"]")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "automodel").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if compare.search(line) and "zero_dp_strategy" not in line
             and not line.lstrip().startswith("#")]
    assert not found, "\n".join(found)


@pytest.mark.fast
def test_a_registered_strategy_gets_its_schema_checked_by_hydra():
    # the toy's options are CommonOptions: FSDP2's policy is not one of them (Hydra refuses it)
    from hydra.errors import ConfigCompositionException

    from automodel.api import load_config

    with pytest.raises(ConfigCompositionException, match="mp_policy"):
        load_config([*TOY_OVERRIDES, FP32], env={})
