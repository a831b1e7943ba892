"""A clip's sound at the edges: muxed as AAC beside the H.264 frames (the MP4 plays both: the audio stream decodes to
the waveform's own length (to the millisecond the container counts in), rate and channels, sample-aligned and close to it), or alone as a 16-bit WAV (within one
PCM step); a waveform AAC or WAV cannot carry is refused before anything is encoded, naming what is wrong."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from stage_runtime.audioio import decode_audio, encode_wav
from stage_runtime.outputs import Audio
from stage_runtime.videoio import decode_mp4, encode_mp4

RATE = 16000


def chirp(channels: int, samples: int, rate: int = RATE) -> np.ndarray:
    """A rising tone per channel (not periodic: a misaligned decode cannot match it by a whole number of periods)."""
    t = np.arange(samples) / rate
    return np.stack([(0.5 - 0.1 * c) * np.sin(2 * np.pi * (200 + 150 * c + 3000 * t) * t)
                     for c in range(channels)]).astype(np.float32)


def frames(count: int = 9, side: int = 32) -> np.ndarray:
    return (np.random.default_rng(0).random((count, side, side, 3)) * 255).astype(np.uint8)


@pytest.mark.parametrize("channels, samples, rate", [(2, 5312, 16000), (1, 4000, 24000), (2, 48000, 48000)])
def test_the_mp4_holds_h264_and_aac_and_the_track_decodes_to_the_waveform(channels, samples, rate):
    wave = chirp(channels, samples, rate)
    data = encode_mp4(frames(), 24, audio=Audio(wave[None], rate))
    with av.open(io.BytesIO(data)) as container:
        kinds = {s.type: s.codec_context.name for s in container.streams}
        audio = container.streams.audio[0]
        assert (audio.rate, audio.channels) == (rate, channels)
        assert float(audio.duration * audio.time_base) == pytest.approx(samples / rate, abs=1e-3)
    assert kinds == {"video": "h264", "audio": "aac"}
    video, fps = decode_mp4(data)
    assert video.shape == (9, 32, 32, 3) and fps == 24.0        # the frames are untouched by the second stream
    track = decode_audio(data)
    extra = track.samples.shape[-1] - samples       # the MP4's edit list counts in its movie timescale: 1 ms
    assert track.sample_rate == rate and track.samples.shape[:2] == (1, channels) and 0 <= extra <= rate // 1000
    err = np.abs(track.samples[0, :, :samples] - wave)
    assert err.mean() < 0.01, err.mean()                      # AAC at 128 kb/s: lossy, close, aligned
    shifted = np.abs(track.samples[0, :, 1:samples] - wave[:, :-1]).mean()
    assert shifted > 5 * err.mean()                          # one sample off is far worse: the track is aligned


def test_a_video_without_sound_has_one_stream():
    with av.open(io.BytesIO(encode_mp4(frames(), 8))) as container:
        assert [s.type for s in container.streams] == ["video"]


def test_the_wav_is_16_bit_pcm_within_one_step_and_clips_out_of_range_samples():
    wave = chirp(2, 3000)
    wave[0, :10] = 1.7                                        # a vocoder may overshoot: clipped, not wrapped
    data = encode_wav(Audio(wave[None], RATE))
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    back = decode_audio(data)
    assert back.sample_rate == RATE and back.samples.shape == (1, 2, 3000)
    assert np.abs(back.samples[0] - np.clip(wave, -1, 1)).max() <= 1 / 32767 + 1e-6


def test_samples_that_are_not_numbers_are_written_as_silence():
    """LTX-2 at one step makes NaN sound (diffusers too): the clip is still served, its sound silent there."""
    wave = chirp(2, 2048)
    wave[:, 1000:1100], wave[0, 5] = np.nan, np.inf
    track = decode_audio(encode_mp4(frames(), 24, audio=Audio(wave[None], RATE)))
    assert np.isfinite(track.samples).all() and np.abs(track.samples[0, :, 1040:1060]).max() < 0.05
    back = decode_audio(encode_wav(Audio(wave[None], RATE))).samples[0]
    assert (back[:, 1000:1100] == 0).all() and back[0, 5] == 32767 / 32768       # full scale


def test_one_track_of_a_two_video_output_is_taken_by_index():
    both = Audio(np.stack([chirp(2, 800), -chirp(2, 800)]), RATE)
    assert np.array_equal(both.track(1).samples[0], -chirp(2, 800)) and both.track(0).seconds == 800 / RATE


@pytest.mark.parametrize("audio, message", [
    (np.zeros((2, 100), np.float32), r"^audio: expected an outputs.Audio, got ndarray"),
    (Audio(np.zeros((2, 2, 100), np.float32), RATE), r"^audio: shape=\(2, 2, 100\): expected one track of 1 or 2"),
    (Audio(np.zeros((1, 3, 100), np.float32), RATE), r"^audio: shape=\(1, 3, 100\): expected one track of 1 or 2"),
    (Audio(np.zeros((1, 2, 0), np.float32), RATE), r"^audio: shape=\(1, 2, 0\)"),
    (Audio(np.zeros((1, 2, 100), np.float32), 12345), r"^audio: sample_rate=12345: AAC takes one of 96000"),
])
def test_a_waveform_aac_cannot_carry_is_refused_naming_what_is_wrong(audio, message):
    with pytest.raises(ValueError, match=message):
        encode_mp4(frames(), 8, audio=audio)


def test_bytes_without_sound_are_refused_by_the_reader():
    with pytest.raises(ValueError, match=r"^data: <\d+ bytes> holds no audio stream"):
        decode_audio(encode_mp4(frames(), 8))
    with pytest.raises(ValueError, match=r"^data: expected a media file's bytes"):
        decode_audio(b"")
