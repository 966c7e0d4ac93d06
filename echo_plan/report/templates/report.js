/* echo-plan report: draw the charts from the embedded JSON, make tables sortable. */
(function () {
  "use strict";
  function recordError(msg) {
    var root = document.documentElement;
    var errs = JSON.parse(root.getAttribute("data-js-errors") || "[]");
    errs.push(String(msg));
    root.setAttribute("data-js-errors", JSON.stringify(errs));
  }
  var payload = JSON.parse(document.getElementById("report-data").textContent);
  var config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  var drawing = [];
  payload.charts.forEach(function (c) {
    var el = document.getElementById(c.id);
    if (!el) { recordError("no element for chart " + c.id); return; }
    drawing.push(Plotly.newPlot(el, c.data, c.layout, config));
  });
  Promise.all(drawing).then(function () {
    document.body.dataset.chartsReady = String(drawing.length);
    document.body.dataset.chartsMs = String(Math.round(performance.now()));
  }, function (e) { recordError("chart failed: " + (e && e.message ? e.message : e)); });

  function sortBy(table, col, numeric, th) {
    var tbody = table.tBodies[0];
    var asc = th.getAttribute("aria-sort") !== "ascending";
    var rows = Array.prototype.slice.call(tbody.rows);
    rows.sort(function (a, b) {
      var x = a.cells[col].getAttribute("data-sort"), y = b.cells[col].getAttribute("data-sort");
      var d = numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y);
      return asc ? d : -d;
    });
    rows.forEach(function (r) { tbody.appendChild(r); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
  }
  document.querySelectorAll("button.more").forEach(function (button) {
    button.addEventListener("click", function () {
      var card = button.closest("section");
      var open = card.classList.toggle("unfolded");
      button.textContent = open ? "show fewer rows" : "show all rows";
    });
  });
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.addEventListener("click", function () { sortBy(table, col, th.dataset.numeric === "1", th); });
    });
  });
})();
