"""The live page of ``python -m headscope explain --serve``: a Gradio app that shows the
answer and each span's heat map while the model generates (Gradio's streaming event
handlers: the handler is a generator, each yield updates the page). Needs gradio
(``pip install "headscope[app]"``).

Opening the page starts a generation; "Generate again" starts another. One generation runs
at a time (the model has one tracer); when one ends, the page, report.json and the PNGs are
written to the output folder as the command writes them."""
from __future__ import annotations

import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from .page import span_png


def _answer(spans) -> list:
    """The answer for ``gr.HighlightedText``: each span's text labelled with its number
    (spans of special tokens only unlabelled)."""
    return [(s.text, None if s.special else f"span {s.index}") for s in spans]


def _gallery_item(explanation, span, folder: Path) -> tuple:
    """The span's PNG as a file in ``folder`` and its caption. A file, not a PIL picture:
    Gradio writes a picture into its cache again on every update, in place, while the
    browser may be reading it (a truncated image); a file it copies once, atomically."""
    k, heat = span.top_regions(1)[0]
    path = folder / f"span{span.index}.png"
    path.write_bytes(span_png(explanation, span))
    return (str(path), f"[{span.index}] {span.text.strip()}  (hottest: region {k}, "
                       f"{heat:.4f} per image token)")


def app(explanations: Callable[[], Iterator], out: Path):
    """The Gradio Blocks of the live page. ``explanations()`` starts a generation and
    yields the explanation after each span (``headscope.explainer.iter_explain``)."""
    import gradio as gr

    def stream():
        # Gradio advances a handler's generator on any of its worker threads, and the
        # tracer's generation must stay on one: it runs on a thread of its own and hands
        # each explanation over with the number of spans it then held.
        updates: queue.Queue = queue.Queue()

        def generate():
            try:
                for result in explanations():
                    updates.put((result, len(result.spans), None))
            except BaseException as e:  # noqa: BLE001 - raised again in the handler
                updates.put((None, 0, e))
            updates.put(None)
        threading.Thread(target=generate, name="headscope-explain", daemon=True).start()
        gallery, final = [], None
        yield [], [], "Generating..."
        # the span PNGs Gradio copies into its cache; removed when the handler ends
        with tempfile.TemporaryDirectory(prefix="headscope-live-") as folder:
            while (update := updates.get()) is not None:
                result, count, error = update
                if error is not None:
                    raise error
                spans = result.spans[:count]
                for span in spans[len(gallery):]:
                    gallery.append(None if span.special
                                   else _gallery_item(result, span, Path(folder)))
                final = result
                yield (_answer(spans), [g for g in gallery if g is not None],
                       f"Generating... {sum(g is not None for g in gallery)} spans.")
            page = final.save(out)
            shown = [g for g in gallery if g is not None]
            yield _answer(final.spans), shown, f"Done: {len(shown)} spans; wrote {page}."

    with gr.Blocks(title="headscope explain", analytics_enabled=False) as blocks:
        gr.Markdown("## headscope explain\nWhich regions of the pictures and videos each "
                    "span of the answer rests on, shown as the model generates.")
        status = gr.Markdown("Starting...", elem_id="status")
        answer = gr.HighlightedText(label="Answer", elem_id="answer", show_legend=False)
        heat = gr.Gallery(label="Each span's heat map (its colour bar names the scores)",
                          elem_id="spans", columns=2, format="png", object_fit="contain",
                          height="auto")
        again = gr.Button("Generate again")
        outputs = [answer, heat, status]
        blocks.load(stream, outputs=outputs, concurrency_limit=1, concurrency_id="generate")
        again.click(stream, outputs=outputs, concurrency_limit=1, concurrency_id="generate")
    return blocks


def launch(blocks, host: str, port: Optional[int]) -> str:
    """Starts serving ``blocks`` on ``host:port`` (None: a free port from 7860 on) in
    Gradio's threads; returns the page's address. The theme uses the system's fonts, so
    the page fetches nothing from the network."""
    import gradio as gr
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["monospace"])
    blocks.queue().launch(server_name=host, server_port=port, prevent_thread_lock=True,
                          quiet=True, footer_links=[], theme=theme)
    return blocks.local_url


def serve(explanations: Callable[[], Iterator], host: str, port: int, out: Path) -> int:
    """Serves the live page on ``host:port`` until Ctrl-C (which raises KeyboardInterrupt:
    exit 130; the files are written atomically, so none is left half-written)."""
    blocks = app(explanations, out)
    launch(blocks, host, port)
    print(f"live page: http://{host}:{port} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        blocks.close()
