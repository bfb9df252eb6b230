"""Image-text samples: token sequences with the model's image tokens, and their images.

The text comes from the configured source (``data=corpus`` or ``synthetic``). A sample with
an image holds, right after its first token, one run of the model's image token as long as
one image's features (``models/multimodal.tokens_per_image``); the model puts the image
features there. Labels never ask to predict an image token (they are
``IGNORE_INDEX``). Samples without an image are plain text: every ``image_every``-th sample
has an image (1: all of them; 0: none), so batches mixing both, and whole batches without
images, occur.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from automodel.data.batches import IGNORE_INDEX


@dataclass
class ImageTextData:
    sequences: torch.Tensor  # [n, seq_len + 1] token ids
    images: torch.Tensor  # [n, C, H, W] (zeros where has_image is False)
    has_image: torch.Tensor  # [n] bool
    image_token_id: int
    tokens_per_image: int

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, index) -> "ImageTextData":
        """The rows ``index`` (a slice or an index tensor) selects."""
        return ImageTextData(self.sequences[index], self.images[index], self.has_image[index],
                             self.image_token_id, self.tokens_per_image)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(inputs, labels, extras) of these rows: ``pixel_values`` for the rows with an image,
        in row order (the order the model meets their image tokens).

        Rows without any image get one placeholder row appended: a blank image and its image
        tokens, with no label to learn. So every micro-batch runs the vision tower and the
        projector, and every rank reduces the same gradients (a rank skipping them would leave
        the others waiting in FSDP2 or DDP); the placeholder adds nothing to the loss and
        zeros to the gradients."""
        rows = self
        if not bool(self.has_image.any()):
            rows = self._with_placeholder()
        inputs = rows.sequences[:, :-1].contiguous()
        labels = rows.sequences[:, 1:].clone()
        labels[labels == self.image_token_id] = IGNORE_INDEX
        if not bool(self.has_image.any()):
            labels[-1] = IGNORE_INDEX
        extras = {"pixel_values": rows.images[rows.has_image].contiguous()}
        return inputs, labels, extras

    def _with_placeholder(self) -> "ImageTextData":
        row = torch.zeros_like(self.sequences[:1])
        row[0, 1:1 + self.tokens_per_image] = self.image_token_id
        return ImageTextData(torch.cat([self.sequences, row]),
                             torch.cat([self.images, torch.zeros_like(self.images[:1])]),
                             torch.cat([self.has_image, torch.ones(1, dtype=torch.bool)]),
                             self.image_token_id, self.tokens_per_image)


def add_images(sequences: torch.Tensor, image_token_id: int, tokens_per_image: int,
               image_shape: tuple, seed: int, image_every: int = 1) -> ImageTextData:
    """Image-text samples from token rows ``[n, seq_len + 1]``: every ``image_every``-th row
    gets a random image (from ``seed``) and the run of image tokens after its first token;
    text tokens equal to the image token are moved to the next id."""
    num, length = sequences.shape
    if image_every and tokens_per_image + 2 > length:
        raise ValueError(f"trainer.seq_len={length - 1} cannot hold an image of "
                         f"{tokens_per_image} tokens and text around it; use trainer.seq_len "
                         f">= {tokens_per_image + 1}")
    sequences = sequences.clone()
    sequences[sequences == image_token_id] = image_token_id - 1 if image_token_id else 1
    has_image = torch.zeros(num, dtype=torch.bool)
    if image_every:
        has_image[::image_every] = True
    sequences[has_image, 1:1 + tokens_per_image] = image_token_id
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(num, *image_shape, generator=gen) * has_image.view(-1, 1, 1, 1)
    return ImageTextData(sequences, images, has_image, image_token_id, tokens_per_image)
