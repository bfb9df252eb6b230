"""Image-text samples from JSONL files through the model's own processor (``data=files`` with
an image-text model).

Each line is one sample: ``{"text": ..., "image": "a.png"}`` (or a list of paths; relative
paths are read from the JSONL file's directory; no image field: a text-only sample). The text
holds the processor's image placeholder once per image (``<image>`` for LLaVA,
``<start_of_image>`` for Gemma 3, ``<|vision_start|><|image_pad|><|vision_end|>`` for
Qwen2-VL), as the model's chat format would. The processor (``AutoProcessor`` from
``data.tokenizer_path``, else ``model.pretrained_path``) expands each placeholder into the
model's image tokens; a sample is one row, cut to ``trainer.seq_len + 1`` tokens or padded
(padding is never a label). Image files are read again, through the processor's image part,
each time a micro-batch holds them: the host keeps token ids, not pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from automodel.data.image_text import ImageFormat, ImageTextData


def _open_image(ref):
    from PIL import Image

    if not isinstance(ref, str):
        return ref  # an image object (the blank placeholder)
    with Image.open(ref) as image:
        return image.convert("RGB")


def _records(paths: list[str], text_key: str, image_key: str):
    """(where, text, image paths) of every sample line."""
    for path in paths:
        if not path.endswith(".jsonl"):
            raise ValueError(f"data.paths: {path}: an image-text model reads .jsonl files (one "
                             f"{{\"{text_key}\": ..., \"{image_key}\": ...}} per line)")
        folder = Path(path).parent
        for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            record = json.loads(line)
            if text_key not in record:
                raise ValueError(f"{where}: no '{text_key}' field (data.text_key)")
            images = record.get(image_key) or []
            images = [images] if isinstance(images, str) else list(images)
            resolved = [str(folder / image) for image in images]
            for image, full in zip(images, resolved):
                if not Path(full).is_file():
                    raise ValueError(f"{where}: image file {image!r} not found (looked for "
                                     f"{full})")
            yield where, str(record[text_key]), resolved


def read_image_text(data, seq_len: int, meta_model, processor_dir: str) -> ImageTextData:
    """The samples of ``data.paths`` (a ``FilesDataConfig``) for the image-text model
    ``meta_model`` (structure only), tokenized by the processor in ``processor_dir``."""
    from PIL import Image
    from transformers import AutoProcessor

    from automodel.models import multimodal as mm
    from automodel.models.image_inputs import tokens_per_image

    try:
        processor = AutoProcessor.from_pretrained(processor_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the model's processor from {processor_dir!r} "
                         f"(data.tokenizer_path, else model.pretrained_path): {err}") from err
    token = mm.image_token_id(meta_model.config)
    inputs = mm.forward_inputs(meta_model)

    def load(ref) -> dict:
        out = processor.image_processor(images=_open_image(ref), return_tensors="pt")
        return {k: v for k, v in out.items() if k in inputs}

    blank = Image.new("RGB", (64, 64))
    count = tokens_per_image(meta_model, load(blank))
    fmt = ImageFormat(image_token_id=token, load=load,
                      placeholder=(torch.tensor([0] + [token] * count), blank),
                      token_masks=tuple(k for k in mm.IMAGE_TOKEN_MASKS if k in inputs),
                      model_positions=mm.derives_positions(meta_model))
    pad = getattr(processor.tokenizer, "pad_token_id", None) or 0
    vocab = mm.text_config(meta_model.config).vocab_size
    rows, lengths, images = [], [], []
    for where, text, paths in _records(data.paths, data.text_key, data.image_key):
        try:
            pictures = [_open_image(p) for p in paths] or None
            ids = processor(text=[text], images=pictures, return_tensors="pt")["input_ids"][0]
        except (ValueError, OSError) as err:
            raise ValueError(f"{where}: the processor refused the sample ({err}); the text "
                             "needs the processor's image placeholder once per image") from err
        if int(ids.max()) >= vocab:
            raise ValueError(f"{where}: token id {int(ids.max())} is outside the model's "
                             f"vocabulary of {vocab} (model.config.vocab_size)")
        image_at = (ids == token).nonzero()
        if paths and not len(image_at):
            raise ValueError(f"{where}: the processor in {processor_dir} put none of the "
                             f"model's image tokens (id {token}, model.config.image_token_id) "
                             "in the sample: use the model's own processor")
        if len(image_at) and int(image_at[-1]) >= seq_len + 1:
            raise ValueError(f"{where}: the sample's image tokens run to position "
                             f"{int(image_at[-1])}, past trainer.seq_len={seq_len}: raise "
                             f"trainer.seq_len to at least {int(image_at[-1]) + 1} or shorten "
                             "the text before the image")
        ids = ids[:seq_len + 1]
        rows.append(torch.nn.functional.pad(ids, (0, seq_len + 1 - len(ids)), value=pad))
        lengths.append(len(ids))
        images.append(tuple(paths))
    if not rows:
        raise ValueError(f"data.paths={list(data.paths)}: no samples found")
    return ImageTextData(torch.stack(rows), torch.tensor(lengths), images, fmt)
