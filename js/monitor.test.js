// Unit tests of the monitor widget's front-end: `node --test js/` (no dependencies, no browser).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";

import monitor, {
  isWebLink, formatSeconds, progressFraction, progressText, metricsText, tail, statusRows, rankTabs, tabLines, LOG_LINES,
  dataText,
} from "./monitor.js";

const { render } = monitor;
const tick = () => new Promise((resolve) => setTimeout(resolve, 0));

// A minimal DOM: just what monitor.js uses.
class FakeNode {
  constructor(tag) {
    this.tagName = tag.toUpperCase();
    this.children = [];
    this.className = "";
    this.style = {};
    this.attributes = {};
    this._text = "";
    this.scrollTop = 0; this.scrollHeight = 0; this.clientHeight = 0;
  }
  appendChild(child) { this.children.push(child); return child; }
  addEventListener(event, callback) { ((this.listeners ||= {})[event] ||= []).push(callback); }
  click() { for (const callback of (this.listeners || {}).click || []) callback(); }
  setAttribute(k, v) { this.attributes[k] = String(v); }
  getAttribute(k) { return this.attributes[k]; }
  set textContent(v) { this.children = []; this._text = String(v); }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  findAll(pred, out = []) { if (pred(this)) out.push(this); for (const c of this.children) c.findAll(pred, out); return out; }
  byClass(name) { return this.findAll((n) => n.className.split(" ").includes(name)); }
}
const fakeDocument = { createElement: (tag) => new FakeNode(tag) };

class FakeModel {
  constructor(values) { this.values = { ...values }; this.handlers = {}; }
  get(k) { return this.values[k]; }
  set(k, v) { this.values[k] = v; for (const cb of this.handlers[`change:${k}`] || []) cb(); }
  on(ev, cb) { (this.handlers[ev] ||= []).push(cb); }
  off(ev, cb) { this.handlers[ev] = (this.handlers[ev] || []).filter((f) => f !== cb); }
  listenerCount() { return Object.values(this.handlers).reduce((n, l) => n + l.length, 0); }
}

function mount(values) {
  const el = new FakeNode("div");
  el.ownerDocument = fakeDocument;
  const model = new FakeModel(values);
  const cleanup = render({ model, el });
  return { el, model, cleanup };
}

test("formatSeconds handles unknown, seconds, minutes and hours", () => {
  assert.equal(formatSeconds(-1), "–");
  assert.equal(formatSeconds(NaN), "–");
  assert.equal(formatSeconds(undefined), "–");
  assert.equal(formatSeconds(4.94), "4.9 s");
  assert.equal(formatSeconds(125), "2 min 5 s");
  assert.equal(formatSeconds(3 * 3600 + 120), "3 h 2 min");
});

test("progress text with and without a declared total", () => {
  assert.equal(progressFraction(5, 0), null);
  assert.equal(progressFraction(150, 100), 1);
  assert.equal(progressText({ step: 40, total: 100, rate: 12.34, eta: 4.9 }), "step 40/100 (40%) · 12.3 steps/s · ETA 4.9 s");
  assert.equal(progressText({ step: 7, total: 0, rate: 2 }), "step 7 · 2.0 steps/s");
});

test("metricsText sorts names and rounds values", () => {
  assert.equal(metricsText({ loss: 0.123456, acc: 0.5 }), "acc=0.5  loss=0.1235");
  assert.equal(metricsText(undefined), "");
});

test("tail keeps the last n lines without mutating its input", () => {
  const lines = ["a", "b", "c", "d"];
  assert.deepEqual(tail(lines, 2), ["c", "d"]);
  assert.deepEqual(lines, ["a", "b", "c", "d"]);
  assert.deepEqual(tail(null, 3), []);
});

test("statusRows orders ranks and keeps known states", () => {
  const rows = statusRows([{ rank: 1, state: "failed", detail: "ValueError: x" }, { rank: 0, state: "done" }]);
  assert.deepEqual(rows, [
    { rank: "0", state: "done", detail: "", rate: "", cpu: "", straggler: false },
    { rank: "1", state: "failed", detail: "ValueError: x", rate: "", cpu: "", straggler: false },
  ]);
  const [row] = statusRows([{ rank: 0, state: "running", rate: 12.3456, cpu: 0.987, straggler: true }]);
  assert.deepEqual([row.rate, row.cpu, row.straggler], ["12.3", "0.99", true]);
});

test("the log has a tab per rank, and each shows that rank's own lines", async () => {
  assert.deepEqual(rankTabs([{ rank: 1 }, { rank: 0 }], { 2: ["x"] }).map((t) => t.key), ["all", "0", "1", "2"]);
  assert.deepEqual(tabLines(["[rank 0] a"], { 0: ["a"] }, "1"), []);
  const { el, model } = mount({
    state: "running", ranks: [{ rank: 0, state: "running" }, { rank: 1, state: "running" }],
    log: ["[rank 0] zero says", "[rank 1] one says"], rank_logs: { 0: ["zero says"], 1: ["one says"] },
  });
  const tabs = el.byClass("dtm-tab");
  assert.deepEqual(tabs.map((t) => t.textContent), ["all", "rank 0", "rank 1"]);
  assert.equal(el.byClass("dtm-tab-active")[0].textContent, "all");
  assert.equal(el.byClass("dtm-log")[0].textContent, "[rank 0] zero says\n[rank 1] one says");
  tabs[2].click();
  assert.equal(el.byClass("dtm-log")[0].textContent, "one says");
  assert.equal(el.byClass("dtm-tab-active")[0].textContent, "rank 1");
  model.set("rank_logs", { 0: ["zero says"], 1: ["one says", "one again"] });  // the chosen tab stays chosen
  await tick();
  assert.equal(el.byClass("dtm-log")[0].textContent, "one says\none again");
});

test("a straggler is flagged in its row; throughput and stacks show when there are some", async () => {
  const { el, model } = mount({
    state: "running", ranks: [{ rank: 0, state: "running", rate: 20, cpu: 0.4 },
                              { rank: 1, state: "running", rate: 5, cpu: 1.0, straggler: true }],
  });
  assert.equal(el.byClass("dtm-straggler").length, 1);
  assert.equal(el.byClass("dtm-straggler-flag")[0].textContent, "straggler ");
  assert.deepEqual(el.byClass("dtm-rank-rate").map((n) => n.textContent), ["20", "5"]);
  assert.equal(el.byClass("dtm-perf")[0].style.display, "none");
  assert.equal(el.byClass("dtm-stacks-pane")[0].style.display, "none");
  model.set("perf", "1.2 k samples/s · MFU 31.0 %");
  model.set("stacks", "rank 0 waits in all_reduce at Cell In[3], line 4\n\n  Traceback (most recent call last):");
  await tick();
  assert.equal(el.byClass("dtm-perf")[0].textContent, "1.2 k samples/s · MFU 31.0 %");
  assert.equal(el.byClass("dtm-stacks-pane")[0].style.display, "block");
  assert.match(el.byClass("dtm-stacks-pane")[0].textContent, /all_reduce at Cell In\[3\], line 4/);
});

test("render draws the status table, progress bar and log tail, and follows model changes", async () => {
  const { el, model, cleanup } = mount({
    state: "running", run_id: "abc123", link: "sqlite:///x.db", plan: "2 local processes",
    ranks: [{ rank: 0, state: "running", detail: "" }, { rank: 1, state: "starting", detail: "host" }],
    step: 25, total: 100, rate: 10, eta: 7.5, elapsed: 2.5, metrics: { loss: 0.5 }, log: ["[rank 0] hello"], message: "",
  });
  const root = el.byClass("dtm-monitor")[0];
  assert.equal(root.getAttribute("data-state"), "running");
  assert.match(el.byClass("dtm-header")[0].textContent, /running · MLflow run abc123/);
  assert.equal(el.findAll((n) => n.tagName === "TR").length, 3); // header + 2 ranks
  assert.equal(el.byClass("dtm-tabs")[0].style.display, "block"); // all, rank 0, rank 1
  assert.equal(el.byClass("dtm-bar-fill")[0].style.width, "25%");
  assert.match(el.byClass("dtm-progress")[0].textContent, /step 25\/100 \(25%\) · 10.0 steps\/s · ETA 7.5 s/);
  assert.equal(el.byClass("dtm-log")[0].textContent, "[rank 0] hello");

  model.set("ranks", [{ rank: 0, state: "done" }, { rank: 1, state: "done" }]);
  model.set("step", 100);
  model.set("state", "finished");
  model.set("log", Array.from({ length: LOG_LINES + 10 }, (_, i) => `line ${i}`));
  assert.equal(root.getAttribute("data-state"), "running"); // redrawn once per batch of changes, not per trait
  await tick();
  assert.deepEqual(el.byClass("dtm-rank-state").map((n) => n.textContent), ["done", "done"]);
  assert.equal(el.byClass("dtm-bar-fill")[0].style.width, "100%");
  assert.equal(root.getAttribute("data-state"), "finished");
  const shown = el.byClass("dtm-log")[0].textContent.split("\n");
  assert.equal(shown.length, LOG_LINES);
  assert.equal(shown.at(-1), `line ${LOG_LINES + 9}`);

  cleanup();
  assert.equal(model.listenerCount(), 0);
});

test("without a total the bar is hidden and the step count still shows", () => {
  const { el } = mount({ state: "running", ranks: [], step: 3, total: 0, rate: 1.5, eta: -1, log: [] });
  assert.equal(el.byClass("dtm-bar")[0].style.display, "none");
  assert.match(el.byClass("dtm-progress")[0].textContent, /^step 3 · 1.5 steps\/s/);
  assert.equal(el.byClass("dtm-log")[0].style.display, "none");
});

test("an http(s) MLflow run page is a link; a local store is text", async () => {
  const { el, model } = mount({ state: "running", ranks: [], link: "http://127.0.0.1:5000/#/experiments/1/runs/abc" });
  const [a] = el.findAll((n) => n.tagName === "A");
  assert.equal(a.getAttribute("href"), "http://127.0.0.1:5000/#/experiments/1/runs/abc");
  assert.equal(a.getAttribute("target"), "_blank");
  assert.match(a.getAttribute("rel"), /noopener/);
  model.set("link", "sqlite:///x.db (run abc)");
  await tick();
  assert.equal(el.findAll((n) => n.tagName === "A").length, 0);
  assert.equal(el.byClass("dtm-link")[0].textContent, "MLflow: sqlite:///x.db (run abc)");
  assert.equal(isWebLink("javascript:alert(1)"), false);
});

test("failure message is shown", () => {
  const { el } = mount({ state: "failed", ranks: [{ rank: 1, state: "failed", detail: "boom" }], message: "rank 1 failed: boom" });
  assert.equal(el.byClass("dtm-message")[0].textContent, "rank 1 failed: boom");
});

test("the next run's waiting workers are shown after the run, and nothing while none wait", async () => {
  const { el, model } = mount({ state: "finished", ranks: [] });
  assert.equal(el.byClass("dtm-held")[0].style.display, "none");
  model.set("held", "2 Ray Train worker(s) (CPU) on the local Ray instance wait for the next run until 12:10:00");
  await tick();
  assert.equal(el.byClass("dtm-held")[0].style.display, "block");
  assert.match(el.byClass("dtm-held")[0].textContent, /wait for the next run until 12:10:00/);
});

test("each ctx.data loader's place in its epoch is a line, shown only while there is one", async () => {
  assert.equal(dataText({}), "");
  assert.equal(dataText({ val: { epoch: 0, batch: 2, batches: 0 }, train: { epoch: 2, batch: 120, batches: 500 } }),
    "data train: epoch 2 · batch 120/500 (24%)\ndata val: epoch 0 · batch 2/0");
  const { el, model } = mount({ state: "running", ranks: [] });
  assert.equal(el.byClass("dtm-data")[0].style.display, "none");
  model.set("data", { train: { epoch: 1, batch: 5, batches: 10 } });
  await tick();
  assert.equal(el.byClass("dtm-data")[0].style.display, "block");
  assert.equal(el.byClass("dtm-data")[0].textContent, "data train: epoch 1 · batch 5/10 (50%)");
});

test("the default export is an anywidget module, and render is not a named export (anywidget deprecates that)", async () => {
  assert.equal(typeof monitor.render, "function");
  assert.equal("render" in (await import("./monitor.js")), false);
});

test("the Python package ships this file (dtrain_magic/js/monitor.js links here)", () => {
  const here = path.dirname(fileURLToPath(import.meta.url));
  const source = readFileSync(path.join(here, "monitor.js"), "utf8");
  const shipped = readFileSync(path.join(here, "..", "dtrain_magic", "js", "monitor.js"), "utf8");
  assert.equal(shipped, source);
});
