// The omlx-core dashboard: polls the JSON endpoints under /dashboard/api once per
// enforcer interval and draws them with uPlot. The API key, when the server wants one,
// lives in this tab's sessionStorage and travels in the Authorization header only.
"use strict";

(function () {
  const KEY_STORE = "omlx-dashboard-key";
  const CEILINGS = ["static", "dynamic", "device", "custom"];
  const CEILING_COLORS = { static: "#7b5ea7", dynamic: "#c06000", device: "#00838f", custom: "#a31545" };
  const state = {
    plots: {},
    columns: null,
    lastT: null,
    binding: undefined,
    windowS: 900,
    intervalS: 1,
    seenRequests: new Set(),
    polls: 0,
    needsKey: false,
    models: null,
    pool: false,
    // model id -> the outcome of the last action the page asked for (pending while it runs)
    modelActions: {},
  };
  window.omlxDashboard = state;

  // -- formatting ----------------------------------------------------------------------

  function size(bytes) {
    if (bytes === null || bytes === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = Math.abs(bytes), unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
    const digits = value >= 100 ? 0 : value >= 10 ? 1 : 2;
    return (bytes < 0 ? "-" : "") + (unit ? value.toFixed(digits) : value) + " " + units[unit];
  }
  function seconds(s) {
    if (s === null || s === undefined) return "–";
    return s < 60 ? s.toFixed(1) + " s" : Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  }
  function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }
  function setStatus(text, bad) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.className = bad ? "status bad" : "status";
  }

  // -- talking to the server -----------------------------------------------------------

  class NeedsKey extends Error {}
  // A refusal with its HTTP status, error code and advice (a 413 names what to do).
  class ApiError extends Error {
    constructor(status, error) {
      super(error.message || "HTTP " + status);
      this.status = status;
      this.code = error.code || null;
      this.advice = Array.isArray(error.advice) ? error.advice : [];
    }
  }

  async function api(path, options) {
    const headers = {};
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers["Authorization"] = "Bearer " + key;
    const { json, ...rest } = options || {};
    if (json) headers["Content-Type"] = "application/json";
    const response = await fetch(path, Object.assign({ headers, cache: "no-store" }, rest));
    const text = await response.text();
    let body = null;
    try { body = JSON.parse(text); } catch (error) { body = null; }
    const error = body && body.error ? body.error : { message: (response.statusText || "HTTP " + response.status) + (text ? ": " + text.slice(0, 200) : "") };
    if (response.status === 401) throw new NeedsKey(error.message);
    if (!response.ok) throw new ApiError(response.status, error);
    if (body === null) throw new ApiError(response.status, { message: "the answer is not JSON: " + text.slice(0, 200) });
    return body;
  }

  function askForKey(message) {
    state.needsKey = true;
    document.getElementById("key-form").hidden = false;
    document.getElementById("main").hidden = true;
    document.getElementById("key-error").textContent = sessionStorage.getItem(KEY_STORE) ? message : "";
    setStatus("API key needed", true);
  }

  document.getElementById("key-form").addEventListener("submit", function (event) {
    event.preventDefault();
    const input = document.getElementById("key-input");
    sessionStorage.setItem(KEY_STORE, input.value.trim());
    input.value = "";
    state.needsKey = false;
    document.getElementById("key-form").hidden = true;
    document.getElementById("main").hidden = false;
    poll();
  });

  // -- plots ---------------------------------------------------------------------------

  function chartWidth(id) {
    return Math.max(320, document.getElementById(id).parentElement.clientWidth - 12);
  }

  function makePlot(id, series, axisValues, range) {
    const old = state.plots[id];
    if (old) old.destroy();
    const opts = {
      width: chartWidth("plot-" + id), height: 220,
      series: [{}].concat(series),
      scales: { x: { time: true }, y: range ? { range } : {} },
      axes: [{}, { values: (u, ticks) => ticks.map(axisValues), size: 84 }],
      legend: { live: true },
    };
    const plot = new uPlot(opts, seriesData(id), document.getElementById("plot-" + id));
    state.plots[id] = plot;
    return plot;
  }

  const PLOTS = {
    memory: () => [
      { label: "in use", key: "in_use_bytes", stroke: "#1f5fbf", width: 2, fill: "rgba(31,95,191,0.08)" },
      { label: "reclaimable", key: "reclaimable_bytes", stroke: "#2e9e4f" },
      { label: "reserved by admission", key: "reserved_bytes", stroke: "#8a6100" },
      { label: "hard limit", key: "hard_limit_bytes", stroke: "#b3261e", width: 2 },
    ].concat(CEILINGS.map((name) => ({
      label: name + " ceiling" + (state.binding === name ? " (binding)" : ""),
      key: "ceiling_" + name, stroke: CEILING_COLORS[name],
      width: state.binding === name ? 3 : 1, dash: state.binding === name ? [] : [6, 4],
    }))),
    throughput: () => [
      { label: "prefill tok/s", key: "prefill_tokens_per_s", stroke: "#1f5fbf" },
      { label: "decode tok/s", key: "decode_tokens_per_s", stroke: "#2e9e4f" },
    ],
    ttft: () => [
      { label: "TTFT p50", key: "ttft_p50_s", stroke: "#1f5fbf" },
      { label: "TTFT p95", key: "ttft_p95_s", stroke: "#b3261e" },
    ],
    queue: () => [
      { label: "queued", key: "queue_depth", stroke: "#8a6100" },
      { label: "running", key: "running", stroke: "#2e9e4f" },
      { label: "preempted", key: "preempted", stroke: "#b3261e" },
    ],
    cache: () => [
      { label: "prefix cache (all tiers)", key: "prefix_hit_rate", stroke: "#1f5fbf" },
      { label: "SSD tier", key: "ssd_hit_rate", stroke: "#7b5ea7" },
    ],
  };
  const AXES = { memory: size, throughput: (v) => v.toFixed(0), ttft: (v) => v.toFixed(2) + " s",
                 queue: (v) => v.toFixed(0), cache: (v) => (v * 100).toFixed(0) + " %" };
  // Memory is drawn against the hard limit: ceilings far above it (a static one of all
  // the RAM) would flatten everything that matters; their values stay in the legend.
  const RANGES = {
    cache: [0, 1],
    memory: (u, min, max) => {
      const keys = ["in_use_bytes", "reserved_bytes", "hard_limit_bytes"];
      const top = Math.max(1, ...keys.flatMap((k) => (state.columns && state.columns[k] || []).filter((v) => v !== null)));
      return [0, top * 1.25];
    },
  };
  const seriesByPlot = {};

  function seriesData(id) {
    const columns = state.columns || {};
    const t = columns.t || [];
    return [t].concat(seriesByPlot[id].map((s) => columns[s.key] || t.map(() => null)));
  }

  function buildPlots() {
    for (const id of Object.keys(PLOTS)) {
      seriesByPlot[id] = PLOTS[id]();
      makePlot(id, seriesByPlot[id].map((s) => ({ label: s.label, stroke: s.stroke, width: s.width || 1.5,
                                                    dash: s.dash, fill: s.fill, spanGaps: false })),
               AXES[id], RANGES[id]);
    }
  }

  function mergeColumns(fresh) {
    if (!state.columns) { state.columns = fresh; return; }
    for (const key of Object.keys(fresh)) {
      state.columns[key] = (state.columns[key] || []).concat(fresh[key]);
    }
    const t = state.columns.t;
    const cutoff = t.length ? t[t.length - 1] - state.windowS : 0;
    let drop = 0;
    while (drop < t.length && t[drop] <= cutoff) drop++;
    if (drop) for (const key of Object.keys(state.columns)) state.columns[key].splice(0, drop);
  }

  // -- panels --------------------------------------------------------------------------

  function renderNow(latest) {
    const now = document.getElementById("now");
    now.replaceChildren();
    if (!latest) { now.textContent = "no sample yet"; return; }
    const items = [["in use", size(latest.in_use_bytes)], ["reclaimable", size(latest.reclaimable_bytes)],
                   ["reserved by admission", size(latest.reserved_bytes)],
                   ["hard limit", size(latest.hard_limit_bytes)]];
    for (const name of CEILINGS) {
      if (latest.ceilings && latest.ceilings[name] !== undefined) items.push([name + " ceiling", size(latest.ceilings[name]), name === latest.binding]);
    }
    items.push(["queued / running / preempted", latest.queue_depth + " / " + latest.running + " / " + latest.preempted]);
    for (const [label, value, binding] of items) {
      const div = document.createElement("div");
      const b = document.createElement("b");
      b.textContent = value;
      div.append(b, document.createTextNode(label + (binding ? " (binding)" : "")));
      if (binding) div.className = "binding";
      now.append(div);
    }
  }

  function emptyRow(tbody, columns, text) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = cell(text);
    td.colSpan = columns;
    tr.append(td);
    tbody.append(tr);
  }

  function renderRequests(rows) {
    const tbody = document.querySelector("#requests tbody");
    tbody.replaceChildren();
    document.getElementById("requests-count").textContent = "(" + rows.length + ")";
    if (!rows.length) emptyRow(tbody, 7, "no request in flight");
    for (const row of rows) {
      state.seenRequests.add(row.request_id);
      const tr = document.createElement("tr");
      tr.dataset.requestId = row.request_id;
      const tokens = row.prompt_tokens + " + " + row.completion_tokens + (row.max_tokens ? " / " + row.max_tokens : "");
      tr.append(cell(row.request_id, "id"), cell(row.model), cell(row.stage, "stage-" + row.stage),
                cell(row.detail || ""), cell(tokens), cell(seconds(row.age_s)));
      const action = document.createElement("td");
      if (row.cancellable) {
        const button = document.createElement("button");
        button.textContent = "cancel";
        button.addEventListener("click", () => cancelRequest(row.request_id, button));
        action.append(button);
      }
      tr.append(action);
      tbody.append(tr);
    }
  }

  async function cancelRequest(requestId, button) {
    button.disabled = true;
    try {
      await api("/dashboard/api/requests/" + encodeURIComponent(requestId), { method: "DELETE" });
      button.textContent = "cancelled";
    } catch (error) {
      button.textContent = "failed";
      button.title = error.message;
    }
  }

  function renderRefusals(refusals) {
    const tbody = document.querySelector("#refusals tbody");
    tbody.replaceChildren();
    if (!refusals.length) emptyRow(tbody, 8, "no refusal");
    for (const r of refusals) {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.request_id;
      const bytes = size(r.estimated_bytes) + (r.base_bytes ? " on " + size(r.base_bytes) : "") + " vs " + size(r.limit_bytes);
      tr.append(cell(clock(r.at)), cell(r.request_id, "id"), cell(r.model_id), cell(String(r.status)),
                cell(r.stage + " (" + r.cause + ")"), cell(r.binding_ceiling || "–"), cell(bytes),
                cell(r.summary + (r.advice.length ? ". " + r.advice.join(" ") : ""), "advice"));
      tbody.append(tr);
    }
  }

  // -- models: the pool's state of each, and its admin actions ---------------------------

  const MODEL_ACTIONS = ["load", "unload", "pin", "unpin"];
  // Why an action does not apply to a model now (null: it does).
  function notApplicable(action, m) {
    if (action === "load") return m.state === "available" || m.state === "failed" ? null : "the model is " + m.state;
    if (action === "unload") return m.state === "resident" ? null : "the model is " + m.state;
    if (action === "pin") return m.pinned ? "already pinned" : null;
    return m.pinned ? null : "not pinned";
  }

  function bytesText(m) {
    const lines = [["weights", m.weights_bytes], ["planned", m.planned_bytes],
                   ["measured", m.measured_bytes], ["resident", m.resident_bytes]];
    return lines.filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => k + " " + size(v));
  }
  function contextText(m) {
    let text;
    if (m.max_context && m.context_length && m.max_context !== m.context_length) text = m.max_context + " of " + m.context_length + " tokens";
    else {
      const tokens = m.max_context || m.context_length;
      text = tokens ? tokens + " tokens" : "–";
    }
    return m.kv_cache ? [text, "KV cache: " + m.kv_cache] : text;
  }
  function useText(m) {
    const lines = [m.last_used_s_ago === null || m.last_used_s_ago === undefined ? "never used" : "used " + seconds(m.last_used_s_ago) + " ago"];
    if (m.state === "resident") {
      if (m.pinned) lines.push("pinned: stays resident");
      else if (m.expires_in_s === null || m.expires_in_s === undefined) lines.push("stays resident (keep-alive forever)");
      else if (m.in_flight) lines.push("unloads " + seconds(m.expires_in_s) + " after idle");
      else lines.push("unloads in " + seconds(m.expires_in_s));
    } else if (m.keep_alive_s !== undefined) {
      lines.push(m.keep_alive_s === null ? "keep-alive forever" : "keep-alive " + seconds(m.keep_alive_s));
    }
    return lines;
  }
  function requestsText(m) {
    const lines = [(m.in_flight ?? "–") + " in flight, " + (m.waiting ?? "–") + " waiting"];
    if (m.running !== null && m.running !== undefined) lines.push("engine: " + m.running + " running, " + (m.queue_depth ?? "–") + " queued");
    return lines;
  }
  function prefixText(m) {
    const pc = m.prefix_cache;
    if (!pc) return "–";
    if (pc.enabled === false) return "off";
    return (pc.hits || 0) + " hits, " + (pc.misses || 0) + " misses, " + (pc.tokens_saved || 0) +
      " tokens saved, " + size(pc.bytes) + " of " + size(pc.budget_bytes);
  }
  function ssdText(m) {
    if (!m.ssd_cache) return m.state === "resident" ? "none" : "–";
    return (m.ssd_cache.hits || 0) + " hits, " + (m.ssd_cache.misses || 0) + " misses, " +
      (m.ssd_cache.blocks || 0) + " blocks, " + size(m.ssd_cache.bytes);
  }

  function fill(td, lines, cls) {
    td.replaceChildren();
    for (const [i, line] of [].concat(lines).entries()) {
      if (i) td.append(document.createElement("br"));
      td.append(document.createTextNode(line));
    }
    td.className = cls || "";
  }

  const MODEL_FIELDS = ["model", "state", "engine", "bytes", "context", "use", "requests", "prefix", "ssd", "actions"];

  // The rows stay in place between polls (only their text changes), so a click is never
  // lost to a redraw.
  function modelRow(tbody, id) {
    for (const tr of tbody.children) if (tr.dataset.model === id) return tr;
    const tr = document.createElement("tr");
    tr.dataset.model = id;
    for (const field of MODEL_FIELDS) {
      const td = document.createElement("td");
      td.dataset.field = field;
      tr.append(td);
    }
    const actions = tr.lastChild;
    const buttons = document.createElement("div");
    buttons.className = "buttons";
    for (const action of MODEL_ACTIONS) {
      const button = document.createElement("button");
      button.textContent = action;
      button.dataset.action = action;
      button.addEventListener("click", () => modelAction(id, action));
      buttons.append(button);
    }
    const result = document.createElement("div");
    result.className = "action-result";
    actions.append(buttons, result);
    return tr;
  }

  function renderModels(payload) {
    state.models = payload.models;
    state.pool = payload.pool;
    const tbody = document.querySelector("#models tbody");
    for (const tr of [...tbody.children]) {
      if (!tr.dataset.model || !payload.models.some((m) => m.model === tr.dataset.model)) tr.remove();
    }
    if (!payload.models.length) emptyRow(tbody, MODEL_FIELDS.length, "no model");
    let previous = null;
    for (const m of payload.models) {
      const tr = modelRow(tbody, m.model);
      const cells = Object.fromEntries([...tr.children].map((td) => [td.dataset.field, td]));
      fill(cells.model, m.source && m.source !== m.model ? [m.model, m.source] : [m.model], "id");
      const stateLines = [m.state + (m.pinned ? ", pinned" : "")];
      fill(cells.state, stateLines, "state-" + m.state);
      if (m.error) {
        const error = document.createElement("div");
        error.className = "error";
        error.textContent = "last load: " + m.error;
        cells.state.append(error);
      }
      fill(cells.engine, [(m.engine || "–") + (m.task && m.task !== "generate" ? " (" + m.task + ")" : "")]);
      fill(cells.bytes, bytesText(m));
      fill(cells.context, [contextText(m)]);
      fill(cells.use, useText(m));
      fill(cells.requests, requestsText(m));
      fill(cells.prefix, [prefixText(m)]);
      fill(cells.ssd, [ssdText(m)]);
      const pending = state.modelActions[m.model] && state.modelActions[m.model].pending;
      for (const button of cells.actions.querySelectorAll("button")) {
        const why = !payload.pool ? "this server has no model pool" : pending ? pending + " in progress"
          : notApplicable(button.dataset.action, m);
        button.disabled = why !== null;
        button.title = why || button.dataset.action + " " + m.model;
      }
      const result = cells.actions.querySelector(".action-result");
      const outcome = state.modelActions[m.model];
      result.textContent = outcome ? outcome.text : "";
      result.className = "action-result" + (outcome && outcome.bad ? " error" : "");
      const expected = previous ? previous.nextSibling : tbody.firstChild;
      if (expected !== tr) tbody.insertBefore(tr, expected);
      previous = tr;
    }
  }

  async function modelAction(id, action) {
    state.modelActions[id] = { pending: action, text: action + "…", bad: false };
    if (state.models) renderModels({ models: state.models, pool: state.pool });
    let outcome;
    try {
      // The server takes a POST only as JSON (a web page of another site cannot send one).
      const m = await api("/admin/models/" + encodeURIComponent(id) + "/" + action, { method: "POST", body: "{}", json: true });
      let text = action + ": done, " + m.state + (m.pinned ? ", pinned" : "");
      if (action === "load" && m.load_seconds !== null && m.load_seconds !== undefined) text += " (loaded in " + seconds(m.load_seconds) + ")";
      if (!m.changed) text = action + ": nothing to do, the model is " + m.state;
      outcome = { text, bad: false };
    } catch (error) {
      let text = action + " refused";
      if (error instanceof ApiError) text += " (" + error.status + (error.code ? " " + error.code : "") + ")";
      text += ": " + error.message;
      if (error.advice && error.advice.length) text += " " + error.advice.join(" ");
      outcome = { text, bad: true };
      if (error instanceof NeedsKey) {
        state.modelActions[id] = outcome;
        askForKey(error.message);
        return;
      }
    }
    state.modelActions[id] = outcome;
    poll();
  }

  // -- the loop ------------------------------------------------------------------------

  let searchTerm = "";
  let timer = null;
  let polling = false;
  let pollAgain = false;

  // One poll at a time: a poll asked for while one runs (after an action, a search)
  // runs right after it, so there is only ever one timer.
  async function poll() {
    if (polling) { pollAgain = true; return; }
    clearTimeout(timer);
    if (state.needsKey) return;
    polling = true;
    let next = true;
    const keyUsed = sessionStorage.getItem(KEY_STORE);
    try {
      const since = state.lastT === null ? "" : "?since=" + state.lastT;
      const [history, requests, refusals, models] = await Promise.all([
        api("/dashboard/api/history" + since), api("/dashboard/api/requests"),
        api("/dashboard/api/refusals" + (searchTerm ? "?request_id=" + encodeURIComponent(searchTerm) : "")),
        api("/dashboard/api/models")]);
      state.windowS = history.window_s;
      state.intervalS = history.interval_s;
      mergeColumns(history.columns);
      const t = state.columns.t;
      if (t.length) state.lastT = t[t.length - 1];
      const binding = history.latest ? history.latest.binding : null;
      if (binding !== state.binding || !Object.keys(state.plots).length) {
        state.binding = binding;
        buildPlots();
      } else {
        for (const id of Object.keys(state.plots)) state.plots[id].setData(seriesData(id));
      }
      renderNow(history.latest);
      renderRequests(requests.requests);
      renderRefusals(refusals.refusals);
      renderModels(models);
      state.polls++;
      setStatus("live, refreshed " + new Date().toLocaleTimeString(), false);
    } catch (error) {
      // A key given while this poll ran is tried by the next one.
      if (error instanceof NeedsKey) {
        if (sessionStorage.getItem(KEY_STORE) === keyUsed) { askForKey(error.message); next = false; }
        else pollAgain = true;
      }
      else setStatus("cannot reach the server: " + error.message, true);
    } finally {
      polling = false;
    }
    if (!next) { pollAgain = false; return; }
    if (pollAgain) { pollAgain = false; poll(); return; }
    timer = setTimeout(poll, Math.max(250, state.intervalS * 1000));
  }

  let searchDelay = null;
  document.getElementById("refusal-search").addEventListener("input", function (event) {
    clearTimeout(searchDelay);
    searchDelay = setTimeout(() => { searchTerm = event.target.value.trim(); poll(); }, 200);
  });
  window.addEventListener("resize", () => {
    for (const id of Object.keys(state.plots)) state.plots[id].setSize({ width: chartWidth("plot-" + id), height: 220 });
  });

  poll();
})();
