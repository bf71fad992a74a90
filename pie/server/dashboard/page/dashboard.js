// The pie dashboard: polls /dashboard/state and reads the live tail /dashboard/events (JSON
// lines) with fetch(), which, unlike EventSource, can send the Authorization header. Text from
// the engine is only ever set as textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "pie-dashboard-token";
const POLL_MS = 1000;
const RETRY_MS = 3000;
const MAX_TAIL_ROWS = 500;
const MAX_MAILBOXES = 50;
const MARKS = { f: "free", c: "cached", u: "used", s: "shared", v: "saved" };

let token = sessionStorage.getItem(TOKEN_KEY);
let polling = null;
let tail = null;
let filter = { actor: "", corr: "" };

const $ = (id) => document.getElementById(id);

function authHeaders() {
  return token ? { Authorization: "Bearer " + token } : {};
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.append(cell instanceof Node ? cell : element("td", cell));
  return tr;
}

async function errorMessage(reply) {
  try {
    const body = await reply.json();
    return (body.error && body.error.message) || reply.statusText;
  } catch (_) {
    return reply.status + " " + reply.statusText;
  }
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// -- signing in ---------------------------------------------------------------------------

function askForToken(message) {
  stop();
  $("panels").hidden = true;
  $("login").hidden = false;
  showError(message || "");
  $("token").focus();
}

function signIn(event) {
  event.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token").value = "";
  $("login").hidden = true;
  start();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  token = null;
  $("who").textContent = "";
  $("sign-out").hidden = true;
  askForToken("");
}

// -- the state ----------------------------------------------------------------------------

async function refresh() {
  let reply;
  try {
    reply = await fetch("/dashboard/state", { headers: authHeaders(), cache: "no-store" });
  } catch (err) {
    showError("cannot reach the server: " + err);
    return false;
  }
  if (reply.status === 401) {
    askForToken(token ? "the server did not accept that token" : "");
    return false;
  }
  if (!reply.ok) {
    stop();
    $("sign-out").hidden = !token;
    showError(await errorMessage(reply));
    return false;
  }
  showError("");
  render(await reply.json());
  return true;
}

function render(state) {
  $("panels").hidden = false;
  if (token) {
    $("who").textContent = token.split(":")[0];
    $("sign-out").hidden = false;
  }
  renderSummary(state.statistics);
  renderInferlets(state.inferlets);
  renderMailboxes(state.statistics.mailboxes);
  renderPages(state.models);
  renderTimeline(state.models);
}

function renderSummary(stats) {
  const inf = stats.inferlets;
  $("summary").textContent =
    `passes ${stats.inference.passes} · tokens ${stats.inference.tokens} · ` +
    `inferlets running ${inf.running}, queued ${inf.queued} · events ${stats.logged_events}`;
}

function renderInferlets(inferlets) {
  const body = $("inferlets").tBodies[0];
  body.replaceChildren(
    ...inferlets.map((i) => {
      const tr = row([i.id, i.user, i.program, i.state, i.contexts, i.tokens, i.launcher]);
      tr.dataset.address = i.address;
      tr.addEventListener("click", () => setFilter(i.address, ""));
      return tr;
    })
  );
  if (!inferlets.length) body.append(row([element("td", "none running", "hint")]));
}

function renderMailboxes(boxes) {
  const sorted = [...boxes].sort((a, b) => b.queued - a.queued || a.address.localeCompare(b.address));
  $("mailboxes").tBodies[0].replaceChildren(
    ...sorted.slice(0, MAX_MAILBOXES).map((m) => {
      const name = element("td", m.address, "link");
      name.addEventListener("click", () => setFilter(m.address, ""));
      return row([name, m.queued, m.capacity, m.received]);
    })
  );
}

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue("--" + name).trim();
}

function renderPages(models) {
  const colors = Object.fromEntries(Object.entries(MARKS).map(([m, kind]) => [m, cssColor(kind)]));
  $("kv").replaceChildren(
    ...models.map((model) => {
      const box = element("div", null, "model");
      box.dataset.model = model.name;
      box.append(element("h3", `${model.name} · ${model.page_size} tokens a page`));
      const legend = element("div", null, "legend");
      for (const kind of Object.values(MARKS)) {
        const item = element("span", `${kind} ${model.page_counts[kind]}`, kind);
        item.dataset.kind = kind;
        item.dataset.count = model.page_counts[kind];
        legend.append(item);
      }
      box.append(legend, pageCanvas(model.pages, colors));
      return box;
    })
  );
}

function pageCanvas(marks, colors) {
  const n = marks.length;
  const cols = n <= 1024 ? 32 : n <= 16384 ? 128 : 512;
  const cell = Math.max(1, Math.floor(512 / cols));
  const canvas = element("canvas", null, "pages");
  canvas.width = cols * cell;
  canvas.height = Math.max(1, Math.ceil(n / cols)) * cell;
  canvas.dataset.pages = n;
  const ctx = canvas.getContext("2d");
  const gap = cell > 3 ? 1 : 0;
  for (let page = 0; page < n; page++) {
    ctx.fillStyle = colors[marks[page]];
    ctx.fillRect((page % cols) * cell, Math.floor(page / cols) * cell, cell - gap, cell - gap);
  }
  return canvas;
}

function renderTimeline(models) {
  const svgNs = "http://www.w3.org/2000/svg";
  $("timeline").replaceChildren(
    ...models.map((model) => {
      const box = element("div", null, "model");
      const passes = model.passes;
      const last = passes[passes.length - 1];
      box.append(
        element(
          "h3",
          last
            ? `${model.name} · pass ${last.number} · tokens ${last.tokens} · placed ` +
                `${last.requests} · fast path ${last.lane_passes} · ` +
                `${(last.seconds * 1000).toFixed(2)} ms`
            : `${model.name} · no passes yet`
        )
      );
      const svg = document.createElementNS(svgNs, "svg");
      svg.setAttribute("class", "passes");
      svg.setAttribute("viewBox", `0 0 ${Math.max(passes.length, 1)} 100`);
      svg.setAttribute("preserveAspectRatio", "none");
      const most = Math.max(1, ...passes.map((p) => p.tokens));
      passes.forEach((p, i) => {
        const bar = document.createElementNS(svgNs, "rect");
        const height = Math.max(2, (100 * p.tokens) / most);
        bar.setAttribute("x", i + 0.1);
        bar.setAttribute("width", 0.8);
        bar.setAttribute("y", 100 - height);
        bar.setAttribute("height", height);
        if (p.failed) bar.setAttribute("class", "failed");
        const title = document.createElementNS(svgNs, "title");
        title.textContent =
          `pass ${p.number} · tokens ${p.tokens} · placed ${p.requests} · ` +
          `fast path ${p.lane_passes} · failed ${p.failed}`;
        bar.append(title);
        svg.append(bar);
      });
      box.append(svg, element("p", `the last ${passes.length} passes: tokens in each`, "hint"));
      return box;
    })
  );
}

// -- the live tail ------------------------------------------------------------------------

function setFilter(actor, corr) {
  $("actor").value = actor;
  $("corr").value = corr;
  applyFilter();
}

function applyFilter(event) {
  if (event) event.preventDefault();
  filter = { actor: $("actor").value.trim(), corr: $("corr").value.trim() };
  $("tail").tBodies[0].replaceChildren();
  openTail();
}

function matches(record) {
  if (filter.corr && String(record.corr) !== filter.corr) return false;
  if (!filter.actor) return true;
  return [record.src, record.dst, "inferlet:" + record.instance].includes(filter.actor);
}

function addEvent(record) {
  if (!matches(record)) return;
  const body = $("tail").tBodies[0];
  const time = new Date(record.time * 1000).toISOString().slice(11, 23);
  const src = element("td", record.src, "link");
  src.addEventListener("click", () => setFilter(record.src, ""));
  const dst = element("td", record.dst, "link");
  dst.addEventListener("click", () => setFilter(record.dst, ""));
  const corr = element("td", record.corr === null ? "-" : record.corr, "link");
  if (record.corr !== null) corr.addEventListener("click", () => setFilter("", record.corr));
  const tr = row([record.seq, time, src, dst, corr, record.kind, element("td", record.detail, "fields")]);
  tr.dataset.seq = record.seq;
  body.prepend(tr);
  while (body.rows.length > MAX_TAIL_ROWS) body.deleteRow(-1);
}

async function openTail() {
  if (tail) tail.abort();
  const controller = new AbortController();
  tail = controller;
  const query = new URLSearchParams();
  if (filter.actor) query.set("actor", filter.actor);
  if (filter.corr) query.set("corr", filter.corr);
  $("tail-status").textContent = "connecting…";
  try {
    const reply = await fetch("/dashboard/events?" + query, {
      headers: authHeaders(),
      signal: controller.signal,
    });
    if (!reply.ok) {
      $("tail-status").textContent = "tail refused: " + (await errorMessage(reply));
      return;
    }
    $("tail-status").textContent = "live";
    await readLines(reply.body, handleLine);
  } catch (err) {
    if (controller.signal.aborted) return;
    $("tail-status").textContent = "tail lost: " + err;
  }
  if (tail === controller && !controller.signal.aborted) {
    $("tail-status").textContent += " (reconnecting)";
    setTimeout(() => tail === controller && openTail(), RETRY_MS);
  }
}

async function readLines(stream, onLine) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value;
    const lines = pending.split("\n");
    pending = lines.pop();
    for (const line of lines) if (line) onLine(JSON.parse(line));
  }
}

function handleLine(record) {
  if (record.type === "event") addEvent(record);
  else if (record.type === "status")
    $("tail-status").textContent = record.dropped
      ? `live · ${record.dropped} events dropped (this page fell behind)`
      : "live";
}

// -- start and stop -----------------------------------------------------------------------

function stop() {
  clearTimeout(polling);
  polling = null;
  if (tail) tail.abort();
  tail = null;
}

async function poll() {
  if (await refresh()) polling = setTimeout(poll, POLL_MS);
}

async function start() {
  stop();
  if (await refresh()) {
    openTail();
    polling = setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("filters").addEventListener("submit", applyFilter);
  $("clear-filters").addEventListener("click", () => setFilter("", ""));
  start();
});
