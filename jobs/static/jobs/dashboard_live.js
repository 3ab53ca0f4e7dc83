// Live dashboard: fetch its panels every few seconds and swap them in, as the run page does
// with its timeline. setTimeout (not setInterval) so a slow server never gets overlapping
// requests; a hidden tab, or a label select in use, skips its turn.
(function () {
  "use strict";
  const box = document.getElementById("dash");
  if (!box) {
    return;
  }
  const every = Number(box.dataset.refreshMs) || 5000;

  function busy() {
    const active = document.activeElement;
    return active !== null && box.contains(active) && active.tagName === "SELECT";
  }

  async function refresh() {
    if (!document.hidden && !busy()) {
      try {
        const response = await fetch(box.dataset.url, { credentials: "same-origin" });
        if (response.redirected) {
          window.location.reload(); // signed out: the page itself goes to the login
          return;
        }
        if (response.ok) {
          box.innerHTML = await response.text();
        }
      } catch (error) {
        // The server is restarting or the network blinked: try again next time.
      }
    }
    window.setTimeout(refresh, every);
  }

  window.setTimeout(refresh, every);
})();
