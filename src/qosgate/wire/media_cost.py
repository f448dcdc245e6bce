"""Prompt tokens of a chat request's image and audio parts, counted as the engine counts them.

An image part's base64 is not text the model reads: a vision model turns the image into a
number of tokens set by its pixel size (``config.ImageTokens``), an audio model a clip into a
number set by its duration (``config.AudioTokens``). The size or duration comes from the file's
header (``wire/media.py``); a part the gateway cannot size (an ``http(s)`` URL, which the
engine fetches, an unknown format, a malformed part) counts the configured ``unknown_tokens``,
never its length as text. ``wire/parse.py`` finds the parts while it checks the messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qosgate.config import AudioTokens, ImageTokens
from qosgate.wire.media import B64, audio_seconds, image_size

_HEADER_CHARS = 256  # where a data URL's comma must be: "data:<media type>;base64,"


@dataclass(frozen=True, slots=True)
class MediaPart:
    """An image or audio member of a content part: its ``kind`` (``image_url``,
    ``input_audio``, ``audio_url``) and its JSON value as decoded."""

    kind: str
    value: Any

    @property
    def chars(self) -> int:
        """The characters of its payload (a URL or base64 text): not text the model reads."""
        text = _payload_text(self)
        return len(text) if text else 0


def _payload_text(p: MediaPart) -> str | None:
    v = p.value
    if isinstance(v, dict):
        v = v.get("data" if p.kind == "input_audio" else "url")
    return v if isinstance(v, str) else None


# ---------------------------------------------------------------------- images
def image_tokens(width: int, height: int, rule: ImageTokens, detail: str | None = None) -> int:
    """The tokens of a ``width`` x ``height`` image by ``rule``."""
    if rule.rule == "fixed":
        return rule.tokens_per_image
    if rule.rule == "tiles":
        return _tiles(width, height, rule, detail)
    return _patches(width, height, rule)


def _patches(width: int, height: int, rule: ImageTokens) -> int:
    """Qwen2-VL's resize: each side to a multiple of the patch, the area kept within the
    bounds with the aspect ratio; one token per patch."""
    f = rule.patch_px
    lo, hi = rule.min_tokens * f * f, rule.max_tokens * f * f
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > hi:
        beta = math.sqrt(height * width / hi)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return (h // f) * (w // f)


def _tiles(width: int, height: int, rule: ImageTokens, detail: str | None) -> int:
    """OpenAI's count: fit within 2048 x 2048, then the short side down to 768, then tiles."""
    if detail == "low":
        return rule.base_tokens
    w, h = float(width), float(height)
    scale = min(1.0, 2048 / max(w, h))
    w, h = w * scale, h * scale
    scale = min(1.0, 768 / min(w, h))
    w, h = w * scale, h * scale
    tiles = math.ceil(w / rule.tile_px) * math.ceil(h / rule.tile_px)
    return rule.base_tokens + rule.tile_tokens * tiles


def unknown_image_tokens(rule: ImageTokens) -> int:
    if rule.unknown_tokens is not None:
        return rule.unknown_tokens
    return image_tokens(1024, 1024, rule)


# ---------------------------------------------------------------------- audio
def audio_tokens(seconds: float, rule: AudioTokens) -> int:
    return math.ceil(seconds * rule.tokens_per_second)


def unknown_audio_tokens(rule: AudioTokens) -> int:
    if rule.unknown_tokens is not None:
        return rule.unknown_tokens
    return audio_tokens(30.0, rule)


# ---------------------------------------------------------------------- a request's parts
def _base64_payload(url: str) -> B64 | None:
    """The payload of a ``data:...;base64,`` URL (None for anything else)."""
    if not url.startswith("data:"):
        return None
    comma = url.find(",", 5, _HEADER_CHARS)
    if comma < 0 or not url[5:comma].lower().endswith(";base64"):
        return None
    return B64(url[comma + 1 :])


@dataclass(slots=True)
class MediaCost:
    """What a request's media parts count by ``images`` and ``audio``, and how that was found
    (for the client)."""

    images: ImageTokens
    audio: AudioTokens
    tokens: int = 0
    sized: int = 0  # images whose size was read
    unsized: int = 0  # images counted at the configured cost
    timed: float = 0.0  # seconds of audio read from headers
    clips: int = 0
    untimed: int = 0

    def describe(self) -> str:
        images, audio = self.images, self.audio
        parts = ["text estimated as characters / 4"]
        if self.sized:
            parts.append(f"{_n(self.sized, 'image')} counted from {_its(self.sized)} size by "
                         f"the {images.rule} rule")
        if self.unsized:
            parts.append(f"{_n(self.unsized, 'image')} not sized (a URL or an unknown format) "
                         f"at {unknown_image_tokens(images)} tokens each")
        if self.clips:
            parts.append(f"{_n(self.clips, 'audio clip')} of {self.timed:.1f} s at "
                         f"{audio.tokens_per_second:g} tokens/s")
        if self.untimed:
            parts.append(f"{_n(self.untimed, 'audio clip')} of unknown length at "
                         f"{unknown_audio_tokens(audio)} tokens each")
        return "; ".join(parts) + f"; {self.tokens} tokens of media"


def _n(k: int, what: str) -> str:
    return f"{k} {what}" + ("s" if k != 1 else "")


def _its(k: int) -> str:
    return "its" if k == 1 else "their"


def media_cost(
    parts: Sequence[MediaPart], images: ImageTokens, audio: AudioTokens
) -> MediaCost:
    """The tokens of ``parts`` by the configured rules."""
    cost = MediaCost(images, audio)
    for p in parts:
        text = _payload_text(p)
        if p.kind == "input_audio":
            payload = B64(text) if text else None
        else:
            payload = _base64_payload(text) if text else None
        if p.kind == "image_url":
            detail = p.value.get("detail") if isinstance(p.value, dict) else None
            size = image_size(payload.read) if payload is not None else None
            if size is not None:
                cost.sized += 1
                cost.tokens += image_tokens(size[0], size[1], images, detail)
            else:
                cost.unsized += 1
                cost.tokens += unknown_image_tokens(images)
            continue
        seconds = audio_seconds(payload.read, payload.size) if payload is not None else None
        if seconds is not None:
            cost.clips += 1
            cost.timed += seconds
            cost.tokens += audio_tokens(seconds, audio)
        else:
            cost.untimed += 1
            cost.tokens += unknown_audio_tokens(audio)
    return cost
