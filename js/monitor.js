// The run monitor of dtrain_magic: an anywidget ESM module (no build step).
// Python side: dtrain_magic/ui/monitor.py (MonitorWidget). Synced traits:
//   state ("starting" | "running" | "finished" | "failed" | "stopped"), plan, run_id, link,
//   ranks (list of {rank, state, detail}), step, total (0 = unknown), rate (steps/s), eta (s, -1 = unknown),
//   elapsed (s), metrics ({name: value}), log (list of recent output lines), message (error or note),
//   held (after the run: the next run's workers waiting, where and until when; Spark and Ray),
//   rank_logs ({rank: its recent lines}: the log tabs "all" / "rank 0" / ...), perf (throughput line),
//   stacks (where every rank is: a title line, then each rank's stack; the Stacks button or a stall),
//   data ({name: {epoch, batch, batches}}: rank 0's ctx.data loaders, where they are in their epoch).
// Each row of ranks may also carry rate (steps/s), cpu (cores) and straggler (bool).
// The pure helpers are exported for the unit tests (js/monitor.test.js, `node --test js/`).

export const RANK_STATES = ["starting", "running", "done", "failed"];

export function formatSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s) || s < 0) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  const rest = Math.round(s - 60 * m);
  if (m < 60) return `${m} min ${rest} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function progressFraction(step, total) {
  if (!total || total <= 0) return null;
  return Math.max(0, Math.min(1, step / total));
}

export function progressText({ step = 0, total = 0, rate = 0, eta = -1 } = {}) {
  const speed = `${(rate || 0).toFixed(1)} steps/s`;
  if (total && total > 0) {
    const pct = Math.round(100 * progressFraction(step, total));
    return `step ${step}/${total} (${pct}%) · ${speed} · ETA ${formatSeconds(eta)}`;
  }
  return `step ${step} · ${speed}`;
}

export function metricsText(metrics) {
  const keys = Object.keys(metrics || {}).sort();
  return keys
    .map((k) => {
      const v = metrics[k];
      return `${k}=${typeof v === "number" ? Number(v.toPrecision(4)) : v}`;
    })
    .join("  ");
}

// One line per ctx.data loader: "data train: epoch 2 · batch 120/500 (24%)".
export function dataText(data) {
  return Object.keys(data || {})
    .sort()
    .map((name) => {
      const d = data[name] || {};
      const batches = d.batches || 0;
      const pct = batches > 0 ? ` (${Math.round((100 * (d.batch || 0)) / batches)}%)` : "";
      return `data ${name}: epoch ${d.epoch ?? 0} · batch ${d.batch || 0}/${batches}${pct}`;
    })
    .join("\n");
}

export function tail(lines, n) {
  const list = Array.isArray(lines) ? lines : [];
  return n > 0 && list.length > n ? list.slice(list.length - n) : list.slice();
}

export function statusRows(ranks) {
  return [...(ranks || [])]
    .sort((a, b) => a.rank - b.rank)
    .map((r) => ({
      rank: String(r.rank),
      state: RANK_STATES.includes(r.state) ? r.state : String(r.state || "unknown"),
      detail: r.detail || "",
      rate: typeof r.rate === "number" ? `${Number(r.rate.toPrecision(3))}` : "",
      cpu: typeof r.cpu === "number" ? `${r.cpu.toFixed(2)}` : "",
      straggler: !!r.straggler,
    }));
}

// The log's tabs: every output line ("all"), then one per rank that has a row or has written something.
export function rankTabs(ranks, rankLogs) {
  const seen = new Set([...(ranks || []).map((r) => String(r.rank)), ...Object.keys(rankLogs || {})]);
  const numbers = [...seen].sort((a, b) => Number(a) - Number(b));
  return [{ key: "all", label: "all" }, ...numbers.map((n) => ({ key: n, label: `rank ${n}` }))];
}

// The lines a tab shows: all ranks' (prefixed) or one rank's own.
export function tabLines(log, rankLogs, selected) {
  if (!selected || selected === "all") return Array.isArray(log) ? log : [];
  const lines = (rankLogs || {})[selected];
  return Array.isArray(lines) ? lines : [];
}

export function runSummary(model) {
  const state = model.get("state") || "starting";
  const runId = model.get("run_id");
  return runId ? `${state} · MLflow run ${runId}` : state;
}

function h(doc, tag, className, text) {
  const node = doc.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const STYLE = `
.dtm-monitor { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; border: 1px solid #ccc;
  border-radius: 4px; padding: 6px 8px; max-width: 980px; }
.dtm-header { font-weight: 600; margin-bottom: 4px; }
.dtm-state-finished { color: #1a7f37; } .dtm-state-failed, .dtm-state-stopped { color: #cf222e; }
.dtm-table { border-collapse: collapse; margin: 4px 0; }
.dtm-table td, .dtm-table th { padding: 1px 10px 1px 0; text-align: left; }
.dtm-rank-done { color: #1a7f37; } .dtm-rank-failed { color: #cf222e; } .dtm-rank-running { color: #0969da; }
.dtm-bar { height: 8px; background: #eee; border-radius: 4px; overflow: hidden; margin: 4px 0; max-width: 600px; }
.dtm-bar-fill { height: 100%; background: #0969da; width: 0%; }
.dtm-log { font-family: var(--jp-code-font-family, monospace); white-space: pre; max-height: 160px; overflow: auto;
  background: #f6f8fa; padding: 4px; margin-top: 4px; }
.dtm-link, .dtm-message { margin-top: 2px; } .dtm-message { color: #cf222e; white-space: pre-wrap; }
.dtm-held { margin-top: 2px; color: #57606a; }
.dtm-perf { color: #57606a; }
.dtm-straggler td { background: #fff8c5; } .dtm-straggler-flag { color: #9a6700; font-weight: 600; }
.dtm-tabs { margin-top: 4px; } .dtm-tab { font-size: 11px; margin-right: 2px; padding: 1px 6px; cursor: pointer;
  border: 1px solid #ccc; background: #f6f8fa; border-radius: 3px; }
.dtm-tab-active { background: #0969da; color: #fff; border-color: #0969da; }
.dtm-stacks-pane { font-family: var(--jp-code-font-family, monospace); white-space: pre; max-height: 320px;
  overflow: auto; background: #fff8f0; border: 1px solid #f0d8b8; padding: 4px; margin-top: 4px; }
.dtm-data { white-space: pre; color: #57606a; }
`;

export const LOG_LINES = 40;

// An http(s) tracking server's run page is a link that opens beside the notebook; a local store
// (sqlite:///..., a directory) is shown as text, with the `mlflow ui` command to browse it.
export function isWebLink(url) {
  return typeof url === "string" && /^https?:\/\//i.test(url);
}

function drawLink(doc, node, url) {
  node.textContent = "";
  if (!url) return;
  if (!isWebLink(url)) {
    node.textContent = `MLflow: ${url}`;
    return;
  }
  node.appendChild(h(doc, "span", "", "MLflow: "));
  const a = h(doc, "a", "dtm-link-a", url);
  a.setAttribute("href", url);
  a.setAttribute("target", "_blank");
  a.setAttribute("rel", "noopener noreferrer");
  node.appendChild(a);
}

function render({ model, el }) {
  const doc = el.ownerDocument || globalThis.document;
  const root = h(doc, "div", "dtm-monitor");
  const style = h(doc, "style", "", STYLE);
  const header = h(doc, "div", "dtm-header");
  const plan = h(doc, "div", "dtm-plan");
  const link = h(doc, "div", "dtm-link");
  const table = h(doc, "table", "dtm-table");
  const bar = h(doc, "div", "dtm-bar");
  const fill = h(doc, "div", "dtm-bar-fill");
  bar.appendChild(fill);
  const progress = h(doc, "div", "dtm-progress");
  const metrics = h(doc, "div", "dtm-metrics");
  const data = h(doc, "div", "dtm-data");
  const message = h(doc, "div", "dtm-message");
  const held = h(doc, "div", "dtm-held");
  const perf = h(doc, "div", "dtm-perf");
  const tabs = h(doc, "div", "dtm-tabs");
  const log = h(doc, "div", "dtm-log");
  const stacks = h(doc, "div", "dtm-stacks-pane");
  for (const node of [style, header, plan, link, table, bar, progress, data, perf, metrics, message, held, tabs, log,
    stacks]) {
    root.appendChild(node);
  }
  el.appendChild(root);

  let lastLog = null;
  let selected = "all"; // the log tab: "all" or a rank's number (front-end state only)
  let lastTabs = "";
  const update = () => {
    const state = model.get("state") || "starting";
    header.textContent = `dtrain_magic · ${runSummary(model)}`;
    header.className = `dtm-header dtm-state-${state}`;
    root.setAttribute("data-state", state);
    plan.textContent = model.get("plan") || "";
    drawLink(doc, link, model.get("link"));

    table.textContent = "";
    const head = h(doc, "tr");
    for (const t of ["rank", "status", "steps/s", "CPU", ""]) head.appendChild(h(doc, "th", "", t));
    table.appendChild(head);
    for (const row of statusRows(model.get("ranks"))) {
      const tr = h(doc, "tr", `dtm-rank-${row.state}${row.straggler ? " dtm-straggler" : ""}`);
      tr.appendChild(h(doc, "td", "", row.rank));
      tr.appendChild(h(doc, "td", "dtm-rank-state", row.state));
      tr.appendChild(h(doc, "td", "dtm-rank-rate", row.rate));
      tr.appendChild(h(doc, "td", "dtm-rank-cpu", row.cpu));
      const detail = h(doc, "td", "");
      if (row.straggler) detail.appendChild(h(doc, "span", "dtm-straggler-flag", "straggler "));
      detail.appendChild(h(doc, "span", "", row.detail));
      tr.appendChild(detail);
      table.appendChild(tr);
    }

    const step = model.get("step") || 0;
    const total = model.get("total") || 0;
    const frac = progressFraction(step, total);
    bar.style.display = frac === null ? "none" : "block";
    fill.style.width = `${frac === null ? 0 : Math.round(frac * 1000) / 10}%`;
    progress.textContent = progressText({ step, total, rate: model.get("rate"), eta: model.get("eta") })
      + ` · elapsed ${formatSeconds(model.get("elapsed"))}`;
    metrics.textContent = metricsText(model.get("metrics"));
    data.textContent = dataText(model.get("data"));
    data.style.display = data.textContent ? "block" : "none";
    message.textContent = model.get("message") || "";
    held.textContent = model.get("held") || "";
    held.style.display = model.get("held") ? "block" : "none";
    perf.textContent = model.get("perf") || "";
    perf.style.display = model.get("perf") ? "block" : "none";
    const stackText = model.get("stacks") || "";
    if (stacks.textContent !== stackText) stacks.textContent = stackText;
    stacks.style.display = stackText ? "block" : "none";

    const rankLogs = model.get("rank_logs") || {};
    const tabList = rankTabs(model.get("ranks"), rankLogs);
    if (!tabList.some((t) => t.key === selected)) selected = "all";
    const tabKey = tabList.map((t) => t.key).join(",") + "|" + selected;
    if (tabKey !== lastTabs) {
      lastTabs = tabKey;
      tabs.textContent = "";
      for (const t of tabList) {
        const button = h(doc, "button", `dtm-tab${t.key === selected ? " dtm-tab-active" : ""}`, t.label);
        button.setAttribute("data-rank", t.key);
        button.addEventListener("click", () => {
          selected = t.key;
          lastLog = null;
          update();
        });
        tabs.appendChild(button);
      }
    }
    tabs.style.display = tabList.length > 2 ? "block" : "none";

    const lines = tail(tabLines(model.get("log"), rankLogs, selected), LOG_LINES);
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 20;
    const text = lines.join("\n");
    if (text !== lastLog) log.textContent = lastLog = text;
    log.style.display = lines.length ? "block" : "none";
    if (atBottom) log.scrollTop = log.scrollHeight;
  };

  // One flush from Python changes several traits at once: draw once per batch, not once per trait.
  let scheduled = false;
  const schedule = () => {
    if (scheduled) return;
    scheduled = true;
    queueMicrotask(() => {
      scheduled = false;
      update();
    });
  };
  const traits = ["state", "plan", "run_id", "link", "ranks", "step", "total", "rate", "eta", "elapsed", "metrics", "log",
    "message", "held", "rank_logs", "perf", "stacks", "data"];
  for (const t of traits) model.on(`change:${t}`, schedule);
  update();
  return () => {
    for (const t of traits) model.off(`change:${t}`, schedule);
  };
}

export default { render };
