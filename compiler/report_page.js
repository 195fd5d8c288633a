// shardprop plan report: draws the plan data (schema shardprop.plan/1, see
// runtime/plan_data.py) embedded in this page. Lists are virtual: only the rows
// on screen exist in the DOM, and repeated layers start collapsed, so a program
// of tens of thousands of ops opens as fast as a small one.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("plan-data").textContent);
  const STR = D.strings, TY = D.types, LAY = D.layouts, VAL = D.values, OPS = D.ops, GR = D.graphs;
  const COLL = D.collectives, MESH = D.mesh;
  const ROW = 24;
  const GUT = 56;
  const AXIS = {};
  MESH.axes.forEach((a, i) => { AXIS[a] = i; });
  const SHORT = { float32: "f32", float16: "f16", bfloat16: "bf16", float64: "f64", int32: "i32", int64: "i64",
    int8: "i8", int16: "i16", uint8: "u8", uint32: "u32", bool: "bool", uint64: "u64", uint16: "u16" };
  const KINDS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "permute"];
  const PALETTE = ["#a5d8ff", "#b2f2bb", "#ffd8a8", "#d0bfff", "#ffc9c9", "#99e9f2", "#ffec99", "#eebefa",
    "#c0eb75", "#fcc2d7", "#bac8ff", "#96f2d7", "#ffe066", "#e9ecef", "#74c0fc", "#8ce99a"];
  const ALTERNATIVES = "not recorded: propagation keeps only the candidate it chose, not the ones it rejected";

  const state = { rank: null, sel: null, tab: "program" };
  const expanded = new Set();

  // ---------------------------------------------------------------- helpers
  const $ = (id) => document.getElementById(id);
  function h(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    if (attrs) for (const k in attrs) {
      const v = attrs[k];
      if (v == null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "style") e.style.cssText = v;
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of kids) if (c != null && c !== false) e.append(c);
    return e;
  }
  function fmtBytes(n) {
    if (n < 1024) return n + " B";
    const u = ["KiB", "MiB", "GiB", "TiB"];
    let i = -1;
    do { n /= 1024; i++; } while (n >= 1024 && i < u.length - 1);
    return (n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2)) + " " + u[i];
  }
  function typeText(t) {
    if (t == null) return "?";
    const ty = TY[t];
    return (SHORT[ty.dtype] || ty.dtype) + "[" + ty.shape.join(",") + "]";
  }
  function layoutText(l) {
    if (l == null) return "";
    const L = LAY[l];
    let s = "[" + L.dims.map((d) => "{" + d.join(",") + "}").join(", ") + "]";
    if (L.partial.length) s += " partial_" + L.partial_op + "{" + L.partial.join(",") + "}";
    return s;
  }
  function axesSize(axes) { let n = 1; for (const a of axes) n *= MESH.sizes[AXIS[a]]; return n; }
  function splitsText(l) {
    if (l == null) return "literal";
    return tupleText(LAY[l].dims.map(axesSize));
  }
  function tupleText(items) { return "(" + items.join(", ") + (items.length === 1 ? "," : "") + ")"; }
  // as plan.ops prints it: split counts per dim, one tuple per operand and per result
  function strategyText(o) {
    return tupleText(o.in_layouts.map(splitsText)) + " -> " + tupleText(o.out_layouts.map(splitsText));
  }
  function linIndex(rank, axes) {
    const c = MESH.coords[rank];
    let idx = 0;
    for (const a of axes) idx = idx * MESH.sizes[AXIS[a]] + c[AXIS[a]];
    return idx;
  }
  function rangesText(list) {
    const out = [];
    for (let i = 0; i < list.length;) {
      let j = i;
      while (j + 1 < list.length && list[j + 1] === list[j] + 1) j++;
      out.push(j - i >= 2 ? list[i] + "-" + list[j] : list.slice(i, j + 1).join(","));
      i = j + 1;
    }
    return out.join(",");
  }
  function src(o) { return o.source == null ? "" : STR[o.source]; }
  function isColl(o) { return o.collective != null; }
  function groupsOf(c) { return D.group_sets[c.groups]; }
  function groupOfRank(c, r) { return groupsOf(c).find((g) => g.includes(r)); }
  function coordsText(r) { return MESH.axes.map((a, i) => a + "=" + MESH.coords[r][i]).join(" "); }

  // ------------------------------------------------------ program structure
  const producer = new Int32Array(VAL.length).fill(-1);
  const consumers = new Array(VAL.length);
  const posInGraph = new Int32Array(OPS.length);
  OPS.forEach((o, i) => {
    for (const v of o.out) producer[v] = i;
    for (const v of o.in) (consumers[v] || (consumers[v] = [])).push(i);
  });
  GR.forEach((g) => g.ops.forEach((op, p) => { posInGraph[op] = p; }));
  const outputIndex = new Map();   // value -> the positions the program returns it at
  GR[0].outputs.forEach((v, k) => { if (!outputIndex.has(v)) outputIndex.set(v, []); outputIndex.get(v).push(k); });
  const planIndex = new Int32Array(OPS.length).fill(-1);
  D.plan_ops.forEach((op, k) => { planIndex[op] = k; });
  // collectives inside scan bodies run once per iteration: times per step (NaN: a while loop)
  function timesPerStep(i) {
    let m = 1, g = OPS[i].graph;
    while (GR[g].parent != null) {
      m *= GR[g].trip_count != null ? GR[g].trip_count : NaN;
      g = OPS[GR[g].parent].graph;
    }
    return m;
  }

  // rows of the program view, from what is expanded
  let rows = [];
  const rowOfOp = new Int32Array(OPS.length);
  const rowOfInput = new Map();
  const rowOfOutput = new Map();

  function rebuild() {
    rows = [];
    rowOfInput.clear();
    rowOfOutput.clear();
    const root = GR[0];
    const inRow = rows.length;
    rows.push({ t: "group", key: "inputs", n: root.inputs.length, what: "inputs" });
    root.inputs.forEach((v, k) => {
      if (expanded.has("inputs")) { rowOfInput.set(v, rows.length); rows.push({ t: "input", v, k }); }
      else rowOfInput.set(v, inRow);
    });
    emitSeq(root.ops, root.repeats, 0, "g0");
    rows.push({ t: "group", key: "outputs", n: root.outputs.length, what: "outputs" });
    if (expanded.has("outputs")) root.outputs.forEach((v, k) => { rowOfOutput.set(k, rows.length); rows.push({ t: "output", v, k }); });
  }
  function emitSeq(ops, reps, depth, key) {
    let pos = 0;
    for (const r of reps) {
      for (; pos < r.start; pos++) emitOp(ops[pos], depth);
      const span = ops.slice(r.start, r.start + r.period * r.count);
      const bkey = key + "/" + r.start;
      const brow = rows.length;
      rows.push({ t: "block", key: bkey, rep: r, ops: span, depth });
      if (expanded.has(bkey)) {
        for (let k = 0; k < r.count; k++) {
          const it = span.slice(k * r.period, (k + 1) * r.period);
          const ikey = bkey + "#" + k;
          const irow = rows.length;
          rows.push({ t: "iter", key: ikey, k, rep: r, ops: it, depth: depth + 1 });
          if (expanded.has(ikey)) emitSeq(it, r.inner || [], depth + 2, ikey);
          else hide(it, irow);
        }
      } else hide(span, brow);
      pos = r.start + r.period * r.count;
    }
    for (; pos < ops.length; pos++) emitOp(ops[pos], depth);
  }
  function emitOp(i, depth) {
    rowOfOp[i] = rows.length;
    rows.push({ t: "op", op: i, depth });
    (OPS[i].subgraphs || []).forEach((g, n) => {
      const key = "g" + g;
      const brow = rows.length;
      rows.push({ t: "body", key, g, n, op: i, depth: depth + 1 });
      if (expanded.has(key)) emitSeq(GR[g].ops, GR[g].repeats, depth + 2, key);
      else hide(GR[g].ops, brow);
    });
  }
  function hide(ops, row) {
    for (const i of ops) {
      rowOfOp[i] = row;
      const subs = OPS[i].subgraphs;
      if (subs) for (const g of subs) hide(GR[g].ops, row);
    }
  }
  // the keys to expand so that op i has a row of its own
  function keysFor(i) {
    const keys = [];
    let op = i;
    for (;;) {
      const g = OPS[op].graph;
      repeatKeys(GR[g].repeats, posInGraph[op], "g" + g, keys);
      if (GR[g].parent == null) return keys;
      keys.push("g" + g);
      op = GR[g].parent;
    }
  }
  function repeatKeys(reps, pos, key, keys) {
    for (const r of reps) {
      if (pos >= r.start && pos < r.start + r.period * r.count) {
        const bkey = key + "/" + r.start;
        const k = Math.floor((pos - r.start) / r.period);
        keys.push(bkey, bkey + "#" + k);
        repeatKeys(r.inner || [], (pos - r.start) % r.period, bkey + "#" + k, keys);
        return;
      }
    }
  }

  // what one repetition of a block holds (worked out once per block)
  function blockStats(row) {
    const r = row.rep;
    if (r.stats) return r.stats;
    const one = row.ops.slice(0, r.period);
    let nColl = 0, bytes = 0, lo = Infinity, hi = -Infinity, file = null, mixed = false;
    const kinds = {};
    const visit = (ops) => {
      for (const i of ops) {
        const o = OPS[i];
        if (isColl(o)) {
          const c = COLL[o.collective];
          nColl++; bytes += c.bytes * timesPerStep(i); kinds[c.kind] = (kinds[c.kind] || 0) + 1;
        }
        const s = src(o);
        const m = /^(.*):(\d+)$/.exec(s);
        if (m) {
          if (file == null) file = m[1];
          if (m[1] === file) { lo = Math.min(lo, +m[2]); hi = Math.max(hi, +m[2]); } else mixed = true;
        }
        (o.subgraphs || []).forEach((g) => visit(GR[g].ops));
      }
    };
    visit(one);
    const where = file == null ? "" : file + ":" + (lo === hi ? lo : lo + "-" + hi) + (mixed ? " and others" : "");
    r.stats = { nColl, bytes, kinds, where };
    return r.stats;
  }
  function bodyTitle(row) {
    const o = OPS[row.op];
    const g = GR[row.g];
    if (o.kind === "scan") return "scan body, runs " + (g.trip_count != null ? g.trip_count + " times" : "each iteration") + " per step";
    if (o.kind === "while") return row.n === 0 ? "while condition" : "while body (iterations known at run time)";
    if (o.kind === "cond") return "branch " + row.n;
    return o.kind + " body " + row.n;
  }
  function countIn(ops) {
    let n = 0, c = 0;
    const visit = (list) => { for (const i of list) { if (isColl(OPS[i])) c++; else n++; (OPS[i].subgraphs || []).forEach((g) => visit(GR[g].ops)); } };
    visit(ops);
    return [n, c];
  }

  // ----------------------------------------------------------- virtual lists
  function VList(box, rowFn, afterRender) {
    const space = box.querySelector(".vspace");
    let count = 0, queued = false;
    const self = {
      box, first: 0, last: -1,
      setCount(n) { count = n; space.style.height = n * ROW + "px"; self.render(); },
      render() {
        queued = false;
        const top = box.scrollTop, height = box.clientHeight || 600;
        const first = Math.max(0, Math.floor(top / ROW) - 8);
        const last = Math.min(count - 1, Math.ceil((top + height) / ROW) + 8);
        self.first = first; self.last = last;
        const frag = document.createDocumentFragment();
        for (let r = first; r <= last; r++) {
          const e = rowFn(r);
          e.style.top = r * ROW + "px";
          e.dataset.row = r;
          frag.append(e);
        }
        space.replaceChildren(frag);
        if (afterRender) afterRender(space, first, last);
      },
      schedule() { if (!queued) { queued = true; requestAnimationFrame(self.render); } },
      scrollTo(r) {
        const top = r * ROW, view = box.clientHeight || 600;
        if (top < box.scrollTop || top + ROW > box.scrollTop + view) box.scrollTop = Math.max(0, top - view / 3);
        self.render();
      },
    };
    box.addEventListener("scroll", self.schedule);
    return self;
  }

  // ---------------------------------------------------------- program rows
  function kindCell(o, depth) {
    const pad = "padding-left:" + (6 + depth * 14) + "px";
    if (isColl(o)) {
      return h("span", { class: "kind", style: pad + ";--kc:var(--" + o.kind + ")" }, h("b", { text: o.kind }));
    }
    return h("span", { class: "kind", style: pad, title: o.kind }, h("span", { class: "kindname", text: o.kind }));
  }
  function collectiveDetail(o) { return fmtBytes(COLL[o.collective].bytes) + " · " + collectiveWhere(o); }
  // which ranks take part: over which axes and groups (in a rank's view, its own group)
  function collectiveWhere(o) {
    const c = COLL[o.collective];
    const r = state.rank;
    const p = c.params || {};
    let where;
    if (c.kind === "slice") {
      if (r == null) where = "cuts " + (p.cuts || []).map((x) => "dim " + x[0] + " over " + x[1].join(",")).join("; ");
      else where = "begin (" + sliceBegin(o, c, r).join(", ") + ")";
    } else if (c.kind === "permute") {
      if (r == null) where = groupsOf(c).length + " pairs";
      else {
        const pairs = groupsOf(c);
        const to = pairs.find((x) => x[0] === r), from = pairs.find((x) => x[1] === r);
        where = "send to " + (to ? to[1] : "-") + ", receive from " + (from ? from[0] : "-");
      }
    } else if (r == null) {
      where = "over " + c.axes.join(",") + ", groups " + groupsOf(c).map((g) => rangesText(g)).join(" ");
    } else {
      where = "group " + groupOfRank(c, r).join("-");
    }
    return where;
  }
  function sliceBegin(o, c, r) {
    const out = VAL[o.out[0]];
    const shape = TY[out.local].shape;
    const begin = shape.map(() => 0);
    for (const [d, axes] of (c.params.cuts || [])) begin[d] = linIndex(r, axes) * shape[d];
    return begin;
  }
  // a row has room for little: a pending partial is written Σ{axes} (max{axes}, min{axes})
  function shortLayout(l) {
    if (l == null) return "";
    const L = LAY[l];
    let s = "[" + L.dims.map((d) => "{" + d.join(",") + "}").join(",") + "]";
    if (L.partial.length) s += " " + (L.partial_op === "sum" ? "Σ" : L.partial_op) + "{" + L.partial.join(",") + "}";
    return s;
  }
  // where rank r's block of value v starts, in layout l
  function offsetsOf(v, l, r) {
    const L = LAY[l];
    return TY[VAL[v].type].shape.map((s, d) => linIndex(r, L.dims[d]) * (s / axesSize(L.dims[d])));
  }
  function valueType(v) {
    const x = VAL[v];
    if (state.rank != null) return typeText(x.local);
    return typeText(x.type) + " " + shortLayout(x.layout);
  }
  function programRow(r) {
    const row = rows[r];
    if (row.t === "op") {
      const i = row.op, o = OPS[i];
      const coll = isColl(o);
      const e = h("div", { class: "row op" + (coll ? " coll" : "") + (state.sel === i ? " sel" : ""), "data-op": i,
        style: coll ? "--kc:var(--" + o.kind + ");--kbg:color-mix(in srgb, var(--" + o.kind + ") 13%, white)" : null });
      const detail = coll ? collectiveDetail(o) : strategyText(o);
      let types;
      if (coll) types = typeText(VAL[o.in[0]].local) + " → " + typeText(VAL[o.out[0]].local);
      else types = o.out.length ? valueType(o.out[0]) + (o.out.length > 1 ? "  +" + (o.out.length - 1) : "") : "";
      e.append(h("span", { class: "gut" }), h("span", { class: "idx", text: "#" + i }), kindCell(o, row.depth),
        h("span", { class: "type", text: types, title: types }),
        h("span", { class: "strat", text: detail, title: detail }),
        h("span", { class: "src", text: src(o), title: src(o) }));
      return e;
    }
    if (row.t === "input" || row.t === "output") {
      const x = VAL[row.v];
      const e = h("div", { class: "row", "data-value": row.v });
      e.append(h("span", { class: "gut" }), h("span", { class: "idx", text: row.t === "input" ? "in " + row.k : "out " + row.k }),
        h("span", { class: "kind", style: "padding-left:6px" }, h("b", { text: x.name })),
        h("span", { class: "type", text: valueType(row.v) }),
        h("span", { class: "strat", text: (x.const ? "constant · " : "") + (state.rank != null
          ? layoutText(x.layout) + " offsets (" + offsetsOf(row.v, x.layout, state.rank).join(", ") + ")"
          : "per device " + typeText(x.local)) }),
        h("span", { class: "src" }));
      return e;
    }
    const open = expanded.has(row.key);
    const e = h("div", { class: "row " + row.t, "data-key": row.key });
    const pad = "padding-left:" + (6 + (row.depth || 0) * 14) + "px";
    let label;
    if (row.t === "group") label = row.n + " " + (row.n === 1 ? row.what.slice(0, -1) : row.what);
    else if (row.t === "block") {
      const s = blockStats(row);
      const kinds = Object.keys(s.kinds).map((k) => k + (s.kinds[k] > 1 ? " ×" + s.kinds[k] : "")).join(", ");
      label = [h("b", { text: "×" + row.rep.count + " repeated" }),
        " " + row.rep.period + " ops each · " + (s.nColl ? s.nColl + " collectives each (" + kinds + "), " + fmtBytes(s.bytes) : "no collectives") +
        " · #" + row.ops[0] + "–#" + row.ops[row.ops.length - 1] + (s.where ? " · " + s.where : "")];
    } else if (row.t === "iter") {
      label = "repetition " + (row.k + 1) + " of " + row.rep.count + " · #" + row.ops[0] + "–#" + row.ops[row.ops.length - 1];
    } else {
      const [n, c] = countIn(GR[row.g].ops);
      label = bodyTitle(row) + " · " + n + " ops, " + c + " collectives";
    }
    e.append(h("span", { class: "gut" }), h("span", { class: "label", style: pad },
      h("span", { class: "tw", text: open ? "▾" : "▸" }), ...[].concat(label)));
    return e;
  }
  function valueRow(v) {
    const p = producer[v];
    if (p >= 0) return rowOfOp[p];
    return rowOfInput.has(v) ? rowOfInput.get(v) : -1;
  }
  function drawEdges(space, first, last) {
    const seen = new Map();
    const add = (a, b, cls) => {
      if (a < 0 || b < 0 || a === b) return;
      const k = a * 1e7 + b;
      if (!seen.has(k) || cls) seen.set(k, cls || seen.get(k) || "");
    };
    const opEdges = (i, r, cls) => {
      const o = OPS[i];
      for (const v of o.in) add(valueRow(v), r, cls === undefined ? "" : cls && "in");
      for (const v of o.out) {
        const cs = consumers[v] || [];
        for (let k = 0; k < cs.length && k < 16; k++) {
          const cr = rowOfOp[cs[k]];
          if (cls || cr < first || cr > last) add(r, cr, cls && "out");
        }
        for (const k of outputIndex.get(v) || []) if (rowOfOutput.has(k)) add(r, rowOfOutput.get(k), cls && "out");
      }
    };
    const dots = [];
    for (let r = first; r <= last; r++) {
      const row = rows[r];
      if (row.t === "op") { opEdges(row.op, r); dots.push([r, isColl(OPS[row.op])]); }
      else if (row.t === "output") add(valueRow(row.v), r, "");
      else if (row.t === "input") dots.push([r, false]);
    }
    if (state.sel != null && rowOfOp[state.sel] != null && rows[rowOfOp[state.sel]] && rows[rowOfOp[state.sel]].op === state.sel) {
      opEdges(state.sel, rowOfOp[state.sel], true);
    }
    const y = (r) => (r - first) * ROW + ROW / 2;
    const x0 = GUT - 8;
    let plain = "", hi = "";
    for (const [k, cls] of seen) {
      const a = Math.floor(k / 1e7), b = k % 1e7;
      const amp = Math.min(GUT - 12, 5 + 6 * Math.log2(1 + Math.abs(b - a)));
      const d = "M" + x0 + "," + y(a) + "C" + (x0 - amp) + "," + y(a) + " " + (x0 - amp) + "," + y(b) + " " + x0 + "," + y(b);
      if (cls) hi += '<path class="' + cls + '" d="' + d + '"/>'; else plain += '<path d="' + d + '"/>';
    }
    let dotsSvg = "";
    for (const [r, c] of dots) dotsSvg += '<circle cx="' + x0 + '" cy="' + y(r) + '" r="3"' + (c ? ' class="coll"' : "") + "/>";
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("class", "edges");
    svg.setAttribute("width", GUT);
    svg.setAttribute("height", (last - first + 1) * ROW);
    svg.style.top = first * ROW + "px";
    svg.innerHTML = plain + hi + dotsSvg;
    space.append(svg);
  }
  const program = VList($("program-view"), programRow, drawEdges);

  // ------------------------------------------------------- collectives list
  function collectiveRow(k) {
    const c = COLL[k], o = OPS[c.op];
    const e = h("div", { class: "row op coll" + (state.sel === c.op ? " sel" : ""), "data-op": c.op,
      style: "--kc:var(--" + c.kind + ");--kbg:color-mix(in srgb, var(--" + c.kind + ") 13%, white)" });
    const where = collectiveWhere(o);
    e.append(h("span", { class: "gut", style: "width:8px" }), h("span", { class: "idx", text: "#" + k }), kindCell(o, 0),
      h("span", { class: "c-shape", text: typeText(VAL[o.in[0]].local) + " → " + typeText(VAL[o.out[0]].local) }),
      h("span", { class: "c-bytes", text: fmtBytes(c.bytes) }),
      h("span", { class: "c-where", text: where, title: where }),
      h("span", { class: "c-why", text: c.reason, title: c.reason }));
    return e;
  }
  const collectivesList = VList($("collectives-view"), collectiveRow, null);

  // ------------------------------------------------------------ the panel
  function originSteps(i) {
    const steps = [];
    const seen = new Set([i]);
    let cur = i;
    for (;;) {
      const o = OPS[cur];
      const via = o.via || [];
      steps.push({ text: STR[o.origin], names: via.length ? null : o.from });
      via.forEach((s, k) => steps.push({ text: STR[s], names: k === via.length - 1 ? o.from : null }));
      const nxt = o.from;
      if (nxt == null) return steps;
      if (seen.has(nxt)) { steps.push({ text: againText(cur, nxt), names: nxt }); return steps; }
      seen.add(nxt);
      cur = nxt;
    }
  }
  function againText(cur, nxt) { return cur === nxt ? "(names this op itself)" : "(op #" + nxt + " again)"; }
  function chainLine(texts) {
    if (texts.length && texts[texts.length - 1] === "user") {
      return texts.length > 1 ? texts.slice(0, -1).join(", ") + " (the user's mark)" : "the user's mark";
    }
    return texts.join(", ");
  }
  function opLink(i, text) {
    const a = h("a", { "data-goto": i, text: text != null ? text : "#" + i + " " + OPS[i].kind });
    return a;
  }
  function layoutGrid(t, l) {
    const shape = TY[t].shape, L = LAY[l], rank = shape.length;
    const splits = L.dims.map(axesSize);
    const nCols = rank ? splits[rank - 1] : 1;
    const rowDims = [];
    for (let d = 0; d < rank - 1; d++) rowDims.push(d);
    const nRows = rowDims.reduce((a, d) => a * splits[d], 1);
    if (nRows * nCols > 256) return h("div", { class: "axis-note", text: nRows * nCols + " blocks: too many to draw" });
    const cells = [];
    for (let k = 0; k < nRows * nCols; k++) cells.push([]);
    for (let dev = 0; dev < MESH.devices; dev++) {
      let r = 0;
      for (const d of rowDims) r = r * splits[d] + linIndex(dev, L.dims[d]);
      const c = rank ? linIndex(dev, L.dims[rank - 1]) : 0;
      cells[r * nCols + c].push(dev);
    }
    const rowsSize = rowDims.reduce((a, d) => a * shape[d], 1), colsSize = rank ? shape[rank - 1] : 1;
    const width = 380;
    const aspect = Math.min(1.1, Math.max(0.12, rowsSize / Math.max(1, colsSize)));
    const cellH = Math.max(24, Math.min(60, (width * aspect) / nRows));
    const grid = h("div", { class: "grid", style: "width:" + width + "px;grid-template-columns:repeat(" + nCols + ",1fr);grid-auto-rows:" + cellH + "px" });
    const partial = L.partial.length > 0;
    const local = shape.map((s, d) => s / splits[d]);
    cells.forEach((devs, k) => {
      const r = Math.floor(k / nCols), c = k % nCols;
      // block extents, for the tooltip
      const idx = [];
      let rr = r;
      for (let q = rowDims.length - 1; q >= 0; q--) { idx[rowDims[q]] = rr % splits[rowDims[q]]; rr = Math.floor(rr / splits[rowDims[q]]); }
      if (rank) idx[rank - 1] = c;
      const ext = idx.map((b, d) => b * local[d] + ":" + (b + 1) * local[d]).join(", ");
      const mine = state.rank != null && devs.includes(state.rank);
      grid.append(h("div", { class: "cell" + (partial ? " partial" : "") + (mine ? " me" : ""),
        style: "background-color:" + PALETTE[k % PALETTE.length],
        title: "block [" + ext + "] on devices " + devs.join(", ") + (partial ? " (each holds a partial " + L.partial_op + ")" : ""),
        text: (partial ? "Σ " : "") + rangesText(devs) }));
    });
    const notes = [];
    const dimNote = (d) => "dim " + d + (splits[d] > 1 ? " ÷" + splits[d] + " {" + L.dims[d].join(",") + "}" : " whole");
    if (rank >= 2) notes.push("rows: " + rowDims.map(dimNote).join(" × ") + "; columns: " + dimNote(rank - 1));
    else if (rank === 1) notes.push("columns: " + dimNote(0));
    else notes.push("a scalar");
    const box = h("div", null, grid, h("div", { class: "axis-note", text: notes.join("") + ". Each cell lists the devices holding that block." }));
    if (partial) {
      box.append(h("div", { class: "partial-note",
        text: "Σ partial " + L.partial_op + " over {" + L.partial.join(",") + "}: the " + axesSize(L.partial) +
          " devices of each cell hold summands; the block is their " + L.partial_op + "." }));
    }
    return box;
  }
  function valueBlock(v, layoutOverride) {
    const x = VAL[v];
    const head = h("div", { class: "vhead mono" });
    if (x.literal != null) {
      head.append(h("b", { text: x.name }), " literal");
      return h("div", { class: "value" }, head);
    }
    const l = layoutOverride != null ? layoutOverride : x.layout;
    head.append(h("b", { text: x.name }), " " + typeText(x.type) + " " + layoutText(l));
    const p = producer[v];
    const made = p >= 0 ? [" · made by ", opLink(p)] : [" · " + (x.const ? "a constant" : "an input")];
    const per = h("div", { class: "axis-note" }, "per device " + typeText(x.local), ...made);
    if (state.rank != null && l != null) per.append(" · rank " + state.rank + " holds offsets (" + offsetsOf(v, l, state.rank).join(", ") + ")");
    return h("div", { class: "value" }, head, per, l != null ? layoutGrid(x.type, l) : null);
  }
  function kv(pairs) {
    const box = h("div", { class: "kv" });
    for (const [k, v] of pairs) box.append(h("div", { text: k }), typeof v === "string" ? h("div", { class: "mono", text: v }) : v);
    return box;
  }
  function redistributions(i) {
    const o = OPS[i];
    const out = [];
    for (const v of o.in) { const p = producer[v]; if (p >= 0 && isColl(OPS[p])) out.push(["before", p]); }
    for (const v of o.out) for (const c of consumers[v] || []) if (isColl(OPS[c])) out.push(["after", c]);
    return out;
  }
  function showPanel() {
    const panel = $("panel");
    const i = state.sel;
    if (i == null) return;
    const o = OPS[i];
    const parts = [];
    if (isColl(o)) {
      const c = COLL[o.collective];
      parts.push(h("h2", null, h("span", { class: "pill", style: "background:var(--" + c.kind + ")", text: c.kind }),
        " #" + i + " ", h("span", { class: "dim", text: " plan.collectives[" + o.collective + "]" })));
      parts.push(h("div", { class: "src", text: (c.source || "no source line") + (c.reason ? " · inserted " + c.reason : "") }));
      const myGroup = state.rank != null && c.kind !== "permute" ? groupOfRank(c, state.rank) : null;
      const groups = h("div", { class: "groups mono" });
      for (const g of groupsOf(c)) groups.append(h("span", { class: myGroup === g ? "me" : null, text: c.kind === "permute" ? g[0] + "→" + g[1] : g.join("-") }));
      parts.push(kv([["kind", c.kind], ["over axes", c.axes.join(", ") || "-"], ["per device", c.in_shape.join("x") + " → " + c.out_shape.join("x") + " " + c.dtype],
        ["bytes sent", fmtBytes(c.bytes) + " per device" + (timesPerStep(i) !== 1 ? " per run (×" + timesPerStep(i) + " per step)" : "")],
        ["params", JSON.stringify(c.params)], [c.kind === "permute" ? "pairs" : "groups", groups]]));
      if (state.rank != null) parts.push(h("div", { class: "axis-note", text: "rank " + state.rank + ": " + collectiveDetail(o) }));
      parts.push(h("h4", { text: "From" }), valueBlock(o.in[0]));
      parts.push(h("h4", { text: "To" }), valueBlock(o.out[0]));
      const users = consumers[o.out[0]] || [];
      if (users.length) parts.push(h("div", null, "read by ", ...users.slice(0, 20).flatMap((u, k) => (k ? [", ", opLink(u)] : [opLink(u)]))));
    } else {
      parts.push(h("h2", null, "#" + i + " ", h("span", { class: "kindname", text: o.kind }),
        planIndex[i] >= 0 ? h("span", { class: "dim", text: "  plan.ops[" + planIndex[i] + "]" }) : null));
      parts.push(h("div", { class: "src", text: src(o) || "no source line" }));
      const steps = originSteps(i);
      parts.push(h("h4", { text: "Why this strategy" }));
      parts.push(h("div", { id: "origin-line", class: "mono", text: chainLine(steps.map((s) => s.text)) }));
      const ol = h("ol", { class: "chain", id: "origin-steps" });
      for (const s of steps) {
        ol.append(h("li", null, s.text === "user" ? "user: the strategy a shard() mark or constraint gives" : s.text,
          s.names != null ? h("span", { class: "dim" }, " → ", opLink(s.names)) : null));
      }
      if (steps.length > 1) parts.push(ol);
      parts.push(h("h4", { text: "Strategy" }));
      const pairs = [["strategy", strategyText(o)], ["alternatives", h("div", { class: "dim", id: "alternatives", text: ALTERNATIVES })]];
      if (o.params != null) pairs.push(["params", STR[o.params]]);
      if (o.note != null) pairs.push(["note", STR[o.note]]);
      parts.push(kv(pairs));
      const red = redistributions(i);
      if (red.length) {
        parts.push(h("h4", { text: "Redistributions" }));
        for (const [side, c] of red) {
          const cc = COLL[OPS[c].collective];
          parts.push(h("div", null, side + ": ", opLink(c, cc.kind), " " + fmtBytes(cc.bytes) + " over " + cc.axes.join(",")));
        }
      }
      parts.push(h("h4", { text: "Operands (as this op reads them)" }));
      o.in.forEach((v, n) => parts.push(valueBlock(v, o.in_layouts[n])));
      parts.push(h("h4", { text: "Results" }));
      o.out.forEach((v, n) => parts.push(valueBlock(v, o.out_layouts[n])));
      if (o.subgraphs) {
        parts.push(h("h4", { text: "Bodies" }));
        o.subgraphs.forEach((g, n) => parts.push(h("div", null, bodyTitle({ op: i, g, n }) + " · " + GR[g].ops.length + " ops ",
          GR[g].ops.length ? opLink(GR[g].ops[0], "first op") : null)));
      }
    }
    panel.replaceChildren(...parts);
    panel.scrollTop = 0;
  }

  // ------------------------------------------------------------- summary
  function summary() {
    const box = $("summary-view");
    const byKind = {}, bySource = new Map();
    let multiplied = false;
    COLL.forEach((c) => {
      const m = timesPerStep(c.op);
      if (m !== 1) multiplied = true;
      const k = byKind[c.kind] || (byKind[c.kind] = { n: 0, bytes: 0, step: 0 });
      k.n++; k.bytes += c.bytes; k.step += c.bytes * m;
      const s = c.source || "(no source line)";
      const e = bySource.get(s) || { n: 0, bytes: 0, kinds: {} };
      e.n++; e.bytes += c.bytes * m; e.kinds[c.kind] = (e.kinds[c.kind] || 0) + 1;
      bySource.set(s, e);
    });
    const parts = [h("h3", { text: "Bytes by kind" })];
    const total = Object.values(byKind).reduce((a, k) => a + k.step, 0) || 1;
    const t1 = h("table", null, h("tr", null, h("th", { text: "kind" }), h("th", { class: "num", text: "count" }),
      h("th", { class: "num", text: "bytes / device" }), multiplied ? h("th", { class: "num", text: "per step (loops)" }) : null, h("th")));
    for (const kind of KINDS) {
      const k = byKind[kind];
      if (!k) continue;
      t1.append(h("tr", null, h("td", null, h("span", { class: "pill", style: "background:var(--" + kind + ")", text: kind })),
        h("td", { class: "num", text: k.n }), h("td", { class: "num", text: fmtBytes(k.bytes) }),
        multiplied ? h("td", { class: "num", text: isNaN(k.step) ? "depends on a while loop" : fmtBytes(k.step) }) : null,
        h("td", null, h("span", { class: "bar", style: "width:" + Math.round(200 * k.step / total) + "px;background:var(--" + kind + ")" }))));
    }
    if (!COLL.length) t1.append(h("tr", null, h("td", { text: "no collectives: every op reads its operands where they are" })));
    parts.push(t1);

    parts.push(h("h3", { text: "Bytes by layer (repeated blocks)" }));
    const t2 = h("table", null, h("tr", null, h("th", { text: "block" }), h("th", { class: "num", text: "repeats" }),
      h("th", { class: "num", text: "ops each" }), h("th", { class: "num", text: "collectives each" }),
      h("th", { class: "num", text: "bytes each" }), h("th", { class: "num", text: "bytes in all" })));
    let inBlocks = 0, nBlocks = 0;
    const blockRows = (graph, key, label) => {
      for (const r of graph.repeats) {
        const span = graph.ops.slice(r.start, r.start + r.period * r.count);
        const s = blockStats({ rep: r, ops: span });
        inBlocks += s.bytes * r.count; nBlocks++;
        const tr = h("tr", { class: "link", "data-goto": span[0] }, h("td", { text: label + (s.where || "ops #" + span[0]) }),
          h("td", { class: "num", text: "×" + r.count }), h("td", { class: "num", text: r.period }), h("td", { class: "num", text: s.nColl }),
          h("td", { class: "num", text: fmtBytes(s.bytes) }), h("td", { class: "num", text: fmtBytes(s.bytes * r.count) }));
        t2.append(tr);
      }
    };
    blockRows(GR[0], "g0", "");
    GR.forEach((g, k) => {
      if (g.parent == null) return;
      const [n, c] = countIn(g.ops);
      let bytes = 0;
      const visit = (ops) => { for (const i of ops) { if (isColl(OPS[i])) bytes += COLL[OPS[i].collective].bytes; (OPS[i].subgraphs || []).forEach((s) => visit(GR[s].ops)); } };
      visit(g.ops);
      const o = OPS[g.parent];
      t2.append(h("tr", { class: "link", "data-goto": g.parent }, h("td", { text: o.kind + " body at " + (src(o) || "#" + g.parent) }),
        h("td", { class: "num", text: g.trip_count != null ? "×" + g.trip_count : "?" }), h("td", { class: "num", text: n }),
        h("td", { class: "num", text: c }), h("td", { class: "num", text: fmtBytes(bytes) }),
        h("td", { class: "num", text: g.trip_count != null ? fmtBytes(bytes * g.trip_count * timesPerStep(g.parent)) : "?" })));
      nBlocks++;
    });
    if (!nBlocks) t2.append(h("tr", null, h("td", { text: "no repeated layers found" })));
    parts.push(t2);

    parts.push(h("h3", { text: "Bytes by source line" }));
    const t3 = h("table", null, h("tr", null, h("th", { text: "source line" }), h("th", { class: "num", text: "collectives" }),
      h("th", { text: "kinds" }), h("th", { class: "num", text: "bytes / step" }), h("th")));
    const lines = [...bySource.entries()].sort((a, b) => b[1].bytes - a[1].bytes);
    const top = lines.length ? lines[0][1].bytes || 1 : 1;
    for (const [s, e] of lines.slice(0, 200)) {
      t3.append(h("tr", { class: "link", "data-search": s }, h("td", { class: "mono", text: s }), h("td", { class: "num", text: e.n }),
        h("td", { text: Object.keys(e.kinds).map((k) => k + " ×" + e.kinds[k]).join(", ") }), h("td", { class: "num", text: fmtBytes(e.bytes) }),
        h("td", null, h("span", { class: "bar", style: "width:" + Math.round(160 * e.bytes / top) + "px" }))));
    }
    if (!lines.length) t3.append(h("tr", null, h("td", { text: "no collectives" })));
    parts.push(t3);
    box.replaceChildren(...parts);
  }

  // -------------------------------------------------------------- search
  function searchHits(q) {
    q = q.trim();
    if (!q) return [];
    const hits = [];
    const m = /^#?(\d+)$/.exec(q);
    if (m && +m[1] < OPS.length) hits.push(+m[1]);
    if (/:\d+$/.test(q)) {
      const want = q.split("/").pop();
      OPS.forEach((o, i) => { if (o.source != null && STR[o.source] === want) hits.push(i); });
      return hits;
    }
    const lq = q.toLowerCase();
    const exact = [], partial = [];
    OPS.forEach((o, i) => {
      if (o.kind === lq) exact.push(i);
      else if (o.kind.includes(lq) || (o.source != null && STR[o.source].toLowerCase().includes(lq)) ||
        o.out.some((v) => VAL[v].name === q)) partial.push(i);
    });
    return hits.concat(exact, partial);
  }
  function showSearch() {
    const q = $("search").value;
    const box = $("search-results");
    const hits = searchHits(q);
    if (!q.trim()) { box.hidden = true; return; }
    const shown = hits.slice(0, 300);
    box.replaceChildren(h("div", { class: "head", text: hits.length + " match" + (hits.length === 1 ? "" : "es") + (hits.length > shown.length ? " (first " + shown.length + " shown)" : "") }),
      ...shown.map((i, k) => h("div", { class: "hit mono" + (k === 0 ? " cur" : ""), "data-goto": i,
        text: "#" + i + "  " + OPS[i].kind + "  " + (src(OPS[i]) || "") + (isColl(OPS[i]) ? "  " + fmtBytes(COLL[OPS[i].collective].bytes) : "") })));
    box.hidden = false;
  }

  // ------------------------------------------------------------- actions
  function redraw() {
    if (state.tab === "program") program.render();
    if (state.tab === "collectives") collectivesList.render();
  }
  function select(i) {
    state.sel = i;
    showPanel();
    redraw();
  }
  function reveal(i) {
    const keys = keysFor(i);
    let changed = false;
    for (const k of keys) if (!expanded.has(k)) { expanded.add(k); changed = true; }
    if (changed) { rebuild(); program.setCount(rows.length); }
    setTab("program");
    state.sel = i;
    program.scrollTo(rowOfOp[i]);
    showPanel();
  }
  function toggle(key) {
    if (expanded.has(key)) expanded.delete(key); else expanded.add(key);
    rebuild();
    program.setCount(rows.length);
  }
  function setTab(tab) {
    state.tab = tab;
    document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === tab));
    $("program-view").hidden = tab !== "program";
    $("collectives-view").hidden = tab !== "collectives";
    $("summary-view").hidden = tab !== "summary";
    if (tab === "summary" && !$("summary-view").childElementCount) summary();
    redraw();
  }
  // the type column as wide as the types are (in a sample of ops on a large program)
  function fitTypeColumn() {
    let width = 0;
    const every = Math.max(1, Math.floor(OPS.length / 2000));
    for (let i = 0; i < OPS.length; i += every) {
      const o = OPS[i];
      if (!isColl(o) && o.out.length) width = Math.max(width, valueType(o.out[0]).length);
    }
    document.documentElement.style.setProperty("--typew", Math.min(44, Math.max(22, width + 2)) + "ch");
  }
  function setRank(r) {
    state.rank = r;
    fitTypeColumn();
    $("view-note").textContent = r == null ? "global program: global shapes and layouts"
      : "program executed by rank " + r + " (" + coordsText(r) + "): local shapes, its collective groups and slice offsets";
    redraw();
    if (state.sel != null) showPanel();
  }

  function onListClick(ev) {
    const t = ev.target.closest("[data-goto],[data-op],[data-key],[data-search]");
    if (!t) return;
    if (t.dataset.search != null) { $("search").value = t.dataset.search; showSearch(); $("search").focus(); return; }
    if (t.dataset.goto != null) { reveal(+t.dataset.goto); return; }
    if (t.dataset.op != null) { select(+t.dataset.op); return; }
    if (t.dataset.key != null) toggle(t.dataset.key);
  }
  $("program-view").addEventListener("click", onListClick);
  $("collectives-view").addEventListener("click", onListClick);
  $("summary-view").addEventListener("click", onListClick);
  $("panel").addEventListener("click", onListClick);
  $("search-results").addEventListener("click", (ev) => { onListClick(ev); $("search-results").hidden = true; });
  let searchTimer = 0;
  $("search").addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(showSearch, 120); });
  $("search").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") { showSearch(); const first = $("search-results").querySelector("[data-goto]"); if (first) { reveal(+first.dataset.goto); $("search-results").hidden = true; } }
    if (ev.key === "Escape") $("search-results").hidden = true;
  });
  document.addEventListener("click", (ev) => { if (!ev.target.closest(".search-box")) $("search-results").hidden = true; });
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => setTab(b.dataset.tab)));
  $("rank").addEventListener("change", (ev) => setRank(ev.target.value === "" ? null : +ev.target.value));
  $("program-view").addEventListener("keydown", (ev) => {
    if (ev.key !== "ArrowDown" && ev.key !== "ArrowUp") return;
    ev.preventDefault();
    const step = ev.key === "ArrowDown" ? 1 : -1;
    let r = state.sel != null ? rowOfOp[state.sel] + step : 0;
    while (r >= 0 && r < rows.length && rows[r].t !== "op") r += step;
    if (r >= 0 && r < rows.length) { state.sel = rows[r].op; program.scrollTo(r); showPanel(); }
  });
  window.addEventListener("resize", redraw);

  // --------------------------------------------------------------- start
  $("program").textContent = D.program;
  $("mesh").textContent = MESH.axes.map((a, k) => a + "=" + MESH.sizes[k]).join(" ") + " (" + MESH.devices + " devices)";
  $("count-ops").textContent = D.plan_ops.length;
  $("count-collectives").textContent = COLL.length;
  $("count-bytes").textContent = fmtBytes(COLL.reduce((a, c) => a + c.bytes, 0));
  const rankSel = $("rank");
  for (let r = 0; r < MESH.devices; r++) rankSel.append(h("option", { value: r, text: "rank " + r + " (" + coordsText(r) + ")" }));
  if (GR[0].inputs.length <= 12) expanded.add("inputs");
  if (GR[0].outputs.length <= 12) expanded.add("outputs");
  rebuild();
  setRank(null);
  program.setCount(rows.length);
  collectivesList.setCount(COLL.length);
  // for tests and bench/report.py: the page is drawn and answers clicks
  window.shardpropReport = { readyMs: performance.now(), rows: () => rows.length, reveal, select };
  document.body.dataset.ready = "1";
})();
