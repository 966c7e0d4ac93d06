/* echo-plan layout probe: injected by echo_plan.report.browser into a copy of a report (never into
   the report a user gets). Once every chart has drawn, it checks the page's layout the way a person
   would see it and writes the problems it found, as JSON, into <body data-layout="...">. */
(function () {
  "use strict";
  var problems = [];
  var facts = {};
  function say(msg) { problems.push(msg); }
  function name(el) {
    return el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") +
      (el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\s+/).join(".") : "");
  }
  function scrolls(el) {  // an element inside a box that scrolls or clips sideways may be wider than the page
    for (var p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      var o = getComputedStyle(p).overflowX;
      if (o === "auto" || o === "scroll" || o === "hidden") return true;
    }
    return false;
  }

  function staticChecks() {
    var main = document.querySelector("main"), nav = document.querySelector("nav.toc");
    if (!main) { say("no <main> element"); return []; }
    var mr = main.getBoundingClientRect();
    // every section card lies inside the main column
    document.querySelectorAll("section.card").forEach(function (card) {
      if (!main.contains(card)) { say("section " + name(card) + " is outside <main>"); return; }
      var r = card.getBoundingClientRect();
      if (r.left < mr.left - 1 || r.right > mr.right + 1) say("section " + name(card) + " sticks out of the main column");
    });
    // the navigation holds only links, on one row
    var links = [];
    if (!nav) { say("no navigation (nav.toc)"); } else {
      Array.prototype.forEach.call(nav.children, function (el) {
        if (el.tagName !== "A" || el.querySelector("*")) say("the navigation holds " + name(el) + ", not only links");
      });
      links = Array.prototype.slice.call(nav.querySelectorAll("a"));
      var tops = links.map(function (a) { return Math.round(a.getBoundingClientRect().top); });
      if (tops.length && Math.max.apply(null, tops) - Math.min.apply(null, tops) > 2) {
        say("the navigation links wrap onto more than one row");
      }
      facts.nav_height_px = Math.round(nav.getBoundingClientRect().height);
    }
    // each link names a section of the main column; sections come in the order of the links
    var targets = [];
    links.forEach(function (a) {
      var id = (a.getAttribute("href") || "").replace(/^#/, "");
      var t = id && document.getElementById(id);
      if (!t) { say("link '" + a.textContent + "' points to #" + id + ", which does not exist"); return; }
      if (!main.contains(t)) say("link '" + a.textContent + "' points to #" + id + ", outside <main>");
      targets.push({ link: a, el: t });
    });
    for (var i = 1; i < targets.length; i++) {
      var before = targets[i - 1].el, after = targets[i].el;
      if (!(before.compareDocumentPosition(after) & Node.DOCUMENT_POSITION_FOLLOWING)) {
        say("section #" + after.id + " comes before #" + before.id + ", against the navigation's order");
      }
    }
    // element ids are unique
    var seen = {};
    document.querySelectorAll("[id]").forEach(function (el) {
      if (seen[el.id]) say("id '" + el.id + "' is used more than once");
      seen[el.id] = true;
    });
    // nothing overflows the page's width
    var width = document.documentElement.clientWidth, wide = 0;
    document.querySelectorAll("body *").forEach(function (el) {
      var r = el.getBoundingClientRect();
      if (r.width && r.right > width + 1 && !scrolls(el) && wide++ < 5) {
        say(name(el) + " overflows the page width (" + Math.round(r.right) + " > " + width + " px)");
      }
    });
    if (document.documentElement.scrollWidth > width + 1) say("the page scrolls sideways");
    // the recommendation is the first thing in the main column, above the fold
    var head = document.getElementById("headline");
    if (!head) say("no recommendation (#headline)"); else {
      facts.headline_top_px = Math.round(head.getBoundingClientRect().top + window.scrollY);
      if (facts.headline_top_px > 400) say("the recommendation starts " + facts.headline_top_px + " px down");
    }
    // no value in a key/value list is a wall of text
    document.querySelectorAll("dl.kv dd").forEach(function (dd) {
      var h = dd.getBoundingClientRect().height;
      if (h > 200) say("a listed value (" + dd.textContent.slice(0, 40) + "...) is " + Math.round(h) + " px tall");
    });
    // every chart has drawn
    var expected = Number(chartsExpected());
    var ready = Number(document.body.dataset.chartsReady || "0");
    facts.charts_expected = expected; facts.charts_ready = ready;
    if (!(ready === expected)) say(ready + " of " + expected + " charts drew");
    document.querySelectorAll("div.chart").forEach(function (c) {
      if (!c.querySelector(".main-svg")) say("chart " + name(c) + " did not draw");
    });
    return targets;
  }

  // each link scrolls its section to the top of the window (below the sticky navigation), or as
  // far as the page can scroll with the section in view
  function scrollChecks(targets, i, done) {
    if (i >= targets.length) { done(); return; }
    window.scrollTo(0, 0);
    targets[i].link.click();
    setTimeout(function () {
      var t = targets[i].el, top = t.getBoundingClientRect().top;
      var nav = document.querySelector("nav.toc"), navBottom = nav ? nav.getBoundingClientRect().bottom : 0;
      var atEnd = window.scrollY + window.innerHeight >= document.documentElement.scrollHeight - 2;
      var atTop = top >= navBottom - 2 && top <= navBottom + 40;
      if (!atTop && !(atEnd && top >= navBottom - 2 && top < window.innerHeight)) {
        say("link '" + targets[i].link.textContent + "' leaves #" + t.id + " at " + Math.round(top) +
            " px (the navigation ends at " + Math.round(navBottom) + " px)");
      }
      scrollChecks(targets, i + 1, done);
    }, 30);
  }

  function chartsExpected() {  // what the report's own data asks to draw
    var data = document.getElementById("report-data");
    try { return String(JSON.parse(data.textContent).charts.length); } catch (e) { return undefined; }
  }
  var waited = 0;
  var maxWaits = window.probeMaxWaits || 600;  /* polls of 50 ms for the charts: browser.with_probe sets it */
  function run() {
    var expected = chartsExpected();
    var errors = document.documentElement.getAttribute("data-js-errors") || "[]";
    if ((expected === undefined || document.body.dataset.chartsReady !== expected) && errors === "[]" && waited < maxWaits) {
      waited++;
      setTimeout(run, 50);
      return;
    }
    var targets = staticChecks();
    scrollChecks(targets, 0, function () {
      window.scrollTo(0, 0);
      facts.problems = problems;
      document.body.setAttribute("data-layout", JSON.stringify(facts));
    });
  }
  run();
})();
