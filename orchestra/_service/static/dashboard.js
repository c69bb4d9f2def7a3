// The dashboard: the runs of a service and one run live, read from its REST API and its
// Server-Sent Events, with the token the user pastes once.
//
// What it shows of a run is bounded whatever the run's size: the status's aggregates (counts,
// agents, priorities, the recent errors), the latest journal events, one task on demand. It never
// keeps or draws a row per task, so a run of a million tasks costs the page what one of ten does.
//
// Text from the service (task ids, messages) is only ever set as textContent, never parsed as
// HTML; the page's Content-Security-Policy allows no inline script either.
"use strict";

(() => {
  const TOKEN_KEY = "orchestra.token";
  const RUNS_SHOWN = 50; // the newest runs listed
  const EVENTS_SHOWN = 20; // the latest journal events shown
  const DRAW_EVERY = 50; // ms: the events that arrive within this are drawn at once
  const AGENTS_SHOWN = 50;
  const PRIORITIES_SHOWN = 12; // the rest summed in one row
  const TASK_EVENTS_SHOWN = 200;
  const STATUS_EVERY = 500; // ms: at most one status read this often while events arrive
  // The journal tells of tasks; elapsed time, throughput, ETA and a pause change without an event,
  // so a live run's status is read this often too, events or not.
  const STATUS_AT_LEAST = 2000;
  const RUNS_EVERY = 5000; // ms between two reads of the runs list (it has no stream)
  const RECONNECT = 2000; // ms before the event stream is opened again after it broke
  // A run nobody runs any more may stay open in its store (a stopped run can be resumed), and its
  // stream then never ends: once the status says so, the stream is read this long more (the
  // service holds events back a second) and closed, and opened again if the run comes back.
  const LINGER = 3000;
  const STATES = ["pending", "queued", "waiting", "running", "retrying",
    "succeeded", "failed", "skipped", "cancelled"];
  const ENDS = ["succeeded", "failed", "skipped", "cancelled"];

  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem(TOKEN_KEY);
  let run = null; // the run shown: its id and what watches it
  let runsTimer = null;

  // -- requests ----------------------------------------------------------------------------------

  class Refused extends Error {
    constructor(status, body) {
      super(describe(status, body));
      this.status = status;
    }
  }

  function describe(status, body) {
    if (body && typeof body.message === "string") return body.message;
    if (body && Array.isArray(body.detail)) {
      // FastAPI's 422: each field at fault and why
      return body.detail.map((d) => `${(d.loc || []).slice(1).join(".")}: ${d.msg}`).join("; ");
    }
    return `the service answered ${status}`;
  }

  async function api(path, { method = "GET", body } = {}) {
    const headers = { Authorization: `Bearer ${token}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const answer = await fetch(path, {
      method, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const type = answer.headers.get("content-type") || "";
    const data = type.includes("json") ? await answer.json() : null;
    if (!answer.ok) {
      const refused = new Refused(answer.status, data);
      if (answer.status === 401) signOut(refused.message);
      throw refused;
    }
    return data;
  }

  const runPath = (id) => `/api/runs/${encodeURIComponent(id)}`;

  // -- the token ---------------------------------------------------------------------------------

  function signOut(message) {
    token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    unwatch();
    clearInterval(runsTimer);
    $("app").hidden = true;
    $("forget").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("connection").textContent = "";
    $("token").focus();
  }

  async function signIn(candidate) {
    token = candidate;
    try {
      await api("/api/runs?limit=1");
    } catch (error) {
      if (error.status !== 401) signOut(error.message);
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("login").hidden = true;
    $("app").hidden = false;
    $("forget").hidden = false;
    $("login-error").textContent = "";
    await loadRuns();
    runsTimer = setInterval(() => loadRuns().catch(() => {}), RUNS_EVERY);
    route();
  }

  // -- the runs list -----------------------------------------------------------------------------

  async function loadRuns() {
    // The newest page only: the service pages its runs newest first.
    const { runs: newest, next_cursor: more } = await api(`/api/runs?limit=${RUNS_SHOWN}`);
    const body = $("runs").tBodies[0];
    body.replaceChildren(...newest.map((r) => {
      const link = el("a", r.id);
      link.href = `#run=${encodeURIComponent(r.id)}`;
      const total = sum(Object.values(r.counts));
      const ended = sum(ENDS.map((s) => r.counts[s] || 0));
      const state = r.live ? (r.paused ? "paused" : "running") : r.state;
      const row = tr([link, state, `${fmt(ended)} / ${fmt(total)}`], [null, null, "num"]);
      row.dataset.run = r.id;
      if (run && run.id === r.id) {
        row.classList.add("selected");
        if (run.status) listed(row, run.status);
      }
      return row;
    }));
    $("runs-more").textContent = more
      ? `the newest ${RUNS_SHOWN} runs` : (newest.length ? "" : "No runs yet.");
    if (!location.hash && newest.length) {
      history.replaceState(null, "", `#run=${encodeURIComponent(newest[0].id)}`);
      route();
    }
  }

  function route() {
    const found = /^#run=(.+)$/.exec(location.hash);
    const id = found ? decodeURIComponent(found[1]) : null;
    if (!token || (run && run.id === id)) return;
    unwatch();
    for (const row of $("runs").tBodies[0].rows) row.classList.toggle("selected", row.dataset.run === id);
    $("run").hidden = false;
    $("no-run").hidden = id !== null;
    $("run-body").hidden = id === null;
    if (id !== null) watch(id);
  }

  // -- one run, live -----------------------------------------------------------------------------

  function watch(id) {
    run = {
      id, stream: new AbortController(), events: [], lastEventId: null, drawing: false,
      reading: false, again: false, last: 0, soon: null, timer: null, over: false,
      following: false, idle: null, status: null, stopped: false,
    };
    $("run-title").textContent = id;
    $("control-message").textContent = "";
    $("task").replaceChildren();
    $("events").tBodies[0].replaceChildren();
    $("errors").replaceChildren();
    refresh();
    run.timer = setInterval(refresh, STATUS_AT_LEAST);
    follow(run);
  }

  function unwatch() {
    if (!run) return;
    run.stream.abort();
    clearInterval(run.timer);
    clearTimeout(run.soon);
    clearTimeout(run.idle);
    run = null;
  }

  // Whether anybody runs the run now, as its last status or summary says: the stream is closed a
  // while after nobody does (LINGER), and opened again when somebody does again.
  function running(watched, yes) {
    if (yes) {
      clearTimeout(watched.idle);
      watched.idle = null;
      if (!watched.following && !watched.over) {
        watched.stream = new AbortController();
        follow(watched);
      }
    } else if (watched.idle === null && watched.following) {
      watched.idle = setTimeout(() => { watched.stream.abort(); }, LINGER);
    }
  }

  // A status read soon (at most one per STATUS_EVERY, the last request always served).
  function refreshSoon() {
    if (!run || run.soon !== null) return;
    const wait = Math.max(0, run.last + STATUS_EVERY - Date.now());
    run.soon = setTimeout(() => { if (run) { run.soon = null; refresh(); } }, wait);
  }

  async function refresh() {
    const watched = run;
    if (!watched) return;
    if (watched.reading) { watched.again = true; return; }
    watched.reading = true;
    watched.last = Date.now();
    try {
      let status = null;
      let summary = null;
      try {
        status = await api(`${runPath(watched.id)}/status`);
      } catch (error) {
        if (error.status !== 409) throw error;
        summary = await api(runPath(watched.id)); // not run here: what its store says
      }
      if (run !== watched) return;
      if (status) showStatus(status); else showSummary(summary);
      running(watched, status ? status.state !== "finished" : summary.held_by !== null);
      if (watched.stopped && !watched.following) {
        watched.stopped = false;
        watched.stream = new AbortController();
        follow(watched);
      }
      showEvents(watched.events);
      $("connection").textContent = "";
    } catch (error) {
      if (run === watched) $("connection").textContent = error.message;
    } finally {
      watched.reading = false;
      if (watched.again && run === watched) { watched.again = false; refreshSoon(); }
    }
  }

  // The run's journal as Server-Sent Events. EventSource cannot send a header, and the token must
  // not travel in a URL: so the stream is read with fetch, and its lines parsed here by the
  // format's rules (fields, blank line ends an event, ids resumed with Last-Event-ID).
  async function follow(watched) {
    watched.following = true;
    try {
      await following(watched);
    } finally {
      watched.following = false;
      watched.idle = null;
    }
  }

  async function following(watched) {
    while (run === watched && !watched.over) {
      const headers = { Authorization: `Bearer ${token}`, Accept: "text/event-stream" };
      if (watched.lastEventId !== null) headers["Last-Event-ID"] = watched.lastEventId;
      try {
        const answer = await fetch(`${runPath(watched.id)}/events`,
          { headers, signal: watched.stream.signal, cache: "no-store" });
        if (!answer.ok) {
          const body = (answer.headers.get("content-type") || "").includes("json") ? await answer.json() : null;
          if (answer.status === 401) signOut(describe(401, body));
          else if (run === watched) $("connection").textContent = describe(answer.status, body);
          return;
        }
        await readEvents(answer.body, watched);
      } catch (error) {
        if (watched.stream.signal.aborted) return;
      }
      if (!watched.over) await new Promise((done) => setTimeout(done, RECONNECT));
    }
  }

  async function readEvents(body, watched) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let rest = "";
    let name = "";
    let data = [];
    let id = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      let text = rest + value;
      // A CR that ends a chunk may be the first half of a CRLF: it waits for the next chunk.
      const cr = text.endsWith("\r") ? "\r" : "";
      if (cr) text = text.slice(0, -1);
      const lines = text.split(/\r\n|\r|\n/);
      rest = lines.pop() + cr;
      for (const line of lines) {
        if (line === "") {
          if (id !== null) watched.lastEventId = id;
          if (data.length) received(watched, name || "message", data.join("\n"));
          name = ""; data = []; id = null;
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (a keep-alive)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") data.push(text);
        else if (field === "event") name = text;
        else if (field === "id" && !text.includes("\0")) id = text;
      }
    }
  }

  function received(watched, name, text) {
    if (run !== watched) return;
    if (name === "end") {
      // A closed run is over. A stopped one may be resumed (and may even end before the next
      // status read sees it run): its status is still read, and with each read its stream is
      // asked again from its last id, which ends at once while the run stays stopped.
      if (JSON.parse(text).state === "stopped") {
        watched.stopped = true;
        watched.stream.abort();
      } else {
        watched.over = true;
        clearInterval(watched.timer);
      }
      refreshSoon();
      loadRuns().catch(() => {});
      return;
    }
    const event = JSON.parse(text);
    watched.events.push(event);
    if (watched.events.length > EVENTS_SHOWN) watched.events.splice(0, watched.events.length - EVENTS_SHOWN);
    drawEventsSoon(watched);
    refreshSoon();
  }

  // The events are drawn as they arrive (what came within one DRAW_EVERY, drawn once): the
  // status read that follows them is throttled, the journal's latest lines are not.
  function drawEventsSoon(watched) {
    if (watched.drawing) return;
    watched.drawing = true;
    setTimeout(() => {
      watched.drawing = false;
      if (run === watched) showEvents(watched.events);
    }, DRAW_EVERY);
  }

  // -- drawing -----------------------------------------------------------------------------------

  function showStatus(s) {
    const live = s.state !== "finished";
    setState(s.state, live ? "runs here" : "ended here");
    $("bar").value = s.progress;
    $("progress-text").textContent =
      `${fmt(s.completed)} / ${fmt(s.total)} tasks ended (${s.progress.toFixed(1)}%)` +
      (s.input_complete ? "" : ", more arriving");
    $("eta").textContent = s.state === "finished" ? "done" : (s.eta === null ? "unknown" : duration(s.eta));
    $("elapsed").textContent = duration(s.elapsed);
    $("throughput").textContent = `${s.throughput.toFixed(1)} tasks/s`;
    $("active").textContent = `${fmt(s.active)} of ${fmt(s.concurrency)}`;
    $("error-rate").textContent = `${percent(s.error_rate)} (recent ${percent(s.recent_error_rate)})`;
    $("attempts").textContent = `${fmt(s.attempts)} (${fmt(s.retries)} retries, ${fmt(s.fallbacks)} fallbacks)`;
    showCounts(s.counts);
    showQueue(s.queue_by_priority);
    showAgents(s.agents);
    $("bottleneck").textContent = s.bottleneck ? bottleneck(s.bottleneck) : "none";
    showErrors(s.errors);
    showSpend(s);
    controls(s.state);
    run.status = s;
    const row = [...$("runs").tBodies[0].rows].find((r) => r.dataset.run === run.id);
    if (row) listed(row, s);
  }

  // The list reads the store, which is written a moment behind the run: the row of the run shown
  // follows its status instead.
  function listed(row, s) {
    row.cells[1].textContent = s.state === "finished" ? "ended" : s.state;
    row.cells[2].textContent = `${fmt(s.completed)} / ${fmt(s.total)}`;
  }

  function showSummary(r) {
    const state = r.held_by ? "running" : r.state;
    setState(state, r.held_by ? `run by ${r.held_by}: its status is read there` : "not running here");
    const total = sum(Object.values(r.counts));
    const ended = sum(ENDS.map((s) => r.counts[s] || 0));
    $("bar").value = total ? (100 * ended) / total : 0;
    $("progress-text").textContent = `${fmt(ended)} / ${fmt(total)} tasks ended`;
    for (const id of ["eta", "elapsed", "throughput", "active", "error-rate", "attempts"]) $(id).textContent = "–";
    showCounts(r.counts);
    showQueue({});
    showAgents([]);
    $("bottleneck").textContent = "–";
    $("errors").replaceChildren();
    showSpend(null);
    controls(null);
  }

  function setState(state, where) {
    const badge = $("run-state");
    badge.textContent = state;
    badge.className = `badge ${state}`;
    $("run-where").textContent = where;
  }

  function controls(state) {
    const live = state !== null && state !== "finished";
    $("pause").disabled = !live || state === "paused" || state === "stopping";
    $("resume").disabled = !live || state !== "paused";
    $("stop").disabled = !live || state === "stopping";
    $("cancel").disabled = !live || state === "stopping";
  }

  function showCounts(counts) {
    const names = [...STATES, ...Object.keys(counts).filter((k) => !STATES.includes(k)).sort()];
    $("counts").tBodies[0].replaceChildren(
      ...names.filter((k) => k in counts).map((k) => {
        const row = tr([k, fmt(counts[k])], [null, "num"]);
        row.dataset.state = k;
        return row;
      }));
  }

  function showQueue(queue) {
    const levels = Object.keys(queue).map(Number).sort((a, b) => a - b);
    const shown = levels.slice(0, PRIORITIES_SHOWN);
    const rows = shown.map((p) => tr([String(p), fmt(queue[p])], [null, "num"]));
    const others = levels.slice(PRIORITIES_SHOWN);
    if (others.length) {
      rows.push(tr([`${others.length} more levels`, fmt(sum(others.map((p) => queue[p])))], [null, "num"]));
    }
    if (!rows.length) rows.push(tr(["none ready", ""], [null, "num"]));
    $("queue").tBodies[0].replaceChildren(...rows);
  }

  function showAgents(agents) {
    const rows = agents.slice(0, AGENTS_SHOWN).map((a) => {
      const breaker = a.next_probe_in === null || a.next_probe_in === undefined
        ? a.breaker : `${a.breaker}, probe in ${duration(a.next_probe_in)}`;
      const row = tr([
        a.name, a.kinds.join(", "), a.paused_for > 0 ? `${a.state}, paused ${duration(a.paused_for)}` : a.state,
        breaker, `${fmt(a.in_flight)} / ${a.limit === null ? "–" : fmt(a.limit)}`,
        percent(a.utilisation), fmt(a.waiting), fmt(a.attempts), fmt(a.failures), a.last_error || "",
      ], [null, null, null, null, "num", "num", "num", "num", "num", "detail"]);
      row.cells[3].classList.add(`state-${a.breaker}`);
      return row;
    });
    if (agents.length > AGENTS_SHOWN) rows.push(tr([`and ${agents.length - AGENTS_SHOWN} more agents`]));
    $("agents").tBodies[0].replaceChildren(...rows);
  }

  function showErrors(errors) {
    const items = errors.slice().reverse().map((e) => {
      const open = el("button", e.task_id);
      open.type = "button";
      open.className = "link";
      open.addEventListener("click", () => { $("task-id").value = e.task_id; showTask(e.task_id); });
      const head = el("div");
      head.append(open, ` ${e.kind}${e.agent ? ` on ${e.agent}` : ""}, at ${duration(e.at)}: `,
        el("span", e.message.startsWith(e.error_type) ? e.message : `${e.error_type}: ${e.message}`, "message"));
      const item = el("li");
      item.append(head);
      if (e.remediation) item.append(el("div", e.remediation, "remedy"));
      return item;
    });
    $("errors").replaceChildren(...(items.length ? items : [el("li", "none", "muted")]));
  }

  function showSpend(s) {
    const cost = $("cost-meter");
    const tokens = $("tokens-meter");
    if (!s) {
      $("cost").textContent = "–"; $("tokens").textContent = "";
      cost.hidden = tokens.hidden = true;
      return;
    }
    const used = sum(Object.values(s.tokens));
    $("cost").textContent = s.max_cost === null || s.max_cost === undefined
      ? `$${s.cost.toFixed(4)} spent (no budget)`
      : `$${s.cost.toFixed(4)} of $${s.max_cost} (${percent(s.cost / s.max_cost)})`;
    cost.hidden = s.max_cost === null || s.max_cost === undefined;
    if (!cost.hidden) { cost.max = s.max_cost; cost.high = 0.8 * s.max_cost; cost.value = s.cost; }
    $("tokens").textContent = s.max_tokens === null || s.max_tokens === undefined
      ? `${fmt(used)} tokens`
      : `${fmt(used)} of ${fmt(s.max_tokens)} tokens (${percent(used / s.max_tokens)})`;
    tokens.hidden = s.max_tokens === null || s.max_tokens === undefined;
    if (!tokens.hidden) { tokens.max = s.max_tokens; tokens.high = 0.8 * s.max_tokens; tokens.value = used; }
  }

  function showEvents(events) {
    $("events").tBodies[0].replaceChildren(...events.slice().reverse().map((e) => {
      const row = tr([clock(e.at), e.event, e.task_id || "", e.agent || "",
        e.attempt === null ? "" : String(e.attempt), e.detail || ""],
      [null, `state-${e.event}`, "mono", null, "num", "detail"]);
      return row;
    }));
  }

  async function showTask(taskId) {
    const watched = run;
    const box = $("task");
    try {
      const t = await api(`${runPath(watched.id)}/tasks/${encodeURIComponent(taskId)}`);
      if (run !== watched) return;
      const table = el("table");
      table.className = "compact";
      const head = table.createTHead().insertRow();
      for (const name of ["time", "event", "agent", "attempt", "detail"]) head.append(el("th", name));
      const body = table.createTBody();
      body.append(...t.events.slice(-TASK_EVENTS_SHOWN).map((e) => tr(
        [clock(e.at), e.event, e.agent || "", e.attempt === null ? "" : String(e.attempt), e.detail || ""],
        [null, `state-${e.event}`, null, "num", "detail"])));
      const summary = el("p", `${t.task_id}: ${t.state}, ${t.attempts} attempt${t.attempts === 1 ? "" : "s"}` +
        (t.agent ? `, last on ${t.agent}` : ""));
      summary.id = "task-summary";
      box.replaceChildren(summary, table);
    } catch (error) {
      if (run === watched) box.replaceChildren(el("p", error.message, "error"));
    }
  }

  // -- control -----------------------------------------------------------------------------------

  async function control(action, body, done) {
    const watched = run;
    const message = $("control-message");
    message.className = "";
    message.textContent = `${action}…`;
    try {
      const answer = await api(`${runPath(watched.id)}/${action}`, { method: "POST", body });
      if (run === watched) message.textContent = done(answer);
    } catch (error) {
      if (run === watched) { message.className = "error"; message.textContent = error.message; }
    }
    if (run === watched) refresh();
    loadRuns().catch(() => {});
  }

  function cancelSelector() {
    const by = $("cancel-by").value;
    const value = $("cancel-value").value.trim();
    if (by !== "priority") return { [by]: value };
    const found = /^(-?\d+)\s*(?:-\s*(-?\d+))?$/.exec(value);
    if (!found) throw new Error("a priority range is low-high (or one number), e.g. 0-2");
    const low = Number(found[1]);
    return { priority: [low, found[2] === undefined ? low : Number(found[2])] };
  }

  // -- helpers -----------------------------------------------------------------------------------

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (className) node.className = className;
    return node;
  }

  function tr(cells, classes = []) {
    const row = document.createElement("tr");
    cells.forEach((cell, i) => {
      const td = document.createElement("td");
      if (cell instanceof Node) td.append(cell); else td.textContent = cell;
      if (classes[i]) td.className = classes[i];
      row.append(td);
    });
    return row;
  }

  const sum = (values) => values.reduce((a, b) => a + b, 0);
  const fmt = (n) => Number(n).toLocaleString("en-US");
  const percent = (x) => `${(100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0)}%`;
  const clock = (at) => new Date(at * 1000).toLocaleTimeString("en-GB");

  function duration(seconds) {
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    const s = Math.round(seconds);
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  // As the service's `Bottleneck.describe`.
  function bottleneck(b) {
    if (b.reason === "slowest kind") return `kind ${b.kind} (most work left)`;
    if (b.reason === "concurrency") return `the global concurrency limit (${fmt(b.waiting)} queued)`;
    if (b.agent) return `agent ${b.agent}: ${b.reason} (${fmt(b.waiting)} waiting)`;
    return `agents of kind ${b.kind} are full (${fmt(b.waiting)} waiting)`;
  }

  // -- wiring ------------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      signIn($("token").value.trim());
      $("token").value = "";
    });
    $("forget").addEventListener("click", () => signOut(""));
    $("pause").addEventListener("click", () => control("pause", undefined,
      (a) => (a.paused ? "Paused: no new attempt starts; the running ones finish." : "Not paused.")));
    $("resume").addEventListener("click", () => control("resume", undefined,
      (a) => (a.paused ? "Still paused." : "Resumed.")));
    $("stop").addEventListener("click", () => {
      const grace = $("grace").value === "" ? null : Number($("grace").value);
      control("stop", { grace }, (a) => `Stopped: the run ended ${a.status}.`);
    });
    $("cancel-form").addEventListener("submit", (e) => {
      e.preventDefault();
      let selector;
      try {
        selector = cancelSelector();
      } catch (error) {
        $("control-message").className = "error";
        $("control-message").textContent = error.message;
        return;
      }
      control("cancel", selector, (a) =>
        `Cancelled ${fmt(a.cancelled.length)} task${a.cancelled.length === 1 ? "" : "s"}` +
        (a.skipped.length ? `, skipped ${fmt(a.skipped.length)} that depend on them` : "") +
        (a.deferred ? " (when they are admitted)" : "") + ".");
    });
    $("task-form").addEventListener("submit", (e) => {
      e.preventDefault();
      showTask($("task-id").value.trim());
    });
    window.addEventListener("hashchange", route);
    if (token) signIn(token); else signOut("");
  });
})();
