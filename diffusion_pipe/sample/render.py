"""One prompt -> pixels through the family's diffusers pipeline, deterministically; grids and files of them.

Prompts come as text-store entries (the encode stage embeds them like captions), so rendering needs neither
text encoders nor tokenizers. Noise comes from a CPU generator seeded by the prompt's seed: the same prompt
gives the same starting noise at every step of a run, on any device.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
import torch

from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.models.base import Adapter, TensorDict
from diffusion_pipe.params import SamplePrompt

if TYPE_CHECKING:
    from PIL.ImageFont import FreeTypeFont


class SampleText(NamedTuple):
    """A text a sample prompt renders from, with what the family's text encoder reads beside it: for a family
    with `text_reads_conditioning`, the prompt's control image at the sample's size (its text entry is keyed and
    made with it); else nothing, and prompts share the entries of equal texts."""

    text: str
    control: str = ""
    width: int = 0
    height: int = 0


def sample_text(adapter: Adapter, prompt: SamplePrompt, text: str) -> SampleText:
    """`text` (the prompt's or its negative prompt) as `prompt` renders from it."""
    if adapter.capabilities.text_reads_conditioning:
        return SampleText(text, prompt.control, prompt.width, prompt.height)
    return SampleText(text)


def prompt_texts(adapter: Adapter, prompts: tuple[SamplePrompt, ...]) -> tuple[SampleText, ...]:
    """Every text the resolved `prompts` render from (the family decides whether negative prompts count)."""
    return tuple(sorted({sample_text(adapter, p, text) for p in prompts for text in adapter.sample_texts(p)}))


def encode_sample_texts(adapter: Adapter, encoders: object, texts: tuple[SampleText, ...],
                        max_length: int) -> dict[SampleText, TensorDict]:
    """The text entries of `texts` made by the family's text encoders, as encode makes them: a text read with a
    control image is read with it as `control_image` crops it to the sample's size."""
    from diffusion_pipe.encode.media import load_pixels_uint8, to_unit_range

    alone = [t for t in texts if not t.control]
    out = dict(zip(alone, adapter.encode_text(encoders, [t.text for t in alone], max_length))) if alone else {}
    for t in (t for t in texts if t.control):
        pixels = to_unit_range(load_pixels_uint8(Path(t.control), "image", t.width, t.height, 1))[None]
        (out[t],) = adapter.encode_conditioned_text(encoders, [t.text], pixels, max_length)
    return out


def check_prompt(adapter: Adapter, prompt: SamplePrompt) -> None:
    """A prompt the model cannot render is an error naming the prompt and what to change: a size that is not a
    multiple the family needs, frames for an image family, a control image missing for an edit family (or given to
    another family, or not a file)."""
    from diffusion_pipe.config import ConfigError

    edits = adapter.samples_need_control
    if edits and not prompt.control:
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r} has no control image; family "
                          f"'{adapter.name}' renders from one: give the prompt `control: path/to/image.png`")
    if prompt.control and not edits:
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r} has a control image, but family "
                          f"'{adapter.name}' renders from text alone; remove `control`")
    if prompt.control and not Path(prompt.control).is_file():
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r}: control image {prompt.control} is not a "
                          "file; give the path of an image (relative to the repository)")
    m = adapter.sample_size_multiple()
    if prompt.width % m or prompt.height % m:
        raise ConfigError(f"train.samples: prompt {prompt.prompt!r} is {prompt.width}x{prompt.height}; family "
                          f"'{adapter.name}' renders sides that are multiples of {m}: set width and height to such")
    if prompt.frames > 1 and "video" not in adapter.capabilities.media:
        raise ConfigError(f"train.samples: prompt {prompt.prompt!r} asks for {prompt.frames} frames but family "
                          f"'{adapter.name}' renders images; set frames to 1")


@torch.no_grad()
def render_prompts(pipe: object, adapter: Adapter, prompts: tuple[SamplePrompt, ...],
                   texts: dict[SampleText, TensorDict], device: torch.device) -> list[np.ndarray]:
    """Pixels (frames, height, width, 3) uint8 of each resolved prompt, in order; `texts` holds the stored text
    entry of every prompt and negative prompt. Prompts that share size, frames, steps, guidance and control image
    render as one batch (one pass of the pipeline), each from the noise of its own seed."""
    out: list[np.ndarray | None] = [None] * len(prompts)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((p.width, p.height, p.frames, p.steps, p.guidance, p.cfg_scale, p.control), []).append(i)
    for (width, height, frames, steps, guidance, cfg_scale, control), members in groups.items():
        calls = [adapter.sample_inputs(texts[sample_text(adapter, p, p.prompt)],
                                       texts.get(sample_text(adapter, p, p.negative_prompt)), guidance, cfg_scale)
                 for p in (prompts[i] for i in members)]
        kwargs = {k: _join([c[k] for c in calls], device) if k not in adapter.sample_shared_inputs else
                  calls[0][k].to(device) for k in calls[0]}
        if control:  # the image the group's prompts edit (or start from), read once for the batch
            kwargs |= adapter.sample_control_inputs(control_image(control, width, height))
        if "video" in adapter.capabilities.media:
            kwargs["num_frames"] = frames
        result = pipe(height=height, width=width, num_inference_steps=steps, output_type="np",
                      generator=[torch.Generator("cpu").manual_seed(prompts[i].seed) for i in members], **kwargs)
        # (B, F, H, W, 3) for video pipelines, (B, H, W, 3) for image ones; values in [0, 1]
        pixels = np.asarray(result.frames) if hasattr(result, "frames") else np.asarray(result.images)[:, None]
        for i, item in zip(members, pixels):
            out[i] = (np.clip(item, 0.0, 1.0) * 255).round().astype(np.uint8)
    return out


def control_image(path: str, width: int, height: int) -> object:
    """A sample prompt's control image as a PIL image at the sample's size, cropped as encode crops a training
    control image to its target's bucket (cover, centre)."""
    from PIL import Image

    from diffusion_pipe.encode.media import load_pixels_uint8

    pixels = load_pixels_uint8(Path(path), "image", width, height, 1)  # (3, 1, H, W)
    return Image.fromarray(pixels[:, 0].permute(1, 2, 0).numpy())


def _join(values: list, device: torch.device) -> object:
    """One pipeline argument from the prompts of a batch: tensors concatenated, lists (a tensor per prompt, as
    ZImagePipeline takes its embeddings) joined, anything else (a scale) the first prompt's."""
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values).to(device)
    if isinstance(values[0], list):
        return [t.to(device) for value in values for t in value]
    return values[0]


class GridLayout(NamedTuple):
    """Where `grid` puts everything, from the cells' sizes and the label texts alone (no pixels): the grid's
    (height, width); the factor every image is scaled by (`up` nearest-neighbour, or `down` box-averaged; the
    other is 1); the scaled cell size; each image's box (top, left, bottom, right), None for a missing cell; the
    label strips' sizes; the font size and each label's lines as drawn (wrapped, the last one ending in an
    ellipsis where the text does not fit)."""

    height: int
    width: int
    up: int
    down: int
    cell_height: int
    cell_width: int
    cells: tuple[tuple[tuple[int, int, int, int] | None, ...], ...]
    header_height: int
    label_width: int
    font_size: int
    row_lines: tuple[tuple[str, ...], ...]
    column_lines: tuple[tuple[str, ...], ...]


_INK = (40, 40, 40)  # label text on the white background
_ELLIPSIS = "\u2026"
_HEADER_LINES = 3  # at most this many lines of a column label; a row label may fill its cell's height


def grid_layout(shapes: Sequence[Sequence[tuple[int, int] | None]], row_labels: Sequence[str] = (),
                column_labels: Sequence[str] = (), gap: int = 2, min_cell: int = 128,
                max_cell: int = 512) -> GridLayout:
    """The layout of `grid` for images of (height, width) `shapes`, a row of them per grid row (None: no image
    there); see `grid` for the arguments. Pure: tests find cells and label strips with it."""
    if row_labels and len(row_labels) != len(shapes):
        raise ValueError(f"grid: {len(row_labels)} row labels for {len(shapes)} rows; give one per row")
    columns = max((len(row) for row in shapes), default=0)
    if column_labels and len(column_labels) != columns:
        raise ValueError(f"grid: {len(column_labels)} column labels for {columns} columns; give one per column")
    sizes = [s for row in shapes for s in row if s is not None]
    if not sizes:
        raise ValueError("grid: no images to lay out")
    side = max(max(h, w) for h, w in sizes)
    up = -(-min_cell // side) if side < min_cell else 1
    down = -(-side // max_cell) if side > max_cell else 1
    # sizes as `_scaled` makes them (Pillow's reduce rounds up)
    scaled = [[None if s is None else (-(-s[0] * up // down), -(-s[1] * up // down)) for s in row] for row in shapes]
    cell_h = max(s[0] for row in scaled for s in row if s is not None)
    cell_w = max(s[1] for row in scaled for s in row if s is not None)

    font_size = min(24, max(12, min(cell_h, cell_w) // 8))
    font = _font(font_size)
    line_h, pad = _line_height(font), font_size // 2
    column_lines = tuple(tuple(_wrap(label, font, cell_w, _HEADER_LINES)) for label in column_labels)
    header_h = (2 * pad + line_h * max(len(lines) for lines in column_lines)) if column_labels else 0
    text_w = max(cell_w, 16 * font_size)  # about 32 characters a line
    row_lines = tuple(tuple(_wrap(label, font, text_w, max(1, cell_h // line_h))) for label in row_labels)
    widest = max((font.getlength(line) for lines in row_lines for line in lines), default=0.0)
    label_w = 2 * pad + math.ceil(widest) if row_labels else 0

    def box(r: int, c: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
        """The image of size `size` centred in the cell of row `r`, column `c`."""
        top = header_h + r * (cell_h + gap) + (cell_h - size[0]) // 2
        left = label_w + c * (cell_w + gap) + (cell_w - size[1]) // 2
        return top, left, top + size[0], left + size[1]

    cells = tuple(tuple(None if s is None else box(r, c, s) for c, s in enumerate(row))
                  for r, row in enumerate(scaled))
    return GridLayout(header_h + len(shapes) * (cell_h + gap) - gap, label_w + columns * (cell_w + gap) - gap,
                      up, down, cell_h, cell_w, cells, header_h, label_w, font_size, row_lines, column_lines)


def grid(rows: Sequence[Sequence[np.ndarray | None]], row_labels: Sequence[str] = (),
         column_labels: Sequence[str] = (), gap: int = 2, min_cell: int = 128, max_cell: int = 512) -> np.ndarray:
    """Images (H, W, 3) uint8 laid out in rows on a white background, labelled: `column_labels` above the columns
    (centred, wrapped to the cell's width, at most 3 lines) and `row_labels` left of the rows (wrapped to about 32
    characters a line, as many lines as the cell is high); each label text shortened with an ellipsis where it
    does not fit. No labels given: no strip. A cell takes the largest image's size and centres its image; a missing
    image (None, or a short row) leaves its cell white.

    So that pictures and text both read, every image is scaled by the same integer factor: grids of small renders
    (largest side under `min_cell`, e.g. the tiny examples' 32 or 64 px) are scaled up nearest-neighbour, pixels
    kept sharp, to at least `min_cell`; grids of large ones (over `max_cell`, e.g. 1024 px renders) are scaled
    down, box-averaged, to at most `max_cell`, which keeps a grid of many steps a sensible size (each render is
    also written whole beside it). The font size follows the cell size (12 to 24 px).

    Pure and deterministic: equal images and labels give equal pixels. `grid_layout` tells where each cell is."""
    from PIL import Image, ImageDraw

    layout = grid_layout([[None if img is None else img.shape[:2] for img in row] for row in rows],
                         row_labels, column_labels, gap, min_cell, max_cell)
    out = np.full((layout.height, layout.width, 3), 255, dtype=np.uint8)
    for row, boxes in zip(rows, layout.cells):
        for img, box in zip(row, boxes):
            if img is not None:
                top, left, bottom, right = box
                out[top:bottom, left:right] = _scaled(img, layout.up, layout.down)
    if not (row_labels or column_labels):
        return out

    image = Image.fromarray(out)
    draw = ImageDraw.Draw(image)
    font = _font(layout.font_size)
    line_h, pad = _line_height(font), layout.font_size // 2
    gap_w, gap_h = layout.cell_width + gap, layout.cell_height + gap
    for c, lines in enumerate(layout.column_lines):
        x = layout.label_width + c * gap_w + layout.cell_width // 2
        y = layout.header_height - pad - line_h * len(lines)  # the lines sit just above the cells
        for i, line in enumerate(lines):
            draw.text((x, y + i * line_h), line, font=font, fill=_INK, anchor="ma")
    for r, lines in enumerate(layout.row_lines):
        y = layout.header_height + r * gap_h + (layout.cell_height - line_h * len(lines)) // 2
        for i, line in enumerate(lines):
            draw.text((pad, y + i * line_h), line, font=font, fill=_INK, anchor="la")
    return np.array(image)


def _scaled(img: np.ndarray, up: int, down: int) -> np.ndarray:
    """`img` scaled up `up` times nearest-neighbour, or down `down` times box-averaged (Pillow's `reduce`)."""
    from PIL import Image

    if up > 1:
        return img.repeat(up, axis=0).repeat(up, axis=1)
    if down > 1:
        return np.asarray(Image.fromarray(img).reduce(down))
    return img


def _font(size: int) -> FreeTypeFont:
    """Pillow's bundled font (in its wheel) at `size` px."""
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _line_height(font: FreeTypeFont) -> int:
    """The distance between two lines of `font`'s text."""
    ascent, descent = font.getmetrics()
    return ascent + descent + 2


def _wrap(text: str, font: FreeTypeFont, width: float, max_lines: int) -> list[str]:
    """`text` in lines of at most `width` px, broken between words (a word wider than a line is cut), at most
    `max_lines` of them: what does not fit is cut and the last line ends in an ellipsis."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while len(word) > 1 and font.getlength(word) > width:
            cut = len(word) - 1
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            lines.append(word[:cut])
            word = word[cut:]
        current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and font.getlength(last + _ELLIPSIS) > width:
            last = last[:-1]
        lines = lines[:max_lines - 1] + [last.rstrip() + _ELLIPSIS]
    return lines


def png_bytes(image: np.ndarray) -> bytes:
    """PNG of an (H, W, 3) uint8 image; no timestamps or text chunks, so equal pixels give equal bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def write_media(path_stem: Path, pixels: np.ndarray, fps: int = 16) -> list[Path]:
    """Write one rendered prompt atomically: `<stem>.png` (the middle frame of a video) and, for more than one
    frame, `<stem>.mp4` too. Returns the paths written."""
    written = [path_stem.with_suffix(".png")]
    write_bytes_atomic(written[0], png_bytes(poster(pixels)))
    if pixels.shape[0] > 1:
        import imageio.v3 as iio

        video = iio.imwrite("<bytes>", pixels, extension=".mp4", plugin="pyav", codec="libx264", fps=fps)
        written.append(path_stem.with_suffix(".mp4"))
        write_bytes_atomic(written[1], video)
    return written


def poster(pixels: np.ndarray) -> np.ndarray:
    """The frame that stands for a rendered prompt in grids: the middle one."""
    return pixels[pixels.shape[0] // 2]
