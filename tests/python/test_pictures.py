"""Pictures as people see them (headscope.pictures): a phone JPEG stored sideways with an
EXIF orientation reaches the model upright through every command (explain, collect, vas and
the DATA loader), and explain's page and report.json show its upright size; greyscale,
transparency, palettes, CMYK, 16-bit greyscale and animated GIFs are read as documented,
and what cannot be read is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from headscope.pictures import BACKGROUND, PictureError, check_picture, read_picture, upright_rgb

COLOURS = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40))
UPRIGHT = (80, 120)  # (width, height) as seen; stored sideways as 120 x 80
PROMPT = "describe the image ."
ORIENTATION = 0x0112


def quarters_upright() -> np.ndarray:
    """(120, 80, 3): four coloured quarters, as the picture is seen."""
    from headscope.hf.testing import quarters
    return np.asarray(quarters(UPRIGHT[1], UPRIGHT[0], COLOURS))


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    """A JPEG as a phone writes it: the pixels stored turned a quarter anticlockwise (120
    wide, 80 high) with EXIF orientation 6 (turn them a quarter clockwise to show them)."""
    path = tmp_path_factory.mktemp("photo") / "photo.jpg"
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    Image.fromarray(np.rot90(quarters_upright(), 1).copy()).save(path, quality=95, exif=exif)
    return path


@pytest.fixture(scope="module")
def upright_png(photo) -> Path:
    """The photo's decoded pixels turned a quarter clockwise by hand (no EXIF reader): what
    a viewer shows, as a plain PNG."""
    with Image.open(photo) as stored:
        assert stored.size == (120, 80)
        pixels = np.rot90(np.asarray(stored.convert("RGB")), -1).copy()
    path = photo.with_name("upright.png")
    Image.fromarray(pixels).save(path)
    return path


def test_a_rotated_jpeg_reads_upright(photo, upright_png):
    got = read_picture(photo)
    assert got.mode == "RGB" and got.size == UPRIGHT
    assert np.array_equal(np.asarray(got), np.asarray(Image.open(upright_png)))
    assert check_picture(photo) == UPRIGHT  # from the header alone
    # the quarters where they are seen: top left red, bottom right yellow (JPEG's rounding)
    seen = np.asarray(got).astype(int)
    assert np.abs(seen[20, 20] - COLOURS[0]).max() < 12
    assert np.abs(seen[100, 60] - COLOURS[3]).max() < 12


def test_upright_rgb_leaves_the_callers_picture_alone(photo):
    with Image.open(photo) as image:
        upright_rgb(image)
        assert image.size == (120, 80) and image.getexif().get(ORIENTATION) == 6


def _save(tmp_path: Path, name: str, image: Image.Image, **kwargs) -> Path:
    path = tmp_path / name
    image.save(path, **kwargs)
    return path


def _pixels(path: Path) -> list:
    got = read_picture(path)
    assert got.mode == "RGB"
    return [tuple(int(v) for v in p) for p in np.asarray(got).reshape(-1, 3)]


def test_greyscale_and_palette(tmp_path):
    grey = Image.fromarray(np.array([[0, 100, 255]], np.uint8), "L")
    assert _pixels(_save(tmp_path, "grey.png", grey)) == [(0, 0, 0), (100, 100, 100),
                                                          (255, 255, 255)]
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 200, 100, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    assert _pixels(_save(tmp_path, "palette.png", palette)) == [(10, 20, 30), (200, 100, 0)]
    # colour 0 transparent: shown on the white background
    assert _pixels(_save(tmp_path, "clear.png", palette, transparency=0)) == [BACKGROUND,
                                                                               (200, 100, 0)]
    assert _pixels(_save(tmp_path, "clear.gif", palette, transparency=0)) == [BACKGROUND,
                                                                               (200, 100, 0)]


def test_alpha_is_composited_on_white(tmp_path):
    rgba = np.array([[[40, 80, 120, 255], [40, 80, 120, 0], [40, 80, 120, 128]]], np.uint8)
    half = tuple(round(255 + (v - 255) * 128 / 255) for v in (40, 80, 120))
    got = _pixels(_save(tmp_path, "rgba.png", Image.fromarray(rgba, "RGBA")))
    assert got[:2] == [(40, 80, 120), BACKGROUND]
    assert max(abs(a - b) for a, b in zip(got[2], half)) <= 1
    la = Image.fromarray(np.array([[[90, 255], [90, 0]]], np.uint8), "LA")
    assert _pixels(_save(tmp_path, "la.png", la)) == [(90, 90, 90), BACKGROUND]


def test_cmyk_and_sixteen_bit_greyscale(tmp_path):
    cmyk = Image.new("CMYK", (2, 1), (255, 0, 0, 0))  # cyan
    cmyk.putpixel((1, 0), (0, 0, 0, 255))  # black
    assert _pixels(_save(tmp_path, "cmyk.tif", cmyk)) == [(0, 255, 255), (0, 0, 0)]
    deep = Image.fromarray(np.array([[0, 32896, 65535, 257]], np.uint16))
    path = _save(tmp_path, "deep.png", deep)
    with Image.open(path) as opened:
        assert opened.mode in ("I;16", "I")
    assert _pixels(path) == [(0, 0, 0), (128, 128, 128), (255, 255, 255), (1, 1, 1)]


def test_an_animated_gif_gives_its_first_frame_and_says_so(tmp_path):
    frames = [Image.new("RGB", (4, 4), c) for c in ((250, 0, 0), (0, 0, 250))]
    path = tmp_path / "moving.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    with pytest.warns(UserWarning, match=r"moving.gif: an animated picture of 2 frames: its "
                                         r"first frame is used"):
        got = read_picture(path)
    assert np.asarray(got)[0, 0].tolist() == [250, 0, 0]


def test_what_cannot_be_read_is_refused_in_one_line(tmp_path):
    floats = _save(tmp_path, "floats.tif", Image.fromarray(np.ones((2, 2), np.float32)))
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    whole = _save(tmp_path, "whole.png", Image.new("RGB", (64, 64), (1, 2, 3)))
    cut = tmp_path / "cut.png"
    cut.write_bytes(whole.read_bytes()[:60])
    for path, message in ((floats, "mode 'F' are not supported"),
                          (text, "not a readable picture"), (cut, "not a readable picture"),
                          (tmp_path / "absent.png", "no such file")):
        for read in (check_picture, read_picture):
            with pytest.raises(PictureError) as e:
                read(path)
            assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
            assert "\n" not in str(e.value)


# ---- through the commands, on a tiny Qwen2-VL ------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from headscope.hf.testing import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen") / "model", "qwen2_vl")


def _data(folder: Path, picture: Path) -> Path:
    """A DATA folder of one example: ``picture`` and the prompt."""
    folder.mkdir()
    (folder / picture.name).write_bytes(picture.read_bytes())
    (folder / "data.jsonl").write_text(json.dumps({"image": picture.name, "prompt": PROMPT}) + "\n")
    return folder


def test_the_data_loader_reads_upright(photo, upright_png, tmp_path):
    from headscope.commands.data import image_size, load_image, read_examples
    (example,) = read_examples(_data(tmp_path / "data", photo))
    assert image_size(example) == UPRIGHT
    assert np.array_equal(np.asarray(load_image(example)), np.asarray(Image.open(upright_png)))


def test_explain_shows_and_reads_the_photo_upright(model, photo, upright_png, tmp_path, capsys):
    from headscope.commands import main
    from headscope.explainer.page import display_size
    reports = []
    for picture in (photo, upright_png):
        out = tmp_path / picture.stem
        assert main(["explain", "--model", str(model), "--image", str(picture), "--prompt",
                     PROMPT, "--regions", "2x2", "--max-new-tokens", "4", "--out", str(out)]) == 0
        reports.append(json.loads((out / "report.json").read_text()))
    capsys.readouterr()
    rotated, upright = reports
    (shown,) = rotated["pictures"]
    assert (shown["width"], shown["height"]) == UPRIGHT
    # the model saw the upright pixels: the same answer, features and regions as the PNG's
    assert rotated["spans"] == upright["spans"] and rotated["pictures"] == upright["pictures"]
    assert rotated["vas_features"] == upright["vas_features"]
    width, height = display_size(Image.new("RGB", UPRIGHT))
    assert height > width
    page = (tmp_path / photo.stem / "index.html").read_text()
    assert f"width='{width}' height='{height}' alt='picture 0'" in page


def test_collect_reads_the_photo_upright(model, photo, upright_png, tmp_path):
    from headscope.commands import main
    from headscope.commands.collection import read_collection
    collections = []
    for picture in (photo, upright_png):
        data = _data(tmp_path / f"data-{picture.stem}", picture)
        out = tmp_path / f"collection-{picture.stem}"
        assert main(["collect", "--model", str(model), "--data", str(data), "--out", str(out),
                     "--regions", "4", "--max-new-tokens", "4", "--subsets", "0"]) == 0
        collections.append(read_collection(out))
    rotated, upright = collections
    assert rotated.tensors["image_size"].tolist() == [list(UPRIGHT)]
    assert rotated.texts == upright.texts
    for name, t in rotated.tensors.items():
        if name != "seconds":
            assert torch.equal(t, upright.tensors[name]), name


def test_vas_reads_the_photo_upright(model, photo, upright_png, tmp_path):
    pytest.importorskip("pyarrow")
    import headscope
    from headscope.commands import main
    from headscope.commands.vas_table import read_table
    tables = []
    for picture in (photo, upright_png):
        data = _data(tmp_path / f"data-{picture.stem}", picture)
        out = tmp_path / f"vas-{picture.stem}"
        assert main(["vas", "--model", str(model), "--data", str(data), "--out", str(out),
                     "--max-new-tokens", "4"]) == 0
        (row,) = read_table(out)[1].to_pylist()
        tables.append(row)
    rotated, upright = tables
    assert rotated["answer"] == upright["answer"]
    assert [rotated[c] for c in headscope.VAS_COLUMNS] == [upright[c] for c in headscope.VAS_COLUMNS]


def test_commands_refuse_an_unreadable_picture_in_one_line(model, tmp_path, capsys):
    from conftest import usage_error
    floats = _save(tmp_path, "floats.tif", Image.fromarray(np.ones((8, 8), np.float32)))
    message = usage_error(capsys, "explain", "--model", model, "--image", floats, "--prompt",
                          PROMPT, "--out", tmp_path / "out")
    assert f"--image {floats}: pictures of mode 'F' are not supported" in message
    data = _data(tmp_path / "data", floats)
    message = usage_error(capsys, "collect", "--model", model, "--data", data, "--out",
                          tmp_path / "collection")
    assert f"{data / 'floats.tif'} (line 1): pictures of mode 'F' are not supported" in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "collection").exists()
