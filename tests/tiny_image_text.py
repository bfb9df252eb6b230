"""Tiny configs of the image-text families transformers ships, made from each family's own
default config (``AutoConfig.for_model``) by shrinking widths, depths, vocabulary and image
size. One rule set for every family: no hand-written per-family config."""

from __future__ import annotations

WIDTH = {"hidden_size", "embed_dim", "d_model", "out_hidden_size", "projection_dim",
         "vision_output_dim", "text_hidden_size", "vision_hidden_size", "output_hidden_size"}
FFN = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
       "projector_hidden_size", "text_intermediate_size"}
SMALL_FFN = {"moe_intermediate_size", "shared_expert_intermediate_size"}
DEPTH = {"num_hidden_layers", "depth", "num_layers", "encoder_layers", "decoder_layers"}
HEADS = {"num_attention_heads", "num_heads", "encoder_attention_heads",
         "decoder_attention_heads", "index_n_heads"}
EXPERTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
TOP_K = {"num_experts_per_tok", "moe_k", "moe_topk"}
CHANNELS = {"base_channels", "latent_channels"}  # convolutional image tokenizers (VQ models)
CODEBOOK = {"num_embeddings"}  # their codebooks
VOCAB = 320  # bytes 0-255 are text; special tokens are moved to 256 and up
LAYERS = 2
# each size key (of a kind above) -> its tiny value
FIXED = {**dict.fromkeys(WIDTH, 32), **dict.fromkeys(FFN, 64), **dict.fromkeys(SMALL_FFN, 32),
         **dict.fromkeys(DEPTH, LAYERS), **dict.fromkeys(HEADS, 2), **dict.fromkeys(EXPERTS, 4),
         **dict.fromkeys(TOP_K, 2), **dict.fromkeys(CHANNELS, 32), **dict.fromkeys(CODEBOOK, 64)}


def _token_key(key) -> bool:
    return isinstance(key, str) and key.endswith(("_token_id", "_token_index", "_token_ids"))


def _collect_tokens(d, found: set) -> None:
    for key, value in d.items():
        if isinstance(value, dict):
            _collect_tokens(value, found)
        elif _token_key(key):
            found.update(v for v in (value if isinstance(value, list) else [value])
                         if isinstance(v, int) and v >= 0)


def _layer_index(value: int) -> int:
    return max(value, -LAYERS) if value < 0 else min(value, LAYERS - 1)


def _fix_rope(out: dict, wants_section: bool) -> None:
    """Multi-axis rotary sections (time, height, width) that fill the shrunk head: scaled from
    the config's own, or [2, 3, 3] where the config leaves them to the modeling code."""
    heads = out.get("num_attention_heads") or 2
    head_dim = (out.get("qk_rope_head_dim") or out.get("head_dim")
                or (out.get("hidden_size") or 32) // heads)
    for key in ("rope_parameters", "rope_scaling"):
        rope = out.get(key)
        if not isinstance(rope, dict):
            continue
        section = rope.get("mrope_section")
        if not (isinstance(section, list) and section) and wants_section and rope:
            section = [2, 3, 3]
        if isinstance(section, list) and section:
            # The sections split the rotary part of the head (partial rotary: a fraction). One
            # too small for a frequency per axis keeps the head's half (interleaved sections,
            # as Qwen 3.5's, are cut to the rotary part by the modeling code).
            rotary = int(head_dim * (rope.get("partial_rotary_factor") or 1)) // 2
            half = rotary if rotary >= len(section) else head_dim // 2
            total = sum(section)
            new = [max(1, s * half // total) for s in section]
            new[-1] += half - sum(new)
            out[key] = {**rope, "mrope_section": new}


MLA = {"qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 32,
       "q_lora_rank": 32}
IMAGE_TOKENS = {"mm_tokens_per_image", "image_seq_length", "num_image_tokens"}


def _shrink(d: dict, tokens: dict, sections: set) -> dict:
    out = {}
    depth = next((d[k] for k in DEPTH if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if isinstance(value, dict) and key == "per_layer_config":
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
        elif isinstance(value, dict) and key in ("rope_parameters", "rope_scaling"):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _shrink(value, tokens, sections)
        elif isinstance(value, list) and depth and len(value) == depth and depth > LAYERS:
            out[key] = value[:LAYERS]
        elif key in MLA and isinstance(value, int):
            out[key] = MLA[key] if value else 0  # (0: no such part, e.g. no rotary half)
        elif key in IMAGE_TOKENS and isinstance(value, int):
            out[key] = 4
        elif key == "sliding_window" and value is None and "use_sliding_window" not in d \
                and "sliding_attention" not in d.get("layer_types", ["sliding_attention"]):
            out[key] = 16  # (no layer slides; some modeling code builds the mask regardless)
        elif isinstance(value, bool) or value is None:
            out[key] = value
        elif _token_key(key) and isinstance(value, list):
            out[key] = [tokens.get(v, v) for v in value]
        elif _token_key(key) and isinstance(value, int):
            out[key] = tokens.get(value, value)
        elif not isinstance(key, str):
            out[key] = value
        elif key in FIXED and isinstance(value, int):
            out[key] = FIXED[key]
        elif key == "num_key_value_heads" and isinstance(value, int):
            out[key] = 1 if value == 1 else 2
        elif key in ("head_dim", "index_head_dim") and isinstance(value, int):
            out[key] = 16 if value else 0
        elif key == "vocab_size" and isinstance(value, int):
            out[key] = VOCAB
        elif key == "image_size":
            out[key] = [32, 32] if isinstance(value, list) else 32
        elif key == "patch_size" and isinstance(value, list) and len(value) != 2:
            out[key] = value  # (one per stage of a convolutional tower: already small)
        elif key == "patch_size":
            small = 4 if "spatial_merge_size" in d or "temporal_patch_size" in d else 8
            out[key] = [small, small] if isinstance(value, list) else small
        elif key == "max_position_embeddings" and isinstance(value, int):
            out[key] = min(value, 512)
        elif key == "sliding_window" and isinstance(value, int):
            out[key] = 16
        elif key == "layer_types" and isinstance(value, list):
            out[key] = value[:LAYERS]
        elif isinstance(value, int) and _layer_key(key):
            out[key] = _layer_index(value)
        elif (isinstance(value, list) and value and all(isinstance(v, int) for v in value)
              and _layer_key(key)):
            out[key] = list(dict.fromkeys(_layer_index(v) for v in value))
        else:
            out[key] = value
    _keep_relations(d, out)
    _fix_rope(out, d.get("model_type") in sections)
    return out


def _layer_key(key: str) -> bool:
    """A layer number or list of them (``vision_feature_layer``, ``global_attn_indexes``); not
    the sizes of a sparse-attention indexer (``index_head_dim``, ``index_topk``)."""
    return ("layer" in key or "index" in key) and not key.startswith("index_")


def _sized(key) -> bool:
    return isinstance(key, str) and key.endswith(("_dim", "_size", "_rank")) and not key.endswith(
        ("vocab_size", "codebook_size", "patch_size", "image_size", "kernel_size", "merge_size"))


def _keep_relations(full: dict, out: dict) -> None:
    """Sizes the rules left alone that the full config ties to sizes the rules changed, in the
    same (sub-)config: equal to one (``codebook_dim`` = ``hidden_size``), or the sum of two
    (``qk_head_dim`` = ``qk_nope_head_dim`` + ``qk_rope_head_dim``), stay so."""
    changed = {k: v for k, v in full.items() if _sized(k) and isinstance(v, int)
               and not isinstance(v, bool) and out.get(k) != v and k not in FFN | SMALL_FFN}
    for key, value in full.items():
        if not _sized(key) or key in changed or not isinstance(value, int) or isinstance(
                value, bool) or not value:
            continue
        equal = [k for k, v in changed.items() if v == value]
        sums = [(a, b) for a in changed for b in changed
                if a < b and changed[a] + changed[b] == value]
        if equal:
            out[key] = out[equal[0]]
        elif len(sums) == 1:
            out[key] = out[sums[0][0]] + out[sums[0][1]]


def _needs_section(model_type: str) -> set:
    """model_types of the sub-configs whose modeling code supplies a default multi-axis rotary
    section when the config has none (the config class exempts it from rope validation)."""
    from transformers import AutoConfig, PretrainedConfig

    found, todo = set(), [AutoConfig.for_model(model_type)]
    while todo:
        c = todo.pop()
        if "mrope_section" in getattr(type(c), "ignore_keys_at_rope_validation", ()) or ():
            found.add(c.model_type)
        todo += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return found


def _widths(full: dict, tiny: dict, found: dict) -> None:
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(tiny.get(key), dict):
            _widths(value, tiny[key], found)
        elif key in WIDTH and isinstance(value, int) and tiny.get(key) != value:
            found.setdefault(value, set()).add(tiny[key])


def _keep_widths(full: dict, tiny: dict, widths: dict | None = None) -> None:
    """Across sub-configs: a size the rules left alone that equals a width of another
    sub-config (an adapter's output = the language model's hidden size) becomes that width."""
    if widths is None:
        widths = {}
        _widths(full, tiny, widths)
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(tiny.get(key), dict):
            _keep_widths(value, tiny[key], widths)
        elif (_sized(key) and isinstance(value, int) and tiny.get(key) == value
              and len(widths.get(value, ())) == 1):
            tiny[key] = next(iter(widths[value]))


def _with_vision(config):
    """A family whose default config leaves its vision tower out (``vision_config=None``, as
    Gemma 4's text-only default does) gets the vision config class's own default, as its
    checkpoints have."""
    from transformers import AutoConfig

    if "vision_config" in (getattr(config, "sub_configs", None) or {}) and getattr(
            config, "vision_config", None) is None:
        return AutoConfig.for_model(config.model_type, vision_config={})
    return config


def tiny_config(model_type: str) -> dict:
    """``model.config`` (for ``AutoConfig.for_model``) of a tiny model of ``model_type``."""
    from transformers import AutoConfig

    full = _with_vision(AutoConfig.for_model(model_type)).to_dict()
    found: set = set()
    _collect_tokens(full, found)
    big = sorted(t for t in found if t >= 256)
    tokens = {t: 256 + i for i, t in enumerate(big)}
    tiny = _shrink(full, tokens, _needs_section(model_type))
    _keep_widths(full, tiny)
    if any(k.endswith("_token_offset") for k in full):  # discrete image codes at offsets
        tiny["text_config"]["vocab_size"] = full["text_config"]["vocab_size"]  # (they fit)
    pinpoints, size = tiny.get("image_grid_pinpoints"), (full.get("vision_config") or {}).get(
        "image_size")
    if pinpoints and isinstance(size, int):  # tiles: the same grids, in tiny images
        tiny["image_grid_pinpoints"] = [[h * 32 // size, w * 32 // size] for h, w in pinpoints]
    drop = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")
    return {k: v for k, v in tiny.items() if k not in drop}
