// tokenmill dashboard: refreshes the live part of a page in place, and sends the changes (replay, discard, cancel).
// No framework, no build step; the server renders every view.
(function () {
  "use strict";
  const live = document.getElementById("live");
  const csrfMeta = document.querySelector('meta[name="csrf-token"]');
  const csrf = csrfMeta ? csrfMeta.content : "";
  let busy = false;

  function toast(message, bad) {
    const box = document.getElementById("toast");
    if (!box) return;
    box.textContent = message;
    box.className = "show" + (bad ? " bad" : "");
    clearTimeout(toast.timer);
    toast.timer = setTimeout(function () { box.className = ""; }, 4000);
  }

  function partialUrl() {
    const url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    return url.toString();
  }

  function isUserBusy() {
    // NOTE: a refresh would drop what the user is doing: a checked box, a text selection in the live part
    if (live.querySelector("input:checked")) return true;
    const selection = window.getSelection();
    return selection && !selection.isCollapsed && live.contains(selection.anchorNode);
  }

  async function refresh() {
    if (busy || document.hidden || isUserBusy()) return;
    busy = true;
    try {
      const response = await fetch(partialUrl(), { credentials: "same-origin", headers: { "Accept": "text/html" } });
      if (response.status === 401) { window.location.reload(); return; }
      if (response.ok) {
        live.innerHTML = await response.text();
        live.removeAttribute("data-stale");
      } else {
        live.setAttribute("data-stale", String(response.status));
      }
    } catch (error) {
      live.setAttribute("data-stale", "offline");
    } finally {
      busy = false;
    }
  }

  async function post(url, body) {
    const response = await fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify(body || {}),
    });
    let data = {};
    try { data = await response.json(); } catch (error) { data = {}; }
    if (!response.ok) throw new Error((data.error && data.error.message) || ("HTTP " + response.status));
    return data;
  }

  function describe(data) {
    if (data.error) return data.error;
    if (data.replayed) return "Replayed " + data.replayed.length + (data.refused.length ? ", refused " + data.refused.length : "");
    if (typeof data.discarded === "number") return "Discarded " + data.discarded;
    if (data.cancelled) return "Cancel sent for " + data.cancelled;
    return "Done";
  }

  async function run(button, url, body) {
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    button.disabled = true;
    try {
      const data = await post(url, body);
      toast(describe(data), Boolean(data.error));
    } catch (error) {
      toast(error.message, true);
    } finally {
      button.disabled = false;
      refresh();
    }
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-action], button[data-bulk]");
    if (!button) return;
    event.preventDefault();
    if (button.dataset.action) {
      run(button, button.dataset.action, button.dataset.body ? JSON.parse(button.dataset.body) : {});
      return;
    }
    const ids = Array.from(document.querySelectorAll('input[name="dead"]:checked')).map(function (box) { return box.value; });
    if (!ids.length) { toast("Select dead letters first", true); return; }
    button.dataset.confirm = (button.classList.contains("danger") ? "Discard " : "Replay ") + ids.length + " dead letter(s)?";
    run(button, button.dataset.bulk, { ids: ids }).then(function () {
      document.querySelectorAll('input[name="dead"]:checked').forEach(function (box) { box.checked = false; });
      refresh();
    });
  });

  const seconds = live ? parseFloat(live.dataset.refresh || "0") : 0;
  if (live && seconds > 0) {
    setInterval(refresh, Math.max(1, seconds) * 1000);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) refresh(); });
  }
})();
