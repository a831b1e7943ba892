"""``generate``'s file: what the CLI writes for one result (a PNG, an MP4 with its sound, or exact frames)."""

from __future__ import annotations

from pathlib import Path


def write_output(result, out: Path, asked: str | None, fps: int | None, audio=None) -> str:
    """An image as PNG; a video (F, H, W, 3) as an MP4 (with its sound as AAC, for a model that makes it), or,
    when ``--out`` ends in ``/``, as its exact frames ``frame_0000.png …`` (lossless) and its sound as
    ``audio.wav``. Returns what was written, for the summary line."""
    from stage_runtime.imageio import encode_png

    if result.ndim == 3:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(encode_png(result))
        return f"{result.shape[1]}x{result.shape[0]} PNG, {out.stat().st_size} bytes"
    from stage_runtime.videoio import encode_mp4, write_frames_png

    frames, height, width = result.shape[:3]
    sound = "" if audio is None else f" and {audio.seconds:.2f} s of {audio.sample_rate} Hz sound"
    if (asked or "").endswith("/"):
        write_frames_png(result, out)
        if audio is not None:
            from stage_runtime.audioio import encode_wav

            (out / "audio.wav").write_bytes(encode_wav(audio))
        return f"{frames} PNG frames of {width}x{height}" + ("" if audio is None else f"{sound} (audio.wav)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_mp4(result, fps, audio=audio))
    codecs = "H.264" if audio is None else "H.264 + AAC"
    return f"{frames} frames of {width}x{height} at {fps} fps{sound}, {codecs} MP4, {out.stat().st_size} bytes"
