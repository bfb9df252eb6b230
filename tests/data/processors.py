"""Local processors for the tiny image-text presets (no hub download), and JSONL samples with
image files, for the tests of the ``data=files`` image-text source.

The tokenizer is byte-level: ids 0..255-k are the bytes (as the presets' byte vocabulary),
and the top k ids the family's special image tokens, in the order given (so they land on the
ids the presets configure: 253 eoi, 254 boi, 255 image for Gemma 3; 255 image for LLaVA).
Qwen2-VL's processor needs torchvision (its video part), which this machine cannot install, so
it is not built here; the Qwen2-VL preset trains on generated images.
"""

import json

from PIL import Image


def byte_tokenizer(specials: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256 - len(specials))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=chars[0],
                                   extra_special_tokens=specials)


def save_processor(family: str, path) -> str:
    """Save the processor of the ``family`` preset (``llava_tiny``, ``gemma3_vl_tiny``) to
    ``path``; returns the placeholder a sample's text holds for one image."""
    if family == "llava_tiny":
        from transformers import CLIPImageProcessor, LlavaProcessor

        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                               crop_size={"height": 32, "width": 32}),
            tokenizer=byte_tokenizer({"image_token": "<image>"}), patch_size=8,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            image_token="<image>")
        placeholder = "<image>"
    elif family == "gemma3_vl_tiny":
        from transformers import Gemma3ImageProcessor, Gemma3Processor

        tokenizer = byte_tokenizer({"eoi_token": "<end_of_image>", "boi_token": "<start_of_image>",
                                    "image_token": "<image_soft_token>"})
        processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(
            size={"height": 32, "width": 32}), tokenizer=tokenizer, image_seq_length=4)
        placeholder = "<start_of_image>"
    else:
        raise ValueError(family)
    processor.save_pretrained(path)
    return placeholder


def save_llava_next(path, text_layers: int = 4) -> str:
    """A tiny LLaVA-NeXT (CLIP tower, Qwen2 language model: the 72B's families) with its
    weights and its processor (several crops per image, by the image's aspect), saved to
    ``path`` as a checkpoint folder is; returns the placeholder of one image."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    grid = [[32, 64], [64, 32], [64, 64]]
    config = LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           projection_dim=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=16),
        text_config=dict(model_type="qwen2", vocab_size=256, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512),
        image_token_index=255, image_grid_pinpoints=grid, vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False)
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(config).save_pretrained(path)
    LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
            image_grid_pinpoints=grid),
        tokenizer=byte_tokenizer({"image_token": "<image>"}), patch_size=16,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1).save_pretrained(path)
    return "<image>"


def write_samples(folder, placeholder: str, texts: list[str], image_every: int = 2,
                  file: str = "samples.jsonl") -> str:
    """A JSONL file ``file`` of ``texts``, every ``image_every``-th one with an image file (of
    a size the processor resizes) before its text; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, text in enumerate(texts):
        if i % image_every:
            lines.append({"text": text})
            continue
        name = f"img{i}.png"
        Image.new("RGB", (40 + i % 7, 30 + i % 5), (i * 37 % 256, i * 91 % 256, 90)).save(
            folder / name)
        lines.append({"text": f"{placeholder} {text}", "image": name})
    path = folder / file
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)
