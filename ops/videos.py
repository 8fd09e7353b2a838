"""Videos as a model's processor takes them. Every video headscope opens (explain's
``--video``, ``headscope.explain``'s ``videos=``) is read here, and a file that cannot be
is refused here, in one line that names it.

Decoding is torchcodec's, the library transformers' video processors decode a file with
(``BaseVideoProcessor.fetch_videos``), through the same function
(``transformers.video_utils.read_video_torchcodec``). The frames are sampled as the
processor samples them: with its ``do_sample_frames`` set, its own ``sample_frames`` with
its own settings (``fps``, ``num_frames``, ``min_frames``, ...); without, every frame. So
:func:`read_video` gives the frames and the ``VideoMetadata`` (source frame count, frame
rate, the sampled frames' indices) that the processor would take from the path itself;
the processor then gets them with ``do_sample_frames=False`` (:meth:`Video.processor_kwargs`)
and knows each frame's time.

Needs torchcodec (``pip install torchcodec``, requirements.txt pins the release built for
the pinned torch) and FFmpeg's libraries (Debian: ``apt-get install ffmpeg``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

import numpy as np
import torch

# what a video processor's preprocess takes out of its settings before it samples frames
# (transformers.video_processing_utils.BaseVideoProcessor.preprocess)
_NOT_SAMPLING = ("input_data_format", "do_convert_rgb", "do_sample_frames", "device",
                 "video_metadata")


class VideoError(ValueError):
    """A video that cannot be read: the message is ``"<path>: <reason>"``."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def decoder_missing() -> str:
    """Why videos cannot be decoded here, or "" when they can."""
    try:
        from torchcodec.decoders import VideoDecoder  # noqa: F401
    except ImportError:
        return "reading videos needs torchcodec: pip install torchcodec (requirements.txt pins it)"
    except (RuntimeError, OSError) as e:
        return (f"torchcodec cannot load FFmpeg's libraries ({str(e).splitlines()[0]}); "
                f"install them: apt-get install ffmpeg (scripts/setup_env.sh does)")
    return ""


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, without torchcodec's source location."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return re.sub(r"^.*?\.cpp:\d+,\s*", "", lines[0]) if lines else type(error).__name__


def _decoder(path: Union[str, Path]):
    """torchcodec's decoder of ``path`` (its stream read, no frame decoded)."""
    missing = decoder_missing()
    if missing:
        raise VideoError(path, missing)
    from torchcodec.decoders import VideoDecoder
    if not Path(path).is_file():
        raise VideoError(path, "no such file")
    try:
        return VideoDecoder(str(path), seek_mode="approximate")
    except (RuntimeError, ValueError, OSError) as e:
        raise VideoError(path, f"not a readable video: {_first_line(e)}") from e


def check_video(path: Union[str, Path]) -> dict:
    """``{"frames", "fps", "width", "height", "seconds"}`` of the video at ``path`` from its
    stream's header, after checking that it opens as a video with frames and a frame rate;
    ``VideoError`` otherwise. Decodes no frame."""
    meta = _decoder(path).metadata
    frames, fps = meta.num_frames, meta.average_fps
    if not frames:
        raise VideoError(path, "not a readable video: its video stream holds no frames")
    if not fps or not np.isfinite(fps):
        raise VideoError(path, "not a readable video: its frame rate is unknown, so its "
                               "frames' times are")
    return {"frames": int(frames), "fps": float(fps), "width": int(meta.width),
            "height": int(meta.height), "seconds": frames / fps}


def sampled_indices(video_processor, metadata) -> np.ndarray:
    """The source frames ``video_processor`` samples of a video of ``metadata``
    (``transformers.video_utils.VideoMetadata``): with ``do_sample_frames`` its own
    ``sample_frames`` under its own settings, as its ``preprocess`` calls it; otherwise
    (or with no processor) every frame."""
    if video_processor is None or not getattr(video_processor, "do_sample_frames", False):
        return np.arange(metadata.total_num_frames)
    settings = {name: getattr(video_processor, name, None)
                for name in video_processor.valid_kwargs.__annotations__
                if name not in _NOT_SAMPLING}
    # int64: torchcodec takes no other index type from numpy
    return np.asarray(video_processor.sample_frames(metadata=metadata, **settings),
                      dtype=np.int64)


@dataclass(frozen=True)
class Video:
    """One video read for a model: ``frames`` ``(N, 3, H, W)`` uint8 RGB, the frames the
    processor samples, and ``metadata``, transformers' ``VideoMetadata`` of the source
    (``total_num_frames``, ``fps``, ``duration``, ``width``, ``height``) with the sampled
    frames' source indices (``frames_indices``)."""
    path: str
    frames: torch.Tensor
    metadata: object

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def source_frames(self) -> torch.Tensor:
        """(N,) int64: each sampled frame's index in the source video."""
        return torch.as_tensor([int(i) for i in self.metadata.frames_indices],
                               dtype=torch.int64)

    @property
    def seconds(self) -> torch.Tensor:
        """(N,) float64: each sampled frame's time in the source video (its index over the
        frame rate, as transformers' ``VideoMetadata.timestamps``)."""
        return self.source_frames.to(torch.float64) / float(self.metadata.fps)

    def pictures(self) -> List:
        """The sampled frames as PIL RGB pictures."""
        from PIL import Image
        return [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in self.frames]

    @staticmethod
    def processor_kwargs(videos) -> dict:
        """What a processor call takes for ``videos`` (a list of :class:`Video`): the
        sampled frames, their metadata and ``do_sample_frames=False`` (they are sampled
        already), and ``return_metadata=True`` (the tracer reads each frame's time from
        ``video_metadata``)."""
        if not videos:
            return {}
        return {"videos": [v.frames for v in videos],
                "video_metadata": [v.metadata for v in videos],
                "do_sample_frames": False, "return_metadata": True}


def read_video(path: Union[str, Path], video_processor=None) -> Video:
    """The frames of the video at ``path`` that ``video_processor`` (a transformers video
    processor, ``processor.video_processor``; None: every frame) samples, decoded as it
    decodes a file (module docstring); ``VideoError`` for a file that cannot be read or
    of which the processor samples no frame."""
    from transformers.video_utils import read_video_torchcodec
    check_video(path)

    def indices(metadata, **_):
        try:
            chosen = sampled_indices(video_processor, metadata)
        except ValueError as e:  # such as fewer frames than the processor samples
            raise VideoError(path, f"the video processor samples no frames of it: "
                                   f"{_first_line(e)}") from e
        if len(chosen) == 0:
            raise VideoError(path, "the video processor samples no frames of it")
        return chosen
    try:
        frames, metadata = read_video_torchcodec(str(path), sample_indices_fn=indices)
    except VideoError:
        raise
    except (RuntimeError, ValueError, OSError, IndexError) as e:
        raise VideoError(path, f"not a readable video: {_first_line(e)}") from e
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
        raise VideoError(path, f"not a readable video: decoded frames of {frames.dtype} "
                               f"{tuple(frames.shape)}, expected uint8 (N, 3, H, W)")
    return Video(str(path), frames, metadata)


def as_video(video, video_processor=None, name: str = "video") -> Video:
    """A :class:`Video` as it is, or the video at a path read by :func:`read_video`."""
    if isinstance(video, Video):
        return video
    if isinstance(video, (str, Path)):
        return read_video(video, video_processor)
    raise TypeError(f"{name} must be a path or a headscope.videos.Video, got "
                    f"{type(video).__name__}")
