"""Memory-plan pictures of the run reports, and the PNG bytes the reports carry.

Owns drawing a memory plan's arena as a PNG (:func:`memory_plan_png`, with Pillow's
own font: :func:`picture_font`, :data:`FONT_PIXELS`), the 256-colour palette
reduction, and what the reports need to know of PNG bytes: their size
(:func:`png_size`), whether they are a palette picture, a copy small enough to
inline in a Prefect artifact (:func:`inline_png`, at most :data:`INLINE_PNG_LIMIT`
bytes) and its ``data:`` URI.  Also the plan numbers a picture shows
(:func:`plan_ratio`) and the plans it accepts (:func:`as_memory_plan`); and a target's
trend over its last nights (:func:`trend_png`, from ``outputs/<model>/history.jsonl``).

The markdown that shows the pictures, and their publishing into the artifact store,
are :mod:`flows.reports`'.
"""

from __future__ import annotations

import functools
import io
import threading
from typing import Any, Mapping

from lowering.benchmark import SPREAD_FLAG
from lowering.memory_plan import ARENA_MEM_ID, MemoryPlan

#: Largest memory-plan picture (PNG bytes, after the palette reduction of
#: :func:`inline_png`) inlined into a model artifact; base64 makes it 4/3 larger.
#: The whole markdown is stored in the Prefect database and sent on every view of
#: the artifact, so it must stay small.  Measured on the demo fleet (800x450 px):
#: 19-21 kB as drawn, 7-9 kB with a 256-colour palette (the LSTM's 368 tensors
#: are the largest).  40 kB is three times that, so only plans far busier than
#: the demo's are left out, and a model artifact stays under ~55 kB per target.
#: Past it the report says so and names the full PNG in the store instead:
#: downscaling does not help (the LSTM at 600 px wide: 16 kB, more than at 800 px,
#: as resampling blurs the flat colours into more distinct pixels).
INLINE_PNG_LIMIT = 40_000


def plan_ratio(arena: int | None, bound: int | None) -> float | None:
    """arena / lower bound (1.0 is optimal); None when unknown, 1.0 for an empty arena."""
    if arena is None or bound is None:
        return None
    if bound == 0:
        return 1.0 if arena == 0 else None
    return arena / bound


def as_memory_plan(plan: MemoryPlan | Mapping[str, Any]) -> MemoryPlan:
    """A MemoryPlan from itself or its ``to_dict()``; a clear error for a summary dict."""
    if isinstance(plan, MemoryPlan):
        return plan
    if isinstance(plan, Mapping) and "allocations" in plan:
        return MemoryPlan.from_dict(plan)
    keys = sorted(plan) if isinstance(plan, Mapping) else type(plan).__name__
    raise ValueError(f"not a memory plan (expected MemoryPlan or MemoryPlan.to_dict(), got {keys})")


#: The picture's size in pixels, and its plot area (left, top, right, bottom).
PICTURE_SIZE = (800, 450)
_PLOT = (112, 40, 576, 396)
#: One colour per tensor, in turn (matplotlib's "tab20").
_TAB20 = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
          "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
          "#17becf", "#9edae5")
_RED = "#d62728"
#: The font sizes of a picture (pixels): title and ticks, legend, names in boxes.
FONT_PIXELS = (14, 11, 10)
#: One picture at a time: the fleet flow publishes reports from several threads, and
#: the cached fonts are FreeType faces, which one thread at a time may render with.
_RENDER_LOCK = threading.Lock()


def memory_plan_png(plan: MemoryPlan | Mapping[str, Any], *, title: str) -> bytes:
    """A PNG of the arena: x = execution step, y = offset, one rectangle per tensor.

    Each planned tensor of the arena (``mem_id`` 1) with a non-zero size is a
    rectangle spanning its inclusive lifetime and its bytes, named inside when the
    box is large enough (cut at its edge); views sharing a base's memory are not
    drawn again.  A dashed red line marks the lower bound, a dotted black one the
    arena size.  800x450 px, drawn with Pillow (15-25 ms; matplotlib took 0.1-0.6 s
    a picture, a fifth of a cold fleet's run time outside lowering: issue 9).  The
    same plan and title give the same bytes.

        ┌ title: N tensors, algorithm, ratio ──────────┐
        │ 350,000 ┤ - - - - - - - - - - - - - - -      │  - - lower bound 352,768 B
        │         │   ┌────┐                           │  ··· arena 352,768 B
        │       0 ┼───┴────┴──────────────────         │
        │         0        execution step        400   │
        └──────────────────────────────────────────────┘
    """
    from PIL import Image, ImageDraw

    plan = as_memory_plan(plan)
    tensors = planned_tensors(plan)
    arena = plan.arena_bytes
    steps = max((a.lifetime[1] + 1 for _, a in tensors), default=1)
    top = max(arena, plan.lower_bound, 1) * 1.08
    left, upper, right, bottom = _PLOT

    def x_at(step: float) -> float:
        return left + (right - left) * step / steps

    def y_at(offset: float) -> float:
        return bottom - (bottom - upper) * offset / top

    with _RENDER_LOCK:  # the cached fonts: one thread at a time
        image = Image.new("RGB", PICTURE_SIZE, "white")
        draw = ImageDraw.Draw(image)
        text, small, tiny = (picture_font(pixels) for pixels in FONT_PIXELS)
        for i, (key, alloc) in enumerate(tensors):
            first, last = alloc.lifetime
            box = (x_at(first), y_at(alloc.offset + alloc.size), x_at(last + 1), y_at(alloc.offset))
            draw.rectangle(box, fill=_TAB20[i % 20], outline="black", width=1)
            if (last + 1 - first) >= 0.08 * steps and alloc.size >= 0.06 * top:
                _label_in(image, box, key, tiny)
        _hline(draw, y_at(plan.lower_bound), left, right, _RED, dash=(6, 3))
        _hline(draw, y_at(arena), left, right, "black", dash=(1, 2))
        draw.rectangle((left, upper, right, bottom), outline="black", width=1)
        for value in _ticks(top):
            y = round(y_at(value))
            draw.line((left - 4, y, left, y), fill="black")
            draw.text((left - 7, y), f"{value:,.0f}", font=text, fill="black", anchor="rm")
        for value in _ticks(steps):
            x = round(x_at(value))
            draw.line((x, bottom, x, bottom + 4), fill="black")
            draw.text((x, bottom + 7), f"{value:,.0f}", font=text, fill="black", anchor="ma")
        draw.text(((left + right) / 2, bottom + 27), "execution step", font=text, fill="black", anchor="ma")
        _vertical_text(image, (22, (upper + bottom) / 2), "arena offset (bytes)", text)
        ratio = plan_ratio(arena, plan.lower_bound)
        ratio_text = f", ratio {ratio:.3f}" if ratio is not None else ""
        draw.text(((left + right) / 2, upper - 8), f"{title}: {len(tensors)} tensors, {plan.algorithm}{ratio_text}",
                  font=text, fill="black", anchor="md")
        for row, (label, colour, dash) in enumerate(((f"lower bound {plan.lower_bound:,} B", _RED, (6, 3)),
                                                     (f"arena {arena:,} B", "black", (1, 2)))):
            y = upper + 8 + 17 * row
            _hline(draw, y, right + 14, right + 42, colour, dash=dash)
            draw.text((right + 50, y), label, font=small, fill="black", anchor="lm")
        return _palette_png(image)


#: The trend picture's size: one panel per figure, side by side.
TREND_SIZE = (800, 220)
#: Figures a trend picture draws: (history line key, panel title, scale).
TREND_FIGURES = (("pte_bytes", ".pte kB", 1e-3), ("latency_ms", "latency ms (this host)", 1.0),
                 ("sqnr_db", "SQNR dB", 1.0))


def trend_png(lines: list[Mapping[str, Any]], *, title: str) -> bytes:
    """A PNG of one target's last nights (``outputs/<model>/history.jsonl`` lines, oldest
    first): a panel per figure the lines have (.pte size, latency, a quantized program's
    SQNR), x = night, the value as a polyline; a night a gate refused is a red dot.  A
    latency measured with the spread flag (p90/median wide: a loaded machine) is hollow.

        ┌ title: N nights ────────────────────────────────────────────┐
        │ .pte kB        │ latency ms (this host) │ SQNR dB             │
        │ ●──●──●──●     │ ●──○──●──●             │ ●──●──●──◉(red)     │
        └─────────────────────────────────────────────────────────────┘
    """
    from PIL import Image, ImageDraw

    panels = [(key, label, scale) for key, label, scale in TREND_FIGURES if any(l.get(key) is not None for l in lines)]
    with _RENDER_LOCK:
        image = Image.new("RGB", TREND_SIZE, "white")
        draw = ImageDraw.Draw(image)
        text, small, _ = (picture_font(pixels) for pixels in FONT_PIXELS)
        draw.text((TREND_SIZE[0] / 2, 8), f"{title}: {len(lines)} nights", font=text, fill="black", anchor="ma")
        width = (TREND_SIZE[0] - 20) / max(len(panels), 1)
        for index, (key, label, scale) in enumerate(panels):
            left, right, upper, bottom = 10 + index * width + 52, 10 + (index + 1) * width - 10, 50, TREND_SIZE[1] - 30
            values = [(i, float(l[key]) * scale, l) for i, l in enumerate(lines) if l.get(key) is not None]
            low, high = min(v for _, v, _ in values), max(v for _, v, _ in values)
            pad = (high - low) * 0.1 or abs(high) * 0.05 or 1.0
            low, high = low - pad, high + pad

            def at(i: int, v: float) -> tuple[float, float]:
                x = left + (right - left) * (i / max(len(lines) - 1, 1))
                return x, bottom - (bottom - upper) * (v - low) / (high - low)

            draw.rectangle((left, upper, right, bottom), outline="black", width=1)
            draw.text(((left + right) / 2, upper - 8), label, font=small, fill="black", anchor="md")
            for value in (low + pad, high - pad):
                y = at(0, value)[1]
                draw.text((left - 4, y), f"{value:,.3g}", font=small, fill="black", anchor="rm")
            points = [at(i, v) for i, v, _ in values]
            if len(points) > 1:
                draw.line(points, fill=_TAB20[0], width=2)
            for (x, y), (_, _, line) in zip(points, values):
                colour = _RED if line.get("regressed") else _TAB20[0]
                hollow = key == "latency_ms" and (line.get("spread") or 0) > SPREAD_FLAG
                draw.ellipse((x - 3.5, y - 3.5, x + 3.5, y + 3.5), outline=colour, width=2,
                             fill="white" if hollow else colour)
            draw.text((left, bottom + 6), "night", font=small, fill="black", anchor="la")
        return _palette_png(image)


def _palette_png(image: Any, *, optimize: bool = False) -> bytes:
    """``image`` as a 256-colour palette PNG (fast octree, no dithering).

    A plan picture is flat colours, lines and anti-aliased text: it looks the same
    at a third of the bytes of an RGB PNG (7 kB instead of 19-21 kB; no pixel off by
    more than 15 levels a channel, where median cut was off by up to 60, at twice
    the time), small enough to inline in a report as it is.  Saved without
    ``optimize``: that makes it 12% smaller at three times the time (8 vs 21 ms).
    Drawing and saving a picture once this way is 20 ms; the RGB picture plus its
    palette copy for the report was 45-50 ms, 3% of a cold flow run's CPU (issue 9).
    """
    from PIL import Image

    small = image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    out = io.BytesIO()
    small.save(out, format="PNG", optimize=optimize)
    return out.getvalue()


def is_palette_png(data: bytes) -> bool:
    """Whether PNG bytes are a palette picture (IHDR colour type 3), read from the header."""
    png_size(data)
    return data[25] == 3


@functools.lru_cache(maxsize=None)
def picture_font(pixels: int):
    """Pillow's own scalable font at ``pixels`` (embedded in Pillow: no font file to find)."""
    from PIL import ImageFont

    return ImageFont.load_default(pixels)


def _ticks(high: float, most: int = 8) -> list[float]:
    """Round tick values from 0 up to ``high``: a step of 1, 2, 2.5 or 5 times a power of
    ten, the smallest that gives at most ``most`` intervals (matplotlib's choice)."""
    import math

    if high <= 0:
        return [0.0]
    power = 10 ** math.floor(math.log10(high / most))
    step = next(m * power for m in (1, 2, 2.5, 5, 10, 20) if high / (m * power) <= most)
    count = int(high / step + 1e-9)
    return [i * step for i in range(count + 1)]


def _hline(draw: Any, y: float, x0: float, x1: float, colour: str, *, dash: tuple[int, int]) -> None:
    """A dashed horizontal line: ``dash`` = (pixels on, pixels off)."""
    on, off = dash
    x, y = x0, round(y)
    while x < x1:
        draw.line((x, y, min(x + on - 1, x1), y), fill=colour, width=1)
        x += on + off


def _label_in(image: Any, box: tuple[float, float, float, float], label: str, font: Any) -> None:
    """``label`` inside ``box``, from its left edge, vertically centred, cut at its right edge."""
    from PIL import Image, ImageDraw

    x0, y0, x1, y1 = (round(v) for v in box)
    width, height = x1 - x0 - 2, y1 - y0 - 2
    if width < 4 or height < 4:
        return
    layer = Image.new("L", (width, height), 0)
    ImageDraw.Draw(layer).text((3, height / 2), label, font=font, fill=255, anchor="lm")
    image.paste("black", (x0 + 1, y0 + 1), layer)


def _vertical_text(image: Any, centre: tuple[float, float], label: str, font: Any) -> None:
    """``label`` read bottom to top, centred on ``centre``."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(label)
    layer = Image.new("L", (right + 2, bottom + 2), 0)
    ImageDraw.Draw(layer).text((1, 1), label, font=font, fill=255)
    layer = layer.rotate(90, expand=True)
    image.paste("black", (round(centre[0] - layer.width / 2), round(centre[1] - layer.height / 2)), layer)


def planned_tensors(plan: MemoryPlan) -> list[tuple[str, Any]]:
    """The (key, allocation) pairs a picture draws: arena tensors with bytes, no aliases."""
    return [
        (key, alloc)
        for key, alloc in plan.allocations.items()
        if alloc.mem_id == ARENA_MEM_ID and alloc.size > 0 and key not in plan.aliases
    ]


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG bytes, read from the IHDR chunk; ValueError if not a PNG."""
    import struct

    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG (bad signature or missing IHDR chunk)")
    return struct.unpack(">II", data[16:24])


def inline_png(png: bytes, *, limit: int = INLINE_PNG_LIMIT) -> bytes | None:
    """``png`` small enough to inline in an artifact, or None past ``limit`` bytes.

    A palette PNG (what :func:`memory_plan_png` draws) is inlined as it is; any
    other is first reduced to a palette (:func:`_palette_png`, saved with
    ``optimize``).  The same PNG gives the same bytes.
    """
    from PIL import Image

    if is_palette_png(png):
        return png if len(png) <= limit else None
    with Image.open(io.BytesIO(png)) as image:
        data = _palette_png(image.convert("RGB"), optimize=True)
    return data if len(data) <= limit else None


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` of ``png``."""
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
