"""Built-in tiny vision-language models: `builtin:tiny-qwen2-vl`, `builtin:tiny-qwen2.5-vl` and
`builtin:tiny-qwen3-vl`.

Each is a real Hugging Face checkpoint folder of its family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL):
config.json with a tiny vision tower (2 blocks, patch 14, or 16 for Qwen3-VL, spatial merge 2) and a
tiny text decoder (Qwen2-style; Qwen3-style with deepstack for Qwen3-VL) with multimodal rotary
positions (mrope), deterministic random weights (fixed seed), the character-level
tokenizer of the text built-ins extended with the family's vision tokens (<|vision_start|>,
<|image_pad|>, <|vision_end|>, <|video_pad|>, after the characters, so text ids equal tiny-qwen2's),
the family's real image processor (`Qwen2VLImageProcessorPil`: PIL only, no torchvision) with small
pixel bounds (a 56x56 image is 4 tokens, at most 16 per image), and a chat template that writes
`<|vision_start|><|image_pad|><|vision_end|>` for every content part of type "image" (or
"image_url"). flowrl (operators/vision.py) expands each <|image_pad|> to the image's token count.
`AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` load the folder offline, as
they load a real checkpoint of these families (`AutoProcessor` would also need torchvision, for the
families' video processor; flowrl never needs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Pixel bounds of the built-ins' image processor: images are resized (keeping the aspect ratio) to a
# multiple of 28 pixels a side with area in [MIN_PIXELS, MAX_PIXELS]; one token per 28x28 pixels
# (Qwen3-VL: 32 and 32x32, patch 16).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16
PROCESSOR = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
PROCESSOR_16 = {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 16, "patch_size": 16}

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The text decoder: tiny-qwen2's shape; head_dim 32 = 16 rotary frequencies, split t/h/w as 4/6/6.
_TEXT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384, max_position_embeddings=1024, tie_word_embeddings=True,
             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [4, 6, 6]})
_VISION_COMMON = dict(depth=2, num_heads=2, in_channels=3, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)

# Qwen3-VL's decoder is Qwen3's (head_dim, q/k norms) with interleaved mrope: 16 frequencies, 6/5/5.
_TEXT_QWEN3 = dict(_TEXT, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [6, 5, 5], "mrope_interleaved": True})

# name -> (model_type, text config keys, vision config keys, image processor keys)
# The model_type of the vision-language families flowrl runs (operators/vision.py).
SUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

VL_MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # ~0.5M parameters (0.05M of them the vision tower).
    "tiny-qwen2-vl": ("qwen2_vl", _TEXT, dict(_VISION_COMMON, embed_dim=32, hidden_size=128, mlp_ratio=2,
                                              hidden_act="quick_gelu"), PROCESSOR),
    # Qwen2.5-VL's tower: RMSNorm, gated MLP, window attention (56-pixel windows) with block 1 global.
    "tiny-qwen2.5-vl": ("qwen2_5_vl", _TEXT, dict(_VISION_COMMON, hidden_size=32, intermediate_size=64,
                                                  out_hidden_size=128, hidden_act="silu", window_size=56,
                                                  fullatt_block_indexes=[1], tokens_per_second=2), PROCESSOR),
    # Qwen3-VL's tower: patch 16, learned position embeddings (a 4x4 grid, interpolated), and block
    # 0's features merged into the decoder after its layer 0 (deepstack).
    "tiny-qwen3-vl": ("qwen3_vl", _TEXT_QWEN3, dict(_VISION_COMMON, patch_size=16, hidden_size=32,
                                                    intermediate_size=64, out_hidden_size=128,
                                                    hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                                                    deepstack_visual_indexes=[0]), PROCESSOR_16),
}


def spec(name: str) -> dict[str, Any]:
    """What the built-in's fingerprint covers (models.py rebuilds the folder when it changes)."""
    model_type, text, vision, processor = VL_MODELS[name]
    out = {"vl": (model_type, text, vision), "tokens": VISION_TOKENS, "template": VL_CHAT_TEMPLATE,
           "pixels": [MIN_PIXELS, MAX_PIXELS]}
    # The default processor is left out so that the first two built-ins keep their first fingerprint
    # (caches are shared between checkouts: two fingerprints of one name would rebuild it in turns).
    return out if processor is PROCESSOR else out | {"processor": processor}


def build_vl_model(name: str, folder: Path) -> None:
    """Write the built-in VL model `name` (config, weights, tokenizer, processor) into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from flowrl_operators.tokenizer import EOS, IM_END, SEED, build_tokenizer, silence_hf

    silence_hf()
    model_type, text, vision, processor = VL_MODELS[name]
    tokenizer = build_tokenizer(extra_special=VISION_TOKENS, chat_template=VL_CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in [EOS, IM_END, *VISION_TOKENS]}
    eos_ids = [ids[EOS], ids[IM_END]]
    common = dict(vocab_size=len(tokenizer), eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=None)
    config = AutoConfig.for_model(
        model_type, text_config=dict(text, **common), vision_config=dict(vision),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=True, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The family's image processor, PIL backend (torchvision is not needed). No processor_config:
    # `AutoProcessor` of these families also builds a video processor, which needs torchvision, so
    # flowrl loads the image processor and the tokenizer themselves (operators/vision.py).
    Qwen2VLImageProcessorPil(**processor).save_pretrained(folder)

