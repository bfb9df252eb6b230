import sys, pathlib, tempfile
sys.argv = [sys.argv[0]] + sys.argv[1:]
import importlib.util
spec = importlib.util.spec_from_file_location("tpf", "/tmp/q/tp_families.py"); tpf = importlib.util.module_from_spec(spec); spec.loader.exec_module(tpf)
import torch, dataclasses, warnings, traceback
from tests.helpers import run_on_ranks
def _one(rank, world, cfg, fam):
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup
    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    run = tpf._with_model(cfg, fam); data = tpf._batch(run); setup = build_setup(run, info)
    try:
        return tpf._one_step(run, setup, data, slice(0, 4))
    except Exception:
        return traceback.format_exc()[-3000:]
if __name__ == "__main__":
    tmp = pathlib.Path(tempfile.mkdtemp())
    r = run_on_ranks(_one, 2, tpf._cfg(tmp, sys.argv[2:]), sys.argv[1], tmp_path=tmp)
    print(r[0])
