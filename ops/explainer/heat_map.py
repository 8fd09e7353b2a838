"""A heat map over a picture or a video frame: where each token's box lies (the region
map), each pixel coloured by its region's heat, the colour bar's ends, and the sizes and
encodings the page and the PNGs draw them in. Shared by ``page.py`` and ``video.py``."""
from __future__ import annotations

import base64
import io

import numpy as np

DISPLAY_SIDE = 448       # the longest side of a picture on the page, in pixels
COLORMAP = "inferno"
HEAT_ALPHA = 0.6


def display_size(image, side: int = DISPLAY_SIDE) -> tuple:
    """(width, height) of ``image`` scaled so that its longest side is ``side``."""
    w, h = image.size
    scale = side / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def displayed(image):
    """``image`` at its display size: small pictures enlarged to crisp pixels, large ones
    reduced smoothly."""
    from PIL import Image
    size = display_size(image)
    return image.resize(size, Image.NEAREST if size[0] > image.size[0] else Image.LANCZOS)


def region_map(picture, size: tuple) -> np.ndarray:
    """``(height, width)`` int64: the region of each pixel of the picture drawn at ``size``
    (width, height), -1 where no token lies. Tokens are painted coarsest first."""
    width, height = size
    boxes = picture.boxes.double().numpy()
    labels = picture.labels.numpy()
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    out = np.full((height, width), -1, dtype=np.int64)
    scale = np.array([width, height, width, height], dtype=np.float64)
    pixels = np.clip(np.rint(boxes * scale), 0, scale).astype(np.int64)
    for i in np.argsort(-area, kind="stable"):
        x0, y0, x1, y1 = pixels[i]
        out[y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)] = labels[i]
    return out


def region_centres(label_map: np.ndarray, regions: tuple) -> dict:
    """Region -> its pixels' centre ``(x, y)`` normalised to the picture, for the
    regions ``[first, end)`` that cover any pixel."""
    height, width = label_map.shape
    ys, xs = np.mgrid[0:height, 0:width]
    centres = {}
    for k in range(*regions):
        mask = label_map == k
        if mask.any():
            centres[k] = ((xs[mask].mean() + 0.5) / width, (ys[mask].mean() + 0.5) / height)
    return centres


def scale(heat: np.ndarray) -> tuple:
    """(low, high) of a span's heat: the ends of its colour bar (regions without tokens,
    NaN, left out)."""
    shown = heat[~np.isnan(heat)]
    return (float(shown.min()), float(shown.max())) if len(shown) else (0.0, 0.0)


def heat_rgba(label_map: np.ndarray, scores: np.ndarray, low: float, high: float
              ) -> np.ndarray:
    """``(height, width, 4)`` uint8: each pixel coloured by its region's score on the
    colormap from ``low`` to ``high``, translucent; transparent off the tokens."""
    import matplotlib
    cmap = matplotlib.colormaps[COLORMAP]
    span = high - low
    values = np.where(label_map >= 0, scores[np.clip(label_map, 0, None)], np.nan)
    t = np.full(values.shape, 0.5) if span <= 0 else (values - low) / span
    rgba = cmap(np.nan_to_num(t, nan=0.0))
    rgba[..., 3] = np.where(np.isnan(values), 0.0, HEAT_ALPHA)
    return (rgba * 255).round().astype(np.uint8)


def png_data_uri(array_or_image) -> str:
    """A PNG of a PIL image or an ``(h, w, 3|4)`` uint8 array as a data URI."""
    from PIL import Image
    image = array_or_image if isinstance(array_or_image, Image.Image) \
        else Image.fromarray(array_or_image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
