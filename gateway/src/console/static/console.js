// The Chorus console's one script, embedded in the binary (console/mod.rs). It only follows
// feeds and writes what they say as text (textContent): never markup from the bus.
"use strict";

function text(tag, value) {
  const el = document.createElement(tag);
  el.textContent = value === undefined || value === null ? "" : String(value);
  return el;
}

// A task's page: its updates as server-sent events.
function followTask(root) {
  const url = root.getAttribute("data-events");
  const state = document.getElementById("task-state");
  const progress = document.getElementById("task-progress");
  const chunks = document.getElementById("task-chunks");
  const events = document.getElementById("task-events");
  const source = new EventSource(url);
  source.onmessage = function (e) {
    let u;
    try { u = JSON.parse(e.data); } catch (_) { return; }
    if (u.kind === "end") { source.close(); return; }
    const line = [u.kind, u.from, u.state, u.fraction, u.text].filter(function (x) {
      return x !== undefined && x !== null && x !== "";
    }).join(" · ");
    events.appendChild(text("li", line));
    if (u.state) { state.textContent = u.state; state.setAttribute("data-state", u.state); }
    if (u.kind === "progress") {
      const pct = typeof u.fraction === "number" ? Math.round(u.fraction * 100) + "%" : "";
      progress.textContent = [pct, u.text || ""].join(" ").trim();
    }
    if (u.kind === "chunk") {
      const payload = typeof u.payload === "string" ? u.payload : JSON.stringify(u.payload);
      chunks.appendChild(document.createTextNode(payload + "\n"));
    }
  };
}

// The live traffic page: the tap's events, pausable here (the server keeps sending; the
// page stops showing and drops what comes while paused).
function followTap(table) {
  const log = document.getElementById("tap-log");
  const pause = document.getElementById("tap-pause");
  const stateEl = document.getElementById("tap-state");
  const dropped = document.getElementById("tap-dropped");
  let paused = false;
  pause.addEventListener("click", function () {
    paused = !paused;
    pause.textContent = paused ? "Resume" : "Pause";
    stateEl.textContent = paused ? "paused" : "live";
    stateEl.className = paused ? "paused" : "";
  });
  const source = new EventSource(table.getAttribute("data-events"));
  source.onmessage = function (e) {
    let m;
    try { m = JSON.parse(e.data); } catch (_) { return; }
    dropped.textContent = String(m.dropped || 0);
    if (paused) { return; }
    const row = document.createElement("tr");
    row.className = "tap-row";
    row.setAttribute("data-kind", m.kind);
    row.appendChild(text("td", m.time));
    row.appendChild(text("td", m.kind));
    row.appendChild(text("td", m.performative));
    row.appendChild(text("td", m.from + " → " + ((m.to && m.to.length) ? m.to.join(",") : "*")));
    row.appendChild(text("td", m.subject));
    row.appendChild(text("td", m.status));
    row.appendChild(text("td", m.trace_id));
    row.appendChild(text("td", m.task));
    row.appendChild(text("td", m.payload));
    log.insertBefore(row, log.firstChild);
    while (log.childNodes.length > 500) { log.removeChild(log.lastChild); }
  };
}

// The overview: its charts fetched again every five seconds (server-drawn SVG from this
// console's own origin).
function refreshOverview(box) {
  const url = box.getAttribute("data-refresh");
  setInterval(function () {
    fetch(url, { credentials: "same-origin" }).then(function (r) {
      return r.ok ? r.text() : null;
    }).then(function (html) {
      if (html !== null) {
        const doc = new DOMParser().parseFromString(html, "text/html");
        box.replaceChildren.apply(box, Array.from(doc.body.childNodes));
      }
    }).catch(function () {});
  }, 5000);
}

document.addEventListener("DOMContentLoaded", function () {
  const task = document.getElementById("task");
  if (task) { followTask(task); }
  const tap = document.getElementById("tap");
  if (tap) { followTap(tap); }
  const overview = document.getElementById("overview");
  if (overview) { refreshOverview(overview); }
});
