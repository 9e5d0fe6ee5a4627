// Unit tests of "Write cell"'s front-end: `node --test js/` (no dependencies, no browser).
import { test } from "node:test";
import assert from "node:assert/strict";

import writer, { cellSource, isConfiguredCell, findCellIndex, domCellIndex, sharedNotebook, insertBelow } from "./cell_writer.js";

const BODY = "import torch\ndef train(ctx):\n    return 1\n";
const CONFIGURED = "%%distribute --configure --backend local -n 2\n" + BODY;

test("the configured cell is a %%distribute --configure line over the body", () => {
  assert.equal(isConfiguredCell(CONFIGURED, BODY), true);
  assert.equal(isConfiguredCell("%%distribute --backend local -n 2\n" + BODY, BODY), false); // not --configure
  assert.equal(isConfiguredCell("%%distribute --configure\nother()", BODY), false);
  assert.equal(isConfiguredCell("%%distribute --configure-x\n" + BODY, BODY), false);
  assert.equal(cellSource({ getSource: () => "a" }), "a");
  assert.equal(cellSource({ source: ["a", "b"] }), "ab");
});

test("the index: the only match, else the widget's own cell, else the last match", () => {
  const sources = ["%load_ext dtrain_magic", CONFIGURED, "x = 1"];
  assert.equal(findCellIndex(sources, BODY), 1);
  const twice = ["%load_ext dtrain_magic", CONFIGURED, "x = 1", CONFIGURED];
  assert.equal(findCellIndex(twice, BODY, 3), 3);
  assert.equal(findCellIndex(twice, BODY, 0), 3); // the DOM cell is not one of them: the last match
  assert.equal(findCellIndex(["a", "edited since it ran", "b"], BODY, 1), 1);
  assert.equal(findCellIndex(["a", "b"], BODY), 1); // nothing known: the end of the notebook
});

class FakeEl {
  constructor(cls, parent = null, attrs = {}) { this.cls = cls; this.parent = parent; this.attrs = attrs; this.kids = []; }
  closest(sel) {
    const want = sel.slice(1);
    for (let n = this; n; n = n.parent) if (n.cls === want) return n;
    return null;
  }
  getAttribute(k) { return k in this.attrs ? this.attrs[k] : null; }
  querySelectorAll() { return this.kids; }
}

test("the widget's cell index from the DOM (windowed attribute, else position)", () => {
  const notebook = new FakeEl("jp-Notebook");
  const cells = [0, 1, 2].map(() => new FakeEl("jp-Cell", notebook));
  notebook.kids = cells;
  assert.equal(domCellIndex(new FakeEl("output", cells[2])), 2);
  const windowed = new FakeEl("jp-Cell", notebook, { "data-windowed-list-index": "7" });
  assert.equal(domCellIndex(new FakeEl("output", windowed)), 7);
  assert.equal(domCellIndex(new FakeEl("output")), null);
});

function fakeShared(sources) {
  const cells = sources.map((s) => ({ getSource: () => s }));
  return {
    cells,
    inserted: [],
    insertCell(index, cell) { this.inserted.push([index, cell]); cells.splice(index, 0, { getSource: () => cell.source }); },
  };
}

test("insertBelow puts a code cell right under the configured cell", () => {
  const shared = fakeShared(["%load_ext dtrain_magic", CONFIGURED, "later"]);
  assert.equal(insertBelow(shared, "%%distribute --backend local\n" + BODY, BODY, null), 2);
  assert.deepEqual(shared.inserted, [[2, { cell_type: "code", source: "%%distribute --backend local\n" + BODY, metadata: {} }]]);
  assert.equal(sharedNotebook({ widget_manager: { context: { model: { sharedModel: shared } } } }), shared);
  assert.equal(sharedNotebook({ widget_manager: {} }), null); // VS Code and others: no notebook document
});

function fakeModel(values, manager) {
  const handlers = {};
  return {
    sent: [],
    widget_manager: manager,
    get: (k) => values[k],
    on: (e, f) => { handlers[e] = f; },
    off: () => {},
    send(msg) { this.sent.push(msg); },
  };
}

function fakeDoc() {
  return {
    createElement(tag) {
      const node = { tag, listeners: {}, style: {}, textContent: "", disabled: false,
        addEventListener(e, f) { this.listeners[e] = f; }, removeEventListener() {} };
      return node;
    },
  };
}

test("a click inserts through the notebook when it can, else asks the kernel (set_next_input)", () => {
  const shared = fakeShared(["%load_ext dtrain_magic", CONFIGURED]);
  const values = { text: "%%distribute --backend local\n" + BODY, body: BODY, note: "", disabled: false };
  const kids = [];
  const el = { ownerDocument: fakeDoc(), appendChild: (n) => kids.push(n), closest: () => null };
  const model = fakeModel(values, { context: { model: { sharedModel: shared } } });
  writer.render({ model, el });
  const button = kids[0];
  assert.equal(button.textContent, "Write cell");
  button.listeners.click();
  assert.deepEqual(model.sent, [{ event: "written", how: "notebook", index: 2 }]);
  assert.equal(shared.cells.length, 3);

  const kids2 = [];
  const el2 = { ownerDocument: fakeDoc(), appendChild: (n) => kids2.push(n), closest: () => null };
  const other = fakeModel(values, {});
  writer.render({ model: other, el: el2 });
  kids2[0].listeners.click();
  assert.deepEqual(other.sent, [{ event: "write", how: "kernel" }]);
});
