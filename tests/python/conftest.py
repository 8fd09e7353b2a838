"""Shared pytest fixtures and guards: the devices every device test runs on, the folder of
the reference implementations (../shared/seeds; docs/vas.md, docs/mixer.md), the geometry
tests' pictures and colours, tests that run in a process of their own, and a memory limit
on the suite's process."""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import headscope  # noqa: F401  (loads the ops)

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"

# Every device test is parametrised over these; CUDA skips with a visible reason.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")),
]

# A test process (the suite's, or an isolated test's own) that holds more than this is
# stopped with every thread's traceback: a runaway test fails in seconds, not by taking the
# machine. HEADSCOPE_TEST_MAX_RSS_GIB overrides it.
MAX_RSS_GIB = float(os.environ.get("HEADSCOPE_TEST_MAX_RSS_GIB", "6"))
_ISOLATED_CHILD = "HEADSCOPE_ISOLATED_TEST"


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt during the test, as at a terminal, also where the
    suite itself runs with SIGINT ignored (a background job of a non-interactive shell,
    where Python leaves the inherited SIG_IGN in place)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_as_at_a_terminal() -> None:
    """For a child process (``preexec_fn``): SIGINT back to its default action, so that
    Python installs its KeyboardInterrupt handler however the suite was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_once_written(argv, path: Path, env, who: str, timeout: float = 300) -> None:
    """Runs ``argv`` and kills it (SIGKILL, as a crash or an out-of-memory kill would) as
    soon as ``path`` exists: the resume tests' interrupted run. Fails if the process ends
    first or ``path`` does not appear within ``timeout`` seconds."""
    proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert proc.poll() is None, f"{who} ended before writing {path.name}"
            assert time.monotonic() < deadline, f"{who} wrote no {path.name} in {timeout} s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def with_options(argv, override) -> list:
    """``argv`` with each ``OPTION VALUE`` pair of ``override`` in place of its own value, or
    appended where ``argv`` has no such option."""
    argv = list(argv)
    for i in range(0, len(override), 2):
        if override[i] in argv:
            argv[argv.index(override[i]) + 1] = override[i + 1]
        else:
            argv += override[i:i + 2]
    return argv


def usage_error(capsys, *argv) -> str:
    """Runs ``python -m headscope ARGV`` in this process where it must refuse its arguments:
    exit 2, one line on stderr, nothing on stdout. Returns that line."""
    from headscope.commands import main
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, code, out, err)
    assert len(err.strip().splitlines()) == 1 and not out, (argv, out, err)
    return err


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of headscope's arithmetic on inputs of ``dtype``: float64's for
    float64, float32's otherwise (float16 and bfloat16 are accumulated in float32)."""
    return 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24


def gamma(n: int, dtype: torch.dtype) -> float:
    """``n u / (1 - n u)``: a value reached through at most ``n`` roundings (a sum of ``n``
    terms in any order, a dot product of ``n - 1``) is within this times the sum of its
    terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 3.1): the
    tolerance of a sum that can cancel scales with its terms, not with its result."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound) -> None:
    """``|got - want| <= bound`` everywhere (``bound`` broadcast), NaN exactly where ``want``
    is NaN."""
    got, want = got.double().cpu(), want.double().cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    excess = ((got - want).abs() - bound).nan_to_num(0.0)
    assert bool((excess <= 0).all()), (f"largest excess {excess.max().item():.3g} over the bound; "
                                       f"got {got}, want {want}, bound {bound}")


def load_seed(module_name: str):
    """Imports ../shared/seeds/<module_name>.py, or skips when the folder is absent."""
    path = SEEDS / f"{module_name}.py"
    if not path.is_file():
        pytest.skip(f"reference implementation not available ({path} is absent in this clone)")
    spec = importlib.util.spec_from_file_location(f"seed_{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---- the geometry tests' harness (tests/python/test_families_*.py) ----------------------------

# the four quarters' colours of their pictures (headscope.hf.testing.quarters): top left, top
# right, bottom left, bottom right
QUARTER_COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0))


def quarter_prompts(processor, sizes, per_row, marker: str, colours=QUARTER_COLOURS,
                    nested: bool = False):
    """A processor's inputs, left-padded, for prompts of ``per_row[b]`` pictures each (the
    pictures of ``sizes``, (height, width), in order, each of four coloured quarters),
    ``marker`` standing for each picture in the text; ``nested``: the pictures given as
    one list per prompt (processors that take no flat list, such as Gemma 4's)."""
    from headscope.hf.testing import quarters
    texts = ["describe " + " and ".join([marker] * count) + " the image ." for count in per_row]
    images = [quarters(*size, colours) for size in sizes]
    if nested:
        ends = torch.tensor(per_row).cumsum(0).tolist()
        images = [images[end - count:end] for end, count in zip(ends, per_row)]
    processor.tokenizer.padding_side = "left"
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def nearest_colour(processor, pixels: torch.Tensor, colours=QUARTER_COLOURS,
                   normaliser=None) -> torch.Tensor:
    """``(N, P)``: for pixels ``(N, P, channels)`` as the processor's image processor (or
    ``normaliser``, such as its video processor) normalised them, the index of the nearest
    of ``colours``."""
    image_processor = normaliser or processor.image_processor
    mean = torch.tensor(image_processor.image_mean)
    std = torch.tensor(image_processor.image_std)
    refs = (torch.tensor(colours, dtype=torch.float32) / 255 - mean) / std  # (colours, C)
    return torch.cdist(pixels.float(), refs[None].expand(len(pixels), -1, -1)).argmin(-1)


def assert_every_image_token_placed(images, input_ids: torch.Tensor, image_token: int) -> None:
    """A family's reading ``images`` of ``input_ids`` ``(B, T)``: per row, its pictures'
    positions are its image tokens, each once, and ``grid_regions(1, 1)`` gives every
    image token a region, every other position -1, one region per picture."""
    from headscope.hf import grid_regions
    from headscope.hf.regions import region_ids
    rid, counts = region_ids(grid_regions(1, 1), images, torch.zeros(*input_ids.shape, 1))
    for b, row in enumerate(images):
        positions = torch.cat([image.positions for image in row])
        is_image = input_ids[b] == image_token
        assert len(set(positions.tolist())) == len(positions)
        assert torch.equal(positions.sort().values, is_image.nonzero().flatten())
        assert bool((rid[b][~is_image] == -1).all()) and bool((rid[b][is_image] >= 0).all())
        assert counts[b] == len(row)


def assert_grids_are_checked(model, inputs, needed=("image_grid_thw",)) -> None:
    """A family that reads each picture's grid off ``image_grid_thw`` (``inputs``: one
    picture): a grid twice as tall as ``input_ids`` lay out raises, and so does each input
    of ``needed`` missing."""
    from headscope.hf.families import family_of
    family = family_of(model)
    wrong = dict(inputs, image_grid_thw=inputs["image_grid_thw"] * torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match="do not split into whole pictures|more image tokens"):
        family.images(model.config, wrong)
    for key in needed:
        with pytest.raises(ValueError, match=f"need the {key}"):
            family.images(model.config, dict(inputs, **{key: None}))


def assert_generation_keeps_regions(model, inputs, layout_key: str) -> None:
    """``tr.generate`` hands the layout input ``layout_key`` (``image_grid_thw``,
    ``target_sizes``) to the forward, and the regions of ``inputs``' prompt stay as a
    forward gave them; plain ``model.generate`` does not hand it on, and the Tracer says so
    rather than guess the layout."""
    from headscope.hf import Tracer, grid_regions
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
        want = tr.region_ids.clone()
        for _ in tr.generate(**inputs, max_new_tokens=2, do_sample=False):
            pass
        assert torch.equal(tr.region_ids[:, :want.shape[1]], want)
        with pytest.raises(ValueError, match=f"need the {layout_key}"):
            model.generate(**inputs, max_new_tokens=1, do_sample=False)


def assert_canvas_views(image, rows: int, cols: int, side: int = 2) -> None:
    """A picture of GotOcr2's tiles (InternVL, Aya Vision) as the image processor cut it on
    a ``rows x cols`` canvas: one tile alone is the base view; more are the tiles, each over
    its cell of the canvas, then a thumbnail over the whole picture, and the grid the tiles
    stitched; every view ``side x side`` tokens."""
    if rows * cols == 1:
        assert [v.name for v in image.views] == ["base"]
        assert image.grid is image.views[0]
    else:
        tiles = image.views[:-1]
        assert [v.name for v in image.views] == ["tile"] * rows * cols + ["thumbnail"]
        assert image.views[-1].box == (0, 0, 1, 1)
        for t, view in enumerate(tiles):
            r, c = divmod(t, cols)
            assert view.box == pytest.approx((c / cols, r / rows, (c + 1) / cols,
                                              (r + 1) / rows))
        assert image.grid.name == "tiles" and image.grid.box == (0, 0, 1, 1)
        assert (image.grid.rows, image.grid.cols) == (side * rows, side * cols)
        assert sorted(image.grid.positions.tolist()) == \
            sorted(torch.cat([v.positions for v in tiles]).tolist())
    assert all((v.rows, v.cols) == (side, side) for v in image.views)


def patch_pixels(conv: torch.nn.Conv2d, tile: torch.Tensor) -> torch.Tensor:
    """``(patches, p * p, C)``: the pixels of each patch of ``tile`` ``(C, S, S)``, patches
    row-major, as the vision tower's patch convolution ``conv`` reads them (checked against
    it)."""
    p = conv.kernel_size[0]
    C, S = tile.shape[0], tile.shape[-1]
    patches = tile.reshape(C, S // p, p, S // p, p).permute(1, 3, 2, 4, 0).reshape(-1, p * p * C)
    with torch.no_grad():
        embeds = conv(tile[None]).flatten(2)[0].t()
    weight = conv.weight.permute(0, 2, 3, 1).reshape(conv.weight.shape[0], -1)
    torch.testing.assert_close(embeds, patches @ weight.t() + conv.bias, atol=1e-5, rtol=1e-5)
    return patches.reshape(len(patches), p * p, C)


def tile_colours(processor, inputs, b: int, first_tile: int, positions, token_pixels,
                 image_token: int, per_tile: int = 4) -> torch.Tensor:
    """``(len(positions), pixels)``: the quarter colour (``nearest_colour``) of each pixel
    read by the tokens at ``positions`` of row ``b`` of a picture of tiles, its tiles from
    ``first_tile`` of ``inputs["pixel_values"]`` on, ``per_tile`` tokens each;
    ``token_pixels(tile)`` gives a tile's ``(tokens, pixels, C)`` in the model's order."""
    order = (inputs["input_ids"][b] == image_token).nonzero().flatten().tolist()
    pixels = torch.cat([token_pixels(inputs["pixel_values"][first_tile + t])
                        for t in range(len(order) // per_tile)])
    colours = nearest_colour(processor, pixels)
    at = {p: i for i, p in enumerate(order)}
    return colours[[at[p] for p in positions.tolist()]]


def assert_tile_quarters_are_regions(model, inputs, colours_at, per_tile: int = 4) -> None:
    """``headscope.hf.testing.assert_quarters_are_regions`` on ``inputs`` of one picture of
    tiles per row (``per_tile`` tokens each, every picture cut into several):
    ``colours_at(b, first_tile, positions)`` gives the colours of row b's tokens at
    ``positions``, its picture's tiles starting at ``first_tile`` of ``pixel_values``; both
    the tiles and the thumbnail read all four colours."""
    from headscope.hf.families import family_of
    from headscope.hf.testing import assert_quarters_are_regions
    tiles = [len(image.positions) // per_tile
             for (image,) in family_of(model).images(model.config, inputs)]
    first = [sum(tiles[:b]) for b in range(len(tiles))]
    tr = assert_quarters_are_regions(model, inputs, lambda b, image: colours_at(
        b, first[b], image.positions))
    assert {v.name for (image,) in tr.images for v in image.views} == {"thumbnail", "tile"}


def assert_tiles_need_pixel_values(model, inputs) -> None:
    """A picture of GotOcr2's tiles (``inputs``: one picture of 2 tiles and a thumbnail)
    needs ``pixel_values`` for its canvas: plain ``generate``, which hands the model the
    vision output instead, raises naming ``tr.generate``, which works; the tiles must add
    up to the image tokens."""
    from headscope.hf import Tracer
    from headscope.hf.families import family_of
    family = family_of(model)
    # plain generate hands the model the vision output, not pixel_values
    with torch.no_grad(), Tracer(model, regions=2, vas=False) as tr:
        with pytest.raises(ValueError, match=r"need the pixel_values .* tr\.generate"):
            model.generate(**inputs, max_new_tokens=1)
        assert len(list(tr.generate(**inputs, max_new_tokens=1))) == 1
    with pytest.raises(ValueError, match="need the pixel_values"):
        family.images(model.config, dict(inputs, pixel_values=None))
    with pytest.raises(ValueError, match="pixel_values hold 4 tiles but input_ids 3"):
        family.images(model.config, dict(inputs, pixel_values=torch.cat(
            [inputs["pixel_values"], inputs["pixel_values"][:1]])))


# ---- tests in a process of their own ---------------------------------------------------------

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "isolated(max_rss_gib): run in a fresh Python process of its own (a test "
        "that needs many GiB: the suite's process never holds them), under that memory limit")
    _watch_memory(MAX_RSS_GIB, config)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("isolated")
    if marker is None or os.environ.get(_ISOLATED_CHILD):
        return None
    limit = marker.kwargs.get("max_rss_gib", MAX_RSS_GIB)
    env = dict(os.environ, **{_ISOLATED_CHILD: "1", "HEADSCOPE_TEST_MAX_RSS_GIB": str(limit)})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(REPO), pyfuncitem.nodeid],
                         cwd=REPO, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process (exit {run.returncode}):\n"
                    f"{run.stdout[-6000:]}\n{run.stderr[-3000:]}", pytrace=False)
    return True


# ---- the memory guard ------------------------------------------------------------------------

_current_test = ["(collection)"]


def pytest_runtest_logstart(nodeid, location):
    _current_test[0] = nodeid


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def _watch_memory(limit_gib: float, config) -> None:
    if not os.path.exists("/proc/self/statm"):
        return

    def watch():
        while True:
            rss = _rss_gib()
            if rss > limit_gib:
                # what pytest captures would be lost with the process: write past it
                capture = config.pluginmanager.getplugin("capturemanager")
                if capture is not None:
                    capture.suspend_global_capture(in_=True)
                sys.stderr.write(f"\nheadscope tests: the test process holds {rss:.1f} GiB, over "
                                 f"its limit of {limit_gib:g} GiB, in {_current_test[0]}; "
                                 f"stopping it. Every thread:\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(3)
            threading.Event().wait(0.25)

    threading.Thread(target=watch, name="headscope-memory-guard", daemon=True).start()


def pytest_terminal_summary(terminalreporter):
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20
    terminalreporter.write_line(f"peak memory: this process {own:.2f} GiB, its largest child "
                                f"process {children:.2f} GiB")
