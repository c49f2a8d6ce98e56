"""An env's image observations: the images of an observation travel in its info dict, under `info["images"]`
(one image or a list: PIL images, PNG bytes, or file paths), and the observation text says where they go with
`<image>` (else they go before it). Between processes they are PNG bytes (the env worker to the driver); over
HTTP (`rollflow env serve`) base64 text of those bytes, turned back into bytes by the client (`RemoteEnv`).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

IMAGES_KEY = "images"


def image_bytes(value: Any) -> list[bytes]:
    """`info["images"]` as a list of PNG bytes (bytes are kept as they are).

    Raises:
        ValueError: a value that is no image (one line, naming it).
    """
    from rollflow.data.vision import read_image
    from rollflow.errors import DataError

    images = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (bytes, bytearray)):
            images.append(bytes(item))
            continue
        try:
            image = read_image(item)
        except DataError as err:
            raise ValueError(f"env info['images'] holds something that is not an image: {err}") from None
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def images_to_json(info: dict[str, Any]) -> dict[str, Any]:
    """`info` with its images (if any) as base64 text of their PNG bytes, for a JSON reply (the server)."""
    if info.get(IMAGES_KEY) is None:
        return info
    return {**info, IMAGES_KEY: [base64.b64encode(data).decode("ascii") for data in image_bytes(info[IMAGES_KEY])]}


def images_from_json(info: dict[str, Any]) -> dict[str, Any]:
    """What `images_to_json` made, with the images back as PNG bytes (the client).

    Raises:
        ValueError: the images are not a list of base64 text (a server that speaks another protocol).
    """
    texts = info.get(IMAGES_KEY)
    if texts is None:
        return info
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise ValueError(f"the server's info['images'] is not a list of base64 texts: {str(texts)[:80]}")
    try:
        return {**info, IMAGES_KEY: [base64.b64decode(text, validate=True) for text in texts]}
    except binascii.Error:
        raise ValueError("the server's info['images'] holds text that is not base64") from None
