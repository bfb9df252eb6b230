import warnings, pathlib, tempfile, sys
import torch, torch.distributed as dist
from tests.helpers import run_on_ranks

def _diag(rank, world, fam):
    warnings.simplefilter("ignore")
    from tests.distributed.test_image_text_families import _with_model
    from automodel.api import load_config
    from automodel.models.builder import build_model
    from automodel.distributed.context_parallel import ContextParallel, ATTENTION_NAME, _no_mask
    from automodel.distributed.tp_image_text import split_sequence_on_entry
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    cfg = _with_model(load_config(["model=llava_tiny"]), fam)
    ref_m = build_model(cfg.model, 0).eval()
    m = build_model(cfg.model, 0).eval()
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    outs = {}
    def rec(tag):
        def hook(mod, args, out):
            outs.setdefault(tag, []).append(out[0] if isinstance(out, tuple) else out)
        return hook
    for i, l in enumerate(ref_m.get_decoder().layers):
        l.register_forward_hook(rec(("ref", i)))
        l.self_attn.register_forward_hook(rec(("ref_attn", i)))
    for i, l in enumerate(m.get_decoder().layers):
        l.register_forward_hook(rec(("cp", i)))
        l.self_attn.register_forward_hook(rec(("cp_attn", i)))
    cp = ContextParallel(ring_size=2, ulysses_size=1, ring_rank=rank, ulysses_rank=0,
                         ring_group=dist.group.WORLD, cp_group=dist.group.WORLD)
    with torch.no_grad():
        ref_m(input_ids=ids)
        AttentionInterface.register(ATTENTION_NAME, cp.attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
        m.get_decoder().set_attn_implementation(ATTENTION_NAME)
        split_sequence_on_entry(m.get_decoder(), cp)
        m(input_ids=ids, position_ids=torch.arange(24).expand(2, -1))
    idx = cp.positions(24, torch.device("cpu"))
    res = []
    for i in range(len(m.get_decoder().layers)):
        for kind in ("attn", ""):
            r = outs[(f"ref_{kind}" if kind else "ref", i)][0].index_select(1, idx)
            c = outs[(f"cp_{kind}" if kind else "cp", i)][0]
            res.append((i, kind or "layer", (r - c).abs().max().item()))
    return res

if __name__ == "__main__":
    tmp = pathlib.Path(tempfile.mkdtemp())
    r = run_on_ranks(_diag, 2, sys.argv[1], tmp_path=tmp)
    print(r[0]); print(r[1])
