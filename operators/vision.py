"""Vision-language (VL) checkpoints: what every flowrl component needs to know about images.

One `Vision` per checkpoint folder (`vision(model)`, loaded once per process) wraps the checkpoint's
own chat template, tokenizer and image processor (`AutoTokenizer`, `AutoImageProcessor`: the PIL
backend when torchvision is absent; not `AutoProcessor`, which for these families also builds a
video processor that needs torchvision) and answers:

- `prompt(messages, images)`: the token ids of a chat prompt whose messages hold image parts, each
  image's one `<|image_pad|>` expanded to the image's number of tokens (what the vision tower gives
  for it after merging patches), and the images in placeholder order;
- `observation_ids(messages, images, model_ids)`: the ids that follow the model's last turn (its
  end of turn, e.g. an environment's image observation, the next assistant header);
- `pixels(refs)`: the processor's tensors for the images (`pixel_values`, `image_grid_thw`), their
  pixels read from the run's image store (flowrl.data.images);
- `positions(ids, refs)`: the multimodal rotary positions (mrope: temporal, height, width rows) of a
  token sequence with its images, and the offset text tokens after the last image have (position =
  index + delta), the same numbers as transformers' `get_rope_index` for these families.

Placeholder convention: the k-th image of a sequence is the k-th run of image-pad tokens that
directly follows a vision-start token (what the chat templates write); its length must be the
image's token count. Image-pad tokens elsewhere (a model may sample the token) are plain text, as
they are during decoding, and so are runs after the last image (`spans` is lenient there; the
engine refuses a prompt whose placeholder runs and images differ in number: `image_runs`).

Supported families: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`SUPPORTED`): the built-ins
`builtin:tiny-qwen2-vl`, `builtin:tiny-qwen2.5-vl`, `builtin:tiny-qwen3-vl`, and real checkpoints of
those families in a local folder.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flowrl.data.images import ImageRef
from flowrl.data.images import store as image_store
from flowrl_operators.models import model_type, resolve_model
from flowrl_operators.models_vl import SUPPORTED
from flowrl_operators.tokenizer import BUILD_LOCK, silence_hf

_PLACEHOLDER = "\u0001FLOWRL\u0001"  # assistant content no template produces on its own
IMAGE_PARTS = ("image", "image_url")


@functools.lru_cache(maxsize=8)
def _load(folder: str) -> Vision:
    return Vision(Path(folder))


def vision(model: str | os.PathLike) -> Vision:
    """The `Vision` of a VL checkpoint, loaded once per process. A text-only model raises ValueError."""
    folder = resolve_model(model)
    kind = model_type(folder)
    if kind not in SUPPORTED:
        raise ValueError(f"model {str(model)!r} (model_type {kind!r}) is not a vision-language model; images "
                         f"need one of the families {', '.join(SUPPORTED)} (e.g. builtin:tiny-qwen2-vl)")
    return _load(str(folder))


class Vision:
    """A VL checkpoint's processor and the facts about its images (see the module docs)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        silence_hf()
        self.folder = folder
        with BUILD_LOCK:
            self.config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            self.image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        self.chat_template = self.tokenizer.chat_template or _template_file(folder)
        images = self.image_processor
        self.patch_size: int = images.patch_size
        self.merge_size: int = images.merge_size
        self.temporal_patch_size: int = images.temporal_patch_size
        size = images.size
        self.min_pixels: int = size["shortest_edge"]
        self.max_pixels: int = size["longest_edge"]
        self.image_token_id: int = self.config.image_token_id
        self.vision_start_id: int = self.config.vision_start_token_id
        self.image_token: str = self.tokenizer.convert_ids_to_tokens(self.image_token_id)

    # --- sizes ------------------------------------------------------------------------------------

    def grid(self, ref: ImageRef) -> tuple[int, int, int]:
        """(t, h, w): the image's patches over time (1 for an image), height and width after resizing."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        height, width = smart_resize(ref.height, ref.width, factor=self.patch_size * self.merge_size,
                                     min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, height // self.patch_size, width // self.patch_size

    def image_tokens(self, ref: ImageRef) -> int:
        """How many placeholder tokens the image takes in a prompt (its patches / merge_size**2)."""
        t, h, w = self.grid(ref)
        return t * h * w // self.merge_size**2

    # --- prompts ----------------------------------------------------------------------------------

    def prompt(self, messages: list[dict[str, Any]], images: Sequence[ImageRef] | None = None,
               add_generation_prompt: bool = True) -> tuple[list[int], list[ImageRef]]:
        """Token ids of a chat prompt with images, and its images in placeholder order.

        A message's `content` is a string or a list of parts: {"type": "text", "text": ...},
        {"type": "image"} or {"type": "image_url", ...}. `images` gives one ImageRef per image part,
        in order; without it each part names its image itself: "image" (an ImageRef, PIL image,
        bytes or path) or "image_url": {"url": "data:image/...;base64,..."}, stored in the run's
        image store. Raises ValueError when parts and images disagree.
        """
        refs = _refs(messages, images)
        text = self._render(messages, add_generation_prompt)
        return self._encode(text, refs), refs

    def observation_ids(self, messages: list[dict[str, Any]], images: Sequence[ImageRef] | None = None,
                        model_ids: Sequence[int] = (), history: list[dict[str, Any]] | None = None,
                        add_generation_prompt: bool = True) -> tuple[list[int], list[ImageRef]]:
        """Token ids that follow the model's last turn up to the next assistant prompt: the end of
        the assistant turn, `messages` (e.g. a tool or user message holding an image observation)
        and the next assistant header; returns (ids, images) as `prompt` does. `model_ids`: the
        model's last turn as sampled; when it ends with the end-of-turn token (its stop token), that
        token is not repeated. `history`: the conversation before that turn (default: one user
        message; only templates that render turns differently by position need it). The same
        rendering as text workflows' `continuation_ids`, with the images' placeholders expanded."""
        refs = _refs(messages, images)
        before = list(history) if history else [{"role": "user", "content": "."}]
        rendered = self._render(before + [{"role": "assistant", "content": _PLACEHOLDER}] + list(messages),
                                add_generation_prompt)
        if rendered.count(_PLACEHOLDER) != 1:
            raise ValueError(f"{self.folder.name}: the chat template does not render assistant content verbatim; "
                             "observation_ids cannot find where the model's turn ends")
        tail = rendered.split(_PLACEHOLDER, 1)[1]
        if model_ids:
            last = self.tokenizer.convert_ids_to_tokens(int(model_ids[-1]))
            if last in self.tokenizer.all_special_tokens and tail.startswith(last):
                tail = tail[len(last):]
        return self._encode(tail, refs), refs

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str, refs: list[ImageRef]) -> list[int]:
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(refs):
            raise ValueError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(refs)} images")
        expanded = pieces[0]
        for ref, piece in zip(refs, pieces[1:], strict=True):
            expanded += self.image_token * self.image_tokens(ref) + piece
        return list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

    # --- pixels and positions ---------------------------------------------------------------------

    def pixels(self, refs: Sequence[ImageRef], store: Any = None) -> dict[str, torch.Tensor]:
        """`pixel_values` [patches, channels * temporal * patch**2] (fp32) and `image_grid_thw`
        [images, 3] for the images, pixels read from `store` (default: this process's image store)."""
        if not refs:
            raise ValueError("pixels() needs at least one image")
        store = store or image_store()
        out = self.image_processor(images=[store.get(ref) for ref in refs], return_tensors="pt")
        grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
        if grids != [self.grid(ref) for ref in refs]:  # the token counts of prompt() must match the tower
            raise ValueError(f"{self.folder.name}: the image processor's grids {grids} differ from the sizes' "
                             f"{[self.grid(ref) for ref in refs]}")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def image_runs(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) of every run of image-pad tokens that follows a vision-start token."""
        runs: list[tuple[int, int]] = []
        i, n = 1, len(ids)
        while i < n:
            if ids[i] == self.image_token_id and ids[i - 1] == self.vision_start_id:
                end = i
                while end < n and ids[end] == self.image_token_id:
                    end += 1
                runs.append((i, end))
                i = end
            i += 1
        return runs

    def spans(self, ids: Sequence[int], refs: Sequence[ImageRef]) -> list[tuple[int, int]]:
        """[start, end) of each image's placeholder tokens in `ids` (module docs: the convention)."""
        runs = self.image_runs(ids)
        if len(runs) < len(refs):
            raise ValueError(f"the sequence has placeholders for {len(runs)} images, {len(refs)} were given")
        for k, (ref, (start, end)) in enumerate(zip(refs, runs, strict=False)):
            if end - start != self.image_tokens(ref):
                raise ValueError(f"image {k} ({ref.width}x{ref.height}) needs {self.image_tokens(ref)} placeholder "
                                 f"tokens, the sequence has {end - start} at position {start}")
        return runs[: len(refs)]

    def positions(self, ids: Sequence[int], refs: Sequence[ImageRef]) -> tuple[torch.Tensor, int]:
        """Multimodal rotary positions [3, len(ids)] (long) and the delta of the text after the last
        image: token i >= the last image's end has position i + delta on all three rows."""
        rows, at, pos = [], 0, 0
        for ref, (start, end) in zip(refs, self.spans(ids, refs), strict=True):
            rows.append(torch.arange(pos, pos + start - at).expand(3, -1))
            pos += start - at
            t, h, w = self.grid(ref)
            h, w = h // self.merge_size, w // self.merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            rows.append(grid.reshape(3, -1) + pos)
            pos += max(h, w)
            at = end
        rows.append(torch.arange(pos, pos + len(ids) - at).expand(3, -1))
        return torch.cat(rows, dim=1), pos - at


def _refs(messages: list[dict[str, Any]], images: Sequence[ImageRef] | None) -> list[ImageRef]:
    """The images of the messages' image parts, in order (see Vision.prompt)."""
    parts = [part for m in messages if isinstance(m.get("content"), list) for part in m["content"]
             if isinstance(part, dict) and part.get("type") in IMAGE_PARTS]
    if images is not None:
        if len(images) != len(parts):
            raise ValueError(f"the messages hold {len(parts)} image parts but {len(images)} images were given")
        return list(images)
    refs = []
    for i, part in enumerate(parts):
        value = part.get("image")
        if value is None and isinstance(part.get("image_url"), dict):
            value = part["image_url"].get("url")
        if value is None:
            raise ValueError(f"image part {i} names no image: give 'image' or 'image_url': {{'url': ...}}")
        refs.append(value if isinstance(value, ImageRef) else image_store().put(value))
    return refs


def _template_file(folder: Path) -> str:
    """A checkpoint's chat template kept beside the tokenizer (chat_template.jinja / .json)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text())["chat_template"]
    raise FileNotFoundError(f"{folder} has no chat template (tokenizer_config.json, chat_template.jinja/.json)")
