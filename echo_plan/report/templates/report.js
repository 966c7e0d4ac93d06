/* echo-plan report: let the text paint first, then load Plotly (embedded below as text) and draw
   the charts one by one from the embedded JSON, top of the page first; make tables sortable. */
(function () {
  "use strict";
  function recordError(msg) {
    var root = document.documentElement;
    var errs = JSON.parse(root.getAttribute("data-js-errors") || "[]");
    errs.push(String(msg));
    root.setAttribute("data-js-errors", JSON.stringify(errs));
  }
  function mark(name) {
    document.body.dataset[name] = String(Math.round(performance.now()));
  }
  var payload = JSON.parse(document.getElementById("report-data").textContent);
  document.body.dataset.chartsExpected = String(payload.charts.length);
  var config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };

  function drawFrom(i, drawn) {
    if (i >= payload.charts.length) {
      Promise.all(drawn).then(function () {
        document.body.dataset.chartsReady = String(drawn.length);
        mark("chartsMs");
        var fcp = performance.getEntriesByName("first-contentful-paint")[0];
        if (fcp) document.body.dataset.firstPaintMs = String(Math.round(fcp.startTime));
      }, function (e) { recordError("chart failed: " + (e && e.message ? e.message : e)); });
      return;
    }
    var c = payload.charts[i];
    var el = document.getElementById(c.id);
    if (!el) {
      recordError("no element for chart " + c.id);
    } else {
      drawn.push(Plotly.newPlot(el, c.data, c.layout, config));
    }
    if (sync) { drawFrom(i + 1, drawn); } else { setTimeout(function () { drawFrom(i + 1, drawn); }, 0); }
  }

  function start() {
    try {
      (0, eval)(document.getElementById("plotly-js").textContent);  // defines window.Plotly
    } catch (e) {
      recordError("Plotly failed to load: " + e);
      return;
    }
    mark("plotlyMs");
    drawFrom(0, []);
  }
  // The text of the report paints before the 4.8 MB of Plotly is compiled, and the browser may
  // paint between charts. With #sync in the URL everything draws before the load event instead,
  // so a headless browser that reads the page at load sees the real time it took (the benchmark).
  var sync = window.location.hash === "#sync";
  if (sync) { start(); } else { requestAnimationFrame(function () { setTimeout(start, 0); }); }

  document.querySelectorAll("button.more").forEach(function (button) {
    button.addEventListener("click", function () {
      var card = button.closest("section");
      var open = card.classList.toggle("unfolded");
      button.textContent = open ? "show fewer rows" : "show all rows";
    });
  });
  document.querySelectorAll("button.copy").forEach(function (button) {
    button.addEventListener("click", function () {
      var text = document.getElementById(button.dataset.copy).textContent;
      function done(ok) { button.textContent = ok ? "Copied" : "Select and copy"; }
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(text).then(function () { done(true); }, function () { done(false); });
      } else {
        var range = document.createRange();  // no clipboard API (a file:// page in some browsers): select it
        range.selectNodeContents(document.getElementById(button.dataset.copy));
        var sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(range);
        done(false);
      }
    });
  });
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
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.addEventListener("click", function () { sortBy(table, col, th.dataset.numeric === "1", th); });
    });
  });
})();
