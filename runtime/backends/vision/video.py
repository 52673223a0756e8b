"""Videos as the engine takes them: a container checked, frames sampled with a cap, each keyed.

A video becomes what SmolVLM2's own processor makes of it: frames sampled at the processor's
``video_sampling.fps`` (evenly over the video), at most ``max_frames`` of them (the model option
``max_video_frames`` lowers or raises the processor's cap), each a one-tile image of the frame
processor (``store.py``) with its timestamp, after a line saying how many frames of how long a
video follow. Each frame is a ``DecodedImage`` keyed on its pixels (``frame=True``), so its soft
tokens are priced by the one KV reservation and reused by content like an image's.
Qwen-VL's frames go to its video processor as one span (``register_video``). OpenCV (``cv2``,
``opencv-python`` in the ``[vision]`` extra) decodes the file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Final, NamedTuple

import numpy as np

from runtime.backends.vision.media import DecodedImage, MediaLimits, decode_image
from runtime.errors import InvalidMedia, TooManyFrames
from runtime.messages import VideoPart

# The containers accepted, by their first bytes (MP4/MOV carry ``ftyp`` at offset 4).
CONTAINERS: Final = ("MP4", "MOV", "WebM", "MKV", "AVI")
_INTRO: Final = (
    "You are provided the following series of {count} frames from a {length} [H:MM:SS] video.\n"
)
_FRAME: Final = "\nFrame from {at}:"
_OUTRO: Final = "\n\n"


class VideoSampling(NamedTuple):
    """A processor's sampling: frames a second and the most frames of one video."""

    fps: float
    max_frames: int


def sampling_of(processor: Any) -> VideoSampling | None:
    """The video sampling the processor of a video-capable family declares (SmolVLM2's
    ``video_sampling``), or None: the family takes no video."""
    declared = getattr(getattr(processor, "image_processor", None), "video_sampling", None)
    videos: Any = getattr(processor, "video_processor", None)
    if not isinstance(declared, dict) and hasattr(videos, "merge_size"):
        # Qwen2-VL's video processor: a whole video becomes one span (video_grid_thw).
        return VideoSampling(float(videos.fps), int(videos.max_frames))
    if not isinstance(declared, dict):
        return None
    return VideoSampling(float(declared.get("fps", 1)), int(declared.get("max_frames", 64)))


class Frames(NamedTuple):
    """A video's sampled frames, each with its time in seconds, and the video's length."""

    images: list[DecodedImage]
    seconds: list[float]
    length_s: float


def frame_cap(sampling: VideoSampling, limits: MediaLimits) -> int:
    return limits.max_video_frames or sampling.max_frames


def video_frames(
    part: VideoPart, where: str, sampling: VideoSampling, limits: MediaLimits
) -> Frames:
    """The frames of ``part`` (``where`` names it in errors); raises ``InvalidMedia`` (an
    unsupported container, undecodable, too large or too long) or ``TooManyFrames``."""
    cap = frame_cap(sampling, limits)
    if part.data and part.frames:
        raise InvalidMedia(f"{where} has both a video file and frames; send one of them")
    if part.frames:
        if len(part.frames) > cap:
            raise TooManyFrames(
                f"{where} has {len(part.frames)} frames; this model takes at most {cap} from one "
                "video (max_video_frames): sample fewer"
            )
        if not part.fps > 0:
            raise InvalidMedia(f"{where}.fps is {part.fps}; send the frames' rate, above 0")
        images = [
            DecodedImage(decode_image(data, f"{where}.frames[{k}]", limits).pixels, frame=True)
            for k, data in enumerate(part.frames)
        ]
        return Frames(images, [k / part.fps for k in range(len(images))], len(images) / part.fps)
    return _sample_file(part.data, where, sampling, cap, limits)


def _container(data: bytes) -> str | None:
    if data[4:8] == b"ftyp":
        return "MOV" if data[8:10] == b"qt" else "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM" if b"webm" in data[:64] else "MKV"
    if data[:4] == b"RIFF" and data[8:11] == b"AVI":
        return "AVI"
    return None


def _sample_file(
    data: bytes, where: str, sampling: VideoSampling, cap: int, limits: MediaLimits
) -> Frames:
    import cv2

    if not data:
        raise InvalidMedia(f"{where} is empty; send a video file's bytes or its frames")
    if len(data) > limits.max_video_bytes:
        raise InvalidMedia(
            f"{where} is {len(data)} bytes, more than the {limits.max_video_bytes} a video may "
            "be; send a shorter or smaller video"
        )
    if _container(data) is None:
        raise InvalidMedia(
            f"{where} is not a video container the runtime reads; send one of "
            f"{', '.join(CONTAINERS)}"
        )
    # OpenCV reads videos from files only: a private temporary file, removed at once.
    handle, name = tempfile.mkstemp(prefix="mlxrt-video-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        capture = cv2.VideoCapture(name)
        try:
            return _sample(capture, where, sampling, cap, limits)
        finally:
            capture.release()
    finally:
        os.unlink(name)


def _sample(
    capture: Any, where: str, sampling: VideoSampling, cap: int, limits: MediaLimits
) -> Frames:
    import cv2

    total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) if capture.isOpened() else 0
    native_fps = float(capture.get(cv2.CAP_PROP_FPS)) if total else 0.0
    if total <= 0 or native_fps <= 0:
        raise InvalidMedia(f"{where} could not be decoded as a video; send it again")
    width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
    height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if width * height > limits.max_pixels:
        raise InvalidMedia(
            f"{where} is {width}x{height} pixels a frame, more than the {limits.max_pixels} "
            "an image may have; downscale it"
        )
    length_s = total / native_fps
    if length_s > limits.max_video_seconds:
        raise InvalidMedia(
            f"{where} lasts {length_s:.0f} s, more than the {limits.max_video_seconds} s a video "
            "may (max_video_seconds); send a shorter clip"
        )
    count = max(1, min(cap, total, round(length_s * sampling.fps)))
    indices = np.linspace(0, total - 1, count).round().astype(int).tolist()
    images: list[DecodedImage] = []
    for index in indices:
        capture.set(cv2.CAP_PROP_POS_FRAMES, index)
        ok, frame = capture.read()
        if not ok:
            raise InvalidMedia(f"{where} is a damaged video: frame {index} could not be read")
        rgb = np.ascontiguousarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), dtype=np.uint8)
        images.append(DecodedImage(rgb, frame=True))
    return Frames(images, [i / native_fps for i in indices], length_s)


def _clock(seconds: float, hours: bool) -> str:
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    if hours:
        return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
    return f"{minutes:02d}:{secs:02d}"


def video_text(frames: Frames, markers: list[str]) -> str:
    """SmolVLM2's text for a video: its intro, then each frame's timestamp and marker."""
    text = _INTRO.format(count=len(markers), length=_clock(frames.length_s, hours=True))
    for at, marker in zip(frames.seconds, markers, strict=True):
        text += _FRAME.format(at=_clock(at, hours=False)) + marker
    return text + _OUTRO
