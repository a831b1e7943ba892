// An image request: POST /v1/images/generations (or /v1/images/edits with the uploads) with stream: true, each
// event drawn on its card as it arrives — progress, the partial image of each output as it sharpens, the final
// images. Abort: POST /v1/abort with the request id the page chose.

import { newRequestId, postEvents, postJson, streamError } from "./api.js";
import { Card } from "./cards.js";

function imageSrc(data) {
  return `data:image/${data.output_format || "png"};base64,${data.b64_json}`;
}

// params: the JSON fields of the request; uploads: {images: [File], mask: File|null} for an edit, else null.
export async function runImages(container, params, uploads) {
  const requestId = newRequestId();
  const body = { ...params, stream: true, request_id: requestId };
  const edit = uploads !== null;
  const card = new Card(container, edit ? "edit" : "image", params.prompt);
  card.node.dataset.requestId = requestId;
  const slots = Array.from({ length: params.n || 1 }, (_, i) => card.addImage(i, params.size));
  card.onAbort(() => postJson("/v1/abort", { request_ids: [requestId] }).catch((error) => card.fail(error)));
  let partials = 0;
  let finals = 0;
  try {
    const events = postEvents(edit ? "/v1/images/edits" : "/v1/images/generations", edit ? form(body, uploads) : body);
    for await (const { event, data } of events) {
      if (event.endsWith(".progress")) {
        card.progress(data.phase, data.step, data.num_steps);
      } else if (event.endsWith(".partial_image")) {
        card.partial(slots[partials % slots.length], imageSrc(data), data.partial_image_index);
        partials += 1;
      } else if (event.endsWith(".completed")) {
        card.final(slots[finals % slots.length], imageSrc(data));
        finals += 1;
      } else if (event === "error") {
        throw streamError(data);
      }
    }
    if (finals === slots.length) card.finish("completed", `${finals} image${finals > 1 ? "s" : ""}`);
    else card.finish("failed", `the stream ended after ${finals} of ${slots.length} images`);
  } catch (error) {
    card.fail(error);
    if (error.needsKey) throw error;
  }
}

function form(body, uploads) {
  const data = new FormData();
  for (const [name, value] of Object.entries(body)) {
    if (value === undefined || value === null || name === "loras") continue;
    data.append(name, String(value));
  }
  const field = uploads.images.length > 1 ? "image[]" : "image";
  for (const file of uploads.images) data.append(field, file, file.name);
  if (uploads.mask) data.append("mask", uploads.mask, uploads.mask.name);
  return data;
}
