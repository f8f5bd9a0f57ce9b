// The Trainyard dashboard's script. It reads the same /v1 API the CLI does, with the token the user
// pastes in (kept in this browser's localStorage only). A job's page loads its series once,
// downsampled by the server, then grows them from the job's event stream (no polling); its logs
// follow the logs stream. Every value from the API reaches the page as text (textContent), never
// as HTML: job names and log lines are user input. Charts are uPlot's (vendor/uplot).
"use strict";

const LIST_POLL_MS = 5000;  // the jobs and workers tables, which have no stream
const MAX_POINTS = 2000;  // per series, downsampled by the server (min, max and last of each bucket kept)
const LOG_LINES_KEPT = 5000;
const COLORS = ["#3b82f6", "#ef4444", "#10b981", "#f59e0b", "#8b5cf6", "#ec4899", "#14b8a6", "#84cc16"];
// Sections of a job's charts, in order; a name none claims is the job's own (a script's `loss`, `perplexity`).
const GROUPS = [
  ["Loss", name => /(^|_)(loss|accuracy)$/.test(name) && !name.startsWith("sys/")],
  ["Optimisation", name => ["lr", "grad_norm"].includes(name)],
  ["Throughput", name => ["tokens_per_s", "step_time_s", "peak_memory_mb"].includes(name)],
  ["System", name => name.startsWith("sys/") && name !== "sys/wall_time"],
];
const OWN_GROUP = "Reported by the job";
// An evaluation series (eval_loss, val/accuracy, eval/loss…): a point every few hundred steps, each
// an exact value over the split. Drawn bold with its points, and never smoothed: an average with
// the evals before it would not be any evaluation's value (at 0.8 the step-750 eval read 2.28, not 2.16).
const EVALUATION = /(^|[\/_])(eval|val|valid|validation|test)([\/_]|$)/;
const HIDDEN = new Set(["sys/wall_time"]);  // not a chart: it maps steps to times for the wall-time axis
const FINAL = new Set(["succeeded", "failed", "cancelled", "pruned"]);

let generation = 0;  // bumped on every navigation, so a slow answer for the previous page is dropped
let leaving = new AbortController();  // aborts the open page's streams and timers when it is left
let loginMessage = "";  // why the login form is back, shown on it once

// --- Talking to the API ---------------------------------------------------------------------

function token() { return localStorage.getItem("trainyard-token"); }

// keepRefusal: answer a refusal (a 422's body says which field) instead of throwing it.
async function request(path, options = {}, keepRefusal = false) {
  const sent = token();
  const response = await fetch(path, { ...options, headers: { ...options.headers, Authorization: "Bearer " + sent } });
  if (response.status === 401) {
    // Only if it refused the token we hold now: a late answer to a token typed before must not log out the next one.
    if (token() === sent) { localStorage.removeItem("trainyard-token"); loginMessage = "The server refused that token."; route(); }
    throw new Error("not logged in");
  }
  if (!response.ok && !keepRefusal) throw new Error(path + ": HTTP " + response.status);
  return response;
}

async function api(path) { return (await request(path)).json(); }

const sleep = (ms, signal) => new Promise(resolve => { const t = setTimeout(resolve, ms); signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }); });

// Server-Sent Events read with fetch, which (unlike EventSource) sends the token. Calls
// onMessages(type, [data…]) with each chunk's messages; reconnects after a cut with Last-Event-ID
// until the server says `end` or the page is left.
async function follow(path, after, onMessages, signal) {
  let last = after;
  while (!signal.aborted) {
    try {
      const response = await request(path, { signal, headers: last == null ? {} : { "Last-Event-ID": String(last) } });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        const blocks = buffer.split("\n\n");
        buffer = blocks.pop();
        const batch = [];
        for (const block of blocks) {
          const fields = {};
          for (const line of block.split("\n")) {
            const colon = line.indexOf(":");
            if (colon > 0) fields[line.slice(0, colon)] = line.slice(colon + 1).replace(/^ /, "");
          }
          if (fields.event === "end") { onMessages(batch); return; }
          if (fields.data === undefined) continue;  // a keep-alive comment
          if (fields.id !== undefined) last = Number(fields.id);
          batch.push({ type: fields.event, data: JSON.parse(fields.data) });
        }
        if (batch.length) onMessages(batch);
      }
    } catch (error) {
      if (signal.aborted || error.message === "not logged in") return;
    }
    await sleep(1000, signal);
  }
}

// A link can't carry the Authorization header, so fetch the file and hand the browser a blob.
async function saveAs(path, filename) {
  const response = await request(path);
  const link = el("a", { href: URL.createObjectURL(await response.blob()), download: filename });
  link.click();
  URL.revokeObjectURL(link.href);
}
function download(checkpoint) { return saveAs("/v1/checkpoints/" + checkpoint.id + "/download", "job" + checkpoint.job_id + "-step" + checkpoint.step + ".safetensors"); }

// --- Small DOM helpers: every API value goes in as text -------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key.startsWith("on")) node[key] = value; else if (value !== false) node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
}

function table(headings, rows) {
  return el("div", { class: "scroll" }, el("table", {}, el("tr", {}, ...headings.map(h => el("th", {}, h))),
    ...rows.map(cells => el("tr", {}, ...cells.map(c => c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c))))));
}

function statusBadge(status) { return el("span", { class: "status " + status }, status); }
// A script job that gave no max_steps has none (null): show its step alone.
function steps(job) { return job.max_steps ? job.step + " / " + job.max_steps : String(job.step); }
function progressBar(fraction) { const bar = el("span", { class: "bar" }, el("span")); bar.firstChild.style.width = (100 * fraction).toFixed(1) + "%"; return bar; }
function number(value, digits = 4) { return value == null ? "–" : Number(value).toPrecision(digits); }
function duration(seconds) {
  if (seconds == null) return "–";
  const s = Math.round(seconds);
  return s >= 3600 ? Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m" : s >= 60 ? Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s" : s + "s";
}
// Sizes as people read them: a 2.8 KiB checkpoint is not "0.00 MB".
function bytes(size) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (size >= 1024 && i < units.length - 1) { size /= 1024; i++; }
  return (i ? size.toFixed(size < 10 ? 1 : 0) : String(size)) + " " + units[i];
}
// How long a job has run: from its first start to its end, or to now while it runs.
function runTime(job) {
  if (!job.started_at) return "–";
  return duration(((job.finished_at ? new Date(job.finished_at) : new Date()) - new Date(job.started_at)) / 1000);
}
function when(iso) { return iso ? new Date(iso).toLocaleString() : "–"; }
// A job's pace while it runs; its end once it is over (a finished job has no speed).
function pace(job) {
  if (FINAL.has(job.status)) return job.finished_at ? "ended " + when(job.finished_at) + (job.started_at ? " after " + duration((new Date(job.finished_at) - new Date(job.started_at)) / 1000) : "") : "ended";
  return job.status === "running" ? number(job.steps_per_second, 3) + " step/s · ETA " + duration(job.eta_seconds) : job.status;
}
// A tick or legend value short enough never to be clipped: 0.00099 is 9.9e-4.
function short(value) {
  if (value == null) return "–";
  const size = Math.abs(value);
  return size !== 0 && (size < 1e-3 || size >= 1e6) ? value.toExponential(2).replace(/\.?0+e/, "e") : String(+value.toPrecision(4));
}

// --- Series: as loaded, then grown by the event stream --------------------------------------

// One job's series: {name: {steps: [], values: []}}, kept sorted by step.
function addPoint(series, name, step, value) {
  const s = series[name] ??= { steps: [], values: [] };
  let i = s.steps.length;
  while (i > 0 && s.steps[i - 1] > step) i--;
  if (i > 0 && s.steps[i - 1] === step) s.values[i - 1] = value;  // a resumed run recomputed the step
  else { s.steps.splice(i, 0, step); s.values.splice(i, 0, value); }
}

function groupOf(name) { return (GROUPS.find(([, claims]) => claims(name)) || [OWN_GROUP])[0]; }

// Steps to Unix seconds, through the worker's sys/wall_time samples (linear between them and past the ends).
function stepsToTime(series) {
  const clock = series["sys/wall_time"];
  if (!clock || clock.steps.length < 2) return null;
  const { steps: xs, values: ts } = clock, n = xs.length;
  return step => {
    let hi = xs.findIndex(x => x >= step);
    if (hi <= 0) hi = hi === 0 ? 1 : n - 1;
    const lo = hi - 1, rate = (ts[hi] - ts[lo]) / ((xs[hi] - xs[lo]) || 1);
    return ts[lo] + (step - xs[lo]) * rate;
  };
}

// Exponential moving average, debiased at the start as TensorBoard's smoothing is.
function smooth(values, weight) {
  if (!weight) return values;
  let mean = 0, seen = 0;
  return values.map(v => { if (v == null) return null; mean = mean * weight + (1 - weight) * v; seen++; return mean / (1 - weight ** seen); });
}

// --- Charts: a board of uPlot charts over one or more runs, sharing their zoom -------------------

class Board {
  // runs: [{label, series}]; merged: draw eval_loss on train_loss's chart (a single job's page).
  constructor(root, runs, merged) {
    this.root = root; this.runs = runs; this.merged = merged;
    this.options = { smoothing: 0, log: false, x: "step" };
    this.charts = new Map();  // key -> {box, plot, names}
    this.range = null;  // the shared x zoom, or null for all of it
    this.pending = false;
    this.resize = new ResizeObserver(entries => entries.forEach(e => e.target.plot?.setSize(this.size(e.target))));
    this.root.append(this.toolbar());
    this.sections = el("div");
    this.root.append(this.sections);
    this.build();
  }

  toolbar() {
    const set = (key, value) => { this.options[key] = value; this.range = null; this.build(); };
    const smoothing = el("input", { type: "range", min: 0, max: 0.99, step: 0.01, value: 0, "aria-label": "smoothing" });
    smoothing.oninput = () => { this.options.smoothing = Number(smoothing.value); this.refresh(); };
    const log = el("input", { type: "checkbox", id: "log-scale" });
    log.onchange = () => set("log", log.checked);
    const x = el("select", { id: "x-axis", "aria-label": "x axis" }, el("option", { value: "step" }, "step"), el("option", { value: "time" }, "wall time"));
    x.onchange = () => set("x", x.value);
    const button = (text, label, action) => el("button", { type: "button", "aria-label": label, onclick: action }, text);
    return el("div", { class: "toolbar" },
      el("label", {}, "smoothing", smoothing), el("label", {}, log, "log scale"), el("label", {}, "x axis", x),
      el("span", {}, button("−", "zoom out", () => this.zoom(2)), " ", button("+", "zoom in", () => this.zoom(0.5)), " ",
        button("←", "pan left", () => this.pan(-0.25)), " ", button("→", "pan right", () => this.pan(0.25)), " ",
        button("reset zoom", "reset zoom", () => this.setRange(null))),
      el("span", { class: "muted" }, "drag across a chart to zoom, wheel to zoom, double-click to reset"));
  }

  // What decides which charts there are and which lines each draws: a new series changes it.
  signature() { return JSON.stringify([this.layout(), this.runs.map(run => Object.keys(run.series).sort())]); }

  chartKey(name) { return this.merged && name === "eval_loss" ? "train_loss" : name; }

  // Every chart key there is data for, grouped: [[group, [key…]]…] in GROUPS order, the job's own before System.
  layout() {
    const keys = new Set();
    for (const run of this.runs) for (const name of Object.keys(run.series)) if (!HIDDEN.has(name)) keys.add(this.chartKey(name));
    const order = [...GROUPS.slice(0, 3).map(g => g[0]), OWN_GROUP, "System"];
    return order.map(group => [group, [...keys].filter(k => groupOf(k) === group).sort()]).filter(([, ks]) => ks.length);
  }

  // All charts made afresh (new options, or a series with no chart yet).
  build() {
    this.built = this.signature();
    this.syncing = true;  // a new chart's first scales are no zoom
    for (const { box, plot } of this.charts.values()) { this.resize.unobserve(box); plot.destroy(); }
    this.charts.clear();
    const layout = this.layout();
    this.sections.replaceChildren(...layout.map(([group, keys]) =>
      el("section", { "data-group": group }, el("h3", {}, group), el("div", { class: "charts" }, ...keys.map(key => this.makeChart(key))))));
    if (!layout.length) this.sections.append(el("p", { class: "muted" }, "No metrics reported yet."));
    this.syncing = false;
  }

  makeChart(key) {
    const names = Object.keys(Object.assign({}, ...this.runs.map(r => r.series))).filter(n => this.chartKey(n) === key)
      .sort((a, b) => (b === key) - (a === key) || a.localeCompare(b));  // the chart's own series first: train_loss before eval_loss
    // The loss chart, the one people come for, spans the board's width.
    const box = el("div", { class: "chart" + (key === "train_loss" ? " wide" : ""), "data-chart": key }, el("h4", {}, this.merged && key === "train_loss" ? "loss" : key));
    const lines = this.runs.flatMap((run, r) => names.map((name, n) => ({ run, name, label: [run.label, name].filter(Boolean).join(" · "),
      color: COLORS[(this.runs.length > 1 ? r : n) % COLORS.length], dash: this.runs.length > 1 && n ? [6, 3] : undefined })));
    const css = getComputedStyle(document.documentElement), fg = css.getPropertyValue("--muted").trim(), grid = css.getPropertyValue("--line").trim();
    const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, size: fitLabels };
    const time = this.options.x === "time";
    const data = this.data(lines);
    const plot = new uPlot({
      ...this.size(box), data,
      scales: { x: { time }, y: { distr: this.options.log ? 3 : 1 } },
      axes: [{ ...axis, values: time ? undefined : ticks }, { ...axis, values: ticks }],
      series: [{ label: time ? "time" : "step", value: time ? undefined : (u, v) => v ?? u.data[0][u.data[0].length - 1] ?? "–" },  // at rest: the last step
        ...lines.map(line => {
          const evaluation = EVALUATION.test(line.name);
          return { label: line.label, stroke: line.color, dash: line.dash, width: evaluation ? 2.5 : 1.5, spanGaps: true, value: (u, v, i) => this.legendValue(u, i),
            // The machine's samples hold from one to the next (a straight line between two would be a trend no one measured).
            paths: groupOf(line.name) === "System" ? uPlot.paths.stepped({ align: 1 }) : undefined,
            points: { show: (u, i) => evaluation || drawnCount(u.data[i]) <= 50, size: evaluation ? 7 : 5, fill: line.color } };
        })],
      cursor: { sync: { key: "board" }, drag: { x: true, y: false } },
      hooks: { setScale: [(u, scale) => scale === "x" && this.followZoom(u)] },
      plugins: [wheelZoom(this), rollbackMarks(this)],
    }, data, box);
    box.plot = plot;
    this.resize.observe(box);
    this.charts.set(key, { box, plot, lines });
    this.describe(box, lines, data);
    if (this.range) plot.setScale("x", { min: this.range[0], max: this.range[1] });
    return box;
  }

  // A legend's value: the line's at the cursor's x, or away from the chart at its last x, so a legend
  // never reads "–" until hovered. A line with no point there (an eval every 100 steps) shows its
  // latest one before it, saying where it is from: "2.16 @ 700", never as if it were the current step's.
  legendValue(u, i) {
    const xs = u.data[0], ys = u.data[i];
    if (!xs.length) return "–";
    const at = xs[u.cursor.idx ?? xs.length - 1];
    let j = u.cursor.idx ?? xs.length - 1;
    while (j >= 0 && ys[j] == null) j--;
    if (j < 0) return "–";
    return short(ys[j]) + (xs[j] === at ? "" : this.options.x === "time" ? " (earlier)" : " @ " + xs[j]);
  }

  // uPlot's aligned data: [xs, ys of each line], xs the union of every line's, gaps as null.
  data(lines) {
    const toTime = new Map(this.runs.map(run => [run, stepsToTime(run.series)]));
    const tables = lines.map(({ run, name }) => {
      const s = run.series[name] || { steps: [], values: [] }, clock = toTime.get(run);
      let xs = s.steps, ys = EVALUATION.test(name) ? s.values : smooth(s.values, this.options.smoothing);
      if (this.options.x === "time") xs = clock ? xs.map(clock) : [];
      if (!xs.length) ys = [];
      if (this.options.log) ys = ys.map(v => v > 0 ? v : null);
      return [xs, ys];
    });
    return tables.length ? uPlot.join(tables.map(t => t[0].length ? t : [[], []])) : [[]];
  }

  // For people (a note of what isn't drawn) and for tests (data-points: points drawn per line).
  describe(box, lines, data) {
    const counts = Object.fromEntries(lines.map((line, i) => [line.label, drawnCount(data[i + 1] || [])]));
    box.dataset.points = JSON.stringify(counts);
    const nonFinite = lines.reduce((n, { run, name }) => n + (run.series[name]?.values.filter(v => v == null).length || 0), 0);
    let note = box.querySelector(".note");
    const text = nonFinite ? nonFinite + " NaN or infinite values not drawn" : this.options.x === "time" && !lines.some(l => stepsToTime(l.run.series)) ? "no wall times recorded for this job" : "";
    if (!note) { note = el("div", { class: "note error" }); box.insertBefore(note, box.children[1]); }
    note.textContent = text;
  }

  size(box) { return { width: Math.max(240, box.clientWidth - 20 || 400), height: box.classList.contains("wide") ? 300 : 220 }; }

  // New points arrived: redraw once per frame, keeping the zoom; a new series gets its chart.
  refresh() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      if (this.signature() !== this.built) return this.build();
      for (const { box, plot, lines } of this.charts.values()) {
        const data = this.data(lines);
        plot.setData(data, this.range == null);
        if (this.range) plot.setScale("x", { min: this.range[0], max: this.range[1] });
        this.describe(box, lines, data);
      }
    });
  }

  // Zoom: one x range for every chart of the board.
  setRange(range) {
    this.range = range;
    this.syncing = true;
    for (const { plot } of this.charts.values()) {
      if (range) plot.setScale("x", { min: range[0], max: range[1] });
      else plot.setData(plot.data);  // uPlot's own ranges again (a single point's too, which a min = max scale can't draw)
    }
    this.syncing = false;
  }

  followZoom(plot) {
    if (this.syncing) return;
    const [lo, hi] = extent(plot.data[0]);
    const { min, max } = plot.scales.x;
    this.setRange(min <= lo && max >= hi ? null : [min, max]);
  }

  current() {
    const first = this.charts.values().next().value;
    return first ? this.range || extent(first.plot.data[0]) : [null, null];
  }

  zoom(factor, at) {
    const [min, max] = this.current();
    if (min == null) return;
    const centre = at ?? (min + max) / 2;
    this.setRange([centre - (centre - min) * factor, centre + (max - centre) * factor]);
  }

  pan(fraction) {
    const [min, max] = this.current();
    if (min != null) this.setRange([min + (max - min) * fraction, max + (max - min) * fraction]);
  }

  destroy() { this.resize.disconnect(); for (const { plot } of this.charts.values()) plot.destroy(); }
}

// Tick labels with just the digits that tell neighbours apart: 572.31, 572.32; 4e-4, 6e-4.
function ticks(u, splits, axisIdx, space, increment) {
  const size = Math.max(...splits.map(Math.abs));
  if (!(increment > 0) || !isFinite(size)) return splits.map(short);
  if (size !== 0 && (size < 1e-3 || size >= 1e6)) {
    const digits = Math.max(0, Math.floor(Math.log10(size)) - Math.floor(Math.log10(increment)));
    return splits.map(v => v === 0 ? "0" : v.toExponential(digits).replace(/\.?0+e/, "e"));  // zero, not "0e+0"
  }
  let decimals = 0;
  while (decimals < 12 && Math.abs(increment * 10 ** decimals - Math.round(increment * 10 ** decimals)) > 1e-6) decimals++;
  return splits.map(v => v.toFixed(decimals));
}

function extent(xs) { return xs.length ? [xs[0], xs[xs.length - 1]] : [null, null]; }
function drawnCount(ys) { return ys.reduce((n, v) => n + (v != null), 0); }

// An axis as wide as its longest tick label, so none is clipped (uPlot's "axis autosize" recipe).
function fitLabels(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;
  let size = axis.ticks.size + axis.gap;
  const longest = (values ?? []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
  if (longest) { u.ctx.font = axis.font[0]; size += u.ctx.measureText(longest).width / devicePixelRatio; }
  return Math.ceil(size) + 4;
}

// The wheel zooms the board around the cursor.
function wheelZoom(board) {
  return { hooks: { ready: u => u.over.addEventListener("wheel", event => {
    event.preventDefault();
    board.zoom(event.deltaY > 0 ? 1.25 : 0.8, u.posToVal(event.offsetX, "x"));
  }, { passive: false }) } };
}

// --- Logs: followed live, filtered and searched in the browser -------------------------------

class LogsPanel {
  constructor(jobId, signal) {
    this.lines = [];
    this.ranks = new Set();
    this.rank = el("select", { "aria-label": "rank" }, el("option", { value: "" }, "all ranks"));
    this.search = el("input", { type: "search", placeholder: "search the loaded lines", "aria-label": "search logs" });
    this.count = el("span", { class: "muted" });
    this.box = el("pre", { class: "logs", tabindex: 0, "aria-label": "logs" });
    this.rank.onchange = this.search.oninput = () => this.render(true);
    this.root = el("section", { class: "logs-panel" }, el("h3", {}, "Logs"),
      el("div", { class: "toolbar" }, el("label", {}, "rank", this.rank), this.search, this.count), this.box);
    this.render(true);
    follow("/v1/jobs/" + jobId + "/logs?follow=true&tail=500", null, batch => this.add(batch.map(m => m.data)), signal);
  }

  add(lines) {
    for (const line of lines) {
      // A progress bar redraws itself with \r: what shows is its last state, and the next redraw replaces this line.
      const text = line.line.split("\r").filter(part => part.trim()).pop() ?? "";
      const previous = this.lines[this.lines.length - 1];
      const shown = { rank: line.rank, attempt: line.attempt, text };
      if (previous && previous.rank === line.rank && isProgressBar(previous.text) && isProgressBar(text)) this.lines[this.lines.length - 1] = shown;
      else this.lines.push(shown);
      if (line.rank != null && !this.ranks.has(line.rank)) {
        this.ranks.add(line.rank);
        this.rank.append(el("option", { value: line.rank }, "rank " + line.rank));
      }
    }
    this.lines.splice(0, this.lines.length - LOG_LINES_KEPT);
    this.render(false);
  }

  render(jump) {
    const atBottom = this.box.scrollTop + this.box.clientHeight >= this.box.scrollHeight - 20;
    const rank = this.rank.value, needle = this.search.value.toLowerCase();
    const shown = this.lines.filter(l => (rank === "" || String(l.rank) === rank) && (!needle || l.text.toLowerCase().includes(needle)));
    const prefix = l => "[" + l.attempt + (l.rank == null ? "" : ":" + l.rank) + "] ";
    this.box.replaceChildren(...shown.flatMap(l => [prefix(l), ...highlight(l.text, needle), "\n"]));
    if (!this.lines.length) this.box.textContent = "(no output yet)";
    this.count.textContent = needle || rank !== "" ? shown.length + " of " + this.lines.length + " lines" : this.lines.length + " lines";
    if (jump || atBottom) this.box.scrollTop = this.box.scrollHeight;  // follow, unless the reader scrolled up
  }
}

function isProgressBar(text) { return /\d+%\|/.test(text); }
function highlight(text, needle) {
  if (!needle) return [text];
  const parts = [], lower = text.toLowerCase();
  let at = 0, hit;
  while ((hit = lower.indexOf(needle, at)) >= 0) { parts.push(text.slice(at, hit), el("mark", {}, text.slice(hit, hit + needle.length))); at = hit + needle.length; }
  parts.push(text.slice(at));
  return parts;
}

// --- Pages ------------------------------------------------------------------------------------

function loginPage(message) {
  const input = el("input", { id: "token", type: "password", placeholder: "API token", autocomplete: "off", "aria-label": "API token" });
  const form = el("form", { class: "login" },
    el("h2", {}, "Log in"),
    el("p", { class: "muted" }, "Run `trainyard open` for a link that signs this browser in, or paste an API token (trainyard up writes the local admin's to <data-dir>/token)."),
    input, el("button", { type: "submit" }, "Log in"),
    el("p", { class: "error" }, message || ""));
  form.onsubmit = event => { event.preventDefault(); localStorage.setItem("trainyard-token", input.value.trim()); location.hash = "#/jobs"; route(); };
  return form;
}

const selected = new Set();  // jobs ticked for comparing

const STATUSES = ["queued", "scheduled", "running", "succeeded", "failed", "cancelled", "pruned"];
const jobFilter = { q: "", status: "" };  // the jobs table's search, kept across its re-reads
let searching;  // the re-read a keystroke asks for, once typing pauses

async function jobsPage() {
  const query = new URLSearchParams({ limit: 100 });
  if (jobFilter.q) query.set("q", jobFilter.q);
  if (jobFilter.status) query.set("status", jobFilter.status);
  const [page, dashboard] = await Promise.all([api("/v1/jobs?" + query), api("/v1/dashboard")]);
  const counts = Object.entries(dashboard.jobs_by_status).map(([s, n]) => s + " " + n).join(" · ");
  const compare = el("button", { type: "button", id: "compare", disabled: selected.size < 2, onclick: () => { location.hash = "#/compare/" + [...selected].sort((a, b) => a - b).join(","); } },
    "Compare selected (" + selected.size + ")");
  const tick = job => {
    const box = el("input", { type: "checkbox", "aria-label": "select job " + job.id, "data-focus": "select-" + job.id, checked: selected.has(job.id) });
    box.onchange = () => { box.checked ? selected.add(job.id) : selected.delete(job.id); compare.disabled = selected.size < 2; compare.textContent = "Compare selected (" + selected.size + ")"; };
    return box;
  };
  // Searched by the server (name or owner, any case; a status), so a match beyond the newest 100 is found too.
  const search = el("input", { type: "search", id: "job-search", placeholder: "name or owner", value: jobFilter.q, "aria-label": "search jobs by name or owner", "data-focus": "job-search" });
  search.oninput = () => { jobFilter.q = search.value.trim(); clearTimeout(searching); searching = setTimeout(route, 300); };
  const status = el("select", { id: "job-status", "aria-label": "status", "data-focus": "job-status" },
    ...["", ...STATUSES].map(s => el("option", { value: s, selected: s === jobFilter.status }, s || "any status")));
  status.onchange = () => { jobFilter.status = status.value; route(); };
  const filtered = jobFilter.q || jobFilter.status;
  return el("div", {},
    el("h2", {}, "Jobs"),
    dashboard.scheduler_down ? el("p", { class: "error", id: "scheduler-down", role: "alert" }, dashboard.scheduler_down) : "",
    el("div", { class: "toolbar" }, el("span", { class: "muted" }, counts || "no jobs yet"), search, status, compare),
    page.items.length || !filtered ? table(["", "id", "name", "owner", "status", "progress", "step", "step/s", "ETA", "run time", "last loss", "effective batch", "created"],
      page.items.map(job => [
        tick(job), String(job.id), el("a", { href: "#/jobs/" + job.id, "data-focus": "job-" + job.id }, job.name), job.owner, statusBadge(job.status),
        job.max_steps ? progressBar(job.step / job.max_steps) : "—", steps(job), FINAL.has(job.status) ? "—" : number(job.steps_per_second, 3),
        FINAL.has(job.status) ? "—" : duration(job.eta_seconds), runTime(job), number(job.last_train_loss), String(job.effective_batch_size ?? "—"), when(job.created_at),
      ])) : el("p", { class: "muted", id: "no-match" }, "No job matches."));
}

// Where the loss guard rolled a run back: a red band over the steps whose batches it skipped (from the
// checkpoint it went on from to the spike's last step), on every chart of the run, by step only.
function rollbackMarks(board) {
  return { hooks: { draw: [u => {
    if (board.options.x !== "step") return;
    for (const run of board.runs) for (const mark of run.rollbacks || []) {
      const left = u.valToPos(mark.resume_step, "x", true), right = u.valToPos(mark.last_step, "x", true);
      u.ctx.save();
      u.ctx.fillStyle = "rgba(200, 40, 40, 0.18)";
      u.ctx.fillRect(left, u.bbox.top, Math.max(2, right - left), u.bbox.height);
      u.ctx.restore();
    }
  }] } };
}

function jobSummary(job) {
  return el("div", { class: "summary" },
    el("h2", {}, "Job " + job.id + ": ", job.name, " ", statusBadge(job.status)),
    el("p", {}, "owner " + job.owner + " · step " + steps(job) + " · " + pace(job) + " · last loss " + number(job.last_train_loss) +
      " · effective batch " + (job.effective_batch_size ?? "—") + " · " + job.spec.resources.nodes + "×" + job.spec.resources.processes_per_node + " " + job.spec.resources.device),
    job.waiting_reason ? el("p", { class: "muted" }, job.waiting_reason) : "",
    job.rollback_marks.length ? el("ul", { class: "rollbacks" }, ...job.rollback_marks.map(mark => el("li", {},
      "Rolled back (red on the charts): steps " + mark.first_step + "–" + mark.last_step + " spiked; went on from step " + mark.resume_step +
      ", past the batches of steps " + (mark.resume_step + 1) + "–" + mark.last_step + ". " + mark.reason))) : "",
    job.failure_reason ? el("pre", { class: "error" }, job.failure_reason) : "");
}

// What a run was and how it ended, at a glance: its run time and last values, its spec, its outputs;
// and what one does next: cancel it, or submit it again with changes.
function overview(job, run, outputs) {
  const finals = Object.entries(run.series)
    .filter(([name, s]) => s.values.length && !HIDDEN.has(name) && ["Loss", OWN_GROUP].includes(groupOf(name)))
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([name, s]) => name + " " + short(s.values[s.values.length - 1]) + " (step " + s.steps[s.steps.length - 1] + ")");
  const spec = flatten(job.spec);
  return el("div", { class: "overview" },
    el("div", { class: "toolbar" },
      FINAL.has(job.status) ? "" : el("button", { type: "button", id: "cancel-job", onclick: async event => {
        event.target.disabled = true;
        await request("/v1/jobs/" + job.id + "/cancel", { method: "POST" });
      } }, "Cancel"),
      el("button", { type: "button", id: "clone-job", onclick: () => document.getElementById("resubmit").replaceChildren(resubmitForm(job)) }, "Clone and resubmit…"),
      el("span", { class: "muted" }, "run time " + runTime(job) + (finals.length ? " · last " + finals.join(" · ") : ""))),
    el("div", { id: "resubmit" }),
    el("details", { class: "spec" }, el("summary", {}, "Spec"),
      table(["field", "value"], Object.keys(spec).sort().map(field => [field, el("td", { class: "wrap" }, spec[field])]))),
    outputs.length ? el("div", { class: "outputs" }, el("h3", {}, "Outputs"), table(["directory", "step", "files", "size", ""], outputs.map(o => [
      o.name, o.step == null ? "–" : String(o.step), String(o.files), bytes(o.size_bytes),
      el("button", { type: "button", onclick: () => saveAs("/v1/jobs/" + job.id + "/outputs/" + o.name, "job" + job.id + "-" + o.name.replaceAll("/", "_") + ".tar") }, "download")]))) : "");
}

// The job's spec to edit and submit as a new job; the API's refusal (a 422 naming the field) shown as is.
function resubmitForm(job) {
  const text = el("textarea", { id: "resubmit-spec", rows: 18, spellcheck: "false", "aria-label": "job spec (JSON)" });
  text.value = JSON.stringify({ ...job.spec, name: job.spec.name + "-again" }, null, 2);
  const error = el("pre", { class: "error", id: "resubmit-error" });
  const submit = async event => {
    event.preventDefault();
    error.textContent = "";
    let spec;
    try { spec = JSON.parse(text.value); } catch (problem) { error.textContent = "not JSON: " + problem.message; return; }
    const response = await request("/v1/jobs", { method: "POST", body: JSON.stringify(spec), headers: { "Content-Type": "application/json" } }, true);
    const answer = await response.json().catch(() => ({}));
    if (!response.ok) {
      const detail = Array.isArray(answer.detail) ? answer.detail.map(d => (d.loc || []).filter(p => p !== "body").join(".") + ": " + d.msg).join("\n") : answer.detail;
      error.textContent = "refused (" + response.status + "): " + (detail || response.statusText);
      return;
    }
    location.hash = "#/jobs/" + answer.id;
  };
  return el("form", { class: "resubmit", onsubmit: submit },
    el("p", { class: "muted" }, "Job " + job.id + "'s spec: change what you want, then submit it as a new job."), text,
    el("div", { class: "toolbar" }, el("button", { type: "submit" }, "Submit as a new job"),
      el("button", { type: "button", onclick: event => event.target.closest("form").remove() }, "Close")), error);
}

function attemptsTable(job) {
  // A cluster pool's attempts say which cluster job runs them and what the cluster says of it.
  const pooled = job.attempts.some(a => a.pool);
  const cluster = a => a.pool ? a.pool + (a.cluster_job_id ? " job " + a.cluster_job_id : "") + (a.cluster_state ? ": " + a.cluster_state : "") : "–";
  return table(["#", "node", "host", "processes", "status", ...(pooled ? ["cluster"] : []), "resumed from step", "started", "finished", "reason"],
    job.attempts.map(a => [String(a.number), String(a.node_rank), a.host_name || "–", String(a.processes), statusBadge(a.status), ...(pooled ? [cluster(a)] : []),
      a.resumed_from_step == null ? "–" : String(a.resumed_from_step), when(a.started_at), when(a.finished_at), el("td", { class: "reason" }, a.failure_reason || "")]));
}

function checkpointsTable(checkpoints, policy) {
  if (!checkpoints.length) return el("p", { class: "muted" }, "No checkpoints yet.");
  // A job keeping its best by another metric (checkpoint.best_metric) shows that metric too; "(best)" marks the one kept.
  const ranked = policy && policy.keep_best && policy.best_metric !== "eval_loss" ? [policy.best_metric] : [];
  const marked = (text, c) => text + (c.best ? " (best)" : "");
  const loss = c => c.eval_loss == null ? "–" : c.eval_loss.toFixed(4);
  const value = c => c.best_value == null ? "–" : String(+c.best_value.toPrecision(4));
  return table(["step", "eval_loss", ...ranked, "size", "sha256", "created", ""],
    checkpoints.map(c => [String(c.step), ...(ranked.length ? [loss(c), marked(value(c), c)] : [marked(loss(c), c)]),
      bytes(c.size_bytes), c.sha256.slice(0, 16) + "…", when(c.created_at),
      el("button", { type: "button", onclick: () => download(c) }, "download")]));
}

// A job's page: loaded once, then kept current by its event stream.
async function jobPage(id, signal) {
  const [job, metrics, checkpoints, outputs] = await Promise.all([
    api("/v1/jobs/" + id), api("/v1/jobs/" + id + "/metrics?max_points=" + MAX_POINTS), api("/v1/jobs/" + id + "/checkpoints"), api("/v1/jobs/" + id + "/outputs"),
  ]);
  const run = { label: "", series: Object.fromEntries(Object.entries(metrics.series).map(([n, s]) => [n, { steps: s.steps, values: s.values }])),
    rollbacks: job.rollback_marks };
  const summary = el("div", {}, jobSummary(job), overview(job, run, outputs));
  const attempts = el("div", {}, attemptsTable(job)), stored = el("div", {}, checkpointsTable(checkpoints, job.spec.checkpoint));
  const charts = el("section", { class: "board" });
  const page = el("div", {}, summary, charts, el("h3", {}, "Attempts"), attempts, el("h3", {}, "Checkpoints"), stored);
  return { page, start: () => {
    const board = new Board(charts, [run], true);
    signal.addEventListener("abort", () => board.destroy());
    page.append(new LogsPanel(id, signal).root);
    const reload = async () => {
      const [fresh, checkpoints, outputs] = await Promise.all([api("/v1/jobs/" + id), api("/v1/jobs/" + id + "/checkpoints"), api("/v1/jobs/" + id + "/outputs")]);
      if (signal.aborted) return;
      Object.assign(job, fresh);
      run.rollbacks = fresh.rollback_marks;
      // What the reader opened stays as it was: a spec being edited, the spec unfolded.
      const editing = summary.querySelector("form.resubmit"), unfolded = summary.querySelector("details.spec")?.open;
      summary.replaceChildren(jobSummary(job), overview(job, run, outputs));
      if (editing) summary.querySelector("#resubmit").replaceChildren(editing);
      summary.querySelector("details.spec").open = Boolean(unfolded);
      attempts.replaceChildren(attemptsTable(fresh)); stored.replaceChildren(checkpointsTable(checkpoints, fresh.spec.checkpoint));
    };
    follow("/v1/jobs/" + id + "/events", metrics.last_event_id, batch => {
      for (const { type, data } of batch) {
        if (type === "metrics") for (const [name, value] of Object.entries(data.data.values)) addPoint(run.series, name, data.data.step, value);
      }
      if (batch.some(m => m.type === "metrics")) board.refresh();
      if (batch.some(m => m.type !== "metrics") || !batch.length) reload();  // a status or checkpoint; or the end
      else { job.step = Math.max(job.step, ...batch.map(m => m.data.data.step)); summary.firstChild.replaceWith(jobSummary(job)); }
    }, signal);
  } };
}

// Spec fields as dotted paths: {"training.max_steps": 2000, …}.
function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) for (const [k, v] of Object.entries(value)) flatten(v, prefix ? prefix + "." + k : k, out);
  else out[prefix] = JSON.stringify(value);
  return out;
}

async function comparePage(ids, signal) {
  const jobs = await Promise.all(ids.map(id => api("/v1/jobs/" + id)));
  const metrics = await Promise.all(ids.map(id => api("/v1/jobs/" + id + "/metrics?max_points=" + MAX_POINTS)));
  const runs = jobs.map((job, i) => ({ label: "#" + job.id + " " + job.name, series: metrics[i].series }));
  const specs = jobs.map(job => flatten(job.spec));
  const fields = [...new Set(specs.flatMap(Object.keys))].sort().filter(f => new Set(specs.map(s => s[f])).size > 1);
  const diff = fields.length
    ? table(["field", ...runs.map(r => r.label)], fields.map(f => [f, ...specs.map(s => el("td", { class: "wrap changed" }, s[f] ?? "—"))]))
    : el("p", { class: "muted" }, "The specs are the same.");
  const charts = el("section", { class: "board" });
  const page = el("div", {},
    el("h2", {}, "Compare " + runs.map(r => r.label).join(", ")),
    el("p", {}, ...jobs.flatMap((job, i) => [i ? " · " : "", el("a", { href: "#/jobs/" + job.id }, "#" + job.id), " ", statusBadge(job.status), " step " + steps(job)])),
    el("h3", {}, "Spec differences"), el("div", { class: "spec-diff" }, diff), charts);
  return { page, start: () => {
    const board = new Board(charts, runs, false);
    signal.addEventListener("abort", () => board.destroy());
    runs.forEach((run, i) => follow("/v1/jobs/" + jobs[i].id + "/events", metrics[i].last_event_id, batch => {
      for (const { type, data } of batch) if (type === "metrics") for (const [name, value] of Object.entries(data.data.values)) addPoint(run.series, name, data.data.step, value);
      board.refresh();
    }, signal));
  } };
}

async function workersPage() {
  const workers = await api("/v1/workers");
  return el("div", {},
    el("h2", {}, "Workers"),
    table(["host", "device", "busy slots", "utilisation", "running", "online", "last heartbeat"],
      workers.map(w => [w.name, w.device + (w.gpus.length ? " (" + w.gpus.map(g => g.name + " " + g.memory_gb + " GB").join(", ") + ")" : ""),
        w.busy_slots + " / " + w.slots, progressBar(w.slots ? w.busy_slots / w.slots : 0),
        w.attempts.map(a => (a.job_id == null ? "another user's job" : "job " + a.job_id) + (a.gpus ? " on GPU " + a.gpus.join(",") : "")).join("; ") || "–",
        w.online ? "yes" : "no", when(w.last_heartbeat)])));
}

async function sweepsPage() {
  const page = await api("/v1/sweeps?limit=100");
  const best = sweep => { const t = sweep.trials.find(t => t.number === sweep.best_trial); return t ? "t" + t.number + ": " + number(t.value) : "–"; };
  return el("div", {},
    el("h2", {}, "Sweeps"),
    page.items.length
      ? table(["id", "name", "owner", "status", "trials ended", "objective", "best", "created"], page.items.map(sweep => [
        String(sweep.id), el("a", { href: "#/sweeps/" + sweep.id, "data-focus": "sweep-" + sweep.id }, sweep.name), sweep.owner, statusBadge(sweep.status),
        sweep.trials.filter(t => FINAL.has(t.status)).length + " / " + sweep.spec.budget.max_trials,
        sweep.spec.objective.metric + " (" + sweep.spec.objective.direction + ")", best(sweep), when(sweep.created_at)]))
      : el("p", { class: "muted" }, "No sweeps yet: `trainyard sweep submit FILE` or POST /v1/sweeps."));
}

// A sweep's page: its trials (parameters, status, objective) and their curves of the objective and
// train_loss overlaid. Re-read every LIST_POLL_MS while it runs: one event stream per trial would
// pass the browser's six connections per server.
async function sweepPage(id, signal) {
  const sweep = await api("/v1/sweeps/" + id);
  const metric = sweep.spec.objective.metric;
  const runs = [];  // one per trial, in trial order
  const load = async sweep => {
    const wanted = sweep.trials.filter(t => !runs[t.number] || !FINAL.has(runs[t.number].status));  // new, or not ended when last read
    const series = await Promise.all(wanted.map(t => api("/v1/jobs/" + t.job_id + "/metrics?max_points=" + MAX_POINTS + "&names=" + encodeURIComponent(metric + ",train_loss"))));
    // Updated in place: the board's lines hold these objects.
    wanted.forEach((t, i) => { runs[t.number] = Object.assign(runs[t.number] || { label: "t" + t.number }, { series: series[i].series, status: t.status }); });
  };
  await load(sweep);
  const summary = el("div"), trials = el("div"), charts = el("section", { class: "board" });
  const draw = sweep => {
    const best = sweep.trials.find(t => t.number === sweep.best_trial);
    summary.replaceChildren(
      el("h2", {}, "Sweep " + sweep.id + ": ", sweep.name, " ", statusBadge(sweep.status)),
      el("p", {}, "owner " + sweep.owner + " · " + sweep.spec.sampler.kind + " sampler, pruner " + sweep.spec.pruner.kind + " · objective " +
        metric + " (" + sweep.spec.objective.direction + ") · " + sweep.trials.length + " of " + sweep.spec.budget.max_trials + " trials" +
        (sweep.failure_reason ? " · " + sweep.failure_reason : "")),
      best ? el("p", { id: "best-trial" }, "Best: trial t" + best.number + " (", el("a", { href: "#/jobs/" + best.job_id }, "job " + best.job_id), ") " + metric + " " + number(best.value)) : "",
      sweep.best_spec ? el("details", {}, el("summary", {}, "best spec, ready to submit"), el("pre", { class: "wrap" }, JSON.stringify(sweep.best_spec, null, 2))) : "");
    const paths = Object.keys(sweep.spec.search_space);
    trials.replaceChildren(table(["trial", "job", ...paths, "status", "step", metric, "why it ended"], sweep.trials.map(t => [
      t.number === sweep.best_trial ? el("strong", {}, "t" + t.number + " ★") : "t" + t.number, el("a", { href: "#/jobs/" + t.job_id }, String(t.job_id)),
      ...paths.map(path => short(t.params[path])), statusBadge(t.status), String(t.step), number(t.value), t.reason || "–"])));
  };
  draw(sweep);
  const page = el("div", {}, summary, el("h3", {}, "Trials"), trials, charts);
  return { page, start: () => {
    const board = new Board(charts, runs, false);  // the same array: trials added to `runs` get their lines
    signal.addEventListener("abort", () => board.destroy());
    (async () => {
      let status = sweep.status;
      while (status === "running" || runs.some(r => !FINAL.has(r.status))) {
        await sleep(LIST_POLL_MS, signal);
        if (signal.aborted) return;
        const fresh = await api("/v1/sweeps/" + id);
        await load(fresh);
        if (signal.aborted) return;
        draw(fresh);
        board.refresh();
        status = fresh.status;
      }
    })().catch(error => { if (!signal.aborted) trials.prepend(el("p", { class: "error" }, String(error.message || error))); });
  } };
}

async function usagePage() {
  const [usage, teams] = await Promise.all([api("/v1/usage"), api("/v1/teams")]);
  const hours = seconds => (seconds / 3600).toFixed(3);
  const slots = byDevice => Object.entries(byDevice).map(([device, n]) => n + " " + device).join(", ") || "–";
  return el("div", {},
    el("h2", {}, "Teams"),
    teams.length
      ? el("section", { id: "teams" }, table(["team", "quota", "in use", "borrowed", "waiting jobs", "recent device-hours", "fair share", "members (* default)"],
        teams.map(t => [t.name, slots(t.quota), slots(t.in_use), slots(t.borrowed), String(t.waiting_jobs), t.recent_device_hours.toFixed(3),
          t.fair_share.toFixed(2), t.members.join(", ") || "–"])))
      : el("p", { class: "muted" }, "No teams: every job runs by priority and age. An admin makes them: `trainyard team create NAME cuda=8`."),
    el("h2", {}, "Usage"),
    el("p", { class: "muted" }, "Device-hours (processes × hours run) since the beginning, until " + when(usage.until) + "; an admin sees every user."),
    el("section", { id: "usage-users" }, table(["user", "jobs", "device-hours"], usage.users.map(u => [u.user, String(u.jobs), hours(u.device_seconds)]))),
    el("h3", {}, "Jobs that used the most"),
    table(["id", "name", "owner", "device-hours"],
      usage.jobs.map(j => [el("a", { href: "#/jobs/" + j.job_id }, String(j.job_id)), j.name, j.owner, hours(j.device_seconds)])));
}

// --- Routing: a job's and a comparison's pages stream; the tables are re-read every LIST_POLL_MS ---

function show(page) {
  const view = document.getElementById("view");
  const focused = document.activeElement?.dataset?.focus;  // keep the keyboard's place across a re-render
  const scroll = window.scrollY;
  view.replaceChildren(page);
  window.scrollTo(0, scroll);
  const again = focused && view.querySelector(`[data-focus="${focused}"]`);
  if (again) {
    again.focus();
    if (again.type === "search") again.setSelectionRange(again.value.length, again.value.length);  // typing goes on at the end
  }
}

async function render(mine, signal) {
  const hash = location.hash || "#/jobs";
  const job = hash.match(/^#\/jobs\/(\d+)$/), compare = hash.match(/^#\/compare\/([\d,]+)$/), sweep = hash.match(/^#\/sweeps\/(\d+)$/);
  try {
    if (job || compare || sweep) {
      const { page, start } = job ? await jobPage(job[1], signal) : sweep ? await sweepPage(sweep[1], signal)
        : await comparePage(compare[1].split(",").filter(Boolean), signal);
      if (mine !== generation) return;
      show(page);
      start();
      return;
    }
    const lists = { "#/workers": workersPage, "#/usage": usagePage, "#/sweeps": sweepsPage };
    const page = await (lists[hash] || jobsPage)();
    if (mine !== generation) return;
    show(page);
    await sleep(LIST_POLL_MS, signal);
    if (mine === generation && token()) render(mine, signal);
  } catch (error) {
    if (token() && mine === generation) document.getElementById("view").replaceChildren(el("p", { class: "error" }, String(error.message || error)));
  }
}

// Opened from a one-time link (`trainyard open`, `trainyard up`): #login=CODE, a fragment, so no
// server saw the code. It is taken off the address at once (history, a shared screen) and
// exchanged for this browser's own session token, kept as a pasted token is.
async function signInFromLink() {
  const code = location.hash.match(/^#login=([\w-]+)$/)?.[1];
  if (!code) return;
  history.replaceState(null, "", location.pathname + "#/jobs");
  const response = await fetch("/v1/login", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ code }) });
  if (response.ok) localStorage.setItem("trainyard-token", (await response.json()).token);
  else loginMessage = "That sign-in link was used already or has expired: `trainyard open` makes a new one.";
}

function route() {
  clearTimeout(searching);  // a search typed just before leaving the jobs table must not re-render the next page
  leaving.abort();
  leaving = new AbortController();
  if (location.hash === "#/logout") { localStorage.removeItem("trainyard-token"); location.hash = "#/jobs"; return; }
  if (!token()) { document.getElementById("view").replaceChildren(loginPage(loginMessage)); loginMessage = ""; return; }
  render(++generation, leaving.signal);
}

window.addEventListener("hashchange", route);
signInFromLink().finally(route);
