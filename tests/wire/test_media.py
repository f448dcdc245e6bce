"""Image sizes and audio lengths from headers (``wire/media.py``), the token rules
(``wire/media_cost.py``) and the prompt estimate of bodies with images (``wire/parse.py``).

The files are made by hand (``tests/support/media_files.py``); where Pillow is installed, the
readers are checked on its encoders' output too.
"""

from __future__ import annotations

import base64
import json
import random
import zlib
from typing import Any

import pytest

from qosgate.config import Admission, AudioTokens, ImageTokens
from qosgate.wire.media import B64, audio_seconds, bytes_reader, image_size
from qosgate.wire.media_cost import image_tokens, unknown_image_tokens
from qosgate.wire.parse import BadBody, Body, estimate_how, estimate_prompt_tokens, parse_body
from tests.support.media_files import bmp, gif, jpeg, mp3, pillow, png, wav, webp


def test_png_written_by_hand_is_a_complete_png() -> None:
    data = png(37, 21)
    idat = data[33 + 8 : -12 - 4]  # after the signature and IHDR, before the CRC and IEND
    assert len(zlib.decompress(idat)) == 21 * (1 + 37 * 3)
    assert image_size(bytes_reader(data)) == (37, 21)


HAND_MADE = {
    "png": png,
    "jpeg": jpeg,
    "jpeg progressive": lambda w, h: jpeg(w, h, progressive=True),
    "jpeg with a 60 KB EXIF segment": lambda w, h: jpeg(w, h, exif=60_000),
    "gif": gif,
    "webp lossy": webp,
    "webp lossless": lambda w, h: webp(w, h, "VP8L"),
    "webp extended": lambda w, h: webp(w, h, "VP8X"),
}


@pytest.mark.parametrize("kind", sorted(HAND_MADE))
def test_image_size_from_the_header(kind: str) -> None:
    for w, h in ((1, 1), (640, 480), (333, 1001), (4000, 3000)):
        data = HAND_MADE[kind](w, h)
        assert image_size(bytes_reader(data)) == (w, h), kind
        # the same through base64, decoding only what is read
        assert image_size(B64(base64.b64encode(data).decode()).read) == (w, h)


@pytest.mark.parametrize(
    ("fmt", "mode", "kw"),
    [
        ("JPEG", "RGB", {}),
        ("JPEG", "RGB", {"progressive": True}),
        ("JPEG", "RGB", {"exif": b"Exif\x00\x00" + bytes(60_000)}),
        ("GIF", "RGB", {}),
        ("WEBP", "RGB", {"quality": 50}),
        ("WEBP", "RGB", {"lossless": True}),
        ("WEBP", "RGBA", {"exif": b"Exif\x00\x00xx"}),  # extended (VP8X)
        ("PNG", "RGB", {}),
    ],
)
def test_image_size_from_pillow_s_encoders(fmt: str, mode: str, kw: dict[str, object]) -> None:
    pytest.importorskip("PIL")
    for w, h in ((1, 1), (640, 480), (333, 1001)):
        data = pillow(fmt, w, h, mode, **kw)
        assert image_size(bytes_reader(data)) == (w, h), (fmt, kw)


def test_unknown_or_broken_images_have_no_size() -> None:
    for data in (b"", b"hello world, not an image", b"\x89PNG\r\n\x1a\n",
                 b"\xff\xd8\xff\xe0\x00", bmp(10, 10), png(9, 9)[:20], jpeg(9, 9)[:95],
                 webp(5, 5)[:22]):
        assert image_size(bytes_reader(data)) is None
    assert image_size(B64("!!!! not base64 ####").read) is None


def test_b64_reads_any_range_like_the_decoded_bytes() -> None:
    rng = random.Random(7)
    for n in (0, 1, 2, 3, 4, 5, 100, 1001):
        data = rng.randbytes(n)
        b = B64(base64.b64encode(data).decode())
        assert b.size == n
        for _ in range(50):
            off, k = rng.randrange(0, n + 3), rng.randrange(0, 40)
            assert b.read(off, k) == data[off : off + k], (n, off, k)


# ---------------------------------------------------------------------- audio
@pytest.mark.parametrize(
    ("data", "seconds"),
    [
        (wav(2.5), 2.5),
        (wav(1.0, 44_100, 2), 1.0),
        (wav(3.0, extra=b"INFOISFT" + bytes(1000)), 3.0),
        (mp3(100), 100 * 417 * 8 / 128_000),  # constant bit rate: the size says it
        (mp3(100, id3=True), 100 * 417 * 8 / 128_000),
        (mp3(100, xing=True), 100 * 1152 / 44_100),  # the Info tag's frame count
    ],
)
def test_audio_seconds(data: bytes, seconds: float) -> None:
    assert audio_seconds(bytes_reader(data), len(data)) == pytest.approx(seconds, rel=1e-3)
    b = B64(base64.b64encode(data).decode())
    assert audio_seconds(b.read, b.size) == pytest.approx(seconds, rel=1e-3)


def test_unknown_audio_has_no_length() -> None:
    for data in (b"", b"OggS" + bytes(100), b"fLaC" + bytes(100), bytes(5000)):
        assert audio_seconds(bytes_reader(data), len(data)) is None


# ---------------------------------------------------------------------- rules
def test_patches_rule_is_qwen2_vl_resize() -> None:
    rule = ImageTokens()
    assert image_tokens(512, 400, rule) == 18 * 14  # 504 x 392 after rounding to 28 px
    assert image_tokens(1920, 1080, rule) == 69 * 39
    assert image_tokens(10, 10, rule) == 4  # up to min_tokens
    assert image_tokens(20_000, 20_000, rule) <= rule.max_tokens  # down to max_tokens
    assert image_tokens(1000, 1000, ImageTokens(max_tokens=256)) == 256  # 448 x 448 px


def test_tiles_and_fixed_rules() -> None:
    tiles = ImageTokens(rule="tiles")
    assert image_tokens(2048, 4096, tiles) == 85 + 170 * 6  # OpenAI's worked example
    assert image_tokens(512, 512, tiles) == 85 + 170
    assert image_tokens(4096, 4096, tiles, "low") == 85
    assert image_tokens(9999, 3, ImageTokens(rule="fixed")) == 576
    assert unknown_image_tokens(tiles) == 85 + 170 * 4
    assert unknown_image_tokens(ImageTokens(unknown_tokens=77)) == 77


# ---------------------------------------------------------------------- the estimate
def chat(*parts: object, text: str = "What is in this picture?") -> bytes:
    content = [{"type": "text", "text": text}, *parts]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def text_tokens(b: Body, payload: str) -> int:
    """The characters / 4 of the messages without the media payload (a URL or base64)."""
    return (len(b.messages) - len(payload)) // 4


def test_an_image_counts_by_its_size_not_its_base64() -> None:
    data = png(512, 400, noise=True)
    assert len(data) > 600_000
    part = image_part(data)
    b = parse_body(chat(part), "chat")
    assert estimate_prompt_tokens(b) == text_tokens(b, part["image_url"]["url"]) + 252
    how = estimate_how(b)
    assert "characters / 4" in how and "1 image" in how and "patches" in how


def test_url_unknown_and_broken_images_count_the_configured_cost() -> None:
    adm = Admission(images=ImageTokens(unknown_tokens=1000))
    url = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    bmp_part = image_part(bmp(64, 64), "image/bmp")
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 90_000}}
    odd = {"type": "image_url", "image_url": 42}  # the engine will refuse it; 1000 here
    for part in (url, bmp_part, broken, odd):
        b = parse_body(chat(part, text=""), "chat", adm)
        payload = part["image_url"]["url"] if isinstance(part["image_url"], dict) else ""
        assert estimate_prompt_tokens(b) == text_tokens(b, payload) + 1000, part


def test_audio_counts_its_duration() -> None:
    adm = Admission(audio=AudioTokens(tokens_per_second=10))
    clip = {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(wav(12.0)).decode(), "format": "wav"}}
    b = parse_body(chat(clip, text=""), "chat", adm)
    payload = clip["input_audio"]["data"]
    assert estimate_prompt_tokens(b) == text_tokens(b, payload) + 120
    assert "12.0 s at 10 tokens/s" in estimate_how(b)
    unknown = {"type": "input_audio", "input_audio": {"data": "T2dnUw==", "format": "ogg"}}
    b = parse_body(chat(unknown, text=""), "chat", adm)
    assert estimate_prompt_tokens(b) == text_tokens(b, "T2dnUw==") + 300  # 30 s


def test_text_only_bodies_are_estimated_as_before() -> None:
    for body in (
        b'{"messages":[{"role":"user","content":"' + b"x" * 400 + b'"}]}',
        b'{"messages":[{"role":"user","content":[{"type":"text","text":"' + b"y" * 400
        + b'"}]}], "tools": [{"type": "function"}]}',
        b'{"messages":[{"role":"user","content":"a [ {b} [[ ["}], "stop": ["x"]}',
    ):
        b = parse_body(body, "chat")
        assert b.media is None
        assert estimate_prompt_tokens(b) == len(b.messages) // 4
        assert estimate_how(b) == "estimated as characters / 4"


def test_parts_that_are_not_objects_are_left_to_the_engine() -> None:
    body = b'{"messages":[{"role":"user","content":["just a string", 3]}]}'
    b = parse_body(body, "chat")  # accepted as before; the engine will judge the parts
    assert b.media is None and estimate_prompt_tokens(b) == len(b.messages) // 4
    bad = b'{"messages":[{"role":5,"content":[{"type":"text","text":"x"}]}]}'
    with pytest.raises(BadBody) as exc:
        parse_body(bad, "chat")
    assert exc.value.param == "messages[0].role"
