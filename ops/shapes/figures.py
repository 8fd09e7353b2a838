"""Pictures of one span's attribution: the image with the region outlines, the object's
true box, and the span's region scores as a heat map (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..io import atomic_path
from ..metrics import region_centroids as normalised_centroids


def region_map(labels: np.ndarray, grid: Sequence[int], image_size: int) -> np.ndarray:
    """``(image_size, image_size)`` region label of every pixel, from the ``(rows*cols,)``
    row-major labels of the image's token grid."""
    rows, cols = grid
    cell = labels.reshape(rows, cols)
    return np.kron(cell, np.ones((image_size // rows, image_size // cols), dtype=cell.dtype))


def region_centroids(labels: np.ndarray, grid: Sequence[int], image_size: int,
                     num_regions: int) -> np.ndarray:
    """``(K, 2)`` pixel centre (x, y) of each region's tokens."""
    return normalised_centroids(torch.as_tensor(labels), *grid, num_regions).numpy() * image_size


def _outline_segments(pixel_labels: np.ndarray) -> list:
    """Line segments (in pixel coordinates) between neighbouring pixels of different
    regions."""
    segments = []
    h, w = pixel_labels.shape
    for y, x in zip(*np.nonzero(pixel_labels[:, 1:] != pixel_labels[:, :-1])):
        segments.append([(x + 1, y), (x + 1, y + 1)])
    for y, x in zip(*np.nonzero(pixel_labels[1:, :] != pixel_labels[:-1, :])):
        segments.append([(x, y + 1), (x + 1, y + 1)])
    return segments


def save_png(image, path: Path) -> None:
    """Writes a PIL image as a PNG, atomically (never a partial file at ``path``)."""
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")


def span_figure(path: Path, image, labels: np.ndarray, grid: Sequence[int],
                centroids: np.ndarray, scores: np.ndarray, title: str, score_name: str,
                box: Optional[Sequence[int]], top_region: int) -> None:
    """Writes a PNG of two panels: the image with region outlines, their numbers (at
    ``centroids``, ``(K, 2)`` pixels) and the true box, and the span's scores per region as
    a heat map over the image, the top region marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    pixels = np.asarray(image)
    size = pixels.shape[0]
    pixel_labels = region_map(labels, grid, size)
    heat = np.asarray(scores, dtype=np.float64)[pixel_labels]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 4.6), dpi=110)
    extent = (0, size, size, 0)
    for ax in axes:
        ax.imshow(pixels, extent=extent, interpolation="nearest")
        ax.add_collection(LineCollection(_outline_segments(pixel_labels), colors="black",
                                         linewidths=1.0, alpha=0.7))
        if box is not None:
            x0, y0, x1, y1 = box
            ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, lw=2.2,
                                   ec="lime", ls="--"))
        ax.set_xticks([])
        ax.set_yticks([])
    for k, (x, y) in enumerate(centroids):
        axes[0].text(x, y, str(k), color="black", ha="center", va="center", fontsize=8,
                     bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.75))
    axes[0].set_title("image, numbered regions, true box (dashed)", fontsize=10)
    shown = axes[1].imshow(heat, extent=extent, cmap="inferno", alpha=0.72,
                           interpolation="nearest")
    top = pixel_labels == top_region
    axes[1].add_collection(LineCollection(_outline_segments(top.astype(np.int64)),
                                          colors="cyan", linewidths=2.4))
    x, y = centroids[top_region]
    axes[1].text(x, y, f"top: {top_region}", color="cyan", ha="center", va="center",
                 fontsize=9, fontweight="bold")
    axes[1].set_title(f"{score_name} (hottest outlined)", fontsize=10)
    fig.colorbar(shown, ax=axes[1], fraction=0.046, pad=0.03)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
