"""Every covered image-text family under each model-parallel layout: the table in
docs/image_text.md#layouts.

Each family of ``tests/distributed/test_image_text_families.COVERED`` is made tiny from its
own default config (``tests/tiny_image_text.py``) and fed the suite's batch (four rows, one
image). Rank 0 runs the preflight's model checks and its fake step first (a ``ConfigError``
is the row's ``refused``); otherwise one training step (fp32) under the layout is compared
with the same step in one process: ``ok`` within 1e-5 (loss) and 1e-4 (gradient norm) relative, else
``MISMATCH`` with both deviations, or ``ERROR`` with the exception.

    python benchmarks/image_text_families.py                       # cp2 on every family
    python benchmarks/image_text_families.py --layouts tp2,tp2_sp --only llava,qwen2_vl
    python benchmarks/image_text_families.py --layouts tp2_sp_cp2,pp2_tp2_sp    # (4 ranks)
"""

import argparse
import dataclasses
import datetime
import pathlib
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.distributed.test_image_text_families import COVERED, _batch, _one_step, _with_model  # noqa: E402
from tests.distributed.test_image_text_layouts import _pipeline_step  # noqa: E402
from tests.helpers import FP32, run_on_ranks  # noqa: E402

SP = ["parallelism.sequence_parallel=true"]
LAYOUTS = {  # name: (ranks, overrides)
    "tp2": (2, ["mesh.tp_size=2"]),
    "tp2_sp": (2, ["mesh.tp_size=2"] + SP),
    "tp2_heads": (2, ["mesh.tp_size=2", "parallelism.multimodal.vision.tp=heads"]),
    "cp2": (2, ["mesh.cp_size=2"]),
    "tp2_sp_cp2": (4, ["mesh.tp_size=2", "mesh.cp_size=2"] + SP),
    "ep2": (2, ["mesh.ep_size=2"]),
    "pp2_1f1b": (2, ["pipeline=1f1b", "pipeline.pp_microbatch_size=1"]),
    "pp2_interleaved": (2, ["pipeline=interleaved", "pipeline.pp_microbatch_size=1"]),
    "pp2_tp2_sp": (4, ["pipeline=1f1b", "pipeline.pp_microbatch_size=1", "mesh.tp_size=2"]
                   + SP),
}


def _refusal(run) -> list:
    """[the preflight's refusal on rank 0, or None], the same on every rank."""
    from automodel.checks.fake_step import check_fake_step
    from automodel.checks.preflight import check_model_layout
    from automodel.config.build import ConfigError

    why = [None]
    if torch.distributed.get_rank() == 0:
        try:
            check_model_layout(run)
            check_fake_step(run)
        except ConfigError as err:
            why = [str(err).splitlines()[0][:240]]
    torch.distributed.broadcast_object_list(why, src=0)
    return why


def _one_family(rank, world, cfg, plain, family):
    """One family's row (``plain``: the same config without the layout: the one-process
    step's)."""
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup

    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    run = _with_model(cfg, family)
    why = _refusal(run)
    if why[0] is not None:
        return f"REFUSED {why[0]}"
    data = _batch(run, multiple=8)  # (context parallelism: 2 * cp chunks)
    setup = build_setup(run, info)
    alone = _with_model(plain, family)
    one = dataclasses.replace(build_setup(alone, info), strategy="none", mesh=None, cp=None)
    (loss, norm), (loss_1, norm_1) = (
        _pipeline_step(run, setup, data) if setup.pp_enabled
        else _one_step(run, setup, data, slice(0, 4)),
        _one_step(alone, one, data, slice(0, 4)))
    dl, dn = loss / loss_1 - 1, norm / norm_1 - 1
    return ("ok" if abs(dl) < 1e-5 and abs(dn) < 1e-4 else "MISMATCH") + f" {dl:.1e} {dn:.1e}"


def _row(ranks: int, cfg, plain, family: str, seconds: float) -> str:
    """The family's row from its own ranks; a crash or a hang (``seconds``, the process
    group's timeout) is the row's ``ERROR``."""
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        return run_on_ranks(_one_family, ranks, cfg, plain, family, tmp_path=tmp,
                            timeout=datetime.timedelta(seconds=seconds))[0]
    except Exception as err:  # (a row, not the end of the sweep)
        return f"ERROR {type(err).__name__}: {' '.join(str(err).split())[-240:]}"


def main() -> None:
    from automodel.api import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="cp2", help=",".join(LAYOUTS))
    parser.add_argument("--only", default=",".join(COVERED))
    parser.add_argument("--seconds", type=float, default=120,
                        help="a family's collective timeout (a hang ends its row)")
    args = parser.parse_args()
    families = args.only.split(",")
    for layout in args.layouts.split(","):
        ranks, over = LAYOUTS[layout]
        tmp = pathlib.Path(tempfile.mkdtemp())
        base = ["parallelism=fsdp2", FP32, "model=llava_tiny", "data=synthetic",
                "trainer.global_batch_size=4", f"distributed.nproc_per_node={ranks}"]
        cfg = load_config(base + over, str(tmp))  # (dp inferred: 1, or 2 under ep)
        plain = load_config(base, str(tmp))
        for family in families:
            print(layout, family, _row(ranks, cfg, plain, family, args.seconds), flush=True)


if __name__ == "__main__":
    main()
