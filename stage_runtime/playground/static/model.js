// What the served model takes, from /v1/models' diffstage facts: the sizes it serves, its frame counts, what
// the form shows for it.

const SCALES = [0.125, 0.25, 0.5, 0.75, 1, 1.25, 1.5];
const MAX_SIDE = 2048;

function roundTo(value, multiple) {
  return Math.max(multiple, Math.round(value / multiple) * multiple);
}

// Preset "WxH" sizes: only its own for a fixed-size model (DiT); else its default scaled and turned, each side a
// multiple of the family's size multiple (and of 8, the API's rule). Width and height can be typed as well.
export function sizesOf(facts) {
  const width = facts.default_width;
  const height = facts.default_height;
  if (facts.fixed_size) return [`${width}x${height}`];
  const multiple = sizeMultiple(facts);
  const seen = new Map();
  for (const scale of SCALES) {
    for (const [w, h] of [[width, height], [height, width]]) {
      const sw = roundTo(w * scale, multiple);
      const sh = roundTo(h * scale, multiple);
      if (sw <= MAX_SIDE && sh <= MAX_SIDE) seen.set(`${sw}x${sh}`, sw * sh);
    }
  }
  return [...seen.entries()].sort((a, b) => a[1] - b[1]).map(([size]) => size);
}

// Frame counts the family takes (frame_rule [m, r]: m·k + r), up to its maximum or twice its default.
export function sizeMultiple(facts) {
  const multiple = Math.max(8, facts.size_multiple || 8);
  return multiple % 8 === 0 ? multiple : multiple * 8;
}

// The typed size's problem, named as the API names it (null when the family takes it).
export function sizeProblem(facts, width, height) {
  const multiple = sizeMultiple(facts);
  for (const side of [width, height]) {
    if (!Number.isInteger(side) || side < multiple || side > MAX_SIDE || side % multiple) {
      return `size: ${width}x${height}: each side must be a multiple of ${multiple} between ${multiple} and ${MAX_SIDE}`;
    }
  }
  return null;
}

export function framesOf(facts) {
  const [multiple, remainder] = facts.frame_rule;
  const most = facts.max_frames || Math.max(facts.default_frames * 2, multiple * 8 + remainder);
  const counts = [];
  for (let k = 1; multiple * k + remainder <= most && counts.length < 24; k += 1) {
    counts.push(multiple * k + remainder);
  }
  if (!counts.includes(facts.default_frames)) counts.push(facts.default_frames);
  return counts.sort((a, b) => a - b);
}

// The sections of the form this model uses (data-needs names in index.html).
export function needsOf(facts, loras) {
  const needs = new Set();
  const video = facts.frame_rule !== null && facts.frame_rule !== undefined;
  needs.add(video ? "video" : "image");
  if (facts.guidance !== "distilled") needs.add("guidance");
  if (facts.num_classes === null || facts.num_classes === undefined) needs.add("negative");
  if (!video && facts.execution_mode === "step") needs.add("previews");
  if ((video && facts.reference) || (!video && facts.supports_edits)) needs.add("image-input");
  if (!video && (facts.edit_tasks || []).includes("inpaint")) needs.add("mask");
  if (loras.length) needs.add("loras");
  if (!facts.fixed_size) needs.add("free-size");
  return needs;
}

export function isVideo(facts) {
  return facts.frame_rule !== null && facts.frame_rule !== undefined;
}

export function describe(facts) {
  const parts = [facts.pipeline_class, `${facts.execution_mode} mode`,
    `${facts.default_width}x${facts.default_height}`, `${facts.default_steps} steps`];
  if (facts.parallel_kinds && facts.parallel_kinds.length) parts.push(facts.parallel_kinds.join("+"));
  return parts.join(" · ");
}

export function promptHint(facts) {
  if (facts.class_labels && facts.class_labels.length) {
    const labels = facts.class_labels.slice(0, 12).map(([label]) => label).join(", ");
    return `a class label: ${labels}${facts.class_labels.length > 12 ? ", …" : ""}`;
  }
  if (facts.edits_only) return "an instruction for the uploaded image";
  if (isVideo(facts) && facts.reference === "required") return "upload the first frame's picture too";
  return "";
}
