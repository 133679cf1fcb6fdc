// The partition report's picture: each method's computations grouped by the module calls export
// recorded, laid out top to bottom in layers, partitions outlined in their backend's colour.
// Everything it draws comes from the JSON block in the page; nothing is fetched.
"use strict";
(() => {
  const REPORT = JSON.parse(document.getElementById("report-data").textContent);
  const CHAR = 6.7, BOX_H = 24, GROUP_H = 40, GAP_X = 16, GAP_Y = 28, PAD = 12, TITLE = 22, LABEL_MAX = 40;
  const REGION_X = GAP_X / 2 + 1, REGION_Y = GAP_Y / 2 + 1;
  const FAR = 400; // an edge longer than this is drawn faint: a value read many rows below where it is made
  const SMALL = 0.45; // below this scale a box's 11px label is under 5px: boxes are drawn without it
  const FIRST_VIEW_ITEMS = 120; // groups open at first while the picture shows at most this many boxes
  const COMPUTATION = 0, INPUT = 1; // node kinds (2: the outputs)
  const LEFT_OUT = -1, MIXED = -2, NONE_YET = -3; // a module call's partition when not one of its own

  const escape = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  const clip = (s) => (s.length > LABEL_MAX ? s.slice(0, LABEL_MAX - 1) + "\u2026" : s);
  const shortType = (t) => t.slice(t.lastIndexOf(".") + 1);
  const textWidth = (s) => s.length * CHAR;
  const rectAt = ([x, y, w, h]) => `x="${x.toFixed(1)}" y="${y.toFixed(1)}" width="${w.toFixed(1)}" height="${h.toFixed(1)}"`;

  // One method's graph as a tree of module calls, each holding its calls and computations in graph order.
  class Graph {
    constructor(method) {
      this.method = method.method;
      this.nodes = method.nodes.map(([name, op, module, partition, inputs, reasons, kind, flops]) => ({
        name, op, module, partition, inputs, reasons, kind, flops,
      }));
      this.partitions = method.partitions.map(([tag, backend]) => ({ tag, backend }));
      const M = method.modules.length;
      this.root = M;
      this.modules = method.modules.map(([name, label, type, parent]) => ({ name, label, type, parent }));
      this.modules.push({ name: "", label: this.method, type: "", parent: -1 });
      this.callers = this.modules.map((m) => m.parent); // as export recorded them, for a node's details
      // A module call with one computation (a Linear, a LayerNorm) is drawn as that computation, captioned.
      const count = new Int32Array(M);
      for (const node of this.nodes) for (let g = node.module; g >= 0; g = this.modules[g].parent) count[g]++;
      const kept = (g) => g < 0 || count[g] > 1;
      for (const node of this.nodes) {
        let g = node.module;
        node.call = g;
        node.caption = "";
        for (; !kept(g); g = this.modules[g].parent) node.caption = this.modules[g].label;
        node.module = g;
      }
      this.modules.forEach((m, g) => {
        if (g === M) return;
        let p = m.parent;
        while (!kept(p)) p = this.modules[p].parent;
        m.parent = p < 0 ? M : p;
      });
      const N = this.nodes.length;
      this.N = N;
      this.depth = new Int32Array(M + 1);
      this.chains = [];
      for (let g = 0; g < M; g++) {
        if (!kept(g)) continue;
        const p = this.modules[g].parent;
        this.depth[g] = this.depth[p] + 1;
        this.chains[g] = p === M ? [g] : [...this.chains[p], g];
      }
      this.chains[M] = [];
      this.items = Array.from({ length: M + 1 }, () => []); // children: node index n, or N + module index
      this.members = Array.from({ length: M + 1 }, () => []); // every node under a module call
      this.purity = new Int32Array(M + 1).fill(NONE_YET);
      this.backends = Array.from({ length: M + 1 }, () => new Map());
      const seen = new Uint8Array(M + 1);
      this.nodes.forEach((node, n) => {
        const chain = this.chainOf(n);
        for (const g of chain) {
          if (!seen[g]) {
            seen[g] = 1;
            this.items[this.modules[g].parent].push(N + g);
          }
        }
        this.items[chain.length ? chain[chain.length - 1] : M].push(n);
        for (const g of [M, ...chain]) {
          this.members[g].push(n);
          if (node.kind !== COMPUTATION) continue;
          const p = node.partition;
          this.purity[g] = this.purity[g] === NONE_YET || this.purity[g] === p ? p : MIXED;
          const b = p < 0 ? -1 : this.partitions[p].backend;
          this.backends[g].set(b, (this.backends[g].get(b) || 0) + 1);
        }
      });
    }
    chainOf(n) {
      const g = this.nodes[n].module;
      return g < 0 ? [] : this.chains[g];
    }
    partitionOfItem(item) {
      return item < this.N ? (this.nodes[item].kind === COMPUTATION ? this.nodes[item].partition : LEFT_OUT) : this.purity[item - this.N];
    }
    computations(g) {
      let count = 0;
      for (const b of this.backends[g].values()) count += b;
      return count;
    }
  }

  // The boxes of one group's children in layers: a child's layer is one below the lowest it reads from.
  function layers(graph, g, sizeOf) {
    const items = graph.items[g];
    const index = new Map(items.map((item, k) => [item, k]));
    const d = graph.depth[g];
    const childOf = (n) => {
      const chain = graph.chainOf(n);
      return chain.length > d ? graph.N + chain[d] : n;
    };
    const inside = (n) => g === graph.root || graph.chainOf(n)[d - 1] === g;
    const preds = items.map(() => new Set());
    for (const n of graph.members[g]) {
      const k = index.get(childOf(n));
      for (const i of graph.nodes[n].inputs) {
        if (!inside(i)) continue;
        const j = index.get(childOf(i));
        if (j !== k) preds[k].add(j);
      }
    }
    const succs = items.map(() => []);
    const waiting = new Int32Array(items.length);
    preds.forEach((ps, k) => {
      waiting[k] = ps.size;
      for (const j of ps) succs[j].push(k);
    });
    const layer = new Int32Array(items.length).fill(-1);
    const queue = [];
    for (let k = 0; k < items.length; k++) if (!waiting[k]) queue.push(k);
    let head = 0;
    let next = 0; // lowest item in graph order not placed yet: where a cycle is broken
    for (let placed = 0; placed < items.length; ) {
      if (head === queue.length) {
        while (layer[next] >= 0) next++;
        queue.push(next);
        waiting[next] = 0;
      }
      const k = queue[head++];
      if (layer[k] >= 0) continue;
      let l = 0;
      for (const j of preds[k]) if (layer[j] >= 0) l = Math.max(l, layer[j] + 1);
      layer[k] = l;
      placed++;
      for (const s of succs[k]) if (--waiting[s] === 0) queue.push(s);
    }
    const rows = [];
    items.forEach((item, k) => (rows[layer[k]] ||= []).push(k));
    // One sweep down: each row ordered by where the boxes it reads from sit in the rows above.
    const x = new Float64Array(items.length);
    const placedRows = [];
    for (const row of rows.filter(Boolean)) {
      const key = row.map((k) => {
        const xs = [...preds[k]].filter((j) => layer[j] < layer[k]).map((j) => x[j]);
        return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
      });
      const order = row.map((k, r) => r);
      order.sort((a, b) => (key[a] ?? a) - (key[b] ?? b) || a - b);
      const sorted = order.map((r) => row[r]);
      let at = 0;
      for (const k of sorted) {
        const [w] = sizeOf(items[k]);
        x[k] = at + w / 2;
        at += w + GAP_X;
      }
      placedRows.push(sorted.map((k) => items[k]));
    }
    return placedRows;
  }

  class View {
    constructor(section, method) {
      this.graph = new Graph(method);
      this.section = section;
      this.picture = section.querySelector(".picture");
      this.tip = section.querySelector(".tip");
      this.detail = section.querySelector("pre.detail");
      this.search = section.querySelector("input.search");
      this.count = section.querySelector(".found-count");
      this.open = new Uint8Array(this.graph.modules.length);
      this.open[this.graph.root] = 1;
      this.view = { x: 0, y: 0, k: 1 };
      this.found = [];
      this.foundAt = -1;
      this.selected = -1;
      this.openFirstView();
      this.render();
      this.fit(false);
      this.listen();
    }

    // Open module calls level by level while the picture stays small; a call with one child opens with it.
    openFirstView() {
      const { graph } = this;
      let frontier = [graph.root];
      let shown = graph.items[graph.root].length;
      while (frontier.length) {
        const next = [];
        for (const g of frontier) {
          for (const item of graph.items[g]) {
            if (item < graph.N) continue;
            const c = item - graph.N;
            const more = graph.items[c].length - 1;
            if (graph.items[c].length === 1 || shown + more <= FIRST_VIEW_ITEMS) {
              this.open[c] = 1;
              shown += more;
              next.push(c);
            }
          }
        }
        frontier = next;
      }
    }

    setAllOpen(value) {
      this.open.fill(value);
      this.open[this.graph.root] = 1;
      this.render();
      this.fit(false);
    }

    visible(n) {
      for (const g of this.graph.chainOf(n)) if (!this.open[g]) return this.graph.N + g;
      return n;
    }

    size(item) {
      const { graph } = this;
      if (item < graph.N) return [Math.max(44, textWidth(clip(this.label(item))) + 16), BOX_H];
      const g = item - graph.N;
      if (this.open[g]) return this.layout(g).size;
      const m = graph.modules[g];
      const sub = `${shortType(m.type)} \u00b7 ${graph.computations(g)} ops`;
      return [Math.max(110, textWidth(clip("\u25b8 " + m.label)) + 20, textWidth(sub) + 20), GROUP_H];
    }

    label(n) {
      const node = this.graph.nodes[n];
      if (node.kind !== COMPUTATION) return node.name;
      const op = node.op.replace(/^aten\./, "").replace(/\.default$/, "");
      return node.caption ? `${node.caption}: ${op}` : op;
    }

    layout(g) {
      const cached = this.layouts.get(g);
      if (cached) return cached;
      const rows = layers(this.graph, g, (item) => this.size(item));
      const place = new Map();
      let y = 0;
      const sized = rows.map((row) => row.map((item) => [item, this.size(item)]));
      const widths = sized.map((row) => row.reduce((a, [, [w]]) => a + w, 0) + GAP_X * (row.length - 1));
      const width = Math.max(0, ...widths);
      for (const [r, row] of sized.entries()) {
        const rowWidth = widths[r];
        const height = Math.max(...row.map(([, [, h]]) => h));
        let x = (width - rowWidth) / 2;
        for (const [item, [w, h]] of row) {
          place.set(item, [x, y + (height - h) / 2, w, h]);
          x += w + GAP_X;
        }
        y += height + GAP_Y;
      }
      const m = this.graph.modules[g];
      // Room around the rows for the partitions' outlines, below the title.
      const top = (g === this.graph.root ? PAD : TITLE) + REGION_Y;
      const titleWidth = textWidth(`\u25be ${m.label} \u00b7 ${shortType(m.type)}`) * 1.05 + 2 * PAD;
      const size = [Math.max(width + 2 * (PAD + REGION_X), titleWidth), top + Math.max(0, y - GAP_Y) + REGION_Y + PAD / 2];
      const shift = (size[0] - width) / 2;
      for (const box of place.values()) {
        box[0] += shift;
        box[1] += top;
      }
      const result = { size, place };
      this.layouts.set(g, result);
      return result;
    }

    render() {
      const started = performance.now();
      this.layouts = new Map();
      const { graph } = this;
      const at = new Map(); // visible item -> [x, y, w, h] in the picture
      const back = [], labels = [], boxes = [];
      const draw = (g, ox, oy) => {
        const { place } = this.layout(g);
        const regions = new Map();
        const outlines = g === graph.root || graph.purity[g] < 0;
        for (const [item, [x, y, w, h]] of place) {
          const box = [ox + x, oy + y, w, h];
          const p = graph.partitionOfItem(item);
          if (outlines && p >= 0) (regions.get(p) || regions.set(p, []).get(p)).push(box);
        }
        for (const [p, rects] of [...regions].sort((a, b) => a[0] - b[0])) {
          const colour = REPORT.colours[graph.partitions[p].backend];
          const tint = REPORT.tints[graph.partitions[p].backend];
          const grown = rects.map(([x, y, w, h]) => [x - REGION_X, y - REGION_Y, w + 2 * REGION_X, h + 2 * REGION_Y]);
          back.push(`<g class="region" data-partition="${p}">`);
          // Outlines first, then fills over them: where a partition's rectangles meet, the fill hides
          // the lines between them, and only the outline of their union stays.
          for (const r of grown) back.push(`<rect ${rectAt(r)} fill="none" stroke="${colour}" stroke-width="3"/>`);
          for (const r of grown) back.push(`<rect ${rectAt(r)} fill="${tint}"/>`);
          back.push("</g>");
          const [x, y] = grown[0];
          labels.push(`<text class="ptag" x="${(x + 6).toFixed(1)}" y="${(y + 10).toFixed(1)}" style="fill:${colour}">${escape(graph.partitions[p].tag)}</text>`);
        }
        for (const [item, [x, y, w, h]] of place) {
          const box = [ox + x, oy + y, w, h];
          at.set(item, box);
          if (item >= graph.N && this.open[item - graph.N]) {
            const c = item - graph.N, m = graph.modules[c];
            const pure = graph.purity[c] >= 0 ? " pure" : "";
            back.push(
              `<g class="frame${pure}" data-module="${escape(m.name)}"><rect class="frame" ${rectAt(box)} rx="6"/></g>`,
            );
            labels.push(
              `<text class="title" data-module="${escape(m.name)}" x="${(box[0] + 8).toFixed(1)}" y="${(box[1] + 16).toFixed(1)}">\u25be ${escape(m.label)} \u00b7 ${escape(shortType(m.type))}</text>`,
            );
            draw(c, box[0], box[1]);
          } else {
            boxes.push(this.box(item, box));
          }
        }
      };
      draw(graph.root, 0, 0);
      const [width, height] = this.layout(graph.root).size;
      this.extent = [width, height];
      const edges = this.edges(at);
      const svg =
        `<svg xmlns="http://www.w3.org/2000/svg" width="${width.toFixed(0)}" height="${height.toFixed(0)}">${back.join("")}` +
        `<g class="edges">${edges}</g><g class="labels">${labels.join("")}</g>${boxes.join("")}</svg>`;
      this.picture.querySelector("svg")?.remove();
      this.picture.insertAdjacentHTML("afterbegin", svg);
      this.svg = this.picture.querySelector("svg");
      this.applyView();
      if (this.selected >= 0) this.mark(this.selected, "selected");
      this.section.dataset.renderMs = (performance.now() - started).toFixed(1);
    }

    box(item, [x, y, w, h]) {
      const { graph } = this;
      const r = rectAt([x, y, w, h]);
      const tx = (x + w / 2).toFixed(1), ty = (y + h / 2 + 4).toFixed(1);
      if (item < graph.N) {
        const node = graph.nodes[item];
        let cls = "node", style;
        if (node.kind !== COMPUTATION) {
          cls += " io";
          style = "";
        } else if (node.partition < 0) {
          cls += " left-out";
          style = `fill:${REPORT.leftOutTint};stroke:${REPORT.leftOut}`;
        } else {
          const b = graph.partitions[node.partition].backend;
          style = `fill:${REPORT.tints[b]};stroke:${REPORT.colours[b]}`;
        }
        const rx = node.kind === COMPUTATION ? 3 : 12;
        return (
          `<g class="${cls}" data-node="${escape(node.name)}" data-n="${item}"><rect ${r} rx="${rx}" style="${style}"/>` +
          `<text x="${tx}" y="${ty}" text-anchor="middle">${escape(clip(this.label(item)))}</text></g>`
        );
      }
      const g = item - graph.N, m = graph.modules[g];
      const total = graph.computations(g) || 1;
      let bar = "", bx = x + 6;
      const barWidth = w - 12;
      for (const [b, count] of [...graph.backends[g]].sort((a, c) => (a[0] < 0) - (c[0] < 0) || a[0] - c[0])) {
        const part = (barWidth * count) / total;
        const colour = b < 0 ? REPORT.leftOut : REPORT.colours[b];
        bar += `<rect x="${bx.toFixed(1)}" y="${(y + h - 8).toFixed(1)}" width="${part.toFixed(1)}" height="4" fill="${colour}"/>`;
        bx += part;
      }
      const p = graph.purity[g];
      const stroke = p >= 0 ? ` style="stroke:${REPORT.colours[graph.partitions[p].backend]}"` : "";
      return (
        `<g class="group" data-module="${escape(m.name)}" data-g="${g}"><rect class="box" ${r} rx="6"${stroke}/>` +
        `<text x="${(x + 8).toFixed(1)}" y="${(y + 14).toFixed(1)}">\u25b8 ${escape(clip(m.label))}</text>` +
        `<text class="sub" x="${(x + 8).toFixed(1)}" y="${(y + 26).toFixed(1)}">${escape(shortType(m.type))} \u00b7 ${graph.computations(g)} ops</text>${bar}</g>`
      );
    }

    edges(at) {
      const { graph } = this;
      const drawn = new Map(); // one edge per pair of visible boxes: "from to" -> [from, to, crosses a boundary]
      graph.nodes.forEach((node, n) => {
        const to = this.visible(n);
        for (const i of node.inputs) {
          const from = this.visible(i);
          if (from === to) continue;
          const boundary = graph.nodes[i].partition !== node.partition && (node.kind === COMPUTATION || graph.nodes[i].kind === COMPUTATION);
          const edge = drawn.get(`${from} ${to}`) || drawn.set(`${from} ${to}`, [from, to, false]).get(`${from} ${to}`);
          edge[2] ||= boundary;
        }
      });
      const paths = [];
      for (const [from, to, boundary] of drawn.values()) {
        const a = at.get(from), b = at.get(to);
        if (!a || !b) continue;
        const x1 = a[0] + a[2] / 2, y1 = a[1] + a[3], x2 = b[0] + b[2] / 2, y2 = b[1];
        const bend = Math.max(18, Math.abs(y2 - y1) / 2);
        const cls = [boundary ? "boundary" : "", Math.abs(y2 - y1) > FAR ? "far" : ""].join(" ").trim();
        paths.push(
          `<path${cls ? ` class="${cls}"` : ""} d="M${x1.toFixed(1)} ${y1.toFixed(1)}C${x1.toFixed(1)} ${(y1 + bend).toFixed(1)} ${x2.toFixed(1)} ${(y2 - bend).toFixed(1)} ${x2.toFixed(1)} ${y2.toFixed(1)}"/>`,
        );
      }
      return paths.join("");
    }

    // The drawing moves as one layer (a CSS transform): the browser moves and scales what it drew
    // instead of drawing every box again, and draws it afresh, sharp, once the picture stops.
    applyView() {
      const { x, y, k } = this.view;
      this.svg.style.transform = `translate(${x.toFixed(1)}px, ${y.toFixed(1)}px) scale(${k.toFixed(4)})`;
      this.svg.classList.toggle("small", k < SMALL); // labels too small to read are not drawn
      this.svg.style.willChange = "transform";
      clearTimeout(this.settle);
      this.settle = setTimeout(() => (this.svg.style.willChange = "auto"), 200);
    }

    // The whole picture in view; at first (``whole`` false) a tall one fits its width and shows its top.
    fit(whole = true) {
      const { clientWidth: w, clientHeight: h } = this.picture;
      const [width, height] = this.extent;
      const all = Math.min((w - 20) / width, (h - 20) / height, 1);
      const across = Math.min((w - 20) / width, 1);
      this.view.k = Math.max(0.02, whole || all >= 0.5 ? all : across);
      this.view.x = (w - width * this.view.k) / 2;
      this.view.y = 10;
      this.applyView();
    }

    zoom(factor, cx, cy) {
      const k = Math.min(4, Math.max(0.02, this.view.k * factor));
      const f = k / this.view.k;
      this.view.x = cx - (cx - this.view.x) * f;
      this.view.y = cy - (cy - this.view.y) * f;
      this.view.k = k;
      this.schedule();
    }

    schedule() {
      if (this.pending) return;
      this.pending = requestAnimationFrame(() => {
        this.pending = 0;
        this.applyView();
      });
    }

    // Move the picture so that ``element`` (a box, a layer's title) sits in the middle, at readable size.
    centre(element) {
      if (!element) return;
      const box = element.getBBox();
      const { clientWidth: w, clientHeight: h } = this.picture;
      this.view.k = Math.max(this.view.k, 0.9);
      this.view.x = w / 2 - (box.x + box.width / 2) * this.view.k;
      this.view.y = h / 2 - (box.y + box.height / 2) * this.view.k;
      this.applyView();
    }

    element(n) {
      return this.svg.querySelector(`g.node[data-n="${n}"]`);
    }

    mark(n, cls) {
      for (const el of this.svg.querySelectorAll(`g.node.${cls}`)) el.classList.remove(cls);
      this.element(n)?.classList.add(cls);
    }

    describe(item) {
      const { graph } = this;
      if (item >= graph.N) {
        const g = item - graph.N, m = graph.modules[g];
        const shares = [...graph.backends[g]].map(([b, c]) => `${b < 0 ? "not delegated" : REPORT.backends[b]}: ${c}`);
        return `${m.name}\n${m.type}\n${graph.computations(g)} computations (${shares.join(", ")})\nclick to open`;
      }
      const node = graph.nodes[item];
      if (node.kind !== COMPUTATION) return `${node.name}\n${node.kind === INPUT ? "input" : "output"} of ${graph.method}`;
      const p = node.partition;
      const where = p >= 0 ? `partition ${graph.partitions[p].tag} (${REPORT.backends[graph.partitions[p].backend]})` : "not delegated";
      const chain = [];
      for (let g = node.call; g >= 0 && g !== graph.root; g = graph.callers[g]) {
        chain.unshift(`${graph.modules[g].name} (${shortType(graph.modules[g].type)})`);
      }
      const lines = [node.name, `${node.op}: ${where}`];
      for (const [b, r] of Object.entries(node.reasons)) lines.push(`${b}: ${r}`);
      if (chain.length) lines.push(`in ${chain.join(" \u203a ")}`);
      if (node.flops) lines.push(`${node.flops.toLocaleString("en")} FLOPs`);
      const inputs = node.inputs.map((i) => graph.nodes[i].name);
      if (inputs.length) lines.push(`reads ${inputs.join(", ")}`);
      return lines.join("\n");
    }

    select(n) {
      this.selected = n;
      this.detail.textContent = this.describe(n);
      this.mark(n, "selected");
      const p = this.graph.nodes[n].partition;
      this.svg.classList.toggle("lighting", p >= 0);
      if (p < 0) return;
      for (const el of this.svg.querySelectorAll("g.node, g.group")) {
        const lit = el.dataset.n !== undefined
          ? this.graph.partitionOfItem(Number(el.dataset.n)) === p
          : this.graph.members[Number(el.dataset.g)].some((m) => this.graph.nodes[m].partition === p);
        el.classList.toggle("lit", lit);
      }
    }

    toggle(g) {
      this.open[g] = this.open[g] ? 0 : 1;
      this.render();
    }

    reveal(n) {
      for (const g of this.graph.chainOf(n)) this.open[g] = 1;
      this.render();
      this.select(n);
      this.mark(n, "found");
      this.centre(this.element(n));
    }

    find(text) {
      const q = text.trim().toLowerCase();
      if (!q) {
        this.found = [];
        this.count.textContent = "";
        return;
      }
      const { graph } = this;
      const exact = [], named = [], other = [];
      graph.nodes.forEach((node, n) => {
        const name = node.name.toLowerCase();
        if (name === q) exact.push(n);
        else if (name.includes(q)) named.push(n);
        else if (node.op.toLowerCase().includes(q) || graph.chainOf(n).some((g) => graph.modules[g].name.toLowerCase().includes(q))) other.push(n);
      });
      this.found = [...exact, ...named, ...other];
      this.foundAt = -1;
      this.count.textContent = this.found.length ? `${this.found.length} found` : "none found";
    }

    next() {
      if (!this.found.length) return;
      this.foundAt = (this.foundAt + 1) % this.found.length;
      this.count.textContent = `${this.foundAt + 1} of ${this.found.length}`;
      this.reveal(this.found[this.foundAt]);
    }

    itemOf(target) {
      const node = target.closest("g.node");
      if (node) return Number(node.dataset.n);
      const group = target.closest("g.group");
      if (group) return this.graph.N + Number(group.dataset.g);
      return -1;
    }

    listen() {
      const { picture } = this;
      picture.addEventListener("click", (event) => {
        if (this.dragged) return;
        const title = event.target.closest("text.title");
        if (title) {
          const g = this.graph.modules.findIndex((m) => m.name === title.dataset.module);
          if (g >= 0) this.toggle(g);
          return;
        }
        const item = this.itemOf(event.target);
        if (item < 0) {
          this.svg.classList.remove("lighting");
          return;
        }
        if (item >= this.graph.N) this.toggle(item - this.graph.N);
        else this.select(item);
      });
      picture.addEventListener("mousemove", (event) => {
        const item = this.itemOf(event.target);
        if (item < 0 || this.drag) {
          this.tip.style.display = "none";
          return;
        }
        const bounds = picture.getBoundingClientRect();
        this.tip.textContent = this.describe(item);
        this.tip.style.display = "block";
        this.tip.style.left = `${event.clientX - bounds.left + 14}px`;
        this.tip.style.top = `${event.clientY - bounds.top + 14}px`;
      });
      picture.addEventListener("mouseleave", () => (this.tip.style.display = "none"));
      picture.addEventListener(
        "wheel",
        (event) => {
          event.preventDefault();
          const bounds = picture.getBoundingClientRect();
          if (event.ctrlKey || event.metaKey) {
            this.zoom(Math.exp(-event.deltaY * 0.002), event.clientX - bounds.left, event.clientY - bounds.top);
          } else {
            this.view.x -= event.shiftKey ? event.deltaY : event.deltaX;
            this.view.y -= event.shiftKey ? 0 : event.deltaY;
            this.schedule();
          }
        },
        { passive: false },
      );
      picture.addEventListener("pointerdown", (event) => {
        this.drag = { x: event.clientX, y: event.clientY, vx: this.view.x, vy: this.view.y };
        this.dragged = false;
      });
      window.addEventListener("pointermove", (event) => {
        if (!this.drag) return;
        const dx = event.clientX - this.drag.x, dy = event.clientY - this.drag.y;
        if (!this.dragged && Math.abs(dx) + Math.abs(dy) < 4) return;
        this.dragged = true;
        picture.classList.add("dragging");
        this.view.x = this.drag.vx + dx;
        this.view.y = this.drag.vy + dy;
        this.schedule();
      });
      window.addEventListener("pointerup", () => {
        this.drag = null;
        picture.classList.remove("dragging");
        setTimeout(() => (this.dragged = false), 0);
      });
      const bar = this.section.querySelector(".toolbar");
      bar.addEventListener("click", (event) => {
        const action = event.target.dataset?.action;
        const { clientWidth: w, clientHeight: h } = picture;
        if (action === "fit") this.fit();
        else if (action === "in") this.zoom(1.25, w / 2, h / 2);
        else if (action === "out") this.zoom(0.8, w / 2, h / 2);
        else if (action === "open") this.setAllOpen(1);
        else if (action === "close") this.setAllOpen(0);
      });
      this.search.addEventListener("input", () => this.find(this.search.value));
      this.search.addEventListener("keydown", (event) => {
        if (event.key !== "Enter") return;
        if (!this.found.length) this.find(this.search.value);
        this.next();
      });
    }
  }

  const started = performance.now();
  const views = {};
  REPORT.methods.forEach((method, k) => {
    views[method.method] = new View(document.getElementById(`method-${k}`), method);
  });
  window.torchdelegateReport = views;
  document.body.dataset.openMs = (performance.now() - started).toFixed(1);
  document.body.dataset.ready = "1";
})();
