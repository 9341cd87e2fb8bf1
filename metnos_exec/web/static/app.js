// The live view of metnos-exec. No framework, no build step, nothing fetched from
// elsewhere. Every value from the queue is job data, hence hostile: it enters the page
// only through textContent (and dataset), never through any HTML parser.
"use strict";

const POLL_MS = 1000;
const AXES = ["files", "network", "process_tree", "user", "resources"];
const TOKEN_KEY = "metnos-web-token";
let openJob = null;
let actions = false;

// The token arrives in the address's fragment (#token=...), which the browser never sends
// to a server or puts in a Referer; it is kept for this tab only and wiped from the bar.
function takeToken() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}
takeToken();
window.addEventListener("hashchange", takeToken);  // a token pasted into an open tab

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { "X-Metnos-Token": token } : {};
}

// Invisible characters spelled out, as `top` and `result` do (metnos_exec/_terminal.py):
// a bidi override would reorder what the operator reads, a zero-width or control
// character hide what was sent. Tabs stay; line breaks only in multi-line blocks.
const HIDDEN = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;
const NAMED = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };

function visible(text, newlines) {
  return String(text).replace(HIDDEN, (c) => {
    if (c === "\t" || (newlines && c === "\n")) return c;
    if (NAMED[c]) return NAMED[c];
    const code = c.codePointAt(0);
    const hex = (width) => code.toString(16).padStart(width, "0");
    return code <= 0xff ? `\\x${hex(2)}` : code <= 0xffff ? `\\u${hex(4)}` : `\\U${hex(8)}`;
  });
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = visible(text, false);
  if (cls) node.className = cls;
  return node;
}

function pretty(value) {
  if (value === undefined || value === null) return "-";
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}

function ago(seconds) {
  return seconds < 90 ? `${seconds.toFixed(1)}s` : `${(seconds / 60).toFixed(1)}min`;
}

function when(unix) {
  return unix ? new Date(unix * 1000).toLocaleTimeString() : "-";
}

function wallsCell(walls) {
  const td = el("td");
  if (!walls) {
    td.appendChild(el("span", "no sandbox", "wall none"));
    return td;
  }
  for (const axis of AXES) {
    const state = walls[axis] || "none";
    const badge = el("span", axis[0], `wall ${state}`);
    badge.title = `${axis}: ${state}`;
    badge.dataset.axis = axis;
    badge.dataset.state = state;
    td.appendChild(badge);
  }
  td.appendChild(el("span", ` ${walls.sandbox || ""}`));
  return td;
}

function fill(tableId, rows, makeRow) {
  const body = document.querySelector(`#${tableId} tbody`);
  const fresh = document.createElement("tbody");
  for (const row of rows) fresh.appendChild(makeRow(row));
  if (!rows.length) {
    const tr = el("tr");
    tr.appendChild(el("td", "(none)"));
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}

function jobRow(jobId, cells) {
  const tr = el("tr", null, "job");
  tr.dataset.job = jobId;
  for (const cell of cells) tr.appendChild(cell instanceof Node ? cell : el("td", cell));
  tr.addEventListener("click", (event) => {
    if (event.target.tagName !== "BUTTON") showJob(jobId);
  });
  return tr;
}

function actionButton(label, jobId, verb) {
  const td = el("td");
  if (!actions) return td;
  const button = el("button", label);
  button.type = "button";
  button.dataset.action = verb;
  button.addEventListener("click", () => act(jobId, verb));
  td.appendChild(button);
  return td;
}

function renderCounts(doc) {
  const dl = document.getElementById("counts");
  dl.replaceChildren();
  const c = doc.counts;
  for (const [name, value] of [
    ["queued", c.queued], ["delayed", c.delayed], ["running", c.running],
    ["done", c.done], ["dead", c.dead],
  ]) {
    const div = el("div");
    div.appendChild(el("dt", name));
    const dd = el("dd", value);
    dd.id = `count-${name}`;
    div.appendChild(dd);
    dl.appendChild(div);
  }
  const waiting = doc.waiting_for_a_worker.map(
    (w) => `${w.executor || "(older build)"} on ${w.device}: ${w.queued} queued`);
  document.getElementById("waiting").textContent =
    waiting.length ? visible(`waiting for a worker: ${waiting.join("; ")}`, false) : "";
}

function render(doc) {
  actions = Boolean(doc.view && doc.view.actions);
  document.getElementById("broker").textContent = visible(doc.broker, false);
  document.getElementById("updated").textContent = `updated ${when(doc.at)}`;
  renderCounts(doc);
  fill("running", doc.running, (j) => jobRow(j.job_id, [
    j.job_id, j.executor, j.worker || "-",
    (j.since_seen ? "≥ " : "") + ago(j.elapsed_s), j.attempt,
    actionButton("cancel", j.job_id, "cancel"),
  ]));
  fill("recent", doc.recent, (j) => jobRow(j.job_id, [
    j.job_id, j.executor, el("td", j.status, `status-${j.status}`), wallsCell(j.walls),
    j.error ? `${j.error.code}: ${j.error.message}` : "",
  ]));
  fill("queued", doc.queued, (j) => jobRow(j.job_id, [
    j.job_id, j.executor, j.device, j.attempt, actionButton("cancel", j.job_id, "cancel"),
  ]));
  fill("dead", doc.dead, (d) => jobRow(d.job_id, [
    d.job_id, d.executor || "-", d.code, d.message, d.attempts, actionButton("retry", d.job_id, "retry"),
  ]));
  fill("workers", doc.workers, (w) => {
    const tr = el("tr");
    tr.dataset.worker = w.id;
    for (const cell of [w.id, el("td", w.state, `state-${w.state}`), `${w.host}:${w.pid}`,
      `${w.running}/${w.slots}`, `${ago(w.seen_s_ago)} ago`, w.executors.join(", ")]) {
      tr.appendChild(cell instanceof Node ? cell : el("td", cell));
    }
    return tr;
  });
}

function problem(text) {
  document.getElementById("problem").textContent = visible(text, false);
}

async function getJSON(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  const doc = await response.json();
  if (!response.ok) throw new Error(`${doc.error.code}: ${doc.error.message}`);
  return doc;
}

function renderDetail(doc) {
  const r = doc.result || {};
  document.getElementById("detail-id").textContent = visible(doc.job_id, false);
  const put = (id, value) => {
    document.getElementById(id).textContent = visible(pretty(value), true);
  };
  put("detail-state", doc.state);
  put("detail-args", doc.job ? doc.job.args : null);
  put("detail-result", doc.result
    ? { status: r.status, exit: r.exit, worker: r.worker, attempt: r.attempt, usage: r.usage }
    : null);
  put("detail-error", r.error ? `${r.error.code}: ${r.error.message}` : null);
  put("detail-output", r.output);
  put("detail-stderr", r.stderr || null);
  put("detail-egress", r.egress && r.egress.length ? r.egress : null);
  put("detail-undo", doc.undo.length ? doc.undo : null);
  put("detail-dead", doc.dead_letter);
  fill("detail-walls", doc.containment ? AXES : [], (axis) => {
    const v = doc.containment[axis];
    const tr = el("tr");
    tr.dataset.axis = axis;
    tr.appendChild(el("td", axis));
    tr.appendChild(el("td", v.state, `wall ${v.state}`));
    tr.appendChild(el("td", v.reason));
    return tr;
  });
  const box = document.getElementById("detail-actions");
  box.replaceChildren();
  if (actions) {
    const state = doc.state ? doc.state.state : null;
    if (state === "queued" || state === "running") box.appendChild(actionButton("cancel", doc.job_id, "cancel"));
    if (r.undo_ids && r.undo_ids.length) box.appendChild(actionButton("undo", doc.job_id, "undo"));
    if (state === "dead") box.appendChild(actionButton("retry", doc.job_id, "retry"));
  }
}

async function showJob(jobId) {
  openJob = jobId;
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-message").textContent = "";
  try {
    renderDetail(await getJSON(`/api/jobs/${encodeURIComponent(jobId)}`));
  } catch (err) {
    document.getElementById("detail-message").textContent = visible(err.message, false);
  }
}

async function act(jobId, verb) {
  const message = document.getElementById("action");
  try {
    const response = await fetch(`/api/jobs/${encodeURIComponent(jobId)}/${verb}`, {
      method: "POST", headers: headers(), cache: "no-store",
    });
    const doc = await response.json();
    message.textContent = visible(response.ok
      ? `${verb}: ${doc.outcome || doc.undo_job_id || doc.job_id}`
      : `${verb} refused: ${doc.error.code}: ${doc.error.message}`, false);
  } catch (err) {
    message.textContent = visible(`${verb} failed: ${err.message}`, false);
  }
}

async function poll() {
  try {
    render(await getJSON("/api/overview"));
    problem("");
    if (openJob) await showJob(openJob);
  } catch (err) {
    problem(String(err.message));
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("detail-close").addEventListener("click", () => {
  openJob = null;
  document.getElementById("detail").hidden = true;
});
poll();
