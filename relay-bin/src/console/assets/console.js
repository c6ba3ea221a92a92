// outbox-relay console: refreshes pages marked data-refresh (the overview)
// in place every few seconds. Embedded in the binary; no other script runs.
(function () {
  var main = document.querySelector("main[data-refresh]");
  if (!main) return;
  var every = parseInt(main.getAttribute("data-refresh"), 10) * 1000;
  setInterval(function () {
    if (document.hidden) return;
    fetch(window.location.href, { headers: { "X-Console-Fragment": "1" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) main.innerHTML = html; })
      .catch(function () { /* the next tick tries again */ });
  }, every);
})();
