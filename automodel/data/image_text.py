"""Image-text samples: token sequences holding the model's image tokens, and their images.

A sample is a row of ``seq_len + 1`` token ids (the first ``length`` are real, the rest
padding) and the images whose features fill its runs of image tokens, in order. Images are
kept as references (a seed, or a file path) and turned into the model's own image inputs
(``pixel_values`` and whatever else the family takes: ``models/image_inputs.py``) only when
a micro-batch is built, so the host holds the pixels of one micro-batch at a time.

Labels never ask to predict an image token or padding (they are ``IGNORE_INDEX``). Samples
without images are plain text; batches mixing both, and whole micro-batches without any
image, occur (``data.image_every``, or a file's records without an image).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from automodel.data.batches import IGNORE_INDEX

BLANK_IMAGE = "blank_image"  # extras of rows without images under a pipeline (``split``)
PLACEHOLDER_ROWS = "placeholder_rows"  # extras: rows at the end that are no sample (``split``)


@dataclass(frozen=True)
class ImageFormat:
    """How one model takes images (``models/multimodal.py`` reads it from the model)."""

    image_token_id: int
    load: Callable[[Any], dict]  # an image reference -> its model inputs (dim 0 concatenates)
    placeholder: tuple  # (token ids of a sample holding one image, that image's reference)
    token_masks: tuple = ()  # inputs marking image-token positions (IMAGE_TOKEN_MASKS)
    model_positions: bool = False  # the model derives its own positions from the images


@dataclass
class ImageTextData:
    sequences: torch.Tensor  # [n, seq_len + 1] token ids
    lengths: torch.Tensor  # [n] real tokens per row; the rest is padding
    images: list  # per row: a tuple of image references, in the order of their image tokens
    fmt: ImageFormat

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def has_image(self) -> torch.Tensor:
        return torch.tensor([bool(refs) for refs in self.images], dtype=torch.bool)

    def __getitem__(self, index) -> "ImageTextData":
        """The rows ``index`` (a slice or an index tensor) selects."""
        picked = (self.images[index] if isinstance(index, slice)
                  else [self.images[i] for i in torch.as_tensor(index).tolist()])
        return ImageTextData(self.sequences[index], self.lengths[index], picked, self.fmt)

    def split(self, placeholder_row: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(inputs, labels, extras) of these rows; extras hold the images' model inputs in row
        order (the order the model meets their image tokens), the image-token masks the model
        takes, and ``position_ids=None`` where the model derives its own positions.

        Rows without any image get one placeholder row appended: a blank image and its image
        tokens, with no label to learn. So every micro-batch runs the vision tower and the
        projector, and every rank reduces the same gradients (a rank skipping them would leave
        the others waiting in FSDP2 or DDP); the placeholder adds nothing to the loss and
        zeros to the gradients (the extras count it: ``PLACEHOLDER_ROWS``, so the router's
        per-sequence loss leaves it out). ``placeholder_row=False`` (a pipeline, whose micro-batches
        keep one shape): no row; the extras hold the blank image's inputs under
        ``BLANK_IMAGE: True``, for the first stage to run the tower on
        (``distributed/pipelining/stage_images.py``)."""
        blank = not any(self.images) and not placeholder_row
        rows = self if any(self.images) or blank else self._with_placeholder()
        fmt = self.fmt
        inputs = rows.sequences[:, :-1].contiguous()
        labels = rows.sequences[:, 1:].clone()
        labels[labels == fmt.image_token_id] = IGNORE_INDEX
        position = torch.arange(labels.shape[1])
        labels[position >= (rows.lengths - 1).unsqueeze(1)] = IGNORE_INDEX
        loaded = ([fmt.load(fmt.placeholder[1])] if blank
                  else [fmt.load(ref) for refs in rows.images for ref in refs])
        extras: dict = {key: _concat([image[key] for image in loaded]) for key in loaded[0]}
        if blank:
            extras[BLANK_IMAGE] = True
        elif rows is not self:
            extras[PLACEHOLDER_ROWS] = 1
        for key in fmt.token_masks:
            extras[key] = (inputs == fmt.image_token_id).long()
        if fmt.model_positions:
            extras["position_ids"] = None
        return inputs, labels, extras

    def _with_placeholder(self) -> "ImageTextData":
        tokens, ref = self.fmt.placeholder
        row = torch.zeros_like(self.sequences[:1])
        row[0, :len(tokens)] = tokens
        return ImageTextData(torch.cat([self.sequences, row]),
                             torch.cat([self.lengths, torch.zeros(1, dtype=self.lengths.dtype)]),
                             [*self.images, (ref,)], self.fmt)


def _concat(tensors: list) -> torch.Tensor:
    """The images' inputs along dim 0. Where their other sizes differ (LLaVA-NeXT's crops per
    image: ``pixel_values`` [1, crops, 3, H, W]), each is padded with zeros to the largest, as
    the processor pads a batch of images; the model takes each image's own crops (its
    ``image_sizes``) and leaves the padding."""
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    padded = []
    for t in tensors:
        pad = [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def synthetic_format(config, meta_model, seed: int) -> tuple[ImageFormat, int]:
    """The format of generated images for ``config``'s model (image ``i`` of the data: random
    pixels from ``seed + i``), and how many image tokens one image takes."""
    from automodel.models import image_inputs as ii
    from automodel.models import multimodal as mm

    spec = ii.image_spec(meta_model)
    blank = ii.synthetic_image(spec, None)
    count = ii.tokens_per_image(meta_model, blank)
    token = mm.image_token_id(config)
    inputs = mm.forward_inputs(meta_model)
    fmt = ImageFormat(
        image_token_id=token,
        load=lambda ref: ii.synthetic_image(spec, None if ref is None else seed + ref),
        placeholder=(torch.tensor([0] + [token] * count), None),
        token_masks=tuple(k for k in mm.IMAGE_TOKEN_MASKS if k in inputs),
        model_positions=mm.derives_positions(meta_model))
    return fmt, count


def add_images(sequences: torch.Tensor, fmt: ImageFormat, tokens_per_image: int,
               image_every: int = 1) -> ImageTextData:
    """Image-text samples from token rows ``[n, seq_len + 1]``: every ``image_every``-th row
    gets an image (reference: its row number) and the run of its image tokens after its first
    token; text tokens equal to the image token are moved to the next id."""
    num, length = sequences.shape
    token = fmt.image_token_id
    if image_every and tokens_per_image + 2 > length:
        raise ValueError(f"trainer.seq_len={length - 1} cannot hold an image of "
                         f"{tokens_per_image} tokens and text around it; use trainer.seq_len "
                         f">= {tokens_per_image + 1}")
    sequences = sequences.clone()
    sequences[sequences == token] = token - 1 if token else 1
    images = [(i,) if image_every and i % image_every == 0 else () for i in range(num)]
    for i, refs in enumerate(images):
        if refs:
            sequences[i, 1:1 + tokens_per_image] = token
    return ImageTextData(sequences, torch.full((num,), length), images, fmt)
