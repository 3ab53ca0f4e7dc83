// Live run page: while the run is active, fetch its timeline every few seconds and swap it
// in; when the run has ended, reload the page once so its fields and buttons are final.
// setTimeout (not setInterval) so a slow server never gets overlapping requests.
(function () {
  "use strict";
  const box = document.getElementById("run-timeline");
  if (!box) {
    return;
  }
  const every = Number(box.dataset.refreshMs) || 2000;

  function active() {
    const timeline = box.querySelector(".iq-timeline");
    return timeline !== null && timeline.dataset.active === "true";
  }

  async function refresh() {
    if (!document.hidden) {
      try {
        const response = await fetch(box.dataset.url, { credentials: "same-origin" });
        if (response.ok) {
          box.innerHTML = await response.text();
          if (!active()) {
            window.location.reload();
            return;
          }
        }
      } catch (error) {
        // The server is restarting or the network blinked: try again next time.
      }
    }
    window.setTimeout(refresh, every);
  }

  if (active()) {
    window.setTimeout(refresh, every);
  }
})();
