"""``data=files`` for image-text models: JSONL samples with local image files, through the
model's own processor (saved locally by ``tests/data/processors.py``)."""

import json

import numpy as np
import pytest
import torch

from automodel.api import load_config
from automodel.config.schema import FilesDataConfig
from automodel.data.batches import IGNORE_INDEX
from automodel.data.corpus import generate_documents
from tests.data.processors import save_llava_next, save_processor, write_samples
from tests.distributed.test_image_text import _meta
from tests.helpers import FP32, TRAINER, train

SEQ = 48


def _read(tmp_path, family, texts, seq_len=SEQ, image_every=2):
    from automodel.data.image_files import read_image_text

    placeholder = save_processor(family, tmp_path / "proc")
    path = write_samples(tmp_path / "data", placeholder, texts, image_every)
    return read_image_text(FilesDataConfig(paths=[path]), seq_len, _meta(family),
                           str(tmp_path / "proc")), placeholder


@pytest.mark.fast
@pytest.mark.parametrize("family", ["llava_tiny", "gemma3_vl_tiny"])
def test_samples_go_through_the_processor(family, tmp_path):
    from transformers import AutoProcessor

    texts = ["a short one", "x" * 100, "with some words", "no picture here"]
    data, placeholder = _read(tmp_path, family, texts)
    assert data.has_image.tolist() == [True, False, True, False]
    assert data.lengths[1] == SEQ + 1  # cut to seq_len + 1
    processor = AutoProcessor.from_pretrained(tmp_path / "proc")
    inputs, labels, extras = data[0:2].split()
    from PIL import Image

    with Image.open(tmp_path / "data" / "img0.png") as image:
        expected = processor(text=[f"{placeholder} {texts[0]}"], images=[image.convert("RGB")],
                             return_tensors="pt")
    n = expected["input_ids"].shape[1]
    assert torch.equal(inputs[0, :n], expected["input_ids"][0])
    torch.testing.assert_close(extras["pixel_values"], expected["pixel_values"])
    if "token_type_ids" in expected:  # Gemma 3: the image tokens, as the processor marks them
        assert torch.equal(extras["token_type_ids"][0, :n], expected["token_type_ids"][0])
    token = data.fmt.image_token_id
    assert (inputs == token).any() and not (labels == token).any()
    assert (labels[0, n - 1:] == IGNORE_INDEX).all() and (labels[0, :n - 1] != IGNORE_INDEX).any()
    assert (labels[1] != IGNORE_INDEX).all()
    # a micro-batch of text-only samples carries the placeholder image
    inputs, labels, extras = data[torch.tensor([1, 3])].split()
    assert inputs.shape[0] == 3 and extras["pixel_values"].shape[0] == 1
    assert (labels[2] == IGNORE_INDEX).all()


@pytest.mark.fast
def test_bad_samples_are_clear_errors(tmp_path):
    from automodel.data.image_files import read_image_text

    placeholder = save_processor("llava_tiny", tmp_path / "proc")
    meta, proc = _meta("llava_tiny"), str(tmp_path / "proc")

    def read(lines, seq_len=SEQ):
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return read_image_text(FilesDataConfig(paths=[str(path)]), seq_len, meta, proc)

    with pytest.raises(ValueError, match=r"bad.jsonl:1: image file 'gone.png' not found"):
        read([{"text": f"{placeholder} hi", "image": "gone.png"}])
    write_samples(tmp_path, placeholder, ["x"], 1)  # tmp_path/img0.png
    with pytest.raises(ValueError, match=r"bad.jsonl:2: the processor refused.*placeholder"):
        read([{"text": "fine"}, {"text": "no placeholder", "image": "img0.png"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*past trainer.seq_len=8: raise "
                                         r"trainer.seq_len to at least"):
        read([{"text": f"some text first {placeholder}", "image": "img0.png"}], seq_len=8)
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'text' field"):
        read([{"body": "x"}])
    with pytest.raises(ValueError, match="cannot load the model's processor from"):
        read_image_text(FilesDataConfig(paths=["x.jsonl"]), SEQ, meta, str(tmp_path / "none"))


def test_file_samples_train_in_parallel_as_on_one_rank(tmp_path):
    placeholder = save_processor("gemma3_vl_tiny", tmp_path / "proc")
    path = write_samples(tmp_path / "data", placeholder, generate_documents(40, 3), 2)
    run = ["model=gemma3_vl_tiny", "model.freeze=[vision]", "data=files", f"data.paths=[{path}]",
           f"data.tokenizer_path={tmp_path / 'proc'}", "trainer.seq_len=48"]
    ref = train(["parallelism=none"] + run, tmp_path / "ref", base=TRAINER)
    got = train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "trainer.local_batch_size=1"]
                + run, tmp_path / "got", base=TRAINER)
    assert ref[0]["loss"] - ref[-1]["loss"] > 0.3
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref],
                               rtol=1e-4)


def _llava_next_samples(tmp_path):
    """A tiny LLaVA-NeXT checkpoint with its processor, and samples whose images differ in
    aspect, so in the number of crops the processor makes (a wide image: 2 crops and the
    overview; a square one: 4 and the overview)."""
    from PIL import Image

    placeholder = save_llava_next(tmp_path / "model")
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (64, 30), (200, 10, 10)).save(folder / "wide.png")
    Image.new("RGB", (60, 60), (10, 200, 10)).save(folder / "square.png")
    lines = [{"text": f"{placeholder} wide {i}", "image": "wide.png"} if i % 4 == 0 else
             {"text": f"{placeholder} square {i}", "image": "square.png"} if i % 4 == 2 else
             {"text": f"words only {i}"} for i in range(24)]
    path = folder / "samples.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path), placeholder


@pytest.mark.fast
def test_images_with_different_crop_counts_batch_as_the_processor_batches(tmp_path):
    """A micro-batch of images with different numbers of crops holds each image's crops,
    padded with zeros to the most, as the processor pads a batch (the model reads each
    image's own count from ``image_sizes``)."""
    from PIL import Image
    from transformers import AutoProcessor

    from automodel.data.image_files import read_image_text
    from automodel.models.builder import build_meta_model

    path, _ = _llava_next_samples(tmp_path)
    cfg = load_config(["model=pretrained", f"model.pretrained_path={tmp_path / 'model'}"])
    data = read_image_text(FilesDataConfig(paths=[path]), 32, build_meta_model(cfg.model),
                           str(tmp_path / "model"))
    _, _, extras = data[0:3].split()
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    with Image.open(tmp_path / "data" / "wide.png") as a, \
            Image.open(tmp_path / "data" / "square.png") as b:
        expected = processor.image_processor(images=[a.convert("RGB"), b.convert("RGB")],
                                             return_tensors="pt")
    counts = [processor.image_processor(images=img, return_tensors="pt")["pixel_values"].shape[1]
              for img in (Image.new("RGB", (64, 30)), Image.new("RGB", (60, 60)))]
    assert counts[0] < counts[1]  # (the case: the wide image's crops are padded)
    torch.testing.assert_close(extras["pixel_values"], expected["pixel_values"])
    assert torch.equal(extras["image_sizes"], expected["image_sizes"])
    assert not extras["pixel_values"][0, counts[0]:].any()


def test_images_with_different_crop_counts_train_under_a_pipeline(tmp_path):
    """LLaVA-NeXT from files, its images in 3 and 5 crops: a 2-stage pipeline (the tower on
    the first stage, micro-batches of 2 rows) trains as one process (fp32)."""
    path, _ = _llava_next_samples(tmp_path)
    run = ["model=pretrained", f"model.pretrained_path={tmp_path / 'model'}", "data=files",
           f"data.paths=[{path}]", "trainer.seq_len=32"]
    ref = train(["parallelism=none"] + run, tmp_path / "ref", base=TRAINER)
    got = train(["parallelism=fsdp2", FP32, "pipeline=1f1b", "mesh.pp_size=2",
                 "pipeline.pp_microbatch_size=2"] + run, tmp_path / "got", base=TRAINER)
    assert ref[0]["loss"] - ref[-1]["loss"] > 0.3
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref],
                               rtol=1e-4)
