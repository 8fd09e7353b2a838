"""Pictures as people see them. Every picture headscope opens (the commands' ``--image`` and
DATA files, ``headscope.explain``'s) is read here, and a file that cannot be is refused
here, in one line that names it:

* turned upright by its EXIF orientation, as photo viewers and transformers' ``load_image``
  do (a phone stores its pixels sideways with a tag saying how to turn them);
* converted to 8-bit RGB: greyscale, palette, CMYK and YCbCr pictures as PIL converts them,
  16-bit greyscale (``I;16``, or ``I`` as some PIL versions open it) scaled from 0..65535 to
  0..255 (and clipped there);
* transparency (RGBA, LA, a palette or picture with a transparent colour) composited on
  white (``BACKGROUND``), as a page shows it;
* an animated picture (GIF, APNG, WebP) by its first frame, with a warning saying so.

Other modes (floating-point pixels, say) are refused.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Tuple, Union

BACKGROUND = (255, 255, 255)  # what a transparent pixel shows: white, as on a page

# PIL's own conversion to RGB is right for these modes
_CONVERTED = {"RGB", "L", "1", "P", "CMYK", "YCbCr"}
_TRANSPARENT = {"RGBA", "LA", "PA", "RGBa", "La"}
_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
_ORIENTATION = 0x0112


class PictureError(ValueError):
    """A picture that cannot be read, or whose pixels headscope does not take: the message
    is ``"<path>: <reason>"``."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _check_mode(image, name: str) -> None:
    if image.mode not in _CONVERTED | _TRANSPARENT | _SIXTEEN_BIT:
        raise PictureError(name, f"pictures of mode {image.mode!r} are not supported; allowed: "
                                 f"RGB(A), greyscale (8 or 16 bit, with alpha), palette, CMYK, "
                                 f"YCbCr")


def _open(path: Union[str, Path]):
    from PIL import Image, UnidentifiedImageError
    path = Path(path)
    if not path.is_file():
        raise PictureError(path, "no such file")
    try:
        return Image.open(path)
    except (OSError, UnidentifiedImageError, SyntaxError, Image.DecompressionBombError) as e:
        raise PictureError(path, f"not a readable picture: {e}") from e


def check_picture(path: Union[str, Path]) -> Tuple[int, int]:
    """``(width, height)`` of the picture at ``path`` as it is seen (upright), after checking
    that the file is whole and its mode is taken; ``PictureError`` otherwise. Reads the
    header and checks the file without decoding the pixels."""
    from PIL import Image
    try:
        with _open(path) as image:
            _check_mode(image, str(path))
            width, height = image.size
            image.verify()  # only right after opening
        with _open(path) as image:  # (a PNG's EXIF may follow its pixels, read with them)
            upright = image.getexif().get(_ORIENTATION) in _ROTATED
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise PictureError(path, f"not a readable picture: {e}") from e
    return (height, width) if upright else (width, height)


def read_picture(path: Union[str, Path]):
    """The picture at ``path`` as ``upright_rgb`` gives it, decoded; ``PictureError`` when
    the file cannot be read."""
    from PIL import Image
    with _open(path) as image:
        try:
            return upright_rgb(image, str(path))
        except (OSError, SyntaxError, Image.DecompressionBombError) as e:
            raise PictureError(path, f"not a readable picture: {e}") from e


def upright_rgb(image, name: str = "picture"):
    """An open PIL image as it is seen: its first frame, turned by its EXIF orientation,
    8-bit RGB with transparency on ``BACKGROUND`` (module docstring). ``name`` names it in
    the warning and errors. A new image; ``image`` is left as it is."""
    import numpy as np
    from PIL import Image, ImageOps
    _check_mode(image, name)
    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        warnings.warn(f"{name}: an animated picture of {frames} frames: its first frame is used",
                      stacklevel=2)
        image.seek(0)
    image.load()
    # a copy even without a tag: the caller's image is never changed
    image = ImageOps.exif_transpose(image)
    if image.mode in ("P", "L", "RGB") and "transparency" in image.info:  # a transparent colour
        image = image.convert("RGBA")
    if image.mode in _TRANSPARENT:
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(flat, rgba).convert("RGB")
    if image.mode in _SIXTEEN_BIT:
        grey = np.asarray(image, dtype=np.float64) * (255 / 65535)
        return Image.fromarray(np.clip(np.rint(grey), 0, 255).astype(np.uint8)).convert("RGB")
    return image.convert("RGB")
