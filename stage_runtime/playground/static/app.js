// The playground: reads the served model's facts, builds the form for its family, and runs each request on a
// card of its own (several at once). A stage with an API key makes the page ask for it first.

import { apiKey, getJson, wait } from "./api.js";
import { byId, el, readFile, showNeeds } from "./dom.js";
import { runImages } from "./images.js";
import { describe, framesOf, isVideo, needsOf, promptHint, sizeMultiple, sizeProblem, sizesOf } from "./model.js";
import { runVideo } from "./videos.js";

const AUTO_SIZE = "auto";
const CUSTOM_SIZE = "custom";
const page = { id: null, facts: null, needs: new Set() };

function banner(text) {
  const node = byId("banner");
  node.hidden = !text;
  node.textContent = text || "";
}

// Opens the key dialog and resolves once a key was given (kept in sessionStorage). Several callers at once (two
// cards refused together) share the one dialog.
let keyAsked = null;

function askKey(message) {
  byId("key-message").textContent = message;
  if (keyAsked) return keyAsked;
  const dialog = byId("key-dialog");
  byId("key-input").value = "";
  keyAsked = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = byId("key-input").value.trim();
      if (key) apiKey.set(key);
      byId("change-key").hidden = !apiKey.get();
      keyAsked = null;
      resolve();
    }, { once: true });
    dialog.showModal();
  });
  return keyAsked;
}

async function connect() {
  for (;;) {
    try {
      const models = await getJson("/v1/models");
      banner("");
      return models.data[0];
    } catch (error) {
      if (error.needsKey) {
        await askKey(apiKey.get() ? `The API key was refused (${error.message}). Enter another.`
          : "This stage needs an API key.");
      } else if (error.status === 503) {
        banner(`The stage is not ready yet (${error.message}); retrying…`);
        await wait(1000);
      } else {
        throw error;
      }
    }
  }
}

async function listLoras() {
  try {
    return (await getJson("/v1/loras")).data;
  } catch (error) {
    if (error.needsKey) throw error;
    return [];
  }
}

function fillSelect(select, values, selected, labels = {}) {
  select.replaceChildren(...values.map((value) => el("option", { value, selected: String(value) === String(selected) },
    labels[value] || String(value))));
}

function buildForm(card, loras) {
  const { facts } = page;
  page.needs = needsOf(facts, loras);
  showNeeds(byId("fields"), page.needs);
  byId("model-name").textContent = card.id;
  byId("model-facts").textContent = describe(facts);
  byId("prompt-hint").textContent = promptHint(facts);
  const sizes = sizesOf(facts);
  if (page.needs.has("image-input") && !isVideo(facts)) sizes.unshift(AUTO_SIZE);
  if (page.needs.has("free-size")) sizes.push(CUSTOM_SIZE);
  fillSelect(byId("size"), sizes, facts.edits_only ? AUTO_SIZE : `${facts.default_width}x${facts.default_height}`,
    { [AUTO_SIZE]: "auto (the uploaded image's)", [CUSTOM_SIZE]: "custom" });
  for (const id of ["width", "height"]) {
    byId(id).step = sizeMultiple(facts);
    byId(id).min = sizeMultiple(facts);
  }
  presetChosen();
  byId("steps").value = facts.default_steps;
  if (facts.max_steps) byId("steps").max = facts.max_steps;
  byId("guidance").value = facts.default_guidance;
  if (isVideo(facts)) {
    fillSelect(byId("frames"), framesOf(facts), facts.default_frames);
    byId("fps").value = facts.default_fps;
    byId("image-label").textContent = `First frame (${facts.reference})`;
    byId("image").multiple = false;
  } else {
    byId("image-label").textContent = facts.edits_only ? "Image to edit (required)" : "Image to edit (optional)";
    byId("image").multiple = (facts.max_edit_images || 1) > 1;
  }
  byId("lora-list").replaceChildren(...loras.map((lora) => el("li", {},
    el("label", {}, el("input", { type: "checkbox", dataset: { lora: lora.name } }), lora.name),
    el("input", { type: "number", step: "0.05", min: "-16", max: "16", value: "1", "aria-label": `${lora.name} scale`,
      dataset: { loraScale: lora.name } }))));
  byId("fields").disabled = false;
}

// A preset fills width and height; typing them selects the matching preset, or custom.
function presetChosen() {
  const [width, height] = byId("size").value.split("x").map(Number);
  if (width && height) {
    byId("width").value = width;
    byId("height").value = height;
  }
  byId("width").disabled = byId("height").disabled = byId("size").value === AUTO_SIZE;
}

function sideTyped() {
  const size = `${byId("width").value}x${byId("height").value}`;
  const preset = Array.from(byId("size").options).find((option) => option.value === size);
  byId("size").value = preset ? size : CUSTOM_SIZE;
}

function chosenSize() {
  const preset = byId("size").value;
  if (preset === AUTO_SIZE || !page.needs.has("free-size")) return preset;
  const width = byId("width").valueAsNumber;
  const height = byId("height").valueAsNumber;
  const problem = sizeProblem(page.facts, width, height);
  if (problem) throw new Error(problem);
  return `${width}x${height}`;
}

function number(id) {
  const value = byId(id).valueAsNumber;
  return Number.isFinite(value) ? value : undefined;
}

function selectedLoras() {
  return Array.from(document.querySelectorAll("input[data-lora]:checked"), (box) => ({
    name: box.dataset.lora,
    scale: Number(document.querySelector(`input[data-lora-scale="${CSS.escape(box.dataset.lora)}"]`).value || 1),
  }));
}

// The request's JSON fields from the form (the stage validates them and names a bad one).
async function readParams() {
  const { facts, needs } = page;
  const prompt = byId("prompt").value;
  if (!prompt.trim()) throw new Error("prompt: type a prompt first");
  const params = { model: page.id, prompt, num_inference_steps: number("steps"), seed: number("seed"),
    priority: number("priority") || undefined };
  if (needs.has("guidance")) params.guidance_scale = number("guidance");
  const negative = byId("negative-prompt").value;
  if (needs.has("negative") && negative.trim()) params.negative_prompt = negative;
  const loras = selectedLoras();
  if (loras.length) params.loras = loras;
  const files = needs.has("image-input") ? Array.from(byId("image").files) : [];
  params.size = chosenSize();
  if (isVideo(facts)) {
    params.num_frames = Number(byId("frames").value);
    params.fps = number("fps");
    if (files.length) params.input_reference = await readFile(files[0]);
    return { params, uploads: null };
  }
  params.n = number("count");
  if (needs.has("previews") && Number(byId("partials").value) > 0) params.partial_images = Number(byId("partials").value);
  if (!files.length) {
    if (facts.edits_only) throw new Error("image: this model edits an uploaded image: choose one");
    if (params.size === AUTO_SIZE) throw new Error("size: auto is the uploaded image's size: choose an image or a size");
    return { params, uploads: null };
  }
  const mask = needs.has("mask") && byId("mask").files.length ? byId("mask").files[0] : null;
  return { params, uploads: { images: files, mask } };
}

async function keyRefused(error) {
  if (error && error.needsKey) {
    await askKey(`The API key was refused (${error.message}). Enter another, then generate again.`);
  }
}

async function submit(event) {
  event.preventDefault();
  const errorLine = byId("form-error");
  errorLine.textContent = "";
  let request;
  try {
    request = await readParams();
  } catch (error) {
    errorLine.textContent = error.message;
    return;
  }
  const cards = byId("cards");
  const run = isVideo(page.facts) ? runVideo(cards, request.params) : runImages(cards, request.params, request.uploads);
  run.catch(keyRefused);
}

async function start() {
  byId("change-key").addEventListener("click", () => askKey("Enter the API key to use."));
  byId("request-form").addEventListener("submit", submit);
  byId("size").addEventListener("change", presetChosen);
  byId("width").addEventListener("input", sideTyped);
  byId("height").addEventListener("input", sideTyped);
  try {
    const card = await connect();
    page.id = card.id;
    page.facts = card.diffstage;
    byId("change-key").hidden = !apiKey.get();
    buildForm(card, await listLoras());
    document.body.dataset.ready = "1";
  } catch (error) {
    banner(`Cannot reach the stage: ${error.describe ? error.describe() : error.message}`);
  }
}

start();
