// A card per request in flight: its prompt (as text), a progress bar from the stage's events, the outputs as
// they arrive, an abort button, and its end (data-state: running, completed, failed, aborted).

import { el } from "./dom.js";

const PHASES = { encode: "encoding the prompt", denoise: "denoising", decode: "decoding", mux: "writing the video" };

export class Card {
  constructor(container, kind, prompt) {
    this.status = el("span", { class: "status" }, "queued");
    this.bar = el("progress", { max: 1, value: 0 });
    this.outputs = el("div", { class: "outputs" });
    this.error = el("p", { class: "error", role: "alert", hidden: true });
    this.abortButton = el("button", { type: "button", class: "abort" }, "Abort");
    this.node = el("article", { class: "card", dataset: { kind, state: "running", partials: "0" } },
      el("header", {}, el("span", { class: "kind" }, kind), this.status),
      el("p", { class: "prompt" }, prompt),
      this.bar, this.outputs, this.error,
      el("footer", {}, this.abortButton));
    container.prepend(this.node);
  }

  get state() { return this.node.dataset.state; }

  onAbort(handler) {
    this.abortButton.addEventListener("click", () => {
      this.abortButton.disabled = true;
      this.status.textContent = "aborting…";
      handler();
    });
  }

  // phase encode | denoise | decode | mux; step: the denoising steps done, of total.
  progress(phase, step, total) {
    const done = phase === "denoise" ? Math.min(step, total) : phase === "encode" ? 0 : total;
    this.bar.max = Math.max(total, 1);
    this.bar.value = done;
    this.node.dataset.step = String(done);
    this.status.textContent = `${PHASES[phase] || phase} ${phase === "denoise" ? `${done}/${total}` : ""}`.trim();
  }

  percent(value, phase) {
    this.bar.max = 100;
    this.bar.value = value;
    this.status.textContent = `${PHASES[phase] || phase || "queued"} ${value}%`;
  }

  addImage(index, size) {
    const image = el("img", { alt: `output ${index + 1}`, class: "output", dataset: { index: String(index) } });
    const [width, height] = (size || "").split("x").map(Number);
    if (width && height) image.style.aspectRatio = `${width} / ${height}`;
    this.outputs.append(image);
    return image;
  }

  partial(image, src, partialIndex) {
    image.src = src;
    image.dataset.partial = String(partialIndex);
    this.node.dataset.partials = String(Number(this.node.dataset.partials) + 1);
  }

  final(image, src) {
    image.src = src;
    image.dataset.final = "1";
    delete image.dataset.partial;
  }

  finish(state, message) {
    this.node.dataset.state = state;
    this.abortButton.hidden = true;
    if (state === "completed") {
      this.bar.value = this.bar.max;
      this.status.textContent = message || "done";
    } else {
      this.status.textContent = state;
      this.error.hidden = false;
      this.error.textContent = message || state;
    }
  }

  fail(error) {
    const aborted = error.type === "request_aborted" || error.type === "aborted" || error.name === "AbortError";
    this.finish(aborted ? "aborted" : "failed", error.describe ? error.describe() : String(error.message || error));
  }
}
