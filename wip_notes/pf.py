import sys, warnings, dataclasses
warnings.simplefilter("ignore")
from tests.distributed.test_image_text_families import _with_model
from tests.helpers import FP32
from automodel.api import load_config
from automodel.launch.preflight import preflight
from automodel.config.build import ConfigError
extra = sys.argv[2:]
for fam in sys.argv[1].split(","):
    cfg = load_config(["parallelism=fsdp2", FP32, "mesh.dp_size=1", "mesh.tp_size=2", "model=llava_tiny",
                       "data=synthetic", "trainer.global_batch_size=4", *extra])
    cfg = _with_model(cfg, fam)
    try:
        preflight(cfg)
        print(fam, "PASSES PREFLIGHT")
    except ConfigError as e:
        print(fam, "REFUSED:", str(e)[:400])
