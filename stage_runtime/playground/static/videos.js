// A video: a job through /v1/videos (create, poll its progress, then play its MP4 inline with its thumbnail and
// a download link; abort: DELETE the job). A stage without a job store answers 404 jobs_not_configured: the
// video is then made by POST /v1/videos/sync with stream: true (progress events, then the MP4; abort:
// POST /v1/abort).

import { ApiError, base64Blob, deleteJson, getBlob, getWithHeaders, newRequestId, postEvents, postJson, streamError,
  wait } from "./api.js";
import { Card } from "./cards.js";
import { el } from "./dom.js";

const DEFAULT_POLL_MS = 500;

function play(card, blob, name, thumbnail) {
  const url = URL.createObjectURL(blob);
  const video = el("video", { src: url, controls: true, loop: true, muted: true, playsinline: true,
    class: "output", dataset: { final: "1" } });
  const poster = thumbnail ? URL.createObjectURL(thumbnail) : null;
  if (poster) video.poster = poster;
  const link = el("a", { href: url, download: name, class: "download", title: name }, "Download MP4");
  card.outputs.append(video, el("div", { class: "video-meta" },
    poster ? el("img", { src: poster, alt: "thumbnail", class: "thumbnail" }) : null, link));
  return video;
}

async function runJob(card, params) {
  let job;
  try {
    job = await postJson("/v1/videos", params);
  } catch (error) {
    if (error.type === "jobs_not_configured") return false;
    throw error;
  }
  card.node.dataset.videoId = job.id;
  let deleted = false;
  card.onAbort(() => {
    deleted = true;
    deleteJson(`/v1/videos/${job.id}`).catch((error) => card.fail(error));
  });
  while (job.status === "queued" || job.status === "in_progress") {
    card.percent(job.progress, job.status === "queued" ? "queued" : job.diffstage.phase);
    const { body, headers } = await getWithHeaders(`/v1/videos/${job.id}`).catch((error) => {
      if (deleted && error.status === 404) throw new ApiError(404, "aborted", "the job was deleted");
      throw error;
    });
    job = body;
    if (job.status === "queued" || job.status === "in_progress") {
      await wait(Number(headers.get("openai-poll-after-ms")) || DEFAULT_POLL_MS);
    }
  }
  if (job.status !== "completed") {
    const error = job.error || {};
    throw new ApiError(0, error.code || "failed", error.message || `the job ended ${job.status}`);
  }
  const [video, thumbnail] = await Promise.all([getBlob(`/v1/videos/${job.id}/content`),
    getBlob(`/v1/videos/${job.id}/content?variant=thumbnail`)]);
  play(card, video, `${job.id}.mp4`, thumbnail);
  card.finish("completed", `${job.diffstage.num_frames} frames at ${job.diffstage.fps} fps · ${job.size}`);
  return true;
}

async function runSync(card, params) {
  const requestId = newRequestId();
  card.onAbort(() => postJson("/v1/abort", { request_ids: [requestId] }).catch((error) => card.fail(error)));
  for await (const { event, data } of postEvents("/v1/videos/sync", { ...params, stream: true, request_id: requestId })) {
    if (event === "video.progress") {
      card.progress(data.phase, data.step ?? 0, data.num_steps ?? 1);
    } else if (event === "video.completed") {
      play(card, base64Blob(data.b64_json, data.content_type), `${requestId}.mp4`, null);
      card.finish("completed", `${data.frames} frames at ${data.fps} fps · ${data.size}`);
    } else if (event === "error") {
      throw streamError(data);
    }
  }
}

export async function runVideo(container, params) {
  const card = new Card(container, "video", params.prompt);
  try {
    if (!(await runJob(card, params))) {
      card.node.dataset.kind = "video-sync";
      await runSync(card, params);
    }
    if (card.state === "running") card.finish("failed", "the stream ended without the video");
  } catch (error) {
    card.fail(error);
    if (error.needsKey) throw error;
  }
}
