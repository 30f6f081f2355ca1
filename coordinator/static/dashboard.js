// gpuswarm dashboard: polls the coordinator's /v1 API and updates the page in place.
//
// Plain JavaScript, no build step, no libraries. Every string from the API reaches the page through textContent
// or an attribute value, never as HTML (job names are user input). Charts are inline SVG drawn here.
// Query parameters: ?interval=SECONDS (poll period, default 2).
"use strict";

(() => {
  const TOKEN_KEY = "gpuswarm.ownerToken";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const MAX_POINTS = 4000; // per job in memory; older points are thinned beyond this
  const MAX_CIRCLES = 300; // a dot per point up to this many, the line alone beyond
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

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = String(text);
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
    }, (row, j) => {
      row.className = "clickable";
      row.tabIndex = 0;
      const open = () => { window.location.hash = `#/jobs/${encodeURIComponent(j.id)}`; };
      row.addEventListener("click", open);
      row.addEventListener("keydown", (event) => { if (event.key === "Enter") open(); });
    });
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
    { key: "loss", format: (v) => num(v, 4), floorZero: true },
    { key: "accuracy", format: percent, range: [0, 1] },
    { key: "samples_per_second", format: (v) => num(v, 1), floorZero: true },
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
    const dl = $("job-facts");
    if (dl.children.length !== facts.length) { // a <div> per fact, holding its <dt> and <dd>
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

    for (const metric of METRICS) drawChart(job, metric);
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

  // ------------------------------------------------------------------------------------------------ charts

  function drawChart(job, metric) {
    const chart = document.querySelector(`svg[data-chart="${metric.key}"]`);
    const series = job.points.filter((p) => Number.isFinite(p[metric.key]));
    const latest = series.length ? metric.format(series[series.length - 1][metric.key]) : "";
    setText($(`latest-${metric.key}`), latest);
    const signature = `${job.id}:${series.length}:${job.lastStep}`;
    if (chart.dataset.signature === signature) return;
    chart.dataset.signature = signature;
    chart.setAttribute("data-points", String(series.length));

    const { width: W, height: H } = chart.viewBox.baseVal;
    const box = { left: 56, right: 12, top: 12, bottom: 28 };
    const parts = [];
    if (!series.length) {
      parts.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
      chart.replaceChildren(...parts);
      return;
    }
    const t0 = series[0].at;
    const t1 = Math.max(series[series.length - 1].at, t0 + 1);
    const values = series.map((p) => p[metric.key]);
    let [lo, hi] = metric.range || [Math.min(...values), Math.max(...values)];
    if (metric.floorZero) lo = Math.min(0, lo);
    if (!metric.range) hi += (hi - lo) * 0.05;
    if (hi <= lo) hi = lo + 1;
    const x = (t) => box.left + ((t - t0) / (t1 - t0)) * (W - box.left - box.right);
    const y = (v) => H - box.bottom - ((v - lo) / (hi - lo)) * (H - box.top - box.bottom);

    for (let i = 0; i <= 4; i += 1) { // horizontal grid with value labels
      const v = lo + ((hi - lo) * i) / 4;
      parts.push(svg("line", { x1: box.left, x2: W - box.right, y1: y(v), y2: y(v), class: "grid" }));
      parts.push(svg("text", { x: box.left - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" },
        metric.format(v)));
    }
    for (let i = 0; i <= 4; i += 1) { // time since the first point
      const t = t0 + ((t1 - t0) * i) / 4;
      const label = t1 - t0 < 20 ? `${(t - t0).toFixed(1)}s` : duration(t - t0);
      parts.push(svg("text", { x: x(t), y: H - 8, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle",
        class: "tick" }, label));
    }
    const coords = series.map((p) => `${x(p.at).toFixed(1)},${y(p[metric.key]).toFixed(1)}`).join(" ");
    parts.push(svg("polyline", { points: coords, class: "line", "data-points": series.length }));
    if (series.length <= MAX_CIRCLES) {
      for (const p of series) {
        const dot = svg("circle", { cx: x(p.at).toFixed(1), cy: y(p[metric.key]).toFixed(1), r: 2.5,
          class: "dot", "data-step": p.global_step });
        dot.appendChild(svg("title", {}, `step ${p.global_step} · epoch ${p.epoch ?? "–"} · `
          + `${metric.format(p[metric.key])} · ${clock(p.at)}`));
        parts.push(dot);
      }
    }
    chart.replaceChildren(...parts);
  }

  // ------------------------------------------------------------------------------------------------ routing, polling

  function route() {
    const match = /^#\/jobs\/([^/]+)$/.exec(window.location.hash);
    return match ? decodeURIComponent(match[1]) : null;
  }

  function navigate() {
    state.generation += 1;
    const jobId = route();
    show($("view-overview"), !jobId);
    show($("view-job"), Boolean(jobId));
    if (jobId) {
      if (!state.job || state.job.id !== jobId) {
        state.job = newJobState(jobId);
        setText($("job-name"), jobId);
        setText($("job-state"), "");
        $("job-facts").replaceChildren();
        for (const chart of document.querySelectorAll("svg[data-chart]")) {
          chart.replaceChildren();
          chart.setAttribute("data-points", "0");
          delete chart.dataset.signature;
        }
        for (const id of ["members-table", "artifacts-table"]) $(id).tBodies[0].replaceChildren();
        $("events").replaceChildren();
        delete $("events").dataset.key;
      }
    } else {
      state.job = null;
      document.title = "gpuswarm dashboard";
    }
    poll();
  }

  async function tick() {
    const generation = state.generation;
    const work = [refreshNodes(generation), refreshOwner()];
    work.push(state.job ? refreshJob(generation) : refreshJobs(generation));
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
      renderAuth();
      state.generation += 1;
      if (route()) window.location.hash = "#/";
      else poll();
    });
    $("nodes-filter").addEventListener("input", applyNodeFilter);
    window.addEventListener("hashchange", navigate);
    renderAuth();
    navigate();
  }

  init();
})();
