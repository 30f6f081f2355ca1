// gpuswarm dashboard: polls the coordinator's /v1 API and updates the page in place.
//
// Plain JavaScript, no build step. The one library is uPlot (vendor/uPlot.iife.min.js, loaded before this file),
// which draws the charts on canvases. Every string from the API reaches the page through textContent or an
// attribute value, never as HTML (job and sweep names are user input); uPlot sets its legend's text the same way.
// Query parameters: ?interval=SECONDS (poll period, default 2).
// window.gpuswarmDashboard.chart(key) returns the uPlot drawing the chart data-chart=key (tests read its data).
"use strict";

(() => {
  const TOKEN_KEY = "gpuswarm.ownerToken";
  const MAX_POINTS = 4000; // per job in memory; older points are thinned beyond this
  const params = new URLSearchParams(window.location.search);
  const intervalSeconds = Number(params.get("interval"));
  const INTERVAL_MS = Number.isFinite(intervalSeconds) && intervalSeconds > 0
    ? Math.max(200, intervalSeconds * 1000) : 2000;

  const $ = (id) => document.getElementById(id);
  const state = {
    generation: 0, // bumped on navigation: answers to requests of an older view are dropped
    timer: null,
    running: false,
    again: false,
    nodes: new Map(), // node id -> node, from the last /v1/nodes
    job: null, // {id, points: [], lastStep, detail}
    sweep: null, // {id, detail}
    sweeps: new Map(), // sweep id -> summary, from the last /v1/sweeps
    sweepsAbsent: false, // this coordinator answered /v1/sweeps with 404: an older one, without sweeps
  };

  // ------------------------------------------------------------------------------------------------ API

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  function token() {
    return window.localStorage.getItem(TOKEN_KEY) || "";
  }

  async function api(path, { auth = false } = {}) {
    const headers = { Accept: "application/json" };
    if (auth) headers.Authorization = `Bearer ${token()}`;
    let response;
    try {
      // Relative to the page (/dashboard), so the dashboard also works behind a proxy's path prefix.
      response = await fetch(path, { headers, cache: "no-store" });
    } catch (err) {
      throw new ApiError(0, "unreachable", `Cannot reach the coordinator (${err.message})`);
    }
    let body = null;
    try {
      body = await response.json();
    } catch (err) {
      body = null;
    }
    if (!response.ok) {
      const error = body && body.error ? body.error : {};
      throw new ApiError(response.status, error.code || `http_${response.status}`,
        error.message || `HTTP ${response.status} ${response.statusText}`);
    }
    if (body === null) throw new ApiError(response.status, "bad_json", "the coordinator answered with no JSON");
    return body;
  }

  // ------------------------------------------------------------------------------------------------ DOM helpers

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function setText(node, text) {
    const value = text === undefined || text === null ? "" : String(text);
    if (node.textContent !== value) node.textContent = value;
  }

  function show(node, visible) {
    node.hidden = !visible;
  }

  function message(node, text) {
    setText(node, text || "");
    show(node, Boolean(text));
  }

  // A <dl> of [label, value] pairs, a <div> per pair holding its <dt> and <dd>, updated in place.
  function renderFacts(dl, facts) {
    if (dl.children.length !== facts.length) {
      dl.replaceChildren(...facts.map(() => {
        const pair = el("div");
        pair.append(el("dt"), el("dd"));
        return pair;
      }));
    }
    facts.forEach(([label, value], i) => {
      setText(dl.children[i].children[0], label);
      setText(dl.children[i].children[1], value);
    });
  }

  // Rows that open a hash route on a click or Enter; `target(row)` names it, or null for nowhere (yet).
  function linkRow(row, target) {
    row.className = "clickable";
    row.tabIndex = 0;
    const open = () => {
      const hash = target(row);
      if (hash) window.location.hash = hash;
    };
    row.addEventListener("click", open);
    row.addEventListener("keydown", (event) => { if (event.key === "Enter") open(); });
  }

  // Keyed rows: existing rows are updated cell by cell (text only when it changed), new ones created, gone ones
  // removed, and rows moved only when out of order, so a poll does not rebuild the table.
  function syncRows(tbody, items, keyOf, keyAttr, cellsOf, onCreate) {
    const existing = new Map();
    for (const row of Array.from(tbody.rows)) existing.set(row.getAttribute(keyAttr), row);
    let previous = null;
    for (const item of items) {
      const key = String(keyOf(item));
      let row = existing.get(key);
      const cells = cellsOf(item);
      if (!row) {
        row = document.createElement("tr");
        row.setAttribute(keyAttr, key);
        for (const cell of cells) {
          const td = el("td");
          if (cell.className) td.className = cell.className;
          row.appendChild(td);
        }
        if (onCreate) onCreate(row, item);
      }
      existing.delete(key);
      cells.forEach((cell, i) => {
        const td = row.cells[i];
        setText(td, cell.text);
        if (cell.title !== undefined && td.title !== cell.title) td.title = cell.title;
        if (cell.state !== undefined) td.dataset.state = cell.state;
      });
      const expected = previous ? previous.nextSibling : tbody.firstChild;
      if (expected !== row) tbody.insertBefore(row, expected);
      previous = row;
    }
    for (const row of existing.values()) row.remove();
  }

  // ------------------------------------------------------------------------------------------------ formatting

  const pad = (n) => String(n).padStart(2, "0");

  function clock(seconds) {
    if (!seconds) return "";
    const d = new Date(seconds * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function dateTime(seconds) {
    if (!seconds) return "";
    const d = new Date(seconds * 1000);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(seconds)}`;
  }

  function duration(seconds) {
    if (!Number.isFinite(seconds)) return "";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
    return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }

  function ago(seconds) {
    if (!seconds) return "never";
    return `${duration(Date.now() / 1000 - seconds)} ago`;
  }

  function num(value, digits = 2) {
    return value === null || value === undefined || !Number.isFinite(Number(value)) ? "–"
      : Number(value).toFixed(digits);
  }

  function percent(value) {
    return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`;
  }

  function bytes(size) {
    if (!Number.isFinite(size)) return "";
    const units = ["B", "KB", "MB", "GB"];
    let value = size;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
  }

  function gpuText(resources) {
    const r = resources || {};
    const gpus = Array.isArray(r.gpus) ? r.gpus : [];
    const host = `${r.cpu_cores || "?"} cores, ${num(r.ram_gb, 0)} GB`;
    if (!gpus.length) return `CPU only (${host})`;
    return gpus.map((g) => `${g.count || 1}× ${g.model} ${num(g.memory_gb, 0)} GB`).join(", ");
  }

  function gpuCount(resources) {
    const gpus = resources && Array.isArray(resources.gpus) ? resources.gpus : [];
    return gpus.reduce((sum, g) => sum + (g.count || 1), 0);
  }

  function shortId(id) {
    return id && id.length > 14 ? `${id.slice(0, 12)}…` : id || "";
  }

  // A sweep's metric can be anything the workload reports: four significant digits, exponents at the extremes.
  function metricValue(value) {
    if (value === null || value === undefined || !Number.isFinite(Number(value))) return "–";
    const v = Number(value);
    const rounded = Number(v.toPrecision(4));
    return v !== 0 && (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3) ? rounded.toExponential() : String(rounded);
  }

  function paramValue(value) {
    if (typeof value === "number") return metricValue(value);
    if (typeof value === "string") return value;
    return JSON.stringify(value);
  }

  function paramsText(params) {
    return Object.entries(params || {}).map(([key, value]) => `${key}=${paramValue(value)}`).join(", ");
  }

  // ------------------------------------------------------------------------------------------------ status line

  function updated(ok, error) {
    const banner = $("error-banner");
    if (ok) {
      const now = Date.now() / 1000;
      setText($("last-updated"), `Last updated ${clock(now)}`);
      $("last-updated").dataset.updatedAt = String(now);
      message(banner, "");
    } else {
      const since = $("last-updated").dataset.updatedAt;
      const stale = since ? ` Showing data from ${clock(Number(since))}.` : "";
      message(banner, `${error.message}. Retrying every ${INTERVAL_MS / 1000} s.${stale}`);
      if (error.status === 0) state.sweepsAbsent = false; // it may come back upgraded: ask for sweeps again
    }
  }

  // ------------------------------------------------------------------------------------------------ sign-in

  function renderAuth() {
    const signedIn = Boolean(token());
    show($("signin"), !signedIn);
    show($("signout"), signedIn);
    show($("jobs-wrap"), signedIn);
    if (!signedIn) {
      setText($("owner"), "");
      message($("auth-message"), "");
      show($("sweeps-card"), false);
    }
  }

  function authProblem(err) {
    if (err.status === 401) {
      return `The coordinator refused this owner token (401: ${err.message}). Sign out and enter a valid token.`;
    }
    if (err.status === 403) return `Not allowed with this owner token (403: ${err.message}).`;
    return null;
  }

  // ------------------------------------------------------------------------------------------------ overview

  async function refreshOwner() {
    if (!token()) return;
    try {
      const me = await api("v1/owners/me", { auth: true });
      setText($("owner"), `Signed in as ${me.name} · balance ${num(me.balance, 2)}`);
    } catch (err) {
      if (!authProblem(err)) throw err;
      setText($("owner"), "");
    }
  }

  async function refreshJobs(generation) {
    if (!token()) return;
    let body;
    try {
      body = await api("v1/jobs", { auth: true });
    } catch (err) {
      const problem = authProblem(err);
      if (!problem) throw err;
      if (generation !== state.generation) return;
      message($("auth-message"), problem);
      show($("jobs-wrap"), false);
      return;
    }
    if (generation !== state.generation) return;
    message($("auth-message"), "");
    show($("jobs-wrap"), true);
    const jobs = Array.isArray(body.jobs) ? body.jobs : [];
    show($("jobs-empty"), jobs.length === 0);
    syncRows($("jobs-table").tBodies[0], jobs, (j) => j.id, "data-job-id", (j) => {
      const p = j.progress || {};
      return [
        { text: j.id, className: "mono" },
        { text: j.name || "(unnamed)", title: j.name || "" },
        { text: j.state, state: j.state, className: "state" },
        { text: p.epoch ?? "–", className: "num" },
        { text: percent(j.final_accuracy ?? p.accuracy), className: "num" },
        { text: num(p.loss, 4), className: "num" },
        { text: num(p.samples_per_second, 1), className: "num" },
        { text: j.active_nodes ?? 0, className: "num" },
        { text: dateTime(j.created_at) },
      ];
    }, (row, j) => linkRow(row, () => `#/jobs/${encodeURIComponent(j.id)}`));
  }

  async function refreshNodes(generation) {
    const body = await api("v1/nodes");
    if (generation !== state.generation) return;
    const nodes = Array.isArray(body.nodes) ? body.nodes : [];
    state.nodes = new Map(nodes.map((n) => [n.id, n]));
    const online = nodes.filter((n) => n.online && !n.revoked);
    const busy = online.filter((n) => n.job_ids && n.job_ids.length);
    const gpus = online.reduce((sum, n) => sum + gpuCount(n.resources), 0);
    const verified = nodes.filter((n) => n.verified).length;
    setText($("nodes-summary"), `${nodes.length} registered · ${online.length} online · ${busy.length} busy · `
      + `${gpus} GPUs online · ${verified} verified`);
    syncRows($("nodes-table").tBodies[0], nodes, (n) => n.id, "data-node-id", (n) => {
      const status = n.revoked ? "revoked" : n.online ? (n.state || "online") : "offline";
      return [
        { text: shortId(n.id), title: n.id, className: "mono" },
        { text: gpuText(n.resources) },
        { text: num(n.price_per_gpu_hour, 2), className: "num" },
        { text: num(n.reputation, 2), className: "num" },
        { text: n.verified ? "✓ verified" : "–" },
        { text: status, state: n.online && !n.revoked ? "online" : "offline", className: "state" },
        { text: (n.job_ids && n.job_ids.length ? n.job_ids : []).join(", "), className: "mono" },
        { text: ago(n.last_seen), title: dateTime(n.last_seen) },
      ];
    });
    applyNodeFilter();
  }

  function applyNodeFilter() {
    const query = $("nodes-filter").value.trim().toLowerCase();
    for (const row of $("nodes-table").tBodies[0].rows) {
      const node = state.nodes.get(row.getAttribute("data-node-id"));
      const haystack = `${row.textContent} ${node ? node.id : ""}`.toLowerCase();
      row.hidden = Boolean(query) && !haystack.includes(query);
    }
  }

  // ------------------------------------------------------------------------------------------------ job page

  const METRICS = [
    { key: "loss", label: "loss", format: (v) => num(v, 4), floorZero: true },
    { key: "accuracy", label: "accuracy", format: percent, range: [0, 1],
      tick: (v) => `${Number((100 * v).toFixed(1))}%` },
    { key: "samples_per_second", label: "samples/s", format: (v) => num(v, 1), floorZero: true },
  ];

  function newJobState(id) {
    return { id, points: [], lastStep: null, detail: null };
  }

  function addPoints(job, points) {
    for (const p of points) {
      if (!p || !Number.isFinite(p.global_step) || !Number.isFinite(p.at)) continue;
      if (job.lastStep !== null && p.global_step <= job.lastStep) continue;
      job.points.push(p);
      job.lastStep = p.global_step;
    }
    if (job.points.length > MAX_POINTS) {
      // Thin the older half; the recent half keeps every point.
      const half = Math.floor(job.points.length / 2);
      job.points = job.points.slice(0, half).filter((_, i) => i % 2 === 0).concat(job.points.slice(half));
    }
  }

  async function refreshProgress(job, generation) {
    const after = job.lastStep === null ? "" : `?after=${encodeURIComponent(job.lastStep)}`;
    const body = await api(`v1/jobs/${encodeURIComponent(job.id)}/progress${after}`, { auth: true });
    if (generation !== state.generation) return;
    // A long job's history comes in pages of at most 5000 points (body.truncated): the next poll asks for more.
    addPoints(job, Array.isArray(body.points) ? body.points : []);
  }

  async function refreshJob(generation) {
    const job = state.job;
    let detail;
    try {
      detail = await api(`v1/jobs/${encodeURIComponent(job.id)}`, { auth: true });
      await refreshProgress(job, generation);
    } catch (err) {
      if (generation !== state.generation) return;
      if (err.status === 401 || err.status === 403 || err.status === 404) {
        const text = err.status === 404 ? `No job ${job.id} (404: ${err.message}).`
          : authProblem(err) || err.message;
        message($("job-message"), token() ? text : "Sign in with the owner token to see this job.");
        show($("job-card"), false);
        return;
      }
      throw err;
    }
    if (generation !== state.generation) return;
    message($("job-message"), "");
    show($("job-card"), true);
    job.detail = detail;
    renderJob(job);
  }

  function renderJob(job) {
    const d = job.detail;
    const p = d.progress || {};
    setText($("job-name"), d.name || "(unnamed job)");
    $("job-name").title = d.name || "";
    const badge = $("job-state");
    setText(badge, d.state);
    badge.dataset.state = d.state;
    document.title = `${d.name || d.id} · gpuswarm`;
    const facts = [
      ["Job", d.id],
      ["Workload", d.spec && d.spec.workload],
      ["Epoch", p.epoch ?? "–"],
      ["Global step", p.global_step ?? "–"],
      ["Accuracy", percent(p.accuracy)],
      ["Final accuracy", percent(d.final_accuracy)],
      ["Loss", num(p.loss, 4)],
      ["Samples/s", num(p.samples_per_second, 1)],
      ["Peers", p.peers ?? "–"],
      ["Created", dateTime(d.created_at)],
      ["Started", dateTime(d.started_at) || "–"],
      ["Finished", dateTime(d.finished_at) || "–"],
    ];
    if (d.error) facts.push(["Error", d.error]);
    renderFacts($("job-facts"), facts);

    for (const metric of METRICS) drawJobChart(job, metric);
    renderMembers(d);
    renderEvents(d.events || []);
    syncRows($("artifacts-table").tBodies[0], d.artifacts || [], (a) => a.name, "data-artifact", (a) => [
      { text: a.name, className: "mono" },
      { text: bytes(a.size), className: "num" },
      { text: a.final ? "final" : "checkpoint" },
      { text: percent(a.accuracy), className: "num" },
      { text: dateTime(a.created_at) },
    ]);
  }

  function renderMembers(d) {
    const byNode = new Map();
    for (const a of d.assignments || []) { // the latest assignment of each node
      const seen = byNode.get(a.node_id);
      if (!seen || (a.created_at || 0) >= (seen.assignment.created_at || 0)) {
        byNode.set(a.node_id, { node_id: a.node_id, assignment: a, contribution: null });
      }
    }
    for (const c of d.contributions || []) {
      const row = byNode.get(c.node_id) || { node_id: c.node_id, assignment: null, contribution: null };
      row.contribution = c;
      byNode.set(c.node_id, row);
    }
    syncRows($("members-table").tBodies[0], Array.from(byNode.values()), (m) => m.node_id, "data-node-id", (m) => {
      const a = m.assignment || {};
      const c = m.contribution || {};
      const node = state.nodes.get(m.node_id);
      return [
        { text: shortId(m.node_id), title: m.node_id, className: "mono" },
        { text: node ? gpuText(node.resources) : "" },
        { text: a.state ? `${a.state}${a.reason ? ` (${a.reason})` : ""}` : "–", state: a.state || "",
          className: "state" },
        { text: a.shard_index ?? "–", className: "num" },
        { text: num(a.price_per_gpu_hour, 2), className: "num" },
        { text: c.claims ?? 0, className: "num" },
        { text: c.samples ?? 0, className: "num" },
        { text: c.steps ?? 0, className: "num" },
        { text: num(c.compute_seconds, 1), className: "num" },
        { text: num(c.paid, 4), className: "num" },
        { text: c.flagged ?? 0, className: "num" },
        { text: dateTime(a.created_at) },
      ];
    });
  }

  function renderEvents(events) {
    const list = $("events");
    const key = events.map((e) => `${e.at}|${e.message}`).join("\n");
    if (list.dataset.key === key) return;
    list.dataset.key = key;
    const stick = list.scrollTop + list.clientHeight >= list.scrollHeight - 4;
    list.replaceChildren(...events.map((e) => {
      const item = el("li");
      item.appendChild(el("time", clock(e.at), "muted"));
      item.appendChild(el("span", e.message));
      return item;
    }));
    if (stick) list.scrollTop = list.scrollHeight;
  }

  // ------------------------------------------------------------------------------------------------ charts (uPlot)

  const CHART_HEIGHT = 220;
  // Trial lines: the accent first, then colours that read on the light and the dark background alike.
  const PALETTE = ["#2563eb", "#16a34a", "#db2777", "#ea580c", "#7c3aed", "#0891b2", "#ca8a04", "#64748b"];
  const INTEGER_INCRS = [0, 1, 2, 3, 4, 5, 6].flatMap((e) => [1, 2, 5].map((m) => m * 10 ** e)); // steps, trials
  const charts = new Map(); // data-chart key -> {plot, shape, dataKey, meta}

  // The page's colours, for the canvas (which cannot read CSS variables), taken when a chart is built.
  function colors() {
    const style = window.getComputedStyle(document.documentElement);
    const read = (name) => style.getPropertyValue(name).trim();
    return { accent: read("--accent"), muted: read("--muted"), line: read("--line"), ok: read("--ok"),
      warn: read("--warn"), bad: read("--bad") };
  }

  function axis(c, extra) {
    return { stroke: c.muted, grid: { stroke: c.line, width: 1 }, ticks: { stroke: c.line, width: 1 }, ...extra };
  }

  // A y axis as wide as its longest label (uPlot's fixed 50 px cuts "100.0%" short); `format` or uPlot's own.
  function valueAxis(c, format) {
    const size = (u, values) => 24 + 8 * Math.max(2, ...(values || []).map((v) => String(v).length));
    return axis(c, format ? { size, values: (u, splits) => splits.map(format) } : { size });
  }

  function integerAxis(c) {
    return axis(c, { incrs: INTEGER_INCRS, values: (u, splits) => splits.map((v) => String(v)) });
  }

  // Clock times on one line, 24-hour like the rest of the page: seconds for a short window, dates for days.
  function timeAxis(c) {
    return axis(c, { space: 70, values: (u, splits) => {
      const span = u.scales.x.max - u.scales.x.min;
      return splits.map((v) => {
        const d = new Date(v * 1000);
        const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
        if (span > 2 * 86400) return `${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hm}`;
        return span > 1800 ? hm : `${hm}:${pad(d.getSeconds())}`;
      });
    } });
  }

  // A y range around the data with 5% room, from zero for counts and losses; [0, 1] before there is any.
  function paddedRange(floorZero) {
    return (u, lo, hi) => {
      if (lo === null || hi === null || !Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1];
      const bottom = floorZero ? Math.min(0, lo) : lo;
      const room = (hi - bottom) * 0.05 || Math.abs(hi) * 0.05 || 1;
      return [floorZero && bottom === 0 ? 0 : bottom - room, hi + room];
    };
  }

  function chartWidth(container) {
    return Math.max(240, Math.floor(container.clientWidth) || 400); // a hidden view measures 0: the observer fixes it
  }

  const resizer = new ResizeObserver((entries) => {
    for (const entry of entries) {
      const chart = charts.get(entry.target.dataset.chart);
      const width = Math.floor(entry.contentRect.width);
      if (chart && width > 0 && width !== chart.plot.width) chart.plot.setSize({ width, height: CHART_HEIGHT });
    }
  });

  // The user dragged a window onto the x axis: new data must not reset it.
  function zoomed(plot) {
    const xs = plot.data[0];
    const { min, max } = plot.scales.x;
    return xs.length > 1 && (min > xs[0] || max < xs[xs.length - 1]);
  }

  // Draws `data` (uPlot's columns: x, then one array per series) in the element data-chart=key, with `points`
  // points. `shape` names everything `buildOptions(colors, chart)` depends on (series, labels, styles): a new
  // shape builds a new plot, the same shape only gets the new data, keeping the legend's toggles and a zoom.
  // `dataKey` skips even that when nothing changed; `meta` is kept on the chart for the options' callbacks.
  function plotChart(key, { shape, buildOptions, data, dataKey, points, meta }) {
    const container = document.querySelector(`[data-chart="${key}"]`);
    container.dataset.points = String(points);
    show(container.querySelector(".chart-empty"), points === 0);
    let chart = charts.get(key);
    if (chart && chart.shape !== shape) {
      clearChart(key);
      chart = null;
    }
    if (!chart) {
      chart = { shape, dataKey, meta, plot: null };
      const options = { width: chartWidth(container), height: CHART_HEIGHT, ...buildOptions(colors(), chart) };
      chart.plot = new uPlot(options, data, container);
      charts.set(key, chart);
      resizer.observe(container);
      return;
    }
    chart.meta = meta;
    if (chart.dataKey === dataKey) return;
    chart.dataKey = dataKey;
    chart.plot.setData(data, !zoomed(chart.plot));
  }

  function clearChart(key) {
    const container = document.querySelector(`[data-chart="${key}"]`);
    const chart = charts.get(key);
    if (chart) {
      resizer.unobserve(container);
      chart.plot.destroy();
      charts.delete(key);
    }
    container.dataset.points = "0";
    show(container.querySelector(".chart-empty"), true);
  }

  // A job's metric over time; the legend follows the cursor with the point's time, step and value.
  function drawJobChart(job, metric) {
    const series = job.points.filter((p) => Number.isFinite(p[metric.key]));
    const latest = series.length ? metric.format(series[series.length - 1][metric.key]) : "";
    setText($(`latest-${metric.key}`), latest);
    plotChart(metric.key, {
      shape: job.id,
      data: [series.map((p) => p.at), series.map((p) => p[metric.key])],
      dataKey: `${series.length}:${job.lastStep}`,
      points: series.length,
      meta: series,
      buildOptions: (c, chart) => ({
        scales: { x: { time: true },
          y: { range: metric.range ? () => [...metric.range] : paddedRange(metric.floorZero) } },
        axes: [timeAxis(c), valueAxis(c, metric.tick)],
        series: [
          { label: "time", value: (u, v, s, i) => {
            const p = i === null ? null : chart.meta[i];
            return p ? `${clock(p.at)} · step ${p.global_step} · epoch ${p.epoch ?? "–"}` : "–";
          } },
          { label: metric.label, stroke: c.accent, width: 2, value: (u, v) => (v === null ? "–" : metric.format(v)) },
        ],
      }),
    });
  }

  // ------------------------------------------------------------------------------------------------ sweeps

  // Older coordinators have no /v1/sweeps (404): the card stays hidden, and is not asked for again (each 404 is a
  // console error in the browser) until the coordinator has been unreachable, as it is while being upgraded.
  async function refreshSweeps(generation) {
    if (!token() || state.sweepsAbsent) {
      show($("sweeps-card"), false);
      return;
    }
    let body;
    try {
      body = await api("v1/sweeps", { auth: true });
    } catch (err) {
      // A refused token is the jobs card's to explain; a coordinator without sweeps says nothing.
      if (!(err.status === 404 || err.status === 405 || authProblem(err))) throw err;
      if (err.status === 404 || err.status === 405) state.sweepsAbsent = true;
      if (generation === state.generation) show($("sweeps-card"), false);
      return;
    }
    if (generation !== state.generation) return;
    const sweeps = Array.isArray(body.sweeps) ? body.sweeps : [];
    state.sweeps = new Map(sweeps.map((sw) => [sw.id, sw]));
    show($("sweeps-card"), true);
    show($("sweeps-empty"), sweeps.length === 0);
    syncRows($("sweeps-table").tBodies[0], sweeps, (sw) => sw.id, "data-sweep-id", (sw) => [
      { text: sw.id, className: "mono" },
      { text: sw.name || "(unnamed)", title: sw.name || "" },
      { text: sw.state, state: sw.state, className: "state" },
      { text: `${sw.metric} (${sw.direction})` },
      { text: `${sw.trials_done ?? 0} / ${sw.trials ?? "?"}`, className: "num" },
      { text: metricValue(sw.best_value), className: "num" },
      { text: sw.best_trial === null || sw.best_trial === undefined ? "–" : `#${sw.best_trial}`, className: "num" },
      { text: dateTime(sw.created_at) },
    ], (row, sw) => linkRow(row, () => `#/sweeps/${encodeURIComponent(sw.id)}`));
  }

  async function refreshSweep(generation) {
    const sweep = state.sweep;
    let detail;
    try {
      detail = await api(`v1/sweeps/${encodeURIComponent(sweep.id)}`, { auth: true });
    } catch (err) {
      if (generation !== state.generation) return;
      if (err.status === 401 || err.status === 403 || err.status === 404) {
        const text = err.status === 404 ? `No sweep ${sweep.id} (404: ${err.message}).`
          : authProblem(err) || err.message;
        message($("sweep-message"), token() ? text : "Sign in with the owner token to see this sweep.");
        show($("sweep-card"), false);
        return;
      }
      throw err;
    }
    if (generation !== state.generation) return;
    message($("sweep-message"), "");
    show($("sweep-card"), true);
    sweep.detail = detail;
    renderSweep(detail);
  }

  // A trial's value: its final one, or else the last point of its curve (a running or a pruned trial).
  function trialValue(trial) {
    if (Number.isFinite(trial.value)) return trial.value;
    const curve = trialCurve(trial);
    return curve.length ? curve[curve.length - 1][1] : null;
  }

  function trialCurve(trial) {
    const curve = Array.isArray(trial.curve) ? trial.curve : [];
    return curve.filter((p) => Array.isArray(p) && Number.isFinite(p[0]) && Number.isFinite(p[1]));
  }

  function bestNumber(d) {
    if (d.best && Number.isFinite(d.best.number)) return d.best.number;
    return Number.isFinite(d.best_trial) ? d.best_trial : null;
  }

  function renderSweep(d) {
    // In the detail `trials` is the list of trials: the planned count is `trials_planned`, or else the summary's
    // `trials` from the last sweep list.
    const trials = (Array.isArray(d.trials) ? d.trials : []).slice().sort((a, b) => a.number - b.number);
    const summary = state.sweeps.get(d.id);
    const planned = Number.isFinite(d.trials_planned) ? d.trials_planned
      : summary && Number.isFinite(summary.trials) ? summary.trials : null;
    const best = bestNumber(d);
    setText($("sweep-name"), d.name || "(unnamed sweep)");
    $("sweep-name").title = d.name || "";
    setText($("sweep-state"), d.state);
    $("sweep-state").dataset.state = d.state;
    document.title = `${d.name || d.id} · gpuswarm`;
    for (const node of document.querySelectorAll(".sweep-metric")) setText(node, d.metric);
    setText($("latest-sweep-best"), d.best ? `best ${metricValue(d.best.value)}` : "");

    const facts = [
      ["Sweep", d.id],
      ["Metric", `${d.metric} (${d.direction})`],
      ["Trials done", planned === null ? `${d.trials_done ?? 0}` : `${d.trials_done ?? 0} of ${planned}`],
      ["Trials started", trials.length],
      ["Best value", metricValue(d.best ? d.best.value : d.best_value)],
      ["Best trial", best === null ? "–" : `#${best}`],
      ["Best params", d.best ? paramsText(d.best.params) || "–" : "–"],
      ["Best job", d.best && d.best.job_id ? d.best.job_id : "–"],
      ["Created", dateTime(d.created_at)],
    ];
    for (const [param, spec] of Object.entries(d.space || {})) facts.push([`Space: ${param}`, paramValue(spec)]);
    renderFacts($("sweep-facts"), facts);

    show($("trials-empty"), trials.length === 0);
    syncRows($("trials-table").tBodies[0], trials, (t) => t.number, "data-trial", (t) => [
      { text: `#${t.number}`, className: "num" },
      { text: t.number === best ? "★ best" : "", state: t.number === best ? "best" : "", className: "state" },
      { text: t.state, state: t.state, className: "state" },
      { text: metricValue(trialValue(t)), title: Number.isFinite(t.value) ? "final" : "last reported",
        className: "num" },
      { text: t.pruned_at_step ?? "–", className: "num" },
      { text: paramsText(t.params), title: paramsText(t.params) },
      { text: t.job_id || "–", className: "mono" },
    ], (row) => linkRow(row, (r) => { // the trial's job, once it has one (read at the click: it may have started)
      const latest = state.sweep && state.sweep.detail ? state.sweep.detail.trials : null;
      const trial = (Array.isArray(latest) ? latest : []).find((t) => String(t.number) === r.dataset.trial);
      return trial && trial.job_id ? `#/jobs/${encodeURIComponent(trial.job_id)}` : null;
    }));

    drawTrialValues(d, trials, best);
    drawTrialCurves(d, trials, best);
  }

  // The scatter: each trial's value at its number, one series per kind of trial, the best one ringed.
  const TRIAL_KINDS = [
    { label: "complete", states: ["complete"], color: (c) => c.accent },
    { label: "running", states: ["running"], color: (c) => c.ok },
    { label: "pruned", states: ["pruned"], color: (c) => c.muted },
    { label: "failed", states: ["failed", "cancelled"], color: (c) => c.bad },
  ];

  function drawTrialValues(d, trials, best) {
    const shown = trials.filter((t) => trialValue(t) !== null);
    const values = shown.map(trialValue);
    const data = [shown.map((t) => t.number)];
    for (const kind of TRIAL_KINDS) {
      data.push(shown.map((t, i) => (kind.states.includes(t.state) ? values[i] : null)));
    }
    data.push(shown.map((t, i) => (t.number === best ? values[i] : null)));
    const dot = (color, size) => ({ show: true, size, width: 2, stroke: color, fill: color });
    plotChart("sweep-trials", {
      shape: `${d.id}:${d.metric}`,
      data,
      dataKey: shown.map((t, i) => `${t.number}:${t.state}:${values[i]}`).join(",") + `:${best}`,
      points: shown.length,
      meta: shown,
      buildOptions: (c, chart) => ({
        scales: { x: { time: false, range: (u, lo, hi) => [(lo ?? 0) - 0.5, (hi ?? 0) + 0.5] },
          y: { range: paddedRange(false) } },
        axes: [integerAxis(c), valueAxis(c, metricValue)],
        series: [
          { label: "trial", value: (u, v, s, i) => {
            const t = i === null ? null : chart.meta[i];
            return t ? `#${t.number} · ${paramsText(t.params) || "no params"}` : "–";
          } },
          ...TRIAL_KINDS.map((kind) => ({ label: kind.label, stroke: kind.color(c), paths: () => null,
            points: dot(kind.color(c), 7), value: (u, v) => (v === null ? "–" : metricValue(v)) })),
          { label: "best", stroke: c.warn, paths: () => null, value: (u, v) => (v === null ? "–" : metricValue(v)),
            points: { show: true, size: 15, width: 2.5, stroke: c.warn, fill: "transparent" } },
        ],
      }),
    });
  }

  // The learning curves: one line per trial against the global step; pruned ones dashed and grey, failed ones
  // dashed red, the best one thicker.
  function drawTrialCurves(d, trials, best) {
    const drawn = trials.filter((t) => trialCurve(t).length > 0);
    const curves = drawn.map(trialCurve);
    // uPlot's x column is shared: join() aligns the curves on the union of their steps (undefined elsewhere,
    // which the lines span).
    const data = drawn.length
      ? uPlot.join(curves.map((curve) => [curve.map((p) => p[0]), curve.map((p) => p[1])]))
      : [[]];
    plotChart("sweep-curves", {
      shape: `${d.id}:${d.metric}:` + drawn.map((t) => `${t.number}/${t.state}/${t.number === best}`).join(","),
      data,
      dataKey: curves.map((curve) => `${curve.length}:${curve.length ? curve[curve.length - 1][1] : ""}`).join(","),
      points: curves.reduce((sum, curve) => sum + curve.length, 0),
      meta: null,
      buildOptions: (c) => ({
        // The legend shows a trial's value at the hovered step, or at one within 24 px: none past a curve's end.
        cursor: { hover: { prox: 24 } },
        scales: { x: { time: false }, y: { range: paddedRange(false) } },
        axes: [integerAxis(c), valueAxis(c, metricValue)],
        series: [
          { label: "step", value: (u, v) => (v === null ? "–" : String(v)) },
          ...drawn.map((t) => {
            const stopped = t.state === "pruned" ? c.muted : t.state === "failed" || t.state === "cancelled" ? c.bad
              : null;
            return {
              label: `#${t.number}${t.number === best ? " ★" : ""}${t.state === "pruned" ? " (pruned)" : ""}`,
              stroke: stopped || PALETTE[t.number % PALETTE.length],
              width: t.number === best ? 3 : 1.5,
              dash: stopped ? [6, 4] : undefined,
              spanGaps: true,
              points: { show: false }, // dots would hide the dashes
              value: (u, v) => (v === null || v === undefined ? "–" : metricValue(v)),
            };
          }),
        ],
      }),
    });
  }

  // ------------------------------------------------------------------------------------------------ routing, polling

  // #/ (the overview), #/jobs/ID or #/sweeps/ID.
  function route() {
    const match = /^#\/(jobs|sweeps)\/([^/]+)$/.exec(window.location.hash);
    return match ? { view: match[1], id: decodeURIComponent(match[2]) } : { view: "overview", id: null };
  }

  function resetJobView(jobId) {
    setText($("job-name"), jobId);
    setText($("job-state"), "");
    $("job-facts").replaceChildren();
    for (const metric of METRICS) {
      clearChart(metric.key);
      setText($(`latest-${metric.key}`), "");
    }
    for (const id of ["members-table", "artifacts-table"]) $(id).tBodies[0].replaceChildren();
    $("events").replaceChildren();
    delete $("events").dataset.key;
  }

  function resetSweepView(sweepId) {
    setText($("sweep-name"), sweepId);
    setText($("sweep-state"), "");
    $("sweep-facts").replaceChildren();
    for (const key of ["sweep-trials", "sweep-curves"]) clearChart(key);
    setText($("latest-sweep-best"), "");
    $("trials-table").tBodies[0].replaceChildren();
  }

  function navigate() {
    state.generation += 1;
    const { view, id } = route();
    show($("view-overview"), view === "overview");
    show($("view-job"), view === "jobs");
    show($("view-sweep"), view === "sweeps");
    if (view === "jobs" && (!state.job || state.job.id !== id)) {
      state.job = newJobState(id);
      resetJobView(id);
    }
    if (view === "sweeps" && (!state.sweep || state.sweep.id !== id)) {
      state.sweep = { id, detail: null };
      resetSweepView(id);
    }
    if (view !== "jobs") state.job = null;
    if (view !== "sweeps") state.sweep = null;
    if (view === "overview") document.title = "gpuswarm dashboard";
    poll();
  }

  async function tick() {
    const generation = state.generation;
    const work = [refreshNodes(generation), refreshOwner()];
    if (state.job) work.push(refreshJob(generation));
    else if (state.sweep) work.push(refreshSweep(generation));
    else work.push(refreshJobs(generation), refreshSweeps(generation));
    const results = await Promise.allSettled(work);
    const failed = results.find((r) => r.status === "rejected");
    updated(!failed, failed && failed.reason);
  }

  // One poll at a time: a poll asked for while one runs (navigation, sign-in) runs right after it.
  async function poll() {
    window.clearTimeout(state.timer);
    if (state.running) {
      state.again = true;
      return;
    }
    state.running = true;
    try {
      await tick();
    } catch (err) {
      updated(false, err);
    } finally {
      state.running = false;
      if (state.again) {
        state.again = false;
        poll();
      } else {
        state.timer = window.setTimeout(poll, INTERVAL_MS);
      }
    }
  }

  function init() {
    $("signin").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token-input").value.trim();
      if (!value) return;
      window.localStorage.setItem(TOKEN_KEY, value);
      $("token-input").value = "";
      renderAuth();
      state.generation += 1;
      poll();
    });
    $("signout").addEventListener("click", () => {
      window.localStorage.removeItem(TOKEN_KEY);
      $("jobs-table").tBodies[0].replaceChildren();
      $("sweeps-table").tBodies[0].replaceChildren();
      state.sweeps = new Map();
      renderAuth();
      state.generation += 1;
      if (route().view !== "overview") window.location.hash = "#/";
      else poll();
    });
    $("nodes-filter").addEventListener("input", applyNodeFilter);
    window.addEventListener("hashchange", navigate);
    renderAuth();
    navigate();
  }

  window.gpuswarmDashboard = Object.freeze({ chart: (key) => (charts.has(key) ? charts.get(key).plot : null) });
  init();
})();
