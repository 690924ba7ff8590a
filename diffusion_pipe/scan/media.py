"""Probing one media file: content hash, and width/height/frames/fps measured by decoding it.

Still images are checked without decoding their pixels where the format allows (see `_check_whole`).
Every failure becomes a `Probe` with a `reason` ('corrupt', 'too_large', 'unreadable', ...) and a `detail`
for the report; probing never raises for bad input, so one bad file cannot stop a scan of 100k.
`probe_batch` is the unit of work sent to the process pool.

What a file is comes from its bytes, not its name: a file whose bytes are an image while its extension says
video (a PNG named `.mp4`), or the reverse, is excluded with reason 'wrong_extension' and a detail naming what
it really is, since encode would otherwise treat a still image as a one-frame clip (and stop an image family's
encode). Two checks find it: the leading bytes of the common formats (`sniff`), and, for a video extension, the
demuxer FFmpeg picks (an image demuxer such as `png_pipe` or `image2` means a still image). Within one kind the
extension may be wrong (a PNG named `.jpg`, an MP4 named `.webm`): both decoders go by the bytes.

A `detail` never holds what differs between identical runs or locations: an exception's text loses Python
object reprs (`<_io.BytesIO object at 0x7f...>`) and the file's own path (`error_detail`), so
`reports/scan.json` is the same for the same files.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath
from typing import Any, BinaryIO, Literal

from diffusion_pipe.hashing import hash_bytes, hash_file
from diffusion_pipe.scan.captions import CaptionRead, read_caption

MediaKind = Literal["image", "video"]

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".dib", ".tif", ".tiff", ".gif"})
VIDEO_EXTS = frozenset({".mp4", ".webm", ".mov", ".mkv", ".m4v"})
# Pillow formats whose animated files are videos (animated GIF, animated WebP, APNG); a multi-page TIFF is not.
_ANIMATED_FORMATS = frozenset({"GIF", "WEBP", "PNG"})
# Files up to this size are read once into memory, then hashed and decoded from the same bytes; larger ones are
# hashed streaming and decoded from disk, so memory per worker stays bounded.
_IN_MEMORY_BYTES = 64 << 20
# Browsers show GIF/WebP frames with a delay of <= 10 ms for 100 ms; we measure fps the way they play it.
_MIN_FRAME_MS = 10
_DEFAULT_FRAME_MS = 100


# FFmpeg demuxers of still images: a "video" that one of them opens is a picture with a video's extension.
_IMAGE_DEMUXERS = frozenset({"image2", "image2pipe", "gif", "apng", "ico", "webp", "jpegxl_anim"})
# ISO-media brands of still images (AVIF, HEIC): an `ftyp` box with one of these is not a video.
_HEIF_BRANDS = frozenset({b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"})
# Bytes read to identify a file by its signature (`sniff`).
SNIFF_BYTES = 64
# A Python object's default repr (`<_io.BytesIO object at 0x7f...>`), which exceptions may quote: it changes from
# run to run, so it must not reach a detail.
_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")
# What is left at the end of PyAV's "...input: '<none>'" (input from memory) or "...input: '/a/b.mp4'" (from disk,
# once the path is cut): nothing of it belongs in a detail.
_EMPTY_QUOTE = re.compile(r"""[:\s]*(''|'<none>'|"")?\s*$""")


def media_kind(path: str | PurePath) -> MediaKind | None:
    """'image' or 'video' from the extension (case-insensitive), None for other files.

    GIF and WebP count as images here; `probe_media` turns animated ones into videos.
    """
    ext = os.path.splitext(str(path))[1].lower()
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    return None


@dataclass(frozen=True)
class Probe:
    """What probing one media file found; `reason` is '' when it decoded fine."""

    media: MediaKind
    size_bytes: int = 0
    content_hash: str = ""
    width: int = 0
    height: int = 0
    num_frames: int = 0
    fps: float = 0.0
    reason: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Sniffed:
    """What a file's leading bytes say it is: its kind, a name for people ("a PNG image"), the extension it
    should have."""

    media: MediaKind
    name: str
    extension: str


def sniff(head: bytes) -> Sniffed | None:
    """The format of a file from its first `SNIFF_BYTES` bytes, for the common image and video formats; None when
    they match no signature known here (FFmpeg or Pillow may still read the file). Pure.

    Animated GIF/WebP/PNG are 'image' here (their extensions are image extensions; `probe_media` makes them
    videos by decoding)."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return Sniffed("image", "a PNG image", ".png")
    if head.startswith(b"\xff\xd8\xff"):
        return Sniffed("image", "a JPEG image", ".jpg")
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return Sniffed("image", "a GIF image", ".gif")
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return Sniffed("image", "a WebP image", ".webp")
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return Sniffed("image", "a TIFF image", ".tif")
    # "BM" alone is two common letters: also ask for a known DIB header size after the 14-byte file header.
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in (12, 40, 52, 56, 64, 108,
                                                                                          124):
        return Sniffed("image", "a BMP image", ".bmp")
    if head[4:8] == b"ftyp" and head[8:12] not in _HEIF_BRANDS:
        return Sniffed("video", "an MP4/QuickTime video", ".mov" if head[8:12] == b"qt  " else ".mp4")
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska, or WebM (its doctype says which)
        return Sniffed("video", "a WebM video", ".webm") if b"webm" in head else Sniffed("video", "a Matroska video",
                                                                                       ".mkv")
    return None


def _wrong_extension(base: Probe, path: str, what: str, claimed: MediaKind, fix: str) -> Probe:
    """`base` excluded as 'wrong_extension': its bytes are `what`, its extension says `claimed`."""
    ext = os.path.splitext(path)[1]
    said = "a video" if claimed == "video" else "an image"
    return _replace(base, reason="wrong_extension",
                    detail=f"the bytes are {what}, not {said} as the extension {ext} says; {fix}")


def error_detail(exc: BaseException, path: str | None = None) -> str:
    """'ExceptionType: message' for a report's detail, the same on every run and at every location: Python object
    reprs (which hold memory addresses) and the file's own `path` (the report names the file already) are cut."""
    text = _OBJECT_REPR.sub("", str(exc))
    if path:
        text = text.replace(repr(path), "").replace(path, "")
    text = _EMPTY_QUOTE.sub("", text)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def _own_pixel_limit() -> Iterator[None]:
    """Turn off Pillow's module-level decompression-bomb check for one probe; `_probe_image` checks instead.

    Pillow's check fires inside `Image.open`, before we could learn the size; ours reads the size from the
    header and stops before decoding, so a bomb is reported with its dimensions and never decoded. The
    setting is restored afterwards, so other users of Pillow in the process see no change.
    """
    from PIL import Image

    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = old


def _frame_ms(duration: object) -> float:
    ms = float(duration) if isinstance(duration, (int, float)) else 0.0
    return _DEFAULT_FRAME_MS if ms <= _MIN_FRAME_MS else ms


def _check_whole(img: Any, src: BinaryIO | str) -> None:
    """Read all of a still image's data, decoding as few pixels as its format allows; raise if it is damaged.

    A truncated or damaged file must fail in the scan, not in encode, but a 169-megapixel PNG must not be
    decoded twice (here and in encode): a PNG's chunk checksums cover every byte of its image data, and a JPEG
    decodes its whole stream at 1/8 scale (1/64 of the pixels). Other formats are decoded.
    """
    if img.format == "PNG":
        from PIL import Image

        if not isinstance(src, str):
            src.seek(0)
        with Image.open(src) as fresh:  # verify() must come first after open, and n_frames has read ahead
            fresh.verify()
    elif img.format == "JPEG":
        img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
        img.load()
    else:
        img.load()


def _probe_image(src: BinaryIO | str, base: Probe, max_pixels: int, path: str) -> Probe:
    from PIL import Image

    try:
        with _own_pixel_limit(), Image.open(src) as img:
            width, height = img.size
            if width * height > max_pixels:
                return _replace(base, width=width, height=height, reason="too_large",
                                detail=f"{width}x{height} pixels > max_image_pixels {max_pixels}")
            n_frames = int(getattr(img, "n_frames", 1))
            if n_frames > 1 and getattr(img, "is_animated", False) and img.format in _ANIMATED_FORMATS:
                total_ms = 0.0
                for i in range(n_frames):
                    img.seek(i)
                    img.load()  # decode every frame: a truncated animation must fail here, not in encode
                    total_ms += _frame_ms(img.info.get("duration"))
                return _replace(base, media="video", width=width, height=height, num_frames=n_frames,
                                fps=n_frames * 1000.0 / total_ms)
            # EXIF orientations 5-8 rotate by 90 degrees: the picture as shown is height x width.
            if img.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                width, height = height, width
            _check_whole(img, src)
            return _replace(base, media="image", width=width, height=height, num_frames=1, fps=0.0)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return _replace(base, reason="too_large", detail=error_detail(exc, path))
    except Exception as exc:  # Pillow raises many types on bad data (OSError, SyntaxError, ValueError, ...)
        return _replace(base, reason="corrupt", detail=error_detail(exc, path))


def _probe_video(src: BinaryIO | str, base: Probe, path: str) -> Probe:
    import av

    try:
        with av.open(src) as container:
            demuxer = container.format
            if demuxer.name in _IMAGE_DEMUXERS or demuxer.name.endswith("_pipe"):
                return _wrong_extension(base, path, f"a still image ({demuxer.long_name})", "video",
                                        "rename it to its image format's extension")
            if not container.streams.video:
                return _replace(base, reason="corrupt", detail="no video stream")
            stream = container.streams.video[0]
            declared = stream.average_rate or stream.guessed_rate
            n = width = height = 0
            first_pts: int | None = None
            last_pts: int | None = None
            time_base: Fraction | None = None
            for frame in container.decode(stream):
                if n == 0:
                    width, height = frame.width, frame.height
                if frame.pts is not None:
                    first_pts = frame.pts if first_pts is None else min(first_pts, frame.pts)
                    last_pts = frame.pts if last_pts is None else max(last_pts, frame.pts)
                    time_base = frame.time_base or stream.time_base
                n += 1
    except Exception as exc:  # PyAV raises FFmpeg errors of many kinds (InvalidDataError, EOFError, ...)
        return _replace(base, reason="corrupt", detail=error_detail(exc, path))
    if n == 0:
        return _replace(base, reason="corrupt", detail="no decodable video frame")
    fps = 0.0
    if n > 1 and first_pts is not None and last_pts is not None and time_base and last_pts > first_pts:
        fps = _measured_fps(n, last_pts - first_pts, Fraction(time_base), declared)
    return _replace(base, media="video", width=width, height=height, num_frames=n, fps=fps)


def _measured_fps(n: int, span_ticks: int, time_base: Fraction, declared: Fraction | None) -> float:
    """Frames per second from n decoded frames whose presentation times span `span_ticks` of `time_base`.

    n frames span n - 1 intervals. Timestamps are rounded to the time base (Matroska/WebM: 1 ms, so 12 fps
    measures as 11.994); when the container's declared rate agrees with the measurement within that rounding
    (one tick at each end), the declared rate is the exact value of what was measured and is reported instead.
    """
    span = Fraction(span_ticks) * time_base
    measured = Fraction(n - 1) / span
    if declared:
        tolerance = measured * 2 * time_base / span
        if abs(Fraction(declared) - measured) <= tolerance:
            return float(declared)
    return float(measured)


def _replace(base: Probe, **changes: object) -> Probe:
    fields = {**base.__dict__, **changes}
    return Probe(**fields)  # type: ignore[arg-type]


def probe_media(path: str, max_image_pixels: int) -> Probe:
    """Hash and decode one media file; never raises for bad content (see `Probe.reason`).

    Reasons: 'empty_file', 'unreadable' (open/read failed), 'wrong_extension' (the bytes are a video and the
    name an image's, or the reverse; see the module docstring), 'too_large' (over `max_image_pixels`, checked
    from the header before decoding), 'corrupt' (anything that fails to decode fully).
    """
    kind = media_kind(path)
    assert kind is not None, path
    base = Probe(media=kind)
    try:
        size = os.stat(path).st_size
        if size == 0:
            return _replace(base, reason="empty_file", content_hash=hash_bytes(b""), detail="0 bytes")
        if size <= _IN_MEMORY_BYTES:
            with open(path, "rb") as fh:
                data = fh.read()
            size = len(data)
            base = _replace(base, size_bytes=size, content_hash=hash_bytes(data))
            src: BinaryIO | str = io.BytesIO(data)
            head = data[:SNIFF_BYTES]
        else:
            base = _replace(base, size_bytes=size, content_hash=hash_file(path))
            src = path
            with open(path, "rb") as fh:
                head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        return _replace(base, reason="unreadable", detail=f"{type(exc).__name__}: {exc.strerror or exc}")
    found = sniff(head)
    if found is not None and found.media != kind:
        return _wrong_extension(base, path, found.name, kind, f"rename it to {found.extension}")
    if kind == "video":
        return _probe_video(src, base, path)
    return _probe_image(src, base, max_image_pixels, path)


@dataclass(frozen=True)
class Task:
    """One file to probe: a media file or a caption (.txt)."""

    kind: Literal["media", "caption"]
    path: str  # absolute, or relative to the working directory


def probe_batch(tasks: list[Task], max_image_pixels: int, max_caption_bytes: int | None = None
                ) -> list[Probe | CaptionRead]:
    """Probe a batch of files in order; the unit of work of the scan's process pool."""
    return [
        probe_media(t.path, max_image_pixels) if t.kind == "media" else read_caption(t.path, max_caption_bytes)
        for t in tasks
    ]

