// The stage's public API as the page calls it: JSON calls, server-sent events over a POST, binary content.
// Every call sends the API key when the person gave one (kept in sessionStorage, this tab only).

const KEY_ITEM = "diffstage.apiKey";

export class ApiError extends Error {
  constructor(status, type, message, param) {
    super(message);
    this.status = status;
    this.type = type;
    this.param = param;
  }

  get needsKey() { return this.status === 401; }

  describe() {
    return `${this.type}${this.param ? ` (${this.param})` : ""}: ${this.message}`;
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY_ITEM),
  set: (key) => sessionStorage.setItem(KEY_ITEM, key),
  clear: () => sessionStorage.removeItem(KEY_ITEM),
};

function headers(extra = {}) {
  const key = apiKey.get();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  const error = body && body.error ? body.error : {};
  return new ApiError(response.status, error.type || `http_${response.status}`,
    error.message || response.statusText || "request failed", error.param);
}

async function send(method, path, body, signal) {
  const init = { method, headers: headers(), signal };
  if (body instanceof FormData) {
    init.body = body;
  } else if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJson(path) {
  return (await send("GET", path)).json();
}

export async function postJson(path, body) {
  return (await send("POST", path, body)).json();
}

export async function deleteJson(path) {
  return (await send("DELETE", path)).json();
}

// A response with its headers (the job API's openai-poll-after-ms).
export async function getWithHeaders(path) {
  const response = await send("GET", path);
  return { body: await response.json(), headers: response.headers };
}

export async function getBlob(path) {
  return (await send("GET", path)).blob();
}

// POST a body (JSON or FormData) answered with server-sent events; yields {event, data} as each arrives.
export async function* postEvents(path, body, signal) {
  const response = await send("POST", path, body, signal);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

// An SSE ``error`` event as the error a failed call throws.
export function streamError(data) {
  return new ApiError(0, data.error.type, data.error.message, data.error.param);
}

export function wait(ms) {
  return new Promise((resolve) => { setTimeout(resolve, ms); });
}

export function base64Blob(b64, type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Blob([bytes], { type });
}

export function newRequestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return `pg-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}
