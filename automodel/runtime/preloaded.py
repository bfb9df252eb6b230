"""Imported last by the fork server (``forkserver.context``): the modules every rank of a job
imports, then ``gc.freeze()``.

A rank forked from the server finds these in ``sys.modules`` instead of importing them itself
(about 1 s of CPU per rank for transformers' modeling base, its masks and the dynamo modules
they pull in, the default family's modeling file, safetensors and tokenizers: on a node of 8
ranks, 8 s of CPU at start-up; in a Hydra sweep or a test suite, at every job). The freeze moves
everything imported so far out of the garbage collector's reach: the collections a rank runs
(``destroy_distributed`` runs two) no longer walk the hundreds of thousands of objects of
torch and transformers, and the pages holding them stay shared with the server (a collection
writes to every object it visits).
"""

import gc
import importlib

MODULES = (
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",  # the default model's family
    "safetensors.torch",
    "tokenizers",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:  # (an optional part missing: the rank imports it, or fails, itself)
        pass

gc.freeze()
