"""MiniCPM-V 4.6 (``minicpmv4_6``): each picture is a source view (the whole picture,
resized) and, for a picture larger than the image processor's ``scale_resolution``
squared, slices: the picture resized and cut into rows x cols equal cells, each cell a
view of its own. The processor writes a picture as

    [<image_id>N</image_id>]<image>(source)</image><slice>(slice)</slice><slice>...</slice>
    \\n<slice>(slice)</slice>...   (one line of slices per row)

each view a run of image tokens. ``target_sizes`` gives each view's patch grid (the views'
patches NaViT-packed side by side in ``pixel_values``); the tower's window-attention
merger and the merger's MLP each join 2 x 2 of them into one token (the first skipped in
"4x" mode), row-major over the view. The processor drops which views make a picture and
how its slices are arranged (``grids``); both are read back from ``input_ids`` as the
processor writes them: a picture begins at a run of image tokens opened by the token that
opens the batch's first run (``<image>``: a slice's is ``<slice>``), and a slice starts a
new row of slices unless only the previous slice's closing token and its own opening
token lie between them (the newline between rows is a token in every tokenizer of the
checkpoints). The decoder is Qwen3.5's hybrid (gated delta nets between gated softmax
layers): only its softmax layers are traced."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, View, image_positions, runs, stitch, tile_boxes

WHO = "headscope.hf.Tracer"


def merge_factor(config) -> Tuple[int, int]:
    """Patches per token along (height, width): the tower's window-attention merger (not
    in "4x" mode), then the merger's kernel, ``merger_times`` over."""
    window = (config.vision_config.window_kernel_size if config.downsample_mode != "4x"
              else (1, 1))
    kernel = config.merge_kernel_size
    return tuple(int(w) * int(k) ** config.merger_times for w, k in zip(window, kernel))


@register
class MiniCPMV(Family):
    name = "minicpmv"
    titles = ("MiniCPM-V 4.6",)
    model_types = ("minicpmv4_6",)
    layout = ("a source view of the whole picture, then rows x cols slices (equal cells of "
              "the picture), each view its patches merged 4x4")
    input_keys = ("target_sizes",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        sizes = inputs.get("target_sizes")
        if sizes is None:
            raise missing_input(config, "target_sizes")
        fh, fw = merge_factor(config)
        shapes = iter([(h // fh, w // fw) for h, w in sizes.tolist()])
        ids = inputs["input_ids"].cpu()
        per_row = [runs(p) for p in image_positions(ids, self.image_token_ids(config))]
        found = sum(len(r) for r in per_row)
        if found != len(sizes):
            raise ValueError(f"{WHO}: target_sizes holds {len(sizes)} views (each picture's "
                             f"source view and slices) but input_ids {found} runs of image "
                             f"tokens")
        opener, out = None, []
        for b, row in enumerate(per_row):
            pictures = []
            for run in row:
                rows, cols = next(shapes)
                if len(run) != rows * cols or int(run[0]) == 0:
                    raise ValueError(f"{WHO}: row {b}'s run of {len(run)} image tokens at "
                                     f"position {int(run[0])} is no view of {rows} x {cols} "
                                     f"tokens after its opening marker (target_sizes)")
                mark = int(ids[b, run[0] - 1])
                opener = mark if opener is None else opener
                if mark == opener:
                    pictures.append([])
                elif not pictures:
                    raise ValueError(f"{WHO}: row {b} has a slice before its first picture")
                pictures[-1].append((run, rows, cols))
            out.append([picture(b, views) for views in pictures])
        return out


def picture(b: int, views) -> ImageTokens:
    """One picture from its views ``(positions, rows, cols)`` in sequence order: the source
    view, then its slices, row by row (a new row where more than a slice's closing and
    opening markers lie between two slices)."""
    (source, rows, cols), slices = views[0], views[1:]
    base = View("base", source, rows, cols)
    if not slices:
        return ImageTokens((base,))
    lines = [[slices[0]]]
    for before, after in zip(slices, slices[1:]):
        if int(after[0][0]) - int(before[0][-1]) == 3:
            lines[-1].append(after)
        else:
            lines.append([after])
    R, C = len(lines), len(lines[0])
    shapes = {(r, c) for _, r, c in slices}
    if any(len(line) != C for line in lines) or len(shapes) != 1:
        raise ValueError(f"{WHO}: row {b} has a picture whose slices are no rows x cols "
                         f"grid of equal slices: {[len(line) for line in lines]} slices per "
                         f"row, slice sizes {sorted(shapes)}")
    (r, c), = shapes
    cells = [View("slice", run, r, c, box) for (run, _, _), box in zip(slices, tile_boxes(R, C))]
    tiles = torch.stack([run for run, _, _ in slices]).reshape(R, C, r * c)
    return ImageTokens((base, *cells), View("slices", stitch(tiles, r).flatten(), R * r, C * c))
