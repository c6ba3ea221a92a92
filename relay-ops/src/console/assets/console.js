// outbox-relay console: refreshes pages marked data-refresh (the overview)
// in place every few seconds, and selects a whole page of a list.
// Embedded in the binary; no other script runs.
(function () {
  var main = document.querySelector("main[data-refresh]");
  if (!main) return;
  var every = parseInt(main.getAttribute("data-refresh"), 10) * 1000;
  var timer = setInterval(function () {
    if (document.hidden) return;
    fetch(window.location.href, { headers: { "X-Console-Fragment": "1" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        main.innerHTML = html;
        // A page waiting for a result (the reconciliation) stops once it is there.
        if (main.querySelector("[data-refresh-done]")) clearInterval(timer);
      })
      .catch(function () { /* the next tick tries again */ });
  }, every);
})();
// "Select all" on a list: checks or clears every row's box on the page.
(function () {
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll('input[type="checkbox"][name="ids"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
})();
