// Baton console: one script for the three pages, chosen by <body data-page>. Plain DOM, no
// libraries. Message states come from the server (Postgres); the page adds only "local" (typed,
// not yet accepted) and "synchronized" (the send returned). Nothing is inferred from time.
"use strict";

(function () {
  const page = document.body.dataset.page;
  const conn = document.getElementById("conn");

  function setConn(ok) {
    const s = ok ? "connected" : "disconnected";
    if (conn.dataset.state !== s) {
      conn.dataset.state = s;
      conn.textContent = s;
    }
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  // newID makes the client message id once per message; retries reuse it. crypto.randomUUID
  // needs a secure context (https or localhost): elsewhere build a v4 UUID from getRandomValues.
  function newID() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
    return h.slice(0, 8) + "-" + h.slice(8, 12) + "-" + h.slice(12, 16) + "-" + h.slice(16, 20) + "-" + h.slice(20);
  }

  // seg encodes an id as one path segment. (A conversation or message id "." or ".." cannot
  // be reached this way, encoded or not: the browser resolves such a segment, and its %2E
  // forms, away before sending. The console cannot open those; the README says so.)
  function seg(id) {
    return encodeURIComponent(id);
  }

  // requestTimeout bounds a request's wait for its answer. Past it the request is abandoned
  // (a send then shows local with a retry, which reuses the id: a send the server took after
  // all is not stored twice). The server bounds its own database work below this.
  const requestTimeout = 15000;

  async function api(method, path, body) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), requestTimeout);
    const opts = { method: method, headers: { Accept: "application/json" }, cache: "no-store", signal: ctl.signal };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    try {
      const res = await fetch(path, opts); // a network error or the timeout throws
      let data = null;
      try { data = await res.json(); } catch (e) { data = null; }
      return { status: res.status, ok: res.ok, data: data };
    } finally {
      clearTimeout(timer);
    }
  }

  function fmtTime(s) {
    if (!s) return "";
    const d = new Date(s);
    return isNaN(d) ? s : d.toLocaleTimeString();
  }

  if (page === "chat") chat();
  else if (page === "system") system();
  else if (page === "message") message();

  // ---- chat -------------------------------------------------------------------------------
  function chat() {
    const list = document.getElementById("conversations");
    const msgsEl = document.getElementById("messages");
    const title = document.getElementById("conversation-title");
    const input = document.getElementById("message-input");
    const sendBtn = document.getElementById("send");
    const composer = document.getElementById("composer");
    const notice = document.getElementById("notice");
    const newBtn = document.getElementById("new-conversation");
    const newID_ = document.getElementById("conversation-id");

    let current = null; // conversation id
    let es = null; // EventSource of current
    let reopenTimer = null;
    const msgs = new Map(); // client id → {el, history, content}
    // unsent: conversation id → Map(client id → content) of messages not yet accepted, kept in
    // the browser's storage so that a reload still shows them (local, with a retry that reuses
    // their id) instead of losing what the user typed.
    const unsentKey = "baton-console-unsent";
    const unsent = new Map();
    try {
      for (const [conv, msgs] of JSON.parse(localStorage.getItem(unsentKey) || "[]")) unsent.set(conv, new Map(msgs));
    } catch (e) { /* unreadable or no storage: start empty */ }
    function saveUnsent() {
      const all = [];
      for (const [conv, msgs] of unsent) if (msgs.size > 0) all.push([conv, [...msgs]]);
      try { localStorage.setItem(unsentKey, JSON.stringify(all)); } catch (e) { /* full or no storage */ }
    }

    function showNotice(text) {
      notice.hidden = !text;
      notice.textContent = text || "";
    }

    async function loadConversations() {
      try {
        const r = await api("GET", "/api/conversations");
        if (!es) setConn(r.ok);
        if (!r.ok) return;
        renderConversations(r.data.conversations);
      } catch (e) {
        if (!es) setConn(false);
      }
    }

    function renderConversations(convs) {
      list.textContent = "";
      for (const c of convs) {
        const li = el("li", { "data-conversation": c.id }, c.id);
        if (c.id === current) li.classList.add("current");
        li.addEventListener("click", () => open(c.id));
        list.appendChild(li);
      }
    }

    function open(id) {
      if (location.hash !== "#" + encodeURIComponent(id)) {
        history.replaceState(null, "", "#" + encodeURIComponent(id));
      }
      current = id;
      title.textContent = id;
      showNotice("");
      for (const li of list.children) li.classList.toggle("current", li.dataset.conversation === id);
      input.disabled = false;
      sendBtn.disabled = false;
      msgsEl.textContent = "";
      msgs.clear();
      const pending = unsent.get(id);
      if (pending) for (const [cid, content] of pending) addLocal(cid, content, true);
      if (es) es.close();
      es = null;
      if (!document.hidden) subscribe(); // a hidden tab subscribes when it shows
    }

    function subscribe() {
      if (es) es.close();
      clearTimeout(reopenTimer);
      const conv = current;
      es = new EventSource("/api/conversations/" + seg(conv) + "/events");
      const mine = es;
      es.addEventListener("open", () => {
        if (es === mine) setConn(true);
      });
      es.addEventListener("messages", (ev) => {
        if (es !== mine) return;
        setConn(true);
        const data = JSON.parse(ev.data);
        for (const v of data.messages) applyServer(v);
      });
      let reopening = false; // the server ends a stream now and then (MaxStreamAge), saying so first
      es.addEventListener("reopen", () => {
        if (es === mine) reopening = true;
      });
      es.addEventListener("error", () => {
        if (es !== mine) return;
        if (reopening && mine.readyState === EventSource.CONNECTING) {
          reopening = false;
          return; // the browser reconnects by itself: not a lost connection
        }
        setConn(false);
        if (mine.readyState === EventSource.CLOSED) {
          // The server refused the stream: a conversation that does not exist stays closed,
          // anything else (too many streams, a server error) is tried again.
          api("GET", "/api/conversations/" + seg(conv) + "/messages").then((r) => {
            if (es !== mine) return;
            setConn(r.status < 500);
            if (r.status === 404 || r.status === 400) {
              showNotice((r.data && r.data.error) || "conversation not found");
              return;
            }
            reopenTimer = setTimeout(() => { if (es === mine && current === conv) subscribe(); }, 2000);
          }, () => {
            if (es !== mine) return;
            reopenTimer = setTimeout(() => { if (es === mine && current === conv) subscribe(); }, 2000);
          });
        }
      });
    }

    function setState(m, state) {
      if (m.history[m.history.length - 1] !== state) m.history.push(state);
      m.el.dataset.state = state;
      m.el.dataset.history = m.history.join(" ");
      m.stateEl.textContent = state;
    }

    function build(id, content) {
      const li = el("li", { class: "msg", "data-client-id": id });
      const head = el("div", { class: "head" });
      const stateEl = el("span", { class: "state" });
      head.appendChild(stateEl);
      const link = el("a", { class: "detail", href: "/messages/" + seg(id) }, "timeline");
      head.appendChild(link);
      li.appendChild(head);
      li.appendChild(el("div", { class: "content" }, content));
      const info = el("div", { class: "info" });
      li.appendChild(info);
      msgsEl.appendChild(li);
      const m = { el: li, stateEl: stateEl, info: info, history: [], content: content };
      msgs.set(id, m);
      return m;
    }

    function addLocal(id, content, failedSend) {
      const m = build(id, content);
      setState(m, "local");
      if (failedSend) showRetry(m, id, "not sent: the server could not be reached");
      return m;
    }

    function child(m, cls, tag) {
      let c = m.el.querySelector(":scope > ." + cls);
      if (!c) {
        c = el(tag || "div", { class: cls });
        m.el.appendChild(c);
      }
      return c;
    }

    function drop(m, cls) {
      const c = m.el.querySelector(":scope > ." + cls);
      if (c) c.remove();
    }

    function showRetry(m, id, why) {
      const e = child(m, "send-error");
      e.textContent = why;
      if (!m.el.querySelector(":scope > .retry")) {
        const b = el("button", { class: "retry", type: "button" }, "Retry");
        b.addEventListener("click", () => send(current, id, m.content));
        m.el.appendChild(b);
      }
    }

    function applyServer(v) {
      let m = msgs.get(v.id);
      if (!m) m = build(v.id, v.content);
      const pending = unsent.get(v.conversation_id);
      if (pending && pending.delete(v.id)) saveUnsent();
      // A message the server has is synchronized, whichever told us first.
      if (m.history.length && m.history[m.history.length - 1] === "local") setState(m, "synchronized");
      drop(m, "retry");
      drop(m, "send-error");
      setState(m, v.state);
      const parts = [];
      if (v.outbox_id) parts.push("outbox " + v.outbox_id);
      if (v.attempts) parts.push(v.attempts + " attempt" + (v.attempts === 1 ? "" : "s"));
      if (v.state === "queued" && v.available_at) parts.push("available " + fmtTime(v.available_at));
      if (v.run_id) parts.push("run " + v.run_id);
      if (v.worker) parts.push("worker " + v.worker);
      if (v.lease_expires_at) parts.push("lease until " + fmtTime(v.lease_expires_at));
      m.info.textContent = parts.join(" · ");
      if (v.state === "replied") child(m, "reply").textContent = v.reply || "";
      else drop(m, "reply");
      if (v.state === "failed") child(m, "error").textContent = v.error || "The request failed.";
      else drop(m, "error");
    }

    async function send(conv, id, content) {
      let m = msgs.get(id);
      if (!m && conv === current) m = addLocal(id, content, false);
      let pending = unsent.get(conv);
      if (!pending) unsent.set(conv, (pending = new Map()));
      pending.set(id, content);
      saveUnsent();
      // The send goes out on this tab's own stream connection: the stream closes for it and
      // reopens after (its first event rebuilds every state). Otherwise, with 6 tabs of the
      // console streaming (visible windows, or a browser that does not hide background tabs),
      // the send would wait for a free connection that never comes (at most 6 a host).
      const paused = es !== null && conv === current;
      if (paused) {
        es.close();
        es = null;
      }
      let r;
      try {
        r = await api("POST", "/api/conversations/" + seg(conv) + "/messages", { id: id, content: content });
      } catch (e) {
        r = null;
      } finally {
        if (paused && conv === current && es === null && !document.hidden) subscribe();
      }
      m = msgs.get(id);
      if (r === null || r.status >= 500) {
        if (m) showRetry(m, id, r === null ? "not sent: the console could not be reached or did not answer" : "not sent: " + ((r.data && r.data.error) || "server error " + r.status));
        return;
      }
      if (!r.ok) {
        // The server refused this message (invalid, conflict): retrying cannot help.
        pending.delete(id);
        saveUnsent();
        if (m) {
          drop(m, "retry");
          drop(m, "send-error");
          setState(m, "failed");
          child(m, "error").textContent = (r.data && r.data.error) || "refused (" + r.status + ")";
        }
        return;
      }
      pending.delete(id);
      saveUnsent();
      if (!m) return;
      if (m.history[m.history.length - 1] === "local") setState(m, "synchronized");
      drop(m, "retry");
      drop(m, "send-error");
      // The states after synchronized come from the event stream only (the send woke it): the
      // state in this answer was read apart from the stream and may be older than what the
      // stream already showed.
    }

    composer.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const content = input.value;
      if (!current || content.trim() === "") return;
      input.value = "";
      send(current, newID(), content);
    });
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) {
        ev.preventDefault();
        composer.requestSubmit();
      }
    });
    newBtn.addEventListener("click", async () => {
      const wanted = newID_.value.trim();
      try {
        const r = await api("POST", "/api/conversations", { id: wanted });
        if (!r.ok) {
          showNotice((r.data && r.data.error) || "could not create the conversation (" + r.status + ")");
          return;
        }
        showNotice("");
        newID_.value = "";
        await loadConversations();
        open(r.data.id);
      } catch (e) {
        showNotice("could not reach the console");
        if (!es) setConn(false);
      }
    });

    // A hidden tab holds no event stream. A browser opens at most 6 connections to one host
    // over HTTP/1.1, and each stream holds one: with 6 chat tabs streaming, no other request
    // of the console (a send) could start. When the tab shows again, the stream reopens, and
    // its first event rebuilds every state from the server.
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) {
        if (es) es.close();
        es = null;
        clearTimeout(reopenTimer);
      } else if (current !== null && !es) {
        subscribe();
      }
    });

    loadConversations().then(() => {
      const h = location.hash.slice(1);
      if (h) {
        try { open(decodeURIComponent(h)); } catch (e) { /* a malformed hash opens nothing */ }
      }
    });
    setInterval(() => { if (!document.hidden) loadConversations(); }, 5000);
  }

  // ---- system -----------------------------------------------------------------------------
  function system() {
    const root = document.getElementById("system");
    const field = (name) => root.querySelector('[data-field="' + name + '"]');
    const set = (name, text) => { const f = field(name); if (f) f.textContent = text; };

    function bytes(n) {
      if (n === null || n === undefined) return "–";
      const u = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      let v = n;
      while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
      return (i === 0 ? v : v.toFixed(1)) + " " + u[i];
    }
    function secs(s) {
      if (s === null || s === undefined) return "–";
      if (s < 1) return Math.round(s * 1000) + " ms";
      if (s < 120) return s.toFixed(1) + " s";
      return Math.round(s / 60) + " min";
    }
    function stream(st) {
      if (!st) return "–";
      if (st.error) return "error: " + st.error;
      if (!st.exists) return st.name + ": missing";
      return st.name + ": " + st.messages + " messages";
    }

    function chart(series, bucket) {
      const svg = document.getElementById("chart");
      const NS = "http://www.w3.org/2000/svg";
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      const W = 300, H = 100, P = 4;
      const now = Date.now();
      const span = 5 * 60 * 1000;
      const x = (t) => P + ((t - (now - span)) / span) * (W - 2 * P);
      const maxRate = Math.max(1, ...series.map((p) => p.turns_per_second));
      const lats = series.filter((p) => p.latency_seconds !== null).map((p) => p.latency_seconds);
      const maxLat = Math.max(0.001, ...lats);
      const axis = document.createElementNS(NS, "line");
      axis.setAttribute("x1", P); axis.setAttribute("x2", W - P);
      axis.setAttribute("y1", H - P); axis.setAttribute("y2", H - P);
      axis.setAttribute("stroke", "#999");
      svg.appendChild(axis);
      const bw = Math.max(1, ((bucket * 1000) / span) * (W - 2 * P) - 1);
      for (const p of series) {
        const t = new Date(p.at).getTime();
        const h = (p.turns_per_second / maxRate) * (H - 2 * P);
        const r = document.createElementNS(NS, "rect");
        r.setAttribute("class", "rate");
        r.setAttribute("x", x(t)); r.setAttribute("width", bw);
        r.setAttribute("y", H - P - h); r.setAttribute("height", h);
        r.setAttribute("fill", "#4a7bd0");
        svg.appendChild(r);
      }
      const pts = series.filter((p) => p.latency_seconds !== null)
        .map((p) => (x(new Date(p.at).getTime()) + bw / 2).toFixed(1) + "," + (H - P - (p.latency_seconds / maxLat) * (H - 2 * P)).toFixed(1));
      if (pts.length) {
        const pl = document.createElementNS(NS, "polyline");
        pl.setAttribute("class", "latency");
        pl.setAttribute("points", pts.join(" "));
        pl.setAttribute("fill", "none");
        pl.setAttribute("stroke", "#d0742a");
        pl.setAttribute("stroke-width", "2");
        svg.appendChild(pl);
      }
    }

    async function refresh() {
      let r;
      try {
        r = await api("GET", "/api/status");
      } catch (e) {
        setConn(false);
        return;
      }
      setConn(r.ok);
      if (!r.ok || !r.data) return;
      const d = r.data;
      const c = d.console || {};
      document.getElementById("generated-at").textContent = "at " + fmtTime(d.generated_at);
      const att = document.getElementById("attention");
      const items = (d.attention || []).concat(d.warnings || []);
      att.hidden = items.length === 0;
      att.textContent = items.join(" · ");
      set("relay-state", c.relay_state || "–");
      set("slot-lag", d.slot && d.slot.error ? "error: " + d.slot.error : bytes(d.slot && d.slot.lag_bytes));
      set("retained-wal", bytes(d.slot && d.slot.retained_wal_bytes));
      set("confirmed-lsn", (d.slot && d.slot.confirmed_lsn) || "–");
      const bs = (d.outbox && d.outbox.by_status) || {};
      set("outbox-pending", bs.pending ?? "–");
      set("outbox-processing", bs.processing ?? "–");
      set("outbox-done", bs.done ?? "–");
      set("outbox-error", bs.error ?? "–");
      set("oldest-pending", d.outbox && d.outbox.oldest_pending_age_seconds != null ? secs(d.outbox.oldest_pending_age_seconds) : "none");
      set("dead-letter", c.dead_letters != null ? String(c.dead_letters) : "– (" + (c.dead_letter_error || "unknown") + ")");
      const s = d.streams || {};
      set("turns-stream", s.checked ? stream(s.turns) : s.note || "–");
      set("outcomes-stream", s.checked ? stream(s.outcomes) : s.note || "–");
      set("consumer", s.consumer ? (s.consumer.exists ? s.consumer.num_pending + " pending, " + s.consumer.num_ack_pending + " in flight" : "missing") : "–");
      set("turns-per-second", (c.turns_per_second || 0).toFixed(2));
      const series = c.series || [];
      const lastLat = series.filter((p) => p.latency_seconds !== null).pop();
      set("reply-latency", lastLat ? secs(lastLat.latency_seconds) : "–");
      const wf = field("workers");
      wf.textContent = "";
      if (c.worker_error) wf.textContent = "error: " + c.worker_error;
      else if (!c.workers || c.workers.length === 0) wf.textContent = "none";
      else {
        const ul = el("ul");
        for (const w of c.workers) {
          ul.appendChild(el("li", { "data-worker": w.name }, w.name + ": " + w.runs + " runs, " + w.open + " open, last seen " + fmtTime(w.last_seen)));
        }
        wf.appendChild(ul);
      }
      chart(series, c.bucket_seconds || 10);
    }
    refresh();
    setInterval(refresh, 3000);
  }

  // ---- message ----------------------------------------------------------------------------
  function message() {
    const id = decodeURIComponent(location.pathname.slice("/messages/".length));
    const tl = document.getElementById("timeline");
    const notice = document.getElementById("notice");
    document.getElementById("message-id").textContent = id;
    let timer = null;

    async function refresh() {
      let r;
      try {
        r = await api("GET", "/api/messages/" + seg(id));
      } catch (e) {
        setConn(false);
        return;
      }
      setConn(r.status < 500);
      if (!r.ok) {
        notice.hidden = false;
        notice.textContent = (r.data && r.data.error) || "error " + r.status;
        if (r.status === 404 || r.status === 400) clearInterval(timer);
        return;
      }
      notice.hidden = true;
      const d = r.data;
      const st = document.getElementById("message-state");
      st.textContent = d.state;
      st.dataset.state = d.state;
      document.getElementById("message-meta").textContent =
        "conversation " + d.message.conversation_id + " · role " + d.message.role + " · " + fmtTime(d.message.created_at);
      document.getElementById("message-content").textContent = d.message.content;
      tl.textContent = "";
      for (const e of d.entries) {
        const li = el("li", { "data-kind": e.kind });
        li.appendChild(el("time", { datetime: e.at }, fmtTime(e.at)));
        li.appendChild(el("span", { class: "kind" }, e.kind));
        li.appendChild(el("span", { class: "text" }, e.text));
        tl.appendChild(li);
      }
      if (d.state === "replied" || d.state === "failed") clearInterval(timer);
    }
    refresh();
    timer = setInterval(refresh, 1000);
  }
})();
