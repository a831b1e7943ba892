// Building the page's elements: text is always set as text (a prompt is shown, never parsed as HTML).

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

export function byId(id) {
  return document.getElementById(id);
}

// Show the elements marked data-needs="<need>" for the needs that hold, hide the others.
export function showNeeds(root, needs) {
  for (const node of root.querySelectorAll("[data-needs]")) {
    node.hidden = !needs.has(node.dataset.needs);
  }
}

export function readFile(file, as = "dataURL") {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    if (as === "dataURL") reader.readAsDataURL(file);
    else reader.readAsArrayBuffer(file);
  });
}
