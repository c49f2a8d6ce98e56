"""Images in prompts: reading them from rows, the processor that turns them into model inputs, and the
record (`VisionInputs`) that carries those inputs with a prompt from the engine to the trainer.

A vision-language model (Qwen2-VL and its family) reads an image as a run of placeholder tokens in the
prompt (`<|image_pad|>` repeated once per merged patch, between `<|vision_start|>` and `<|vision_end|>`)
plus the image's patches (`pixel_values`, [patches, channels * temporal * patch * patch]) and their grid
(`image_grid_thw`, [images, 3]: temporal, height, width in patches). `VisionProcessor` makes all three from
a rendered prompt and its images, once, when the prompt is encoded: the engine prefills with them and the
trainer recomputes logprobs with the very same tensors, so nothing is processed twice and the two can not
differ. It is what the model's `AutoProcessor` does (`Qwen2VLProcessor`: expand each placeholder by the
image's merged patch count, tokenize), built from the model directory's image processor
(`AutoImageProcessor`) and tokenizer; it does not need the processor class itself, whose construction needs
torchvision in transformers 5 even for images.

Rows name their images in one column (`data.image_key`, default `images`): a file path (relative paths are
resolved against the dataset file's directory), a `PIL.Image`, a Hugging Face `datasets` image
(`{"bytes": ..., "path": ...}` or decoded), raw bytes, or a list of those. The prompt text places the images
where it says `<image>`; a prompt without that marker has its images before the text, as Qwen2-VL's own
chat format does.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollflow.errors import DataError

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI imports this before it may import torch
    import torch

IMAGE_MARKER = "<image>"  # where a prompt's text places its next image
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END  # how Qwen2-VL's chat template renders an image part


@dataclass
class VisionInputs:
    """The images of one prompt, processed: what a vision-language model reads besides the token ids.

    Attributes:
        pixel_values: [patches, patch features] float32, every image's patches one after the other.
        image_grid_thw: [images, 3] long, each image's (temporal, height, width) in patches.
        images: the RGB images themselves, for engines that run the model's processor on their own side
            (vLLM); the same pixels `pixel_values` were made from.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def stack_vision(items: list[VisionInputs | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The vision inputs of a batch's rows in row order: ([patches, D] pixel values, [images, 3] grids), the
    order the model matches them to the image tokens of its input ids in; None when no row has images."""
    import torch

    present = [item for item in items if item is not None and item.num_images]
    if not present:
        return None
    return (torch.cat([item.pixel_values for item in present]),  # [patches, D]
            torch.cat([item.image_grid_thw for item in present]))  # [images, 3]


def join_vision(parts: list[VisionInputs | None]) -> VisionInputs | None:
    """The images of several parts of one sequence (an episode's turns), in order, as one `VisionInputs`;
    None when no part has images."""
    import torch

    present = [part for part in parts if part is not None and part.num_images]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return VisionInputs(torch.cat([part.pixel_values for part in present]),
                        torch.cat([part.image_grid_thw for part in present]),
                        [image for part in present for image in part.images])


def place_images(text: str, count: int) -> str:
    """`text` with each `<image>` marker replaced by an image's placeholder (`IMAGE_PLACEHOLDER`), or, without
    markers, the `count` placeholders before it (as `image_messages` places them).

    Raises:
        DataError: the text has markers, but not one per image.
    """
    markers = text.count(IMAGE_MARKER)
    if markers and markers != count:
        raise DataError(f"the text has {markers} {IMAGE_MARKER} markers for {count} images")
    if not markers:
        return IMAGE_PLACEHOLDER * count + text
    return text.replace(IMAGE_MARKER, IMAGE_PLACEHOLDER)


def read_image(value: Any, base_dir: Path | None = None):
    """One image value of a row as an RGB `PIL.Image` (see the module docstring for what a value may be).

    Raises:
        DataError: the file is missing or not an image, or the value is of no image kind (one line).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):  # a `datasets` Image
            data = value.get("bytes")
            if isinstance(data, str):  # `read_rows` hands a table's bytes out as base64 text (JSON holds it)
                import base64
                import binascii

                try:
                    data = base64.b64decode(data, validate=True)
                except binascii.Error:
                    raise DataError("an image's 'bytes' is text that is not base64") from None
            return read_image(data if data else value["path"], base_dir)
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None and (base_dir / path).exists():
                path = base_dir / path
            if not path.is_file():
                raise DataError(f"image file {str(value)!r} does not exist")
            image = Image.open(path)
        else:
            raise DataError(f"an image must be a file path, a PIL image or image bytes, got {type(value).__name__}")
        image.load()
    except UnidentifiedImageError:
        raise DataError(f"image {_label(value)} is not an image file PIL can read") from None
    except OSError as err:
        raise DataError(f"image {_label(value)} cannot be read: {err}") from None
    return image.convert("RGB")


def _label(value: Any) -> str:
    return repr(str(value)) if isinstance(value, (str, Path)) else f"({type(value).__name__})"


def resolve_image_paths(rows: list[dict], image_key: str, directory: Path | None) -> list[dict]:
    """The rows with each relative image path that names a file under `directory` (the dataset file's
    directory) made absolute; other values as they are. Rows without images are the same objects."""
    if directory is None:
        return rows

    def resolved(value):
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() and (directory / value).is_file():
            return str(directory / value)
        return value

    out = []
    for row in rows:
        value = row.get(image_key)
        if isinstance(value, (str, list)):
            row = {**row, image_key: [resolved(v) for v in value] if isinstance(value, list) else resolved(value)}
        out.append(row)
    return out


def check_image_column(datasets: Sequence[tuple[str, Sequence[dict]]], image_key: str, default_key: str,
                       vision: bool, key: str = "data.image_key") -> list[str]:
    """The image column against a run's rows, all datasets together (a text-only domain may mix with image ones).

    Args:
        datasets: (source, rows) of every dataset of the run, `source` as messages name it.
        image_key: the configured image column (`data.image_key`).
        default_key: the config's default for it: a text run keeps it without having such a column.
        vision: the model is a vision-language model.
        key: the config key of `image_key`, for the messages.

    Returns:
        A warning when the model is a vision-language one and no row has images there: it gets text only.

    Raises:
        DataError: `image_key` is not the default and no row has that column (a misspelt column would
            otherwise train a vision-language model on text only, silently): one line naming the columns.
    """
    rows = [row for _, part in datasets for row in part]
    sources = " or ".join(source for source, _ in datasets)
    columns = ", ".join(sorted({column for row in rows for column in row})) or "none"
    if image_key != default_key and not any(image_key in row for row in rows):
        raise DataError(f"{key} is {image_key!r}, but no row of {sources} has that column (columns: {columns}); "
                        "set it to the column holding the images")
    if vision and not any(row.get(image_key) for row in rows):  # as `PromptEncoder` tells a row with images
        return [f"no row of {sources} has images in column {image_key!r} ({key}; columns: {columns}): the "
                f"vision-language model gets text-only prompts; set {key} to the column holding the images"]
    return []


def row_images(row: dict, image_key: str, base_dir: Path | None = None) -> list:
    """The row's images (`read_image` of each), [] when the row has none."""
    value = row.get(image_key)
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [read_image(item, base_dir) for item in values]


def encodable_images(row: dict, image_key: str, processor: VisionProcessor | None, use_template: bool) -> list:
    """The images of a row that an encoder (prompt or conversation) is to render with the model's chat template.

    Raises:
        DataError: the model is text-only (no `processor`), there is no chat template to place the images, or
            an image cannot be read; one line each.
    """
    if processor is None:
        raise DataError(f"the row has images (column {image_key!r}), but the model is text-only: use a "
                        "vision-language model (Qwen2-VL's family), or drop the column")
    if not use_template:
        raise DataError("a row with images needs the model's chat template (data.apply_chat_template: true) to "
                        "place its images")
    return row_images(row, image_key)


def described_images(row: dict, image_key: str) -> dict:
    """The row with its image objects (PIL images, bytes, `datasets` images) replaced by short descriptions
    (`<image 32x32>`) and its paths kept: a row that JSON holds."""
    value = row.get(image_key)
    if value is None:
        return row
    values = value if isinstance(value, (list, tuple)) else [value]
    described = [item if isinstance(item, str) else _description(item) for item in values]
    return {**row, image_key: described if isinstance(value, (list, tuple)) else described[0]}


def _description(value: Any) -> str:
    size = getattr(value, "size", None)
    if isinstance(size, tuple) and len(size) == 2:
        return f"<image {size[0]}x{size[1]}>"
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return value["path"]
    return "<image>"


def vision_state(vision: VisionInputs) -> dict:
    """`vision` as JSON (a checkpoint's pending prompts): tensors as nested lists, images as base64 PNG."""
    import base64

    encoded = []
    for image in vision.images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return {"pixel_values": vision.pixel_values.tolist(), "image_grid_thw": vision.image_grid_thw.tolist(),
            "images": encoded}


def vision_from_state(state: dict) -> VisionInputs:
    """What `vision_state` wrote, back as `VisionInputs`."""
    import base64

    import torch

    images = [read_image(base64.b64decode(text)) for text in state["images"]]
    return VisionInputs(torch.tensor(state["pixel_values"], dtype=torch.float32),
                        torch.tensor(state["image_grid_thw"], dtype=torch.long), images)


def image_messages(prompt: str, count: int) -> list[dict]:
    """A one-user-turn conversation holding `count` images and the prompt text, as chat templates take it:
    content parts `{"type": "image"}` where the text says `<image>`, or all before the text.

    Raises:
        DataError: the text has `<image>` markers, but not one per image.
    """
    markers = prompt.count(IMAGE_MARKER)
    if markers and markers != count:
        raise DataError(f"the prompt has {markers} {IMAGE_MARKER} markers for {count} images")
    if not markers:
        parts = [{"type": "image"} for _ in range(count)] + [{"type": "text", "text": prompt}]
    else:
        parts = []
        for index, piece in enumerate(prompt.split(IMAGE_MARKER)):
            if index:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts}]


class VisionProcessor:
    """Turns a rendered prompt and its images into token ids and `VisionInputs`, as the model's processor does.

    Each `<|image_pad|>` of the text stands for one image (in order): it becomes `grid.prod() / merge**2` of
    them, the number of patch embeddings the model's vision tower gives the image after merging.

    Args:
        image_processor: the model's image processor (`AutoImageProcessor.from_pretrained`): resizes,
            normalizes and cuts an image into patches; its `merge_size` is the vision tower's patch merge.
        tokenizer: the model's tokenizer, with the vision tokens in its vocabulary.
    """

    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        missing = [token for token in (IMAGE_PAD, VISION_START, VISION_END)
                   if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id)]
        if missing:
            raise DataError(f"the tokenizer has no {missing[0]} token: it is not a vision-language model's")
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def __call__(self, text: str, images: list) -> tuple[list[int], VisionInputs | None]:
        """Token ids of `text` with each image placeholder expanded, and the images' `VisionInputs` (None
        without images).

        Raises:
            DataError: the text holds another number of `<|image_pad|>` than there are images.
        """
        placeholders = text.count(IMAGE_PAD)
        if placeholders != len(images):
            raise DataError(f"the rendered prompt has {placeholders} image placeholders for {len(images)} images")
        if not images:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        vision = self.process(images)
        return self.tokenizer(self.expand(text, vision), add_special_tokens=False)["input_ids"], vision

    def process(self, images: list) -> VisionInputs:
        """The images' pixel values and grids (the image processor, once for all of them)."""
        processed = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(processed["pixel_values"].float(), processed["image_grid_thw"].long(), list(images))

    def expand(self, text: str, vision: VisionInputs | None) -> str:
        """`text` with its k-th `<|image_pad|>` repeated once per merged patch of image k; the text may hold
        the placeholders of the first images only (a conversation's prefix).

        Raises:
            DataError: more placeholders than images.
        """
        pieces = text.split(IMAGE_PAD)
        grids = [] if vision is None else vision.image_grid_thw
        if len(pieces) - 1 > len(grids):
            raise DataError(f"the text has {len(pieces) - 1} image placeholders for {len(grids)} images")
        counts = [int(grid.prod()) // self.merge_size ** 2 for grid in grids[: len(pieces) - 1]]
        return pieces[0] + "".join(IMAGE_PAD * count + piece for count, piece in zip(counts, pieces[1:]))


def load_vision_processor(path: str, tokenizer, trust_remote_code: bool = False) -> VisionProcessor:
    """The `VisionProcessor` of the (resolved) model directory or hub id `path`, around `tokenizer`.

    Raises:
        DataError: the model has no image processor (`preprocessor_config.json`), one line.
    """
    from transformers import AutoImageProcessor

    try:
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError here
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"the model at {path} has no image processor it can load ({reason})") from None
    return VisionProcessor(image_processor, tokenizer)
