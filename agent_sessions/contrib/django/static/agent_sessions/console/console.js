// The operator's console (agent_sessions.contrib.django): a session's page follows the session's event log
// live through the app's server-sent events view, and refreshes what the events change (the state, what
// waits, the newest transcript page) from the server, without reloading the page.
//
// Text from the store (a tool's result, a user's message) reaches the page only as text: events are written
// with textContent, and the refreshed sections are the server's own page, escaped there, moved in as nodes.
(function () {
  "use strict";

  // Forms that ask before they post (delete).
  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (form instanceof HTMLFormElement && form.dataset.confirm && !window.confirm(form.dataset.confirm)) {
      event.preventDefault();
    }
  });

  const live = document.getElementById("console-live");
  if (!live || typeof EventSource === "undefined") {
    return;
  }
  const KINDS = ["step_started", "steer_applied", "text", "model_response", "tool_called", "tool_finished",
                 "approval_requested", "approval_decided", "compacted", "finished", "failed"];
  const newestPage = live.dataset.newestPage === "1";

  // The same words as the server's reading.event_line.
  function describe(kind, data) {
    const call = data.call || {};
    const result = data.result || {};
    switch (kind) {
      case "step_started": return "step " + data.step + " started";
      case "steer_applied": return "steer landed at #" + ((data.index || 0) + 1) + ": " + (data.text || "");
      case "text": return "text: " + (data.text || "");
      case "model_response": {
        const content = (data.message && data.message.content) || [];
        const names = content.filter(function (c) { return c.type === "tool_call"; }).map(function (c) { return c.name; });
        const texts = content.filter(function (c) { return c.type === "text"; }).map(function (c) { return c.text; });
        return "model replied" + (names.length ? ": calls " + names.join(", ") : ": " + texts.join(" "));
      }
      case "tool_called": return "running " + (call.name || "") + " (" + (call.id || "") + ")";
      case "tool_finished": return (data.name || "") + " finished" + (result.is_error ? " with an error" : "") + ": " +
        (result.text || "");
      case "approval_requested": return "asks approval for " + (call.name || "") + " (" + (call.id || "") + ")";
      case "approval_decided": return (call.name || "") + " " + (data.approved ? "approved" : "denied") + " by " +
        (data.by || "") + (data.reason ? ": " + data.reason : "");
      case "compacted": return "compacted #" + ((data.start || 0) + 1) + " to #" + data.end;
      case "finished": return "finished (" + (data.stop_reason || "") + "): " + (data.text || "");
      case "failed": return "failed: " + (data.type || "") + ": " + (data.message || "");
      default: return kind;
    }
  }

  // What the run is doing now, in one line.
  function status(kind, data) {
    const call = data.call || {};
    switch (kind) {
      case "step_started": return "running: step " + data.step;
      case "model_response": return "running: the model replied";
      case "tool_called": return "running " + (call.name || "") + " (" + (call.id || "") + ")";
      case "tool_finished": return (data.name || "") + " finished";
      case "approval_requested": return "waiting for approval of " + (call.name || "");
      case "approval_decided": return (call.name || "") + (data.approved ? " approved" : " denied");
      case "finished": return "turn finished (" + (data.stop_reason || "") + ")";
      case "failed": return "run failed: " + (data.type || "");
      default: return null;
    }
  }

  const list = document.getElementById("console-events-list");
  const line = document.getElementById("console-live-status");

  function show(event) {
    let payload;
    try {
      payload = JSON.parse(event.data);
    } catch (e) {
      return;
    }
    const data = payload.data || {};
    const item = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = String(payload.at || "").slice(11, 19);
    const kind = document.createElement("b");
    kind.textContent = payload.kind;
    const text = document.createElement("span");
    text.textContent = describe(payload.kind, data);
    item.append(time, " ", kind, " ", text);
    list.prepend(item);
    const now = status(payload.kind, data);
    if (now !== null) {
      line.textContent = now;
    }
    if (payload.kind !== "text") {
      refreshSoon();
    }
  }

  // The sections an event may change, fetched again from the server and swapped in as nodes. A section
  // holding the element being typed in waits for the next event, so an operator's half-written reason stays.
  const SECTIONS = newestPage ? ["console-state", "console-transcript"] : ["console-state"];
  let timer = null;
  let busy = false;
  let again = false;

  function refreshSoon() {
    if (timer === null) {
      timer = window.setTimeout(refresh, 150);
    }
  }

  function refresh() {
    timer = null;
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    fetch(window.location.href, {credentials: "same-origin", headers: {"Accept": "text/html"}})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) {
          return;
        }
        const fresh = new DOMParser().parseFromString(html, "text/html");
        SECTIONS.forEach(function (id) {
          const old = document.getElementById(id);
          const replacement = fresh.getElementById(id);
          if (!old || !replacement) {
            return;
          }
          if (old.contains(document.activeElement)) {
            old.addEventListener("focusout", refreshSoon, {once: true});
            return;
          }
          old.replaceWith(document.importNode(replacement, true));
        });
        live.dataset.refreshed = String(Number(live.dataset.refreshed || "0") + 1);
      })
      .catch(function () { again = true; })
      .finally(function () {
        busy = false;
        if (again) {
          again = false;
          window.setTimeout(refreshSoon, 1000);
        }
      });
  }

  // EventSource reconnects by itself when a response ends (after a run's last event, or the view's time
  // limit), sending the last id it got as Last-Event-ID, which the view prefers to ?after=.
  const source = new EventSource(live.dataset.events + "?after=" + encodeURIComponent(live.dataset.after || "0"));
  KINDS.forEach(function (kind) { source.addEventListener(kind, show); });
  source.addEventListener("open", function () { live.dataset.connected = "1"; });
})();
