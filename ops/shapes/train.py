"""Training a shapes model from scratch (or from another shapes model): teacher-forced
next-token loss on the answer, fresh scenes (or clips) every step, AdamW with warm-up and
cosine decay; resumable from an atomic checkpoint (safetensors and JSON,
``headscope.io.save_state``: loading it runs no code), deterministic in its seed (for a
given number of threads).

Example ``i`` of the run (``i = step * batch + j``) is ``scene(i, 1 + i % max_objects)``
(with ``world="clips"``: ``clip(i, 1 + i % max_objects)``): training sees seeds ``0 ..
steps * batch - 1``, all below ``HELD_OUT_SEED``. The data of a step is a function of its
index; the checkpoint keeps torch's generator state too, so that anything random in a step
(dropout) draws on resume what it would have drawn.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..io import load_state, save_state, write_json
from .accuracy import (CLIP_OBJECTS, CLIP_SEED_RANGES, HELD_OUT_SEED, caption_accuracy,
                       clip_accuracy, held_out_clips, held_out_scenes)
from .clips import MAX_CLIP_OBJECTS, clip, describe_clip
from .model import DATA_DIR, build_model, start_from, training_batch
from .processor import build_processor
from .world import MAX_OBJECTS, describe, scene

STATE_FILE = "train_state.safetensors"
PICKLED_STATE_FILE = "train_state.pt"  # the pickle format of earlier versions, not loaded
REPORT_FILE = "training.json"


@dataclass(frozen=True)
class World:
    """What a run trains on: ``draw(seed, num_objects) -> (visual, objects)``, the true
    description of the objects, the most objects ``draw`` takes and the most a run draws
    by default (``Settings.max_objects``), whether the visual is a clip, and the held-out
    accuracy that ends the run (``evaluate(model, processor, count)``: the report's
    entries)."""
    draw: Callable
    describe: Callable
    max_objects: int
    objects: int
    video: bool
    evaluate: Callable


def _evaluate_pictures(model, processor, count: int) -> dict:
    return {"held_out_scene_seeds": [HELD_OUT_SEED, HELD_OUT_SEED + count - 1],
            "held_out_accuracy": caption_accuracy(model, processor, held_out_scenes(count)),
            "held_out_accuracy_5_to_9_objects": caption_accuracy(
                model, processor, held_out_scenes(count, objects=(5, 9)))}


def _evaluate_clips(model, processor, count: int) -> dict:
    first = CLIP_SEED_RANGES["accuracy"]
    return {"held_out_clip_seeds": [first, first + count - 1],
            "held_out_clip_objects": list(CLIP_OBJECTS),
            "held_out_accuracy": clip_accuracy(model, processor, held_out_clips(count))}


WORLDS = {"pictures": World(scene, describe, MAX_OBJECTS, MAX_OBJECTS, False,
                             _evaluate_pictures),
          "clips": World(clip, describe_clip, MAX_CLIP_OBJECTS, CLIP_OBJECTS[1], True,
                         _evaluate_clips)}
# --init's name for the shipped picture model
SHIPPED_INIT = "shapes"


@dataclass(frozen=True)
class Settings:
    steps: int = 3500
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 200
    seed: int = 0
    hidden: int = 128
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 384
    vision_width: int = 96
    vision_depth: int = 3
    vision_mlp_ratio: int = 4
    max_objects: int = 9
    mixer_rank: int = 0  # 0: softmax vision attention; r: the mixer of rank r in every layer
    world: str = "pictures"  # or "clips": the shapes world in time, for the video model
    init: str = ""  # "": random weights; a model folder (or "shapes") to start from

    def check(self) -> None:
        for name in ("steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"headscope.shapes.train: argument '{name}' must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.mixer_rank < 0:
            raise ValueError(f"headscope.shapes.train: argument 'mixer_rank' must be >= 0 "
                             f"(0: softmax), got {self.mixer_rank}")
        if self.world not in WORLDS:
            raise ValueError(f"headscope.shapes.train: argument 'world' must be one of "
                             f"{sorted(WORLDS)}, got {self.world!r}")
        most = WORLDS[self.world].max_objects
        if not 1 <= self.max_objects <= most:
            raise ValueError(f"headscope.shapes.train: argument 'max_objects' must be in "
                             f"[1, {most}] for {self.world}, got {self.max_objects}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"headscope.shapes.train: argument 'lr' must be > 0, got {self.lr}")
        if self.steps * self.batch > HELD_OUT_SEED:
            raise ValueError("headscope.shapes.train: steps * batch would reach the held-out "
                             "scene seeds")
        if self.init and self.init != SHIPPED_INIT and \
                not (Path(self.init) / "config.json").is_file():
            raise ValueError(f"headscope.shapes.train: argument 'init' must be a model folder "
                             f"(with config.json) or {SHIPPED_INIT!r}, got {self.init!r}")


def _batch(processor, step: int, settings: Settings):
    world = WORLDS[settings.world]
    drawn = [world.draw(i, 1 + i % settings.max_objects)
             for i in range(step * settings.batch, (step + 1) * settings.batch)]
    return training_batch(processor, [visual for visual, _ in drawn],
                          [world.describe(objects) for _, objects in drawn], video=world.video)


def _schedule(settings: Settings):
    def factor(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / settings.warmup
        progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def _save_complete(out: Path, model, processor) -> None:
    """Saves the model and processor into ``out`` through a temporary folder inside it,
    moving each file into place only once all are written (an interrupted save leaves the
    checkpoint and no half-written file; rerunning finishes it)."""
    import tempfile
    with tempfile.TemporaryDirectory(dir=out, prefix=".saving-") as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            os.replace(path, out / path.name)


def train(out: Path, settings: Settings = Settings(), *, checkpoint_every: int = 100,
          stop_after: Optional[int] = None, finish_at: Optional[int] = None,
          eval_scenes: int = 200, progress: bool = True) -> dict:
    """Trains (or resumes training) into ``out``; when done, saves the model and processor
    there (``from_pretrained`` format), measures caption accuracy on ``eval_scenes``
    held-out scenes of 1 to 4 objects and as many of 5 to 9 (clips: on ``eval_scenes``
    held-out clips of 1 to 3 objects) and writes ``training.json``.
    ``finish_at``: end the run at that step of the schedule, which keeps its length
    ``settings.steps`` (the learning rate is where the full run would have it), and save
    it as done (for a run that cannot take its full time). ``stop_after``: leave after
    that many steps of this call with the checkpoint saved (for tests). Returns the report
    (None when stopped early)."""
    from tqdm import tqdm

    settings.check()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    world = WORLDS[settings.world]
    processor = build_processor(video=world.video)
    model = build_model(processor, settings.seed, hidden=settings.hidden,
                        layers=settings.layers, heads=settings.heads,
                        kv_heads=settings.kv_heads, intermediate=settings.intermediate,
                        vision_width=settings.vision_width, vision_depth=settings.vision_depth,
                        vision_mlp_ratio=settings.vision_mlp_ratio,
                        mixer_rank=settings.mixer_rank)
    if settings.init:
        start_from(model, processor, DATA_DIR if settings.init == SHIPPED_INIT else
                   Path(settings.init))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01,
                                  betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings))
    state_path = out / STATE_FILE
    step, elapsed = 0, 0.0
    # [step, mean training loss over the steps since the previous entry], one per checkpoint
    losses, window = [], []
    # [step, the schedule's length from that step on]: a resumed run may change its length
    lengths = [[0, settings.steps]]
    if (out / PICKLED_STATE_FILE).is_file():
        raise ValueError(f"headscope.shapes.train: {out / PICKLED_STATE_FILE} is a checkpoint in "
                         f"the pickle format of earlier versions, which is not loaded (loading "
                         f"a pickle can run any code); delete it to train afresh, or use "
                         f"another --out")
    if state_path.is_file():
        state = load_state(state_path)
        if {**state["settings"], "steps": settings.steps} != asdict(settings):
            raise ValueError(f"headscope.shapes.train: {state_path} was written with settings "
                             f"{state['settings']}, not {asdict(settings)}; use the same ones "
                             f"(only --steps may change) or another --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step, elapsed, losses = state["step"], state["elapsed"], state["losses"]
        lengths = state["lengths"]
        if settings.steps != lengths[-1][1]:
            if step >= settings.steps:
                raise ValueError(f"headscope.shapes.train: {state_path} is at step {step}; "
                                 f"--steps must be above it, got {settings.steps}")
            # the schedule goes on from here as if the run had this length
            lengths.append([step, settings.steps])

    def checkpoint() -> None:
        save_state(state_path, {"settings": asdict(settings), "step": step, "elapsed": elapsed,
                                "losses": losses, "lengths": lengths,
                                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(),
                                "rng": torch.get_rng_state()})

    if finish_at is not None and not 1 <= finish_at <= settings.steps:
        raise ValueError(f"headscope.shapes.train: argument 'finish_at' must be in "
                         f"[1, {settings.steps}] (the steps), got {finish_at}")
    end = settings.steps if finish_at is None else finish_at
    if step > end:
        raise ValueError(f"headscope.shapes.train: {state_path} is at step {step}, past "
                         f"finish_at {finish_at}")
    stop = end if stop_after is None else min(end, step + stop_after)
    model.train()
    bar = tqdm(total=end, initial=step, desc="train shapes model", disable=not progress,
               unit="step")
    try:
        while step < stop:
            started = time.perf_counter()
            loss = model(**_batch(processor, step, settings)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            elapsed += time.perf_counter() - started
            window.append(loss.item())
            bar.set_postfix(loss=f"{window[-1]:.3f}")
            bar.update()
            if step % checkpoint_every == 0 or step == stop:
                losses.append([step, round(sum(window) / len(window), 4)])
                window = []
                checkpoint()
    except KeyboardInterrupt:
        checkpoint()
        raise
    finally:
        bar.close()
    if step < end:
        return None
    model.eval()
    accuracy = world.evaluate(model, processor, eval_scenes)
    _save_complete(out, model, processor)
    report = {"settings": asdict(settings), "train_seconds": round(elapsed, 1),
              "threads": torch.get_num_threads(),
              "finished_at_step": step, "schedule_lengths": lengths,
              "train_scene_seeds": [0, step * settings.batch - 1],
              **accuracy, "training_loss": losses}
    write_json(out / REPORT_FILE, report)
    state_path.unlink()
    return report
