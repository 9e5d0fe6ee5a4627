// "Write cell" of the dtrain_magic configure panel: an anywidget ESM module (no build step).
// Python side: dtrain_magic/ui/panel.py (CellWriter). Synced traits:
//   text (the new cell: the equivalent %%distribute line and the cell's body), body (the configured
//   cell's body, to find that cell), note (what happened, shown beside the button), disabled.
//
// Why in the front-end: IPython's set_next_input travels with the reply to an *execute* request, and a
// widget click is a comm message, so from a button it would appear only after the user runs another
// cell. JupyterLab and Notebook 7 (@jupyter-widgets/jupyterlab-manager) give a widget the notebook's
// document context (model.widget_manager.context): the cell is inserted there, below the configured
// cell, at once. Any other front-end (VS Code, Colab, ...) falls back to the kernel's set_next_input:
// the button sends {event: "write"} and Python calls it.
// The pure helpers are exported for the unit tests (js/cell_writer.test.js, `node --test js/`).

export function cellSource(cell) {
  if (!cell) return "";
  if (typeof cell.getSource === "function") return cell.getSource();
  const source = cell.source;
  return Array.isArray(source) ? source.join("") : String(source || "");
}

// Is `source` the configured cell: a %%distribute --configure line over this body?
export function isConfiguredCell(source, body) {
  const text = String(source || "");
  const newline = text.indexOf("\n");
  const first = newline < 0 ? text : text.slice(0, newline);
  const rest = newline < 0 ? "" : text.slice(newline + 1);
  return /^\s*%%distribute\b/.test(first) && /(^|\s)--configure(\s|$)/.test(first) && rest.trim() === String(body || "").trim();
}

// Index of the configured cell among `sources`; `domIndex` (the cell holding this widget's view, when
// known) breaks ties between identical cells and is used when the cell was edited since it ran.
export function findCellIndex(sources, body, domIndex = null) {
  const matches = [];
  sources.forEach((s, i) => {
    if (isConfiguredCell(s, body)) matches.push(i);
  });
  const dom = Number.isInteger(domIndex) && domIndex >= 0 && domIndex < sources.length ? domIndex : null;
  if (matches.length === 1) return matches[0];
  if (dom !== null && (matches.length === 0 || matches.includes(dom))) return dom;
  if (matches.length) return matches[matches.length - 1];
  return sources.length - 1;
}

// The notebook cell (its index) whose output holds `el`, from the DOM of JupyterLab / Notebook 7.
export function domCellIndex(el) {
  const cell = el && typeof el.closest === "function" ? el.closest(".jp-Cell") : null;
  if (!cell) return null;
  const windowed = cell.getAttribute && cell.getAttribute("data-windowed-list-index");
  if (windowed !== null && windowed !== undefined && windowed !== "" && Number.isInteger(Number(windowed))) return Number(windowed);
  const notebook = cell.closest(".jp-Notebook");
  if (!notebook) return null;
  const index = Array.from(notebook.querySelectorAll(".jp-Cell")).indexOf(cell);
  return index >= 0 ? index : null;
}

// The notebook's shared model when the front-end exposes it to widgets, else null.
export function sharedNotebook(model) {
  try {
    const manager = model && model.widget_manager;
    const context = manager && manager.context;
    const shared = context && context.model && context.model.sharedModel;
    return shared && typeof shared.insertCell === "function" && shared.cells ? shared : null;
  } catch (e) {
    return null;
  }
}

// Insert `text` as a code cell below the configured cell; returns the new cell's index.
export function insertBelow(shared, text, body, domIndex) {
  const sources = Array.from(shared.cells).map(cellSource);
  const index = findCellIndex(sources, body, domIndex) + 1;
  shared.insertCell(index, { cell_type: "code", source: text, metadata: {} });
  return index;
}

function render({ model, el }) {
  const doc = el.ownerDocument || globalThis.document;
  const button = doc.createElement("button");
  button.className = "jupyter-widgets jupyter-button widget-button dtm-write-cell";
  button.textContent = "Write cell";
  button.title = "Put the equivalent %%distribute line and this cell's body into a new cell below";
  const note = doc.createElement("span");
  note.className = "dtm-write-note";
  note.style.marginLeft = "8px";
  el.appendChild(button);
  el.appendChild(note);

  const update = () => {
    button.disabled = Boolean(model.get("disabled")) || !model.get("text");
    note.textContent = model.get("note") || "";
  };
  const click = () => {
    const text = model.get("text");
    if (!text) return;
    const shared = sharedNotebook(model);
    if (shared) {
      try {
        const index = insertBelow(shared, text, model.get("body"), domCellIndex(el));
        model.send({ event: "written", how: "notebook", index });
        return;
      } catch (e) {
        console.warn("[dtrain_magic] could not insert the cell in the notebook; asking the kernel", e);
      }
    }
    model.send({ event: "write", how: "kernel" });
  };
  button.addEventListener("click", click);
  model.on("change:text", update);
  model.on("change:note", update);
  model.on("change:disabled", update);
  update();
  return () => {
    button.removeEventListener("click", click);
    model.off("change:text", update);
    model.off("change:note", update);
    model.off("change:disabled", update);
  };
}

export default { render };
