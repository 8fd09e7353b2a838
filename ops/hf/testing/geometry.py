"""The geometry tests' shared pictures and checks: a picture of four coloured quarters
(:func:`quarters`), and that each image token's box and region lie in the quarter whose
colour its pixels carry (:func:`assert_quarter_colours`, through the model:
:func:`assert_quarters_are_regions`)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..families import family_of
from ..regions import grid_regions
from ..tracer import Tracer


def quarters(height: int, width: int, colours):
    """A PIL picture of ``height x width`` pixels whose quarters (top left, top right,
    bottom left, bottom right) have the four RGB ``colours``: the geometry tests check
    that each token's box lies in the quarter whose colour its pixels carry."""
    import numpy as np
    from PIL import Image
    pixels = np.empty((height, width, 3), np.uint8)
    top, left = height // 2, width // 2
    colours = np.asarray(colours, dtype=np.uint8)
    pixels[:top, :left], pixels[:top, left:] = colours[0], colours[1]
    pixels[top:, :left], pixels[top:, left:] = colours[2], colours[3]
    return Image.fromarray(pixels)


def assert_quarter_colours(boxes: torch.Tensor, colours: torch.Tensor,
                           ignore: Optional[int] = None) -> None:
    """The geometry tests' check of a picture made by :func:`quarters`: ``boxes``
    ``(N, 4)`` are N image tokens' boxes on it, ``colours`` ``(N, P)`` the index (0 to 3)
    of the quarter colour nearest each of a token's P pixels as the model sees them
    (``ignore``: an index that may also appear, such as the black of padding). Every
    pixel of a token whose box lies in one quarter has that quarter's colour (resizing
    blurs the edges by less than half the distance between two colours); a token astride
    the picture's middle lines carries, among its own, the colour of the quarter holding
    its box's centre (where ``grid_regions(2, 2)`` puts it)."""
    quarter = grid_regions(2, 2).of_boxes(boxes)
    astride = ((boxes[:, 0] < 0.5) & (boxes[:, 2] > 0.5)) | \
        ((boxes[:, 1] < 0.5) & (boxes[:, 3] > 0.5))
    assert bool((~astride).any()), "no token lies within one quarter"
    matches = colours == quarter[:, None]
    allowed = matches if ignore is None else matches | (colours == ignore)
    bad = (~allowed[~astride]).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} tokens within one quarter read another colour"
    assert bool(matches[astride].any(1).all()), \
        "a token astride the middle lacks the colour of its centre's quarter"


def assert_quarters_are_regions(model, inputs: Dict[str, torch.Tensor], colours):
    """The geometry tests' check through the model, on a processor's ``inputs`` of one
    :func:`quarters` picture per row: ``colours(b, image)`` gives, for row b's picture
    (an ``ImageTokens``), the ``(tokens, P)`` indices of its tokens' pixels' colours in the
    order of ``image.positions`` (as :func:`assert_quarter_colours` takes them). Traces
    ``model(**inputs)`` with ``grid_regions(2, 2)``: the logits are bitwise the untraced
    model's, each row has 4 regions, every token whose pixels read one colour has that
    colour's region (the colours and the blocks are both numbered row-major), the tokens
    of each kind of view read all four colours, and every other position is -1. Returns
    the detached tracer."""
    with torch.no_grad():
        plain = model(**inputs).logits
        with Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
            assert torch.equal(model(**inputs).logits, plain)
    B = inputs["input_ids"].shape[0]
    assert tr.num_regions == [4] * B
    is_image = torch.isin(inputs["input_ids"],
                          torch.tensor(family_of(model).image_token_ids(model.config)))
    for b in range(B):
        (image,) = tr.images[b]
        read = colours(b, image)
        single = (read == read[:, :1]).all(1)  # tokens whose pixels read one colour only
        regions = tr.region_ids[b, image.positions]
        names = [v.name for v in image.views for _ in range(len(v.positions))]
        seen: Dict[str, set] = {}
        for colour, region, name, one in zip(read[:, 0].tolist(), regions.tolist(), names,
                                             single.tolist()):
            if one:
                assert region == colour, (b, name, colour, region)
                seen.setdefault(name, set()).add(colour)
        assert seen == {name: {0, 1, 2, 3} for name in names}, (b, seen)
        assert bool((tr.region_ids[b][~is_image[b]] == -1).all())
    return tr


