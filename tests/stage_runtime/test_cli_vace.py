"""``stage-runtime generate`` video-to-video (Wan VACE): ``--video``, ``--mask-video`` and ``--reference-image`` files,
decoded with the HTTP edge's bounds, make WanVACEPipeline's own video."""

from __future__ import annotations

import numpy as np

from stage_runtime.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_generate_video_to_video_from_a_video_file_mask_and_reference(tiny_wan_vace_path, tmp_path, capsys):
    """``--video``, ``--mask-video``, ``--reference-image`` on Wan VACE: the frames equal WanVACEPipeline's on the decoded
    files."""
    from family_checks import Family, bare_call, source_video, video_keywords

    from stage_runtime.imageio import encode_png
    from stage_runtime.videoio import decode_mp4, encode_mp4, read_frames_png

    clip = source_video(16, 9)
    (tmp_path / "v.mp4").write_bytes(encode_mp4(clip.frames, 8))
    (tmp_path / "m.mp4").write_bytes(encode_mp4(clip.mask, 8))
    (tmp_path / "r.png").write_bytes(encode_png(clip.references[0]))
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_wan_vace_path, "--prompt", "a fox", "--steps", "2",
                         "--seed", "3", "--guidance", "5", "--video", str(tmp_path / "v.mp4"), "--mask-video",
                         str(tmp_path / "m.mp4"), "--reference-image", str(tmp_path / "r.png"),
                         "--out", f"{tmp_path / 'frames'}/", "--device", "cpu")
    assert rc == 0, err
    decoded = type(clip)(decode_mp4((tmp_path / "v.mp4").read_bytes())[0],
                         decode_mp4((tmp_path / "m.mp4").read_bytes())[0], clip.references)
    row = Family("wan-vace", size=16, frames=9, one_generator=True,
                 call=lambda pipe, prompt, n, g: {"prompt": prompt, "guidance_scale": g})
    expected = bare_call(row, tiny_wan_vace_path, "a fox", 2, 3, 5.0, **video_keywords(decoded))[0]
    assert int(np.abs(read_frames_png(tmp_path / "frames").astype(int) - expected).max()) <= 1
