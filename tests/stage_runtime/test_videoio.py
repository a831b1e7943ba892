"""Video output: MP4 (H.264 yuv420p, BT.709, faststart) through PyAV's libx264 and back, lossless PNG frames,
PSNR, the thumbnail, and the errors that name the bad argument.

The clips are random but smooth (per channel a random gradient in x, y and time plus a long ripple that drifts
over the frames), as generated video is; pure noise is not what a codec is for. The PSNR bounds below keep
≥ 2.5 dB of margin under the lowest of 20 seeds here at crf 18 (whole clip; a frame may be 2 dB under):
16×16×9 at 8 fps min 31.4 dB (median 32.7), 16×16×1 30.2 (31.2), 32×32×17 at 24 fps 35.7 (37.0),
128×192×33 at 16 fps 45.7 (46.0).
"""

from __future__ import annotations

import io
import re

import av
import numpy as np
import pytest
from PIL import Image

from stage_runtime.videoio import (
    decode_mp4, encode_mp4, psnr, read_frames_png, thumbnail_png, write_frames_png,
)


def smooth_clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(frames)[:, None, None] / max(frames - 1, 1)
    y = np.linspace(0, 1, height)[None, :, None]
    x = np.linspace(0, 1, width)[None, None, :]
    channels = []
    for _ in range(3):
        gx, gy, gt = rng.uniform(-60, 60, 3)
        ripple = 30 * np.sin(2 * np.pi * (x + 0.5 * y - t) + rng.uniform(0, 2 * np.pi))
        channels.append(128 + gx * (x - 0.5) + gy * (y - 0.5) + gt * (t - 0.5) + ripple)
    return np.clip(np.stack(np.broadcast_arrays(*channels), -1), 0, 255).round().astype(np.uint8)


@pytest.mark.parametrize(("shape", "fps", "bound"), [
    ((9, 16, 16), 8, 28.0),
    ((17, 32, 32), 24, 33.0),
    ((33, 128, 192), 16, 43.0),       # mdat many times the index: faststart's shift copies in several pieces
    ((1, 16, 16), 30, 27.5),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_mp4_round_trip_keeps_count_size_fps_and_quality(shape, fps, bound, seed):
    clip = smooth_clip(*shape, seed=seed)
    decoded, got_fps = decode_mp4(encode_mp4(clip, fps))
    assert decoded.shape == clip.shape and decoded.dtype == np.uint8
    assert got_fps == fps
    assert psnr(clip, decoded) >= bound
    assert min(psnr(a, b) for a, b in zip(clip, decoded)) >= bound - 2     # no frame dropped or shifted


def test_mp4_is_h264_yuv420p_bt709_with_the_index_first():
    data = encode_mp4(smooth_clip(9, 16, 16, seed=3), 8)
    assert data[4:8] == b"ftyp"
    assert b"avc1" in data
    assert data.index(b"moov") < data.index(b"mdat")       # +faststart: a player starts before the download ends
    with av.open(io.BytesIO(data)) as container:
        (stream,) = container.streams.video
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        frame = next(container.decode(stream))
    assert (frame.colorspace, frame.color_range) == (av.video.reformatter.Colorspace.ITU709,
                                                     av.video.reformatter.ColorRange.MPEG)


def test_saturated_colours_survive_the_bt709_round_trip():
    clip = np.zeros((3, 16, 16, 3), np.uint8)
    for index in range(3):
        clip[index, ..., index] = 255
    decoded, _ = decode_mp4(encode_mp4(clip, 8))
    assert np.abs(decoded.astype(int) - clip).max() <= 3


def test_colour_detail_keeps_its_chroma():
    """Random colours bicubic-upscaled ×8 (features of ~8 px) panning 1 px a frame: the accurate swscale path
    (ACCURATE_RND, bicubic full-chroma) measured 31.3–31.9 dB over 6 seeds here, the library's default flags
    28.6–29.2 dB; the bound sits between them."""
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (17, 26, 3), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(small).resize((26 * 8, 17 * 8), Image.BICUBIC))
    clip = np.stack([texture[:128, i:i + 192] for i in range(5)])
    assert psnr(clip, decode_mp4(encode_mp4(clip, 8))[0]) >= 30.5


def test_crf_and_preset_reach_x264():
    clip = smooth_clip(17, 32, 32, seed=4)
    fine, coarse = encode_mp4(clip, 8, crf=18), encode_mp4(clip, 8, crf=40, preset="ultrafast")
    assert b"crf=18.0" in fine and b"cabac=1" in fine        # x264 writes its options into the stream (an SEI)
    assert b"crf=40.0" in coarse and b"cabac=0" in coarse    # ultrafast turns CABAC off
    assert len(coarse) < len(fine)
    assert psnr(clip, decode_mp4(coarse)[0]) < psnr(clip, decode_mp4(fine)[0])


def test_odd_size_is_refused_for_mp4_and_kept_exactly_as_png(tmp_path):
    clip = smooth_clip(5, 17, 33, seed=6)
    with pytest.raises(ValueError, match=r"frames: 33x17 .*odd side.*even width and height"):
        encode_mp4(clip, 8)
    paths = write_frames_png(clip, tmp_path / "odd")
    assert np.array_equal(read_frames_png(tmp_path / "odd"), clip)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail_png(clip)))), clip[0])
    assert [p.name for p in paths] == [f"frame_{i:04d}.png" for i in range(5)]


def test_png_frames_round_trip_bitwise(tmp_path):
    clip = np.random.default_rng(7).integers(0, 256, (17, 32, 32, 3), dtype=np.uint8)   # noise: every bit counts
    paths = write_frames_png(clip, tmp_path / "new" / "frames")                           # made with its parents
    assert [p.name for p in paths] == [f"frame_{i:04d}.png" for i in range(17)]
    (tmp_path / "new" / "frames" / "notes.txt").write_text("other files are ignored")
    assert np.array_equal(read_frames_png(str(tmp_path / "new" / "frames")), clip)
    with Image.open(paths[0]) as first:
        assert first.format == "PNG" and first.mode == "RGB"


def test_thumbnail_is_the_first_frame_as_png():
    clip = smooth_clip(3, 16, 32, seed=8)
    data = thumbnail_png(clip)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), clip[0])


def test_psnr_values():
    zeros = np.zeros((2, 4, 4, 3), np.uint8)
    assert psnr(zeros, zeros.copy()) == float("inf")
    assert psnr(zeros, zeros + 1) == pytest.approx(20 * np.log10(255), abs=1e-9)    # MSE 1: 48.13 dB
    assert psnr(zeros, zeros + 255) == pytest.approx(0.0, abs=1e-9)


def test_writing_into_a_folder_with_frames_is_refused(tmp_path):
    write_frames_png(smooth_clip(3, 8, 8, seed=9), tmp_path)
    with pytest.raises(ValueError, match=r"directory=.*already holds 3 frame file\(s\) \(frame_0000.png"):
        write_frames_png(smooth_clip(2, 8, 8, seed=9), tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"directory=.*file.*is not a directory"):
        write_frames_png(smooth_clip(2, 8, 8, seed=9), tmp_path / "file")


def test_reading_frames_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"directory=.*missing.*not a directory"):
        read_frames_png(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"holds no frame_NNNN.png files"):
        read_frames_png(tmp_path)
    write_frames_png(smooth_clip(3, 8, 8, seed=10), tmp_path / "gap")
    (tmp_path / "gap" / "frame_0001.png").unlink()
    with pytest.raises(ValueError, match=r"frame 1 is missing \(the next file is frame_0002.png\)"):
        read_frames_png(tmp_path / "gap")
    write_frames_png(smooth_clip(2, 8, 8, seed=10), tmp_path / "sizes")
    Image.new("RGB", (6, 8)).save(tmp_path / "sizes" / "frame_0002.png")
    with pytest.raises(ValueError, match=r"frame_0002.png is 6x8, the first frame 8x8"):
        read_frames_png(tmp_path / "sizes")


GOOD = smooth_clip(2, 8, 8, seed=11)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: encode_mp4(GOOD.astype(np.float32), 8), r"frames: dtype=float32 shape=\(2, 8, 8, 3\)"),
    (lambda: encode_mp4(GOOD[0], 8), r"frames: shape=\(8, 8, 3\) \(ndim=3\)"),
    (lambda: encode_mp4(np.zeros((2, 8, 8, 4), np.uint8), 8), r"frames: shape=\(2, 8, 8, 4\)"),
    (lambda: encode_mp4(GOOD[:0], 8), r"frames: shape=\(0, 8, 8, 3\): expected at least one frame"),
    (lambda: encode_mp4(GOOD.tolist(), 8), r"frames: expected a numpy uint8 array .* got list"),
    (lambda: encode_mp4(GOOD, 0), r"fps=0: must be ≥ 1"),
    (lambda: encode_mp4(GOOD, -24), r"fps=-24: must be ≥ 1"),
    (lambda: encode_mp4(GOOD, 23.976), r"fps=23.976: expected an integer, got float"),
    (lambda: encode_mp4(GOOD, True), r"fps=True: expected an integer, got bool"),
    (lambda: encode_mp4(GOOD, 8, crf=52), r"crf=52: must be in 0..51"),
    (lambda: encode_mp4(GOOD, 8, crf=-1), r"crf=-1: must be in 0..51"),
    (lambda: encode_mp4(GOOD, 8, preset="fastest"), r"preset='fastest': expected one of ultrafast, .*placebo"),
    (lambda: decode_mp4(b""), r"data: 0 bytes"),
    (lambda: decode_mp4(b"\x00\x00\x00\x18ftypisom" + bytes(64)), r"data: <76 bytes> is not a decodable video"),
    (lambda: decode_mp4("clip.mp4"), r"data: expected bytes, got str"),
    (lambda: psnr(GOOD, GOOD[:1]), r"a: shape=\(2, 8, 8, 3\), b: shape=\(1, 8, 8, 3\)"),
    (lambda: psnr(GOOD, GOOD.astype(np.int16)), r"b: int16: expected a numpy uint8 array"),
    (lambda: thumbnail_png(GOOD[0]), r"frames: shape=\(8, 8, 3\)"),
    (lambda: write_frames_png(GOOD.astype(np.uint16), "unused"), r"frames: dtype=uint16"),
])
def test_bad_input_names_the_argument_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_an_upload_is_decoded_within_its_bounds_each_refusal_naming_the_field_and_value():
    """decode_upload (the edge's video decode): the frames as decode_mp4 gives them; over the bytes, the declared
    duration, the frame count or the pixels of a frame → a 400 naming the part and the value, without decoding on."""
    from stage_runtime.errors import InvalidRequestError
    from stage_runtime.videoio import decode_upload

    clip = np.random.default_rng(0).integers(0, 256, (9, 16, 16, 3), dtype=np.uint8)
    data = encode_mp4(clip, 8)
    assert np.array_equal(decode_upload(data, "input_video", 10_000), decode_mp4(data)[0])
    for bounds, message in (({"max_bytes": 100}, f"input_video='<{len(data)} bytes>': an uploaded video is at most "
                                                 "100 bytes"),
                            ({"max_seconds": 0.5}, "input_video='1.1 s': an uploaded video is at most 0.5 s"),
                            ({"max_frames": 4}, "input_video='more than 4 frames': an uploaded video has at most 4"),
                            ({}, "input_video='16x16': a frame is at most 100 pixels")):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            decode_upload(data, "input_video", 100 if not bounds else 10_000, **bounds)
    with pytest.raises(InvalidRequestError, match=r"^mask_video='<5 bytes>': not a decodable video"):
        decode_upload(b"hello", "mask_video", 10_000)
