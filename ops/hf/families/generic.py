"""Any other VLM that puts its image tokens in the sequence, read by its structure
(``headscope.hf.structure``): its image placeholder tokens are those its own
``get_placeholder_mask`` finds, and each run of consecutive placeholders is one picture
with no known layout on the picture plane. Ward regions then cluster a run's tokens in
sequence order (a ``1 x n`` grid); ``grid_regions``, which needs each token's place on
the picture, is refused.

Video placeholders (what ``get_placeholder_mask`` compares with for video features) are
found the same way, each run one video; its frames lie in sequence order, each the same
share of the run, where a probe confirms it (noise on a video's first and last frames
changes exactly the first and last shares), else the video is one frame group covering
all its frames."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..capture import decoder_kwargs
from ..structure import placeholder_token_ids
from .base import Family
from .layout import FrameGroup, ImageTokens, VideoTokens, View, image_positions, runs

WHO = "headscope.hf.Tracer"

# a forward's arguments the probe leaves out: it runs without a cache
_CACHE_KEYS = ("cache", "past_key_values", "use_cache")


class Generic(Family):
    name = "generic"
    layout = "none: each run of image placeholders is one picture, in sequence order"
    has_layout = False

    def image_token_ids(self, config) -> Tuple[int, ...]:
        ids = placeholder_token_ids(config)
        if ids is None:
            raise ValueError(no_image_tokens(config))
        return ids

    def video_token_ids(self, config) -> Tuple[int, ...]:
        ids = placeholder_token_ids(config, "video") or ()
        return tuple(i for i in ids if i not in self.image_token_ids(config))

    def layout_inputs(self, model, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """``input_ids`` and which placeholders hold a piece of the picture
        (``picture_slots``, by :func:`picture_slots`' probe of the model on ``kwargs``);
        with video placeholders in ``input_ids``, which of them hold a piece of a video
        (``video_slots``) and, for videos given as ``pixel_values_videos`` ``(videos,
        frames, ...)``, their count and frames and which placeholders a video's first and
        last frames reach (``edge_frame_slots``)."""
        inputs = super().layout_inputs(model, kwargs)
        decoder, config = self.decoder(model), model.config
        with torch.no_grad():
            inputs["picture_slots"] = picture_slots(model, decoder, kwargs,
                                                    self.image_token_ids(config))
            video_ids = self.video_token_ids(config)
            ids = inputs["input_ids"]
            if not video_ids or ids is None or not bool(
                    torch.isin(ids.cpu(), torch.tensor(video_ids)).any()):
                return inputs
            inputs["video_slots"] = picture_slots(model, decoder, kwargs, video_ids)
            videos = kwargs.get("pixel_values_videos")
            if isinstance(videos, torch.Tensor) and videos.dim() == 5:
                frames = videos.shape[1]
                inputs["video_count"], inputs["video_frames"] = videos.shape[0], frames
                inputs["edge_frame_slots"] = picture_slots(model, decoder, kwargs, video_ids,
                                                           frames=(0, frames - 1))
        return inputs

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        """Each run of consecutive placeholders is one picture; of its slots, those that
        ``inputs["picture_slots"]`` ``(B, T)`` bool marks as holding no piece of the picture
        (begin/end, row breaks, indicator tokens: see :func:`picture_slots`) are markers,
        region -1."""
        slots = inputs.get("picture_slots")
        pictures = []
        for b, positions in enumerate(image_positions(inputs["input_ids"],
                                                      self.image_token_ids(config))):
            row = []
            for run in runs(positions):
                content = run if slots is None else run[slots[b, run].cpu()]
                if not len(content):
                    continue
                markers = run[~torch.isin(run, content)]
                row.append(ImageTokens((View("run", content, 1, len(content)),),
                                       markers=markers))
            pictures.append(row)
        return pictures

    def videos(self, config, inputs: Dict[str, Any]) -> List[List[VideoTokens]]:
        """Each run of consecutive video placeholders is one video (the batch's videos
        in order), its slots that hold no piece of it markers (``video_slots``); its
        ``video_frames`` frames in sequence order, each an equal share of the run, where
        ``edge_frame_slots`` (the slots the first and last frames reach) are exactly the
        first and last shares; otherwise one frame group of every frame."""
        ids = self.video_token_ids(config)
        per_row = image_positions(inputs["input_ids"], ids) if ids else \
            [torch.zeros(0, dtype=torch.int64)] * len(inputs["input_ids"])
        if not any(len(p) for p in per_row):
            return [[] for _ in per_row]
        frames = inputs.get("video_frames")
        if frames is None:
            raise NotImplementedError(
                f"{WHO}: the video placeholders of this {config.model_type} model are read by "
                f"its structure, which needs each video's frames: pixel_values_videos of "
                f"shape (videos, frames, channels, height, width)")
        slots, edges = inputs["video_slots"], inputs["edge_frame_slots"]
        videos, index = [], 0
        for b, positions in enumerate(per_row):
            row = []
            for run in runs(positions):
                content = run[slots[b, run].cpu()]
                if not len(content):
                    continue
                markers = run[~torch.isin(run, content)]
                row.append(VideoTokens(frame_groups(content, frames,
                                                    content[edges[b, content].cpu()]),
                                       frames, index, markers=markers))
                index += 1
            videos.append(row)
        if index != inputs["video_count"]:
            raise ValueError(f"{WHO}: input_ids hold {index} runs of video placeholders but "
                             f"pixel_values_videos {inputs['video_count']} videos")
        return videos


def frame_groups(content: torch.Tensor, frames: int, edge: torch.Tensor
                 ) -> Tuple[FrameGroup, ...]:
    """A video's frame groups read by structure: ``content`` its placeholders that hold a
    piece of it, in sequence order, ``frames`` its frames, ``edge`` the placeholders its
    first and last frames reach. One frame per group, each ``len(content) / frames``
    placeholders in a ``1 x n`` view, where the first and last frames reach exactly the
    first and last such shares; else one group of every frame."""
    n = len(content)
    share = n // frames
    if n % frames == 0:
        ends = torch.cat([content[:share], content[n - share:]]).unique()
        if torch.equal(edge.sort().values, ends):
            return tuple(FrameGroup((f,), ImageTokens((View("run", chunk, 1, share),)))
                         for f, chunk in enumerate(content.reshape(frames, share)))
    return (FrameGroup(tuple(range(frames)), ImageTokens((View("run", content, 1, n),))),)


def picture_slots(model, decoder: torch.nn.Module, kwargs: Dict[str, Any],
                  token_ids: Tuple[int, ...], frames: Optional[Tuple[int, ...]] = None
                  ) -> torch.Tensor:
    """``(B, T)`` bool: the placeholders whose input to the text decoder changes with the
    picture's pixels. The model runs once more, to its text decoder, on the same inputs
    with and without noise added to every ``pixel_values*`` input; a slot whose embedding, and whatever
    the decoder gets per placeholder besides (features it adds at later layers, in
    placeholder order), stays bitwise the same holds a learned marker (begin/end of image,
    row break, indicator), not the picture. ``decoder``: the model's text decoder;
    ``token_ids``: the placeholders' ids; ``frames``: noise on only these frames of every
    video of ``pixel_values_videos`` ``(videos, frames, ...)``, nothing else."""
    named = inspect.signature(model.forward).parameters
    kwargs = {k: v for k, v in kwargs.items()  # (generate's own arguments left out)
              if k in named and named[k].kind is not inspect.Parameter.VAR_KEYWORD
              and k not in _CACHE_KEYS}
    g = torch.Generator().manual_seed(0)
    noisy = dict(kwargs)
    for key, value in kwargs.items():
        if key.startswith("pixel_values") and isinstance(value, torch.Tensor) \
                and value.is_floating_point() and (frames is None
                                                   or key == "pixel_values_videos"):
            noise = torch.randn(value.shape, generator=g).to(value.device, value.dtype)
            if frames is not None:
                only = torch.zeros(value.shape[1], dtype=value.dtype, device=value.device)
                only[list(frames)] = 1
                noise = noise * only.reshape(1, -1, *[1] * (value.dim() - 2))
            noisy[key] = value + noise
    plain = decoder_kwargs(model, decoder, kwargs)
    probed = decoder_kwargs(model, decoder, noisy)
    is_image = torch.isin(kwargs["input_ids"].cpu(), torch.tensor(list(token_ids)))
    changed = (probed["inputs_embeds"] != plain["inputs_embeds"]).any(-1).cpu() & is_image
    count = int(is_image.sum())
    later = [(a, b) for a, b in zip(_tensors(plain), _tensors(probed))
             if a.dim() == 2 and a.shape[0] == count and a is not plain["inputs_embeds"]]
    for a, b in later:  # per placeholder, in sequence order
        changed[is_image] |= (a != b).any(-1).cpu()
    if count and not bool(changed.any()):
        raise NotImplementedError(
            f"headscope.hf.Tracer: the image features of this {model.config.model_type} "
            f"model reach its text decoder neither through the placeholders' embeddings nor "
            f"through per-placeholder decoder inputs, so headscope cannot tell which "
            f"placeholders hold the picture")
    return changed


def _tensors(value) -> List[torch.Tensor]:
    """The tensors in a decoder input (nested in dicts, lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def no_image_tokens(config) -> str:
    """Why a model whose config names no image placeholder cannot be traced."""
    return (f"its config ({type(config).__name__}) names no image placeholder token "
            f"(image_token_id, image_token_index or what its get_placeholder_mask reads), so "
            f"its sequence holds no image tokens to attribute to")
