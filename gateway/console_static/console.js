// The koda console: plain DOM, no framework, nothing from another host.
// Everything drawn from data goes through textContent or attributes set with
// setAttribute, never innerHTML, so a run's output is always shown as text.

const store = window.sessionStorage;
const auth = { token: store.getItem("koda.token") || "", admin: store.getItem("koda.admin") || "" };
const ENDS = new Set(["done", "error", "cancelled"]);
const KINDS = ["chunk", "reset", "status", "approval_required", "done", "error", "cancelled"];
let cleanup = [];

// ---- helpers ---------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  for (const child of children.flat()) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, { method = "GET", body, admin = false } = {}) {
  const headers = {};
  const token = admin ? auth.admin : auth.token;
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 204) return null;
  const data = await res.json().catch(() => null);
  if (!res.ok) {
    const message = data && data.error ? data.error.message : `${res.status} ${res.statusText}`;
    throw new ApiError(res.status, message);
  }
  return data;
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
}

function statusBadge(status) {
  return el("span", { class: `status ${status}`, "data-status": status }, status);
}

function runLink(runId) {
  return el("a", { href: `#run/${encodeURIComponent(runId)}` }, runId);
}

function table(headers, rows, rowAttrs = () => ({})) {
  return el(
    "table",
    {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      rows.map((cells, i) => el("tr", rowAttrs(i), cells.map((c) => el("td", {}, c)))),
    ),
  );
}

function failure(err, id) {
  const op = err instanceof ApiError && (err.status === 401 || err.status === 403);
  return el("p", { class: "error", id }, op ? `${err.message} (sign in with the admin token)` : err.message);
}

// ---- sign in and routing ----------------------------------------------------

function signedIn() {
  return Boolean(auth.token);
}

function showSignIn(message = "") {
  document.getElementById("signin").hidden = false;
  document.getElementById("view").replaceChildren();
  document.getElementById("signout").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("signin-error").textContent = message;
}

async function signIn(event) {
  event.preventDefault();
  const token = document.getElementById("token").value.trim();
  const admin = document.getElementById("admin-token").value.trim();
  auth.token = token;
  auth.admin = admin;
  try {
    await api("/v1/runs?limit=1");
  } catch (err) {
    auth.token = "";
    showSignIn(err.message);
    return;
  }
  store.setItem("koda.token", token);
  store.setItem("koda.admin", admin);
  route();
}

function signOut() {
  auth.token = auth.admin = "";
  store.removeItem("koda.token");
  store.removeItem("koda.admin");
  showSignIn();
}

const VIEWS = { chat: chatView, runs: runsView, run: runView, workers: workersView, schedules: schedulesView, webhooks: webhooksView, usage: usageView };

function route() {
  for (const stop of cleanup) stop();
  cleanup = [];
  if (!signedIn()) {
    showSignIn();
    return;
  }
  document.getElementById("signin").hidden = true;
  document.getElementById("signout").hidden = false;
  document.getElementById("who").textContent = auth.token.startsWith("dev:")
    ? `signed in as ${auth.token.slice(4)}`
    : "signed in";
  const [name, ...rest] = (location.hash.slice(1) || "chat").split("/");
  const view = VIEWS[name] || chatView;
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.dataset.view === name || (name === "run" && a.dataset.view === "runs"));
  }
  const root = document.getElementById("view");
  root.replaceChildren();
  root.dataset.view = name;
  root.dataset.ready = "false";
  Promise.resolve(view(root, decodeURIComponent(rest.join("/"))))
    .catch((err) => root.append(failure(err, "view-error")))
    .finally(() => {
      root.dataset.ready = "true";
    });
}

// ---- chat --------------------------------------------------------------------

async function chatView(root) {
  const page = await api("/v1/runs?limit=100");
  const sessions = [...new Set(page.runs.map((r) => r.session_id))];
  const pick = el("select", { id: "chat-session" }, el("option", { value: "" }, "New session"),
    sessions.map((s) => el("option", { value: s }, s)));
  const text = el("textarea", { id: "chat-text", rows: 3, placeholder: "Ask something" });
  const json = el("textarea", { id: "chat-input-json", rows: 2, placeholder: '{"text": "...", "demo": {"tokens": 40}}' });
  const send = el("button", { id: "chat-send", type: "submit" }, "Send");
  const stop = el("button", { id: "chat-stop", type: "button", class: "secondary", disabled: true }, "Stop");
  const status = el("span", { id: "chat-status" });
  const attempt = el("span", { id: "chat-attempt", class: "note" });
  const runId = el("span", { id: "chat-run" });
  const notes = el("ul", { id: "chat-notes", class: "muted" });
  const output = el("div", { id: "chat-output", class: "output" });
  const error = el("p", { id: "chat-error", class: "error" });
  const history = el("div", { id: "chat-history" });
  // The session as a conversation: its earlier turns, oldest first, then the run
  // followed (its messages above its streaming answer), then the form.
  const conversation = el("div", { id: "chat-conversation" });
  const liveUser = el("div", { id: "chat-live-user", class: "turn-user" });
  let follow = null;

  const form = el("form", { class: "card" },
    el("div", { class: "row" }, el("label", {}, "Session ", pick)),
    text,
    el("details", {}, el("summary", { class: "muted" }, "Input as JSON (optional, replaces the text)"), json),
    el("div", { class: "row" }, send, stop, error));
  root.append(conversation,
    el("div", { class: "card turn live" }, liveUser, el("div", { class: "row" }, "Run ", runId, status, attempt), notes, output),
    form, history);

  async function showConversation() {
    if (!pick.value) {
      conversation.replaceChildren();
      return;
    }
    const session = pick.value;
    const data = await api(`/v1/sessions/${encodeURIComponent(session)}/turns`);
    if (pick.value !== session) return;
    const live = follow ? follow.id : null;
    conversation.replaceChildren(...data.turns.filter((t) => t.run_id !== live).map(turnView));
    const mine = data.turns.find((t) => t.run_id === live);
    if (mine) liveUser.replaceChildren(...userMessages(mine.messages));
  }

  async function showHistory() {
    history.replaceChildren();
    await showConversation();
    if (!pick.value) return;
    const runs = await api(`/v1/sessions/${encodeURIComponent(pick.value)}/runs?limit=20`);
    history.append(el("h3", {}, "This session's runs"), table(["Run", "Status", "Attempt", "Created"],
      runs.runs.map((r) => [runLink(r.run_id), statusBadge(r.status), String(r.attempt), when(r.created_at)])));
  }
  pick.addEventListener("change", () => {
    if (follow) follow.close();
    follow = null;
    liveUser.replaceChildren();
    output.textContent = "";
    runId.replaceChildren();
    status.replaceChildren();
    showHistory().catch((err) => history.replaceChildren(failure(err)));
  });

  function watch(id) {
    if (follow && follow.id === id) return;
    if (follow) follow.close();
    output.textContent = "";
    delete output.dataset.finished;
    notes.replaceChildren();
    attempt.textContent = "";
    runId.replaceChildren(runLink(id));
    status.replaceChildren(statusBadge("pending"));
    stop.disabled = false;
    follow = followRun(id, {
      chunk: (d) => output.append(document.createTextNode(d.content)),
      reset: (d) => {
        output.textContent = "";
        notes.append(el("li", { class: "reset" }, `reset: the answer starts over (attempt ${d.attempt})`));
      },
      attempt: (n) => {
        attempt.textContent = n > 1 ? `retry: attempt ${n}` : "";
      },
      status: (s) => status.replaceChildren(statusBadge(s)),
      approval: (call) => {
        status.replaceChildren(statusBadge("waiting"));
        notes.append(approvalCard(id, call));
      },
      end: async (kind) => {
        stop.disabled = true;
        try {
          const run = await api(`/v1/runs/${encodeURIComponent(id)}`);
          status.replaceChildren(statusBadge(run.status));
          if (run.error) notes.append(el("li", { class: "error" }, run.error));
        } catch (err) {
          status.replaceChildren(statusBadge(kind));
        }
        output.dataset.finished = "true";
        showHistory().catch(() => {});
      },
      dropped: () => notes.append(el("li", { class: "dropped" }, "connection lost: resuming")),
    });
    cleanup.push(() => follow && follow.close());
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    let input = text.value;
    if (json.value.trim()) {
      try {
        input = JSON.parse(json.value);
      } catch (err) {
        error.textContent = `the input JSON does not parse: ${err.message}`;
        return;
      }
    }
    // A new id for every message: the same text sent again is a new message.
    const body = { input, client_message_id: messageId() };
    if (pick.value) body.session_id = pick.value;
    const said = typeof input === "string" ? input : String((input && (input.text ?? input.prompt)) ?? JSON.stringify(input));
    try {
      const accepted = await api("/v1/runs", { method: "POST", body });
      const run = await api(`/v1/runs/${encodeURIComponent(accepted.run_id)}`);
      if (![...pick.options].some((o) => o.value === run.session_id)) {
        pick.append(el("option", { value: run.session_id }, run.session_id));
      }
      pick.value = run.session_id;
      if (accepted.merged) {
        notes.append(el("li", { class: "merged" }, `merged into run ${accepted.run_id}: it starts over on both messages`));
      }
      text.value = "";
      if (accepted.merged && follow && follow.id === accepted.run_id) liveUser.append(...userMessages([said], true));
      else if (!follow || follow.id !== accepted.run_id) liveUser.replaceChildren(...userMessages([said]));
      watch(accepted.run_id);
      showHistory().catch(() => {});
    } catch (err) {
      error.textContent = err.message;
    }
  });

  stop.addEventListener("click", async () => {
    if (!follow) return;
    try {
      const res = await api(`/v1/runs/${encodeURIComponent(follow.id)}/cancel`, { method: "POST", body: { reason: "stopped in the console" } });
      notes.append(el("li", {}, res.status === "cancelled" ? "cancelled" : "stop requested"));
    } catch (err) {
      error.textContent = err.message;
    }
  });
  await showHistory();
}

// A tool call the run waits for: its name and arguments, with Approve and Reject.
function approvalCard(runId, call) {
  const said = el("span", { class: "muted" });
  const decide = async (what) => {
    try {
      const res = await api(`/v1/runs/${encodeURIComponent(runId)}/${what}`, { method: "POST" });
      said.textContent = res.decision;
      approve.disabled = reject.disabled = true;
    } catch (err) {
      said.textContent = err.message;
    }
  };
  const approve = el("button", { type: "button", class: "approve", onclick: () => decide("approve") }, "Approve");
  const reject = el("button", { type: "button", class: "reject", onclick: () => decide("reject") }, "Reject");
  return el("li", { class: "approval", "data-step": call.step },
    "waiting for your approval: ", el("code", {}, `${call.name}(${JSON.stringify(call.arguments)})`), " ", approve, " ", reject, " ", said);
}

// A client_message_id: 128 random bits as hex (crypto.randomUUID needs a secure context).
function messageId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return [...bytes].map((b) => b.toString(16).padStart(2, "0")).join("");
}

// A run's user messages: the first, then each merged into it.
function userMessages(messages, merged = false) {
  return messages.map((m, i) => el("p", { class: i || merged ? "message merged" : "message" }, m));
}

// One earlier turn of a session: the user's messages, then the answer (a cut one marked).
function turnView(t) {
  return el("div", { class: "card turn", "data-run": t.run_id, "data-status": t.status },
    el("div", { class: "turn-user" }, userMessages(t.messages)),
    el("div", { class: "turn-answer output" }, t.answer,
      t.cut ? el("span", { class: "cut" }, "[cut: stopped here]") : null),
    t.error ? el("p", { class: "error" }, t.error) : null,
    el("div", { class: "row muted" }, runLink(t.run_id), statusBadge(t.status)));
}

// One run's events, in seq order, each once. EventSource cannot send a header, so
// each connection opens with a stream ticket (60 s, this run only) rather than the
// token: EventSource resumes by itself with Last-Event-ID while its ticket is valid;
// once the browser gives up (the gateway refused a reconnect: down, or the ticket
// expired), a new ticket and a new EventSource resume after the last seq seen.
function followRun(id, on) {
  let last = -1;
  let shownAttempt = 0;
  let es = null;
  let closed = false;
  let timer = null;
  const state = { id, close };
  async function open() {
    let ticket;
    try {
      ticket = await api(`/v1/runs/${encodeURIComponent(id)}/stream-ticket`, { method: "POST" });
    } catch (err) {
      if (closed) return;
      on.dropped();
      timer = setTimeout(open, 1000);
      return;
    }
    if (closed) return;
    const after = last >= 0 ? `&after=${last}` : "";
    es = new EventSource(`${ticket.events_url}${after}`);
    for (const kind of KINDS) {
      es.addEventListener(kind, (e) => {
        // A dropped connection fires the same "error" name without data: not a run event.
        if (typeof e.data !== "string") return;
        const data = JSON.parse(e.data);
        if (data.seq <= last) return;
        last = data.seq;
        if (data.attempt !== shownAttempt) {
          shownAttempt = data.attempt;
          on.attempt(data.attempt);
        }
        if (kind === "chunk") on.chunk(data);
        else if (kind === "reset") on.reset(data);
        else if (kind === "status") on.status(data.content || "running");
        else if (kind === "approval_required" && on.approval) on.approval(JSON.parse(data.content));
        if (ENDS.has(kind)) {
          close();
          on.end(kind);
        }
      });
    }
    es.addEventListener("error", () => {
      if (closed) return;
      on.dropped();
      if (es.readyState === EventSource.CLOSED) timer = setTimeout(open, 1000);
    });
  }
  function close() {
    closed = true;
    clearTimeout(timer);
    if (es) es.close();
  }
  open();
  return state;
}

// ---- runs ----------------------------------------------------------------------

async function runsView(root) {
  const statusPick = el("select", { id: "runs-status" },
    ["", "pending", "running", "streaming", "done", "failed", "cancelled"].map((s) => el("option", { value: s }, s || "any status")));
  const session = el("input", { id: "runs-session", placeholder: "session id" });
  const user = el("input", { id: "runs-user", placeholder: "user (operators)", size: 14 });
  const everyone = el("input", { id: "runs-all", type: "checkbox" });
  const since = el("input", { id: "runs-since", type: "datetime-local", title: "created at or after" });
  const list = el("div", { id: "runs-list" });
  const older = el("button", { id: "runs-older", type: "button", class: "secondary" }, "Older");
  const newer = el("button", { id: "runs-newer", type: "button", class: "secondary" }, "Newer");
  const cursors = [null];
  let next = null;
  root.append(
    el("form", { class: "card row", id: "runs-filter" }, statusPick, session, user,
      el("label", {}, everyone, " every user"),
      el("label", {}, "created after ", since), el("button", { type: "submit" }, "Filter")),
    el("p", { class: "muted" }, "Your runs, newest first. Operators (admin token): a user, or every user, lists across users; a run's detail opens with its user's token."),
    list, el("div", { class: "row" }, newer, older));

  async function load() {
    const q = new URLSearchParams({ limit: "20" });
    if (statusPick.value) q.set("status", statusPick.value);
    if (session.value.trim()) q.set("session_id", session.value.trim());
    const before = cursors[cursors.length - 1];
    if (before) q.set("before", before);
    const operator = everyone.checked || Boolean(user.value.trim());
    if (user.value.trim()) q.set("user_id", user.value.trim());
    const page = operator ? await api(`/admin/runs?${q}`, { admin: true }) : await api(`/v1/runs?${q}`);
    const floor = since.value ? new Date(since.value).getTime() : null;
    const runs = page.runs.filter((r) => floor === null || new Date(r.created_at).getTime() >= floor);
    next = runs.length === page.runs.length ? page.next_before : null;
    const headers = ["Run", ...(operator ? ["User"] : []), "Session", "Status", "Attempt", "Created", "Finished", "Merged"];
    list.replaceChildren(table(headers,
      runs.map((r) => [operator ? r.run_id : runLink(r.run_id), ...(operator ? [r.user_id] : []), r.session_id,
        statusBadge(r.status), String(r.attempt), when(r.created_at), when(r.finished_at), String(r.merged_messages)]),
      (i) => ({ "data-user": runs[i].user_id || null })));
    older.disabled = !next;
    newer.disabled = cursors.length === 1;
  }
  const reload = () => load().catch((err) => list.replaceChildren(failure(err, "runs-error")));
  root.querySelector("#runs-filter").addEventListener("submit", (e) => {
    e.preventDefault();
    cursors.splice(1);
    reload();
  });
  older.addEventListener("click", () => {
    cursors.push(next);
    reload();
  });
  newer.addEventListener("click", () => {
    cursors.pop();
    reload();
  });
  await load();
}

async function runView(root, id) {
  let run;
  let line;
  try {
    [run, line] = await Promise.all([
      api(`/v1/runs/${encodeURIComponent(id)}`),
      api(`/v1/runs/${encodeURIComponent(id)}/timeline`),
    ]);
  } catch (err) {
    root.append(el("p", { class: "error", id: "run-error" }, err.message));
    return;
  }
  const steps = [
    ...Object.entries(line.times).filter(([, at]) => at).map(([name, at]) => ({ at, what: name.replace(/_at$/, "").replace("_", " "), attempt: "", detail: "" })),
    ...line.events.map((e) => ({ at: e.at, what: e.kind, attempt: String(e.attempt), detail: e.kind === "chunk" ? "" : e.content })),
  ].sort((a, b) => new Date(a.at) - new Date(b.at));
  const facts = [
    ["Status", statusBadge(run.status)],
    ["Session", run.session_id],
    ["Attempt", String(run.attempt)],
    ["Worker", line.worker_id || "-"],
    ["Partition", line.partition === null ? "-" : String(line.partition)],
    ["Cost", `$${line.cost_usd} (${line.billable_calls} calls)`],
    ["Failures", line.failures === null ? "0" : String(line.failures)],
  ];
  if (line.cancel_reason) facts.push(["Cancel reason", line.cancel_reason]);
  if (run.error) facts.push([run.status === "failed" ? "Dead-letter reason" : "Error", el("span", { id: "run-dlq", class: "error" }, run.error)]);
  if (line.schedule_id) facts.push(["Schedule", line.schedule_id]);
  root.append(
    el("h2", {}, "Run ", el("span", { id: "run-id" }, run.run_id)),
    el("div", { class: "card" }, table(["", ""], facts)),
    el("h3", {}, "Timeline"),
    el("div", { id: "run-timeline" }, table(["When", "What", "Attempt", "Detail"], steps.map((s) => [when(s.at), s.what, s.attempt, s.detail]))),
    el("h3", {}, "Attempts"),
    table(["Attempt", "Chunks", "First chunk", "Last chunk"], line.attempts.map((a) => [String(a.attempt), String(a.chunks), when(a.first_chunk_at), when(a.last_chunk_at)])),
    el("h3", {}, "Output"),
    el("div", { id: "run-output", class: "output" }, run.output),
  );
}

// ---- workers -------------------------------------------------------------------

async function workersView(root) {
  const body = el("div", { id: "workers-body" });
  root.append(el("h2", {}, "Workers"), body);
  async function load() {
    const [report, lag] = await Promise.all([api("/admin/workers", { admin: true }), api("/admin/lag", { admin: true })]);
    const holder = new Map();
    for (const w of report.workers) for (const p of w.partitions) holder.set(p, w.worker_id);
    const total = lag.partitions.reduce((n, p) => n + p.lag, 0);
    body.replaceChildren(
      el("p", {}, statusBadge(report.status), ` ${report.alive} alive of ${report.expected} expected, ${report.stale} stale, ${report.conflicts.length} id conflicts`),
      table(["Worker", "Host / pid", "Version", "In flight", "Partitions", "Last beat", "State"],
        report.workers.map((w) => [w.worker_id, `${w.host} / ${w.pid ?? "-"}`, w.version, String(w.in_flight),
          w.partitions.join(", "), `${(w.lastBeatMs / 1000).toFixed(1)} s ago`, w.stale ? "stale" : w.conflict ? "conflict" : "alive"]),
        (i) => ({ class: report.workers[i].stale ? "stale" : null, "data-worker": report.workers[i].worker_id })),
      el("h3", {}, `Consumer lag of ${lag.group} on ${lag.topic}: ${total} records`),
      el("div", { id: "workers-lag" }, table(["Partition", "Held by", "End offset", "Committed", "Lag"],
        lag.partitions.map((p) => [String(p.partition), holder.get(p.partition) || "-", String(p.end_offset),
          p.committed === null ? "-" : String(p.committed), String(p.lag)]))),
    );
  }
  await load();
  const timer = setInterval(() => load().catch((err) => body.replaceChildren(failure(err, "workers-error"))), 5000);
  cleanup.push(() => clearInterval(timer));
}

// ---- schedules -----------------------------------------------------------------

async function schedulesView(root) {
  const list = el("div", { id: "schedules-list" });
  const message = el("p", { id: "schedules-message", class: "muted" });
  const cron = el("input", { id: "schedule-cron", value: "0 9 * * 1-5", size: 14 });
  const zone = el("input", { id: "schedule-zone", value: Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC" });
  const text = el("input", { id: "schedule-text", placeholder: "what each run is asked" });
  const create = el("form", { class: "card row" }, "cron ", cron, "zone ", zone, text, el("button", { type: "submit" }, "Create"));
  root.append(el("h2", {}, "Schedules"), create, message, list);

  async function act(id, action) {
    try {
      const res = await api(`/v1/schedules/${encodeURIComponent(id)}/${action}`, { method: "POST" });
      message.replaceChildren(action === "run-now" ? el("span", {}, "fired run ", runLink(res.run_id)) : `${action}d ${id}`);
    } catch (err) {
      message.replaceChildren(failure(err));
    }
    await load();
  }
  async function load() {
    const { schedules } = await api("/v1/schedules");
    list.replaceChildren(table(["Schedule", "Cron", "Zone", "State", "Next fire", "Last fire", ""],
      schedules.map((s) => [s.id, s.cron, s.timezone, s.enabled ? "active" : "paused", when(s.next_fire_at) || "-", when(s.last_fire_at) || "never",
        el("span", { class: "row" },
          s.enabled
            ? el("button", { type: "button", class: "secondary", "data-action": "pause", onclick: () => act(s.id, "pause") }, "Pause")
            : el("button", { type: "button", class: "secondary", "data-action": "resume", onclick: () => act(s.id, "resume") }, "Resume"),
          el("button", { type: "button", "data-action": "run-now", onclick: () => act(s.id, "run-now") }, "Run now"))]),
      (i) => ({ "data-schedule": schedules[i].id })));
  }
  create.addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await api("/v1/schedules", { method: "POST", body: { cron: cron.value, timezone: zone.value, input: { text: text.value } } });
      message.textContent = "created";
    } catch (err) {
      message.replaceChildren(failure(err));
    }
    await load();
  });
  await load();
}

// ---- webhooks ------------------------------------------------------------------

async function webhooksView(root, selected) {
  const message = el("p", { id: "webhooks-message", class: "muted" });
  const url = el("input", { id: "webhook-url", placeholder: "https://example.com/koda-hook", size: 40 });
  const create = el("form", { class: "card row" }, "URL ", url, el("button", { type: "submit" }, "Create"));
  const list = el("div", { id: "webhooks-list" });
  const deliveries = el("div", { id: "webhook-deliveries" });
  root.append(el("h2", {}, "Webhooks"), create, message, list, deliveries);

  async function load() {
    const { webhooks } = await api("/v1/webhooks");
    list.replaceChildren(table(["Webhook", "URL", "Runs", "Created", ""],
      webhooks.map((w) => [el("a", { href: `#webhooks/${encodeURIComponent(w.id)}` }, w.id), w.url,
        w.all_runs ? "all" : "its schedules'", when(w.created_at),
        el("button", { type: "button", class: "secondary", "data-action": "delete", onclick: () => remove(w.id) }, "Delete")]),
      (i) => ({ "data-webhook": webhooks[i].id })));
  }
  async function remove(id) {
    try {
      await api(`/v1/webhooks/${encodeURIComponent(id)}`, { method: "DELETE" });
      message.textContent = `deleted ${id}`;
    } catch (err) {
      message.replaceChildren(failure(err));
    }
    await load();
  }
  async function showDeliveries(id) {
    const found = await api(`/v1/webhooks/${encodeURIComponent(id)}/deliveries`);
    const tries = (d) => d.tries.map((t) => `#${t.attempt} ${when(t.started_at)} ${t.duration_ms} ms ${t.status_code ?? t.error}`).join("; ");
    deliveries.replaceChildren(el("h3", {}, `Deliveries of ${id}`), table(["Delivery", "Run", "Status", "Attempts", "Next attempt", "Tries"],
      found.deliveries.map((d) => [d.id, runLink(d.run_id), statusBadge(d.status), String(d.attempts), when(d.next_attempt_at) || "-", tries(d)]),
      (i) => ({ "data-delivery": found.deliveries[i].id })));
  }
  create.addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      const made = await api("/v1/webhooks", { method: "POST", body: { url: url.value } });
      message.replaceChildren(el("span", {}, `created ${made.id}; its signing secret, shown only now: `, el("code", { id: "webhook-secret" }, made.secret)));
    } catch (err) {
      message.replaceChildren(failure(err));
    }
    await load();
  });
  await load();
  if (selected) await showDeliveries(selected);
}

// ---- usage ---------------------------------------------------------------------

function barChart(id, rows, key) {
  const width = 480;
  const bar = 22;
  const height = Math.max(1, rows.length) * (bar + 6) + 10;
  const max = Math.max(...rows.map((r) => Number(r.cost_usd)), 0) || 1;
  const label = 110;
  return svg("svg", { id, width, height, viewBox: `0 0 ${width} ${height}`, role: "img" },
    rows.map((r, i) => {
      const y = 5 + i * (bar + 6);
      const w = Math.max(1, ((width - label - 90) * Number(r.cost_usd)) / max);
      return svg("g", {},
        svg("text", { x: 0, y: y + 15 }, String(r[key])),
        svg("rect", { x: label, y, width: w, height: bar, fill: "#2f6fde", rx: 2 }),
        svg("text", { x: label + w + 6, y: y + 15 }, `$${r.cost_usd}`));
    }));
}

async function usageView(root) {
  const [byDay, byModel] = await Promise.all([api("/v1/usage?group_by=day"), api("/v1/usage?group_by=model")]);
  root.append(
    el("h2", {}, "Your usage"),
    el("p", { id: "usage-total" }, `Total $${byDay.totals.cost_usd} over ${byDay.totals.runs} runs, ${byDay.totals.calls} calls`),
    el("div", { class: "grid" },
      el("div", { class: "card" }, el("h3", {}, "Cost by day"), barChart("usage-by-day", byDay.rows, "day")),
      el("div", { class: "card" }, el("h3", {}, "Cost by model"), barChart("usage-by-model", byModel.rows, "model"))),
  );
  const top = el("div", { class: "card", id: "usage-top-users" }, el("h3", {}, "Top users (operators)"));
  root.append(top);
  try {
    const byUser = await api("/admin/usage?group_by=user", { admin: true });
    const rows = [...byUser.rows].sort((a, b) => Number(b.cost_usd) - Number(a.cost_usd)).slice(0, 10);
    top.append(table(["User", "Cost", "Runs", "Calls"], rows.map((r) => [r.user_id, `$${r.cost_usd}`, String(r.runs), String(r.calls)])));
  } catch (err) {
    top.append(failure(err));
  }
}

// ---- start ---------------------------------------------------------------------

document.getElementById("signin").addEventListener("submit", signIn);
document.getElementById("signout").addEventListener("click", signOut);
window.addEventListener("hashchange", route);
route();
