import dataclasses, json, sys, traceback, warnings
import torch
from tests.helpers import FP32, run_on_ranks
from tests.distributed.test_image_text_families import COVERED, _with_model, _one_step
import os


def _batch(cfg):
    from automodel.data.image_text import add_images, synthetic_format
    from automodel.models.builder import build_meta_model
    meta = build_meta_model(cfg.model)
    fmt, count = synthetic_format(meta.config, meta, seed=0)
    rows = torch.randint(0, 250, (4, count + 9), generator=torch.Generator().manual_seed(0))
    return add_images(rows, fmt, count, image_every=int(os.environ.get("IMG", "4")))


def _cfg(tmp, extra):
    from automodel.api import load_config
    return load_config(["parallelism=fsdp2", FP32, "mesh.dp_size=1", "model=llava_tiny",
                        "data=synthetic", "trainer.global_batch_size=4", *extra], str(tmp))


def _tp(rank, world, cfg, families):
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup
    from automodel.launch.preflight import preflight
    from automodel.config.build import ConfigError
    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    out = {}
    for family in families:
        try:
            run = _with_model(cfg, family)
            msg = [None]
            if rank == 0:
                try:
                    preflight(run)
                except ConfigError as e:
                    msg = [str(e)[:200]]
            torch.distributed.broadcast_object_list(msg, src=0)
            if msg[0] is not None:
                out[family] = {"refused": msg[0]}
                continue
            data = _batch(run)
            setup = build_setup(run, info)
            one = dataclasses.replace(setup, strategy="none", mesh=None, cp=None)
            out[family] = {"tp": _one_step(run, setup, data, slice(0, 4)),
                           "one": _one_step(run, one, data, slice(0, 4))}
        except BaseException as e:
            out[family] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.distributed.barrier()
    return out


if __name__ == "__main__":
    import tempfile
    extra = sys.argv[1:]
    import os; fams = os.environ.get("FAMS", ",".join(COVERED)).split(",")
    import pathlib; tmp = pathlib.Path(tempfile.mkdtemp())
    res = run_on_ranks(_tp, 2, _cfg(tmp, extra), fams, tmp_path=tmp)
    for f in fams:
        r = res[0][f]
        if "refused" in r:
            print(f, "REFUSED", r["refused"])
        elif "error" in r:
            print(f, "ERROR", r["error"])
        else:
            (l, g), (l1, g1) = r["tp"], r["one"]
            print(f, "ok" if abs(l/l1-1) < 1e-5 and abs(g/g1-1) < 1e-4 else "MISMATCH", l/l1-1, g/g1-1)
