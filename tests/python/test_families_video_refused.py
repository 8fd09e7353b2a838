"""A family whose video layout headscope does not read yet (MiniCPM-V 4.6) refuses a
video prompt from its own real tiny processor with one clear line naming the model type,
instead of tracing it with the video's tokens left out of every region."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")

from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import tiny_model, tiny_processor  # noqa: E402

# model type -> the text of one video as its processor expects it
VIDEO_TEXT = {"minicpmv4_6": "<|video_pad|>"}


@pytest.mark.parametrize("model_type", sorted(VIDEO_TEXT))
def test_video_prompt_of_a_family_without_video_layout_is_refused(model_type):
    model, processor = tiny_model(model_type), tiny_processor(model_type)
    frames = np.random.default_rng(0).integers(0, 256, (2, 24, 32, 3), dtype=np.uint8)
    metadata = [dict(total_num_frames=2, fps=2.0, frames_indices=[0, 1])]
    inputs = processor(text=[f"describe {VIDEO_TEXT[model_type]} now ."], videos=[frames],
                       video_metadata=metadata, return_metadata=True, do_sample_frames=False,
                       return_tensors="pt")
    inputs = family_of(model).model_inputs(dict(inputs))
    with torch.no_grad():
        model(**inputs)  # the model itself takes the prompt
        with Tracer(model, regions=2, vas=False), pytest.raises(
                NotImplementedError, match=rf"headscope.hf.Tracer: .*video.* of a {model_type} "
                                           rf"model yet"):
            model(**inputs)
