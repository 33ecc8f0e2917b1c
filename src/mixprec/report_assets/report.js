// mixprec report page: pan and zoom, search, FP32 filter, detail panel. No network use.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("mp-data").textContent).graphs;
  var canvas = document.getElementById("canvas");
  var detail = document.getElementById("detail");
  var select = document.getElementById("graph-select");
  var search = document.getElementById("search");
  var count = document.getElementById("search-count");
  var only32 = document.getElementById("fp32-only");
  var views = {};  // graph id -> {svg, vp, s, tx, ty, w, h, adj}
  var current = null;
  var hits = [];
  var hitAt = -1;
  var selected = null;

  Object.keys(data).forEach(function (gid) {
    var svg = document.getElementById("svg-" + gid);
    var g = data[gid];
    var adj = g.nodes.map(function () { return { up: [], down: [] }; });
    g.edges.forEach(function (e) { adj[e[1]].up.push(e[0]); adj[e[0]].down.push(e[1]); });
    views[gid] = { svg: svg, vp: svg.querySelector(".vp"), s: 1, tx: 0, ty: 0,
      w: +svg.getAttribute("data-w"), h: +svg.getAttribute("data-h"), adj: adj, fitted: false };
  });

  function apply(v) {
    v.vp.setAttribute("transform", "translate(" + v.tx + "," + v.ty + ") scale(" + v.s + ")");
  }
  function fit(v, whole) {
    var cw = canvas.clientWidth || 800, ch = canvas.clientHeight || 600;
    v.s = Math.min(1, (cw - 20) / v.w, (ch - 20) / v.h);
    v.tx = (cw - v.w * v.s) / 2;
    v.ty = Math.max(10, (ch - v.h * v.s) / 2);
    if (!whole && v.s < 0.4) {
      // Too small to read: start readable, at the first node (the top of the graph).
      v.s = 0.8;
      var first = v.svg.querySelector("g.n").transform.baseVal.consolidate().matrix;
      v.tx = cw / 2 - first.e * v.s;
      v.ty = 20 - (first.f - 20) * v.s;
    }
    v.fitted = true;
    apply(v);
  }
  function show(gid) {
    if (current === gid) { return; }
    Object.keys(views).forEach(function (k) { views[k].svg.toggleAttribute("hidden", k !== gid); });
    current = gid;
    select.value = gid;
    if (!views[gid].fitted) { fit(views[gid]); }
  }
  function nodeEl(gid, i) { return document.getElementById(data[gid].ids[i]); }
  function centerOn(gid, i) {
    show(gid);
    var v = views[gid];
    var t = nodeEl(gid, i).transform.baseVal.consolidate().matrix;
    if (v.s < 0.6) { v.s = 0.9; }
    v.tx = canvas.clientWidth / 2 - t.e * v.s;
    v.ty = canvas.clientHeight / 2 - t.f * v.s;
    apply(v);
  }

  // Pan (drag) and zoom (wheel, around the pointer).
  var drag = null;
  canvas.addEventListener("pointerdown", function (ev) {
    var v = views[current];
    drag = { x: ev.clientX, y: ev.clientY, tx: v.tx, ty: v.ty, moved: false };
  });
  window.addEventListener("pointermove", function (ev) {
    if (!drag) { return; }
    var dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (!drag.moved && Math.abs(dx) + Math.abs(dy) < 4) { return; }
    drag.moved = true;
    canvas.classList.add("dragging");
    var v = views[current];
    v.tx = drag.tx + dx; v.ty = drag.ty + dy;
    apply(v);
  });
  window.addEventListener("pointerup", function () {
    canvas.classList.remove("dragging");
    setTimeout(function () { drag = null; }, 0);
  });
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var v = views[current];
    var r = canvas.getBoundingClientRect();
    var px = ev.clientX - r.left, py = ev.clientY - r.top;
    var k = Math.exp(-ev.deltaY * 0.0015);
    var s = Math.max(0.02, Math.min(4, v.s * k));
    v.tx = px - (px - v.tx) * (s / v.s);
    v.ty = py - (py - v.ty) * (s / v.s);
    v.s = s;
    apply(v);
  }, { passive: false });

  // Detail panel.
  function esc(t) {
    return String(t).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function tensor(t) {
    return esc(t.name) + " <small>" + esc(t.dtype) + (t.shape ? " [" + esc(t.shape.join(", ")) + "]" : "") + "</small>";
  }
  function link(gid, i) {
    var d = data[gid].nodes[i];
    return '<a href="#" data-g="' + gid + '" data-i="' + i + '">' + esc(d.op || "") + " " + esc(d.name || (d.tensor && d.tensor.name) || "") + "</a>";
  }
  function selectNode(gid, i) {
    if (selected) { selected.classList.remove("sel"); }
    selected = nodeEl(gid, i);
    selected.classList.add("sel");
    var d = data[gid].nodes[i];
    var rows = [];
    function row(k, v) { rows.push("<dt>" + k + "</dt><dd>" + v + "</dd>"); }
    row("precision", esc(d.precision || d.kind || ""));
    if (d.list_class) { row("list class", esc(d.list_class)); }
    if (d.step) { row("painting step", esc(d.step)); }
    if (d.reason) { row("reason", esc(d.reason)); }
    if (d.macs) { row("MACs", (d.macs / 1e6).toFixed(3) + " M"); }
    if (d.tensor) { row("tensor", tensor(d.tensor)); }
    if (d.outputs) { row("outputs", d.outputs.map(tensor).join("<br>")); }
    if (d.calibrated) { row("calibrated range", d.calibrated.map(esc).join("<br>")); }
    if (d.qparams) { row("INT8 scale / zero point", d.qparams.map(esc).join("<br>")); }
    if (d.bodies) {
      row("bodies", d.bodies.map(function (b) {
        return '<button type="button" data-open="' + b[0] + '">open ' + esc(b[1]) + "</button>";
      }).join("<br>"));
    }
    var a = views[gid].adj[i];
    if (a.up.length) { row("from", a.up.map(function (j) { return link(gid, j); }).join("<br>")); }
    if (a.down.length) { row("to", a.down.map(function (j) { return link(gid, j); }).join("<br>")); }
    detail.innerHTML = "<h3>" + esc(d.op || d.kind || "") + "</h3><div class=\"nodename\">" +
      esc(d.name || "") + "</div><dl>" + rows.join("") + "</dl>";
  }
  canvas.addEventListener("click", function (ev) {
    if (drag && drag.moved) { return; }
    var g = ev.target.closest ? ev.target.closest("g.n") : null;
    if (g) { selectNode(current, +g.getAttribute("data-i")); }
  });
  detail.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t.getAttribute("data-open")) { show(t.getAttribute("data-open")); return; }
    if (t.getAttribute("data-g")) {
      ev.preventDefault();
      var gid = t.getAttribute("data-g"), i = +t.getAttribute("data-i");
      centerOn(gid, i); selectNode(gid, i);
    }
  });
  select.addEventListener("change", function () { show(select.value); });
  document.getElementById("fit").addEventListener("click", function () { fit(views[current], true); });

  // Highlights: search hits and FP32 reason groups.
  function clearHits() {
    hits.forEach(function (h) { var el = nodeEl(h[0], h[1]); if (el) { el.classList.remove("hit"); } });
    hits = []; hitAt = -1;
    document.querySelectorAll(".group.on").forEach(function (b) { b.classList.remove("on"); });
  }
  function mark(list) {
    clearHits();
    hits = list;
    hits.forEach(function (h) { nodeEl(h[0], h[1]).classList.add("hit"); });
  }
  function next() {
    if (!hits.length) { return; }
    hitAt = (hitAt + 1) % hits.length;
    var h = hits[hitAt];
    centerOn(h[0], h[1]); selectNode(h[0], h[1]);
  }
  search.addEventListener("input", function () {
    var q = search.value.trim().toLowerCase();
    if (!q) { clearHits(); count.textContent = ""; return; }
    var found = [];
    Object.keys(data).forEach(function (gid) {
      data[gid].nodes.forEach(function (d, i) {
        var text = ((d.name || "") + " " + (d.op || "") + " " + ((d.tensor && d.tensor.name) || "")).toLowerCase();
        if (text.indexOf(q) >= 0) { found.push([gid, i]); }
      });
    });
    mark(found);
    count.textContent = found.length + (found.length === 1 ? " match" : " matches");
    if (found.length) { next(); }
  });
  search.addEventListener("keydown", function (ev) { if (ev.key === "Enter") { next(); } });
  document.querySelectorAll(".group").forEach(function (b) {
    b.addEventListener("click", function () {
      var list = b.getAttribute("data-nodes").split(" ").filter(Boolean).map(function (id) {
        var gid = id.slice(0, id.lastIndexOf("_"));
        return [gid, data[gid].ids.indexOf(id)];
      });
      mark(list);
      b.classList.add("on");
      next();
    });
  });

  // Filter: only FP32 nodes and their neighbours.
  only32.addEventListener("change", function () {
    var on = only32.checked;
    Object.keys(data).forEach(function (gid) {
      var v = views[gid], g = data[gid];
      var keep = g.nodes.map(function () { return !on; });
      if (on) {
        g.nodes.forEach(function (d, i) {
          if (d.precision === "FP32") {
            keep[i] = true;
            v.adj[i].up.forEach(function (j) { keep[j] = true; });
            v.adj[i].down.forEach(function (j) { keep[j] = true; });
          }
        });
      }
      g.nodes.forEach(function (d, i) { nodeEl(gid, i).classList.toggle("gone", !keep[i]); });
      v.svg.querySelectorAll("path.e").forEach(function (p) {
        var a = +p.getAttribute("data-a"), b = +p.getAttribute("data-b");
        p.classList.toggle("gone", !(keep[a] && keep[b]));
      });
    });
  });

  show(Object.keys(data)[0]);
  document.body.setAttribute("data-ready", "1");
})();
