// vramledger ui: the controls, the requests to the JSON API, and the charts, drawn as SVG by hand.
// Every number shown comes from the server (the library's own JSON); this file only lays it out.
"use strict";

const $ = (sel) => document.querySelector(sel);
// The SVG namespace, as the HTML parser assigns it to an inline <svg> (so this file holds no URL at all).
const SVGNS = (() => { const d = document.createElement("div"); d.innerHTML = "<svg></svg>"; return d.firstChild.namespaceURI; })();
const GiB = 2 ** 30, MiB = 2 ** 20;
const SEQS = [128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
  49152, 65536, 98304, 131072];
const RANKS = [1, 2, 4, 8, 16, 32, 64, 128, 256];
const SLIDERS = {
  // flag: [slider position → value, value → slider position, text]
  batch: [(i) => i, (v) => v, (v) => String(v)],
  seq: [(i) => SEQS[i], (v) => nearest(SEQS, v), (v) => v.toLocaleString("en")],
  accum: [(i) => i, (v) => v, (v) => String(v)],
  lora_rank: [(i) => RANKS[i], (v) => nearest(RANKS, v), (v) => String(v)],
  eval_batch: [(i) => (i === 0 ? null : i), (v) => v || 0, (v) => (v ? String(v) : "off")],
  headroom: [(i) => i / 100, (v) => Math.round(v * 100), (v) => `${Math.round(v * 100)}%`],
};
const SWITCHES = ["grad_ckpt", "packing"];
const SELECTS = ["precision", "optimizer", "attn", "loss"];

const state = {
  meta: null,
  model: "meta-llama/Llama-3.1-8B",
  gpu: "rtx-4090",
  values: { method: "lora", batch: 4, seq: 2048, accum: 1, lora_rank: 16, eval_batch: null, headroom: 0.08,
    grad_ckpt: true, packing: false, precision: "bf16-mixed", optimizer: "adamw_torch", attn: "sdpa",
    loss: "standard" },
  touched: new Set(),       // flags the user moved: sent even when a config file gives them
  config: null,             // {name, text} of a dropped training config
  startup: false,           // the server's --config is in use
  deepspeed: null,          // text of a dropped DeepSpeed JSON
  modelConfig: null,        // {name, obj} of a dropped config.json
  extra: {},                // flags the server's CLI has beyond the page's controls (world size, ZeRO, FSDP)
  last: {},                 // the latest answers
};

function nearest(list, v) {
  let best = 0;
  list.forEach((x, i) => { if (Math.abs(Math.log(x / v)) < Math.abs(Math.log(list[best] / v))) best = i; });
  return best;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const a = Math.abs(n);
  if (a >= GiB) return `${(n / GiB).toFixed(2)} GiB`;
  if (a >= MiB) return `${(n / MiB).toFixed(1)} MiB`;
  if (a >= 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${n} B`;
}

function el(tag, attrs = {}, parent = null, text = null) {
  const svgTags = ["svg", "g", "rect", "line", "text", "path", "circle", "polyline", "title", "tspan"];
  const node = svgTags.includes(tag) ? document.createElementNS(SVGNS, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

// -- requests ------------------------------------------------------------------------------------------------------
async function post(name, body) {
  const res = await fetch(`/api/${name}`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const data = await res.json();
  if (!res.ok) throw new Error(data.error || `HTTP ${res.status}`);
  return data;
}

function requestBody() {
  const b = {};
  const hasConfig = state.config !== null || state.startup;
  if (state.modelConfig) {
    b.model_config = state.modelConfig.obj;
    b.model_config_name = state.modelConfig.name;
  } else if (!hasConfig || state.touched.has("model")) {
    b.model = state.model;
  }
  if (state.config) { b.config_text = state.config.text; b.config_name = state.config.name; }
  if (state.startup && !state.config) b.startup_config = true;
  if (state.deepspeed) b.deepspeed_text = state.deepspeed;
  if (state.gpu) b.gpu = state.gpu;
  const v = state.values;
  const send = (flag) => !hasConfig || state.touched.has(flag);
  for (const flag of ["method", "batch", "seq", "accum", ...SWITCHES, ...SELECTS]) {
    if (send(flag)) b[flag] = v[flag];
  }
  if (send("lora_rank") && (v.method === "lora" || v.method === "qlora")) b.lora_rank = v.lora_rank;
  if (send("eval_batch") && v.eval_batch) b.eval_batch = v.eval_batch;
  if (state.touched.has("headroom") || v.headroom !== state.meta.default_headroom) b.headroom = v.headroom;
  for (const [k, val] of Object.entries(state.extra)) if (val !== "" && val !== null) b[k] = val;
  return b;
}

// -- the update cycle: the estimate at once, the frontier and the plan a moment after the last move -----------------
let ticket = 0, slowTimer = null, planTimer = null;

async function refresh() {
  const mine = ++ticket, started = performance.now(), body = requestBody();
  try {
    const [ledger, setup] = await Promise.all([post("estimate", body), post("setup", body)]);
    if (mine !== ticket) return;
    hideError();
    state.last.ledger = ledger;
    state.last.setup = setup;
    renderVerdict(ledger);
    renderBill(ledger);
    renderSetup(setup);
    // the page's own timing, from the control's event to the bill redrawn (bench/ui_bench.py reads it)
    document.body.dataset.updateMs = (performance.now() - started).toFixed(1);
    document.body.dataset.updateSeq = String(mine);
  } catch (err) {
    if (mine === ticket) showError(err.message);
    return;
  }
  clearTimeout(slowTimer);
  clearTimeout(planTimer);
  for (const id of ["#heatmap", "#remedies"]) $(id).classList.add("stale");
  slowTimer = setTimeout(() => refreshFit(mine, body, started), 60);
  planTimer = setTimeout(() => refreshPlan(mine, body), 250);
}

async function refreshFit(mine, body, started) {
  try {
    const [fit, grid] = await Promise.all([post("fit", body), post("grid", body)]);
    if (mine !== ticket) return;
    state.last.fit = fit;
    state.last.grid = grid;
    renderHeatmap(grid, fit);
    $("#heatmap").classList.remove("stale");
    document.body.dataset.heatmapMs = (performance.now() - started).toFixed(1);
    document.body.dataset.heatmapSeq = String(mine);
  } catch (err) {
    if (mine === ticket) { $("#heatmap").textContent = err.message; }
  }
}

async function refreshPlan(mine, body) {
  try {
    const plan = await post("plan", body);
    if (mine !== ticket) return;
    state.last.plan = plan;
    renderRemedies(plan);
    $("#remedies").classList.remove("stale");
  } catch (err) {
    if (mine === ticket) { $("#remedies").textContent = err.message; }
  }
}

function showError(msg) {
  const e = $("#error");
  e.textContent = msg;
  e.hidden = false;
  $(".content").classList.add("stale"); // what is shown is the last setup that worked, not this one
}
function hideError() { $("#error").hidden = true; $(".content").classList.remove("stale"); }

// -- the verdict ---------------------------------------------------------------------------------------------------
function renderVerdict(L) {
  const v = L.verdict, card = $("#verdict"), badge = $("#verdict-badge");
  card.classList.remove("fits", "oom");
  badge.classList.remove("fits", "oom");
  if (!v) {
    $("#verdict-line").textContent = `device total ${fmtBytes(L.device_total_bytes)}`;
    badge.textContent = "no GPU";
  } else {
    const cls = L.fits ? "fits" : "oom";
    card.classList.add(cls);
    badge.classList.add(cls);
    $("#verdict-line").textContent = L.fits
      ? `FITS on ${v.gpu}: ${fmtBytes(v.margin_bytes)} to spare`
      : `DOES NOT FIT on ${v.gpu}: ${fmtBytes(-v.margin_bytes)} over`;
    badge.textContent = `${L.fits ? "fits" : "OOM"} · ${fmtBytes(L.device_total_bytes)} of ${fmtBytes(v.usable_bytes)}`;
  }
  const peak = L.peak_phase, moment = (L.phases[peak] || {}).moment || "";
  $("#verdict-sub").textContent = `peak in ${peak}${moment ? " — " + moment : ""} · allocated `
    + `${fmtBytes(L.peak_allocated_bytes)} · reserved ${fmtBytes(L.peak_reserved_bytes)} · device total `
    + `${fmtBytes(L.device_total_bytes)}` + (v ? ` against ${fmtBytes(v.usable_bytes)} usable (${fmtBytes(
      v.capacity_bytes)} less ${Math.round(v.headroom_fraction * 100)}% headroom)` : "");
  $("#advice").textContent = L.advice || "";
  document.title = `${L.fits === false ? "OOM" : "fits"} · ${L.model} · vramledger`;
}

// -- the bill: one stacked bar per phase, categories in the ledger's order, capacity and usable lines -------------
function billData(L) {
  const phases = Object.keys(L.phases), cats = state.meta.categories;
  const bytes = {};
  for (const it of L.items) {
    const key = `${it.category}|${it.phase}`;
    (bytes[key] = bytes[key] || { total: 0, lines: [] }).total += it.bytes;
    bytes[key].lines.push(it);
  }
  return { phases, cats, bytes };
}

function renderBill(L) {
  const { phases, cats, bytes } = billData(L);
  const W = widthOf("#bill", 940), left = 96, right = 120, rowH = 30, gap = 12, top = 26;
  const H = top + phases.length * (rowH + gap) + 26;
  const v = L.verdict;
  const maxDev = Math.max(...phases.map((p) => L.phases[p].device_bytes), v ? v.capacity_bytes : 0);
  const x = (b) => left + (b / (maxDev * 1.04)) * (W - left - right);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "memory per phase" });
  const axis = el("g", { class: "axis" }, svg), labels = el("g"); // labels go on top, after the lines
  const step = niceStep(maxDev * 1.04 / GiB, 7);
  for (let g = 0; g * step * GiB <= maxDev * 1.04; g++) {
    const gx = x(g * step * GiB);
    el("line", { x1: gx, x2: gx, y1: top - 6, y2: H - 22, stroke: "#eaeef2" }, axis);
    el("text", { x: gx, y: H - 8, "text-anchor": "middle" }, axis, `${+(g * step).toFixed(2)} GiB`);
  }
  phases.forEach((p, r) => {
    const y = top + r * (rowH + gap), isPeak = p === L.peak_phase;
    el("text", { x: left - 10, y: y + rowH / 2 + 4, "text-anchor": "end", class: isPeak ? "strong" : null },
      svg, isPeak ? `▲ ${p}` : p);
    let acc = 0;
    for (const c of cats) {
      const cell = bytes[`${c.value}|${p}`];
      if (!cell || !cell.total) continue;
      const r0 = x(acc), r1 = x(acc + cell.total);
      const rect = el("rect", { x: r0, y, width: Math.max(0.5, r1 - r0), height: rowH, fill: c.color,
        stroke: "#fff", "stroke-width": 0.6, "data-category": c.value, "data-phase": p }, svg);
      tip(rect, `${p} · ${c.display}: ${fmtBytes(cell.total)}\n` + cell.lines.map(
        (it) => `  ${fmtBytes(it.bytes)}  ${it.label}`).join("\n"));
      acc += cell.total;
    }
    el("text", { x: x(acc) + 6, y: y + rowH / 2 + 4, class: isPeak ? "halo strong" : "halo" }, labels,
      fmtBytes(L.phases[p].device_bytes));
  });
  if (v) {
    const ux = x(v.usable_bytes), cx = x(v.capacity_bytes);
    el("line", { x1: ux, x2: ux, y1: top - 14, y2: H - 22, stroke: "#bb5566", "stroke-width": 2,
      "stroke-dasharray": "6 4" }, svg);
    el("text", { x: ux - 4, y: top - 16, "text-anchor": "end", class: "usable" }, svg,
      `usable ${fmtBytes(v.usable_bytes)}`);
    el("line", { x1: cx, x2: cx, y1: top - 14, y2: H - 22, stroke: "#000", "stroke-width": 1.5 }, svg);
    el("text", { x: cx + 4, y: top - 16 }, svg, `capacity ${fmtBytes(v.capacity_bytes)}`);
  }
  svg.appendChild(labels);
  $("#bill").replaceChildren(svg);
  $("#bill-sub").textContent = `${L.model} · ${L.engine} · ${Number(L.params).toLocaleString("en")} params, `
    + `${Number(L.trainable_params).toLocaleString("en")} trainable`;
  const legend = $("#legend");
  legend.replaceChildren();
  for (const c of cats) {
    const cell = bytes[`${c.value}|${L.peak_phase}`];
    if (!cell || !cell.total) continue;
    const item = el("span", {}, legend);
    el("span", { class: "sw" }, item).style.background = c.color; // CSSOM: the CSP forbids inline style attributes
    item.append(c.display);
    el("span", { class: "v" }, item, fmtBytes(cell.total));
  }
}

function widthOf(sel, fallback) {
  // draw at the panel's own width, so that text keeps its size (the SVG is not scaled)
  return Math.max(420, Math.round($(sel).clientWidth || fallback));
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    const L = state.last;
    if (L.ledger) renderBill(L.ledger);
    if (L.grid && L.fit) renderHeatmap(L.grid, L.fit);
    if (L.plan) renderRemedies(L.plan);
  }, 100);
});

function niceStep(span, ticks) {
  const raw = span / ticks, mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

// -- the heatmap: device total over batch × length (log axes), the frontier from `fit`, the user's point -----------
function renderHeatmap(grid, fit) {
  const W = widthOf("#heatmap", 560), H = 400, left = 52, bottom = 40, top = 12, right = 12;
  const Ls = grid.lengths, Bs = grid.batches, usable = grid.usable_bytes;
  const lx = (L) => Math.log2(L), ly = (b) => Math.log2(b);
  const edges = (vals, f) => vals.map((v, i) => [
    i === 0 ? f(v) - (f(vals[1]) - f(v)) / 2 : (f(vals[i - 1]) + f(v)) / 2,
    i === vals.length - 1 ? f(v) + (f(v) - f(vals[i - 1])) / 2 : (f(v) + f(vals[i + 1])) / 2]);
  const ex = edges(Ls, lx), ey = edges(Bs, ly);
  const x0 = ex[0][0], x1 = ex[ex.length - 1][1], y0 = ey[0][0], y1 = ey[ey.length - 1][1];
  const X = (u) => left + ((u - x0) / (x1 - x0)) * (W - left - right);
  const Y = (u) => H - bottom - ((u - y0) / (y1 - y0)) * (H - bottom - top);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "batch by length heatmap" });
  Ls.forEach((L, i) => Bs.forEach((b, j) => {
    const d = grid.device_bytes[i][j], r = d / usable;
    const rect = el("rect", { class: "cell", x: X(ex[i][0]), y: Y(ey[j][1]), width: X(ex[i][1]) - X(ex[i][0]),
      height: Y(ey[j][0]) - Y(ey[j][1]), fill: heat(r), stroke: "#fff", "stroke-width": 0.5 }, svg);
    tip(rect, `micro-batch ${b} × ${L.toLocaleString("en")} tokens\ndevice total ${fmtBytes(d)} `
      + `(${Math.round(r * 100)}% of usable)${r <= 1 ? "" : " — OOM"}\nclick to use this point`);
    rect.addEventListener("click", () => { setValue("batch", b); setValue("seq", L); refresh(); });
  }));
  // the frontier: the largest length that fits for each micro-batch (fit's bisection on multiples of 128)
  const pts = (fit.frontier.points || []).filter((p) => p.micro_batch <= Bs[Bs.length - 1]);
  if (pts.length) {
    let d = "";
    pts.forEach((p, k) => {
      const px = X(Math.min(Math.max(lx(p.seq_len), x0), x1));
      const ya = Y(Math.max(ly(p.micro_batch) - (k === 0 ? 0.5 : 0), y0)), yb = Y(ly(p.micro_batch));
      d += `${k === 0 ? "M" : "L"}${px.toFixed(1)},${ya.toFixed(1)} L${px.toFixed(1)},${yb.toFixed(1)} `;
      const next = pts[k + 1];
      if (next) d += `L${px.toFixed(1)},${Y(ly(next.micro_batch)).toFixed(1)} `;
    });
    el("path", { d, fill: "none", stroke: "#111", "stroke-width": 2.2, "stroke-linejoin": "round" }, svg);
  }
  // the user's point
  const ux = X(lx(fit.seq_len)), uy = Y(ly(fit.micro_batch));
  if (ux >= left && ux <= W - right && uy >= top && uy <= H - bottom) {
    el("circle", { cx: ux, cy: uy, r: 7, fill: fit.fits ? "#fff" : "#bb5566", stroke: "#000", "stroke-width": 2 },
      svg);
  }
  const axis = el("g", { class: "axis" }, svg);
  Ls.forEach((L, i) => {
    if (i % 2 === 0 || Ls.length < 8) el("text", { x: X(lx(L)), y: H - bottom + 14, "text-anchor": "middle" },
      axis, L >= 1024 ? `${L / 1024}k` : String(L));
  });
  el("text", { x: (left + W - right) / 2, y: H - 6, "text-anchor": "middle" }, axis, "sequence length (tokens)");
  Bs.forEach((b) => el("text", { x: left - 6, y: Y(ly(b)) + 4, "text-anchor": "end" }, axis, String(b)));
  el("text", { x: 12, y: (top + H - bottom) / 2, transform: `rotate(-90 12 ${(top + H - bottom) / 2})`,
    "text-anchor": "middle" }, axis, "micro-batch");
  $("#heatmap").replaceChildren(svg);
  $("#fit-sub").textContent = `cells: device total ÷ usable · line: the frontier · ○ you`;
  const lb = fit.largest_batch, ll = fit.largest_length;
  $("#fit-text").textContent =
    `largest micro-batch at ${fit.seq_len.toLocaleString("en")} tokens: ${lb ? lb.micro_batch : "none"}`
    + ` · largest length at micro-batch ${fit.micro_batch}: ${ll ? ll.seq_len.toLocaleString("en") : "none"}`
    + ` (multiples of ${fit.frontier.granularity})`;
}

function heat(r) {
  // fits: pale to deep blue as the cell fills the usable memory; over: pale to deep red up to twice the usable
  const mix = (a, b, t) => a.map((v, i) => Math.round(v + (b[i] - v) * Math.min(1, Math.max(0, t))));
  const c = r <= 1 ? mix([232, 240, 248], [0, 68, 136], (r - 0.2) / 0.8) : mix([246, 214, 220], [136, 34, 85], r - 1);
  return `rgb(${c.join(",")})`;
}

// -- remedies: what each saves and what it costs in time; a click applies it ---------------------------------------
function renderRemedies(P) {
  const rows = P.remedies.filter((r) => r.memory_saved > 0);
  const W = widthOf("#remedies", 560), left = 230, right = 142, rowH = 22, top = 8;
  const H = top + Math.max(1, rows.length) * rowH + 8;
  const max = Math.max(1, ...rows.map((r) => r.memory_saved));
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "remedies" });
  rows.forEach((r, k) => {
    const y = top + k * rowH, w = (r.memory_saved / max) * (W - left - right);
    const change = changeFlags(r.change);
    const g = el("g", { class: change ? "remedy" : null }, svg);
    el("rect", { class: "hit", x: 0, y, width: W, height: rowH, fill: "transparent" }, g); // the whole row clicks
    const task = r.remedy === "seq_len" || r.remedy === "model"; // these change the task
    el("text", { x: left - 8, y: y + 15, "text-anchor": "end", class: task ? "task" : null }, g, `${r.change.setting} → ${r.change.after}`.slice(0, 38));
    el("rect", { x: left, y: y + 3, width: Math.max(1, w), height: rowH - 6, rx: 2,
      fill: r.fits ? "#117733" : "#88ccee" }, g);
    const t = r.time_cost_s, cost = Math.abs(t) < 0.005 ? "±0 s" : `${t > 0 ? "+" : "−"}${Math.abs(t).toFixed(2)} s`;
    el("text", { x: left + w + 6, y: y + 15 }, g, `−${fmtBytes(r.memory_saved)} · ${cost}`);
    tip(g, `${r.title}: ${r.change.setting} ${r.change.before} → ${r.change.after}\nsaves ${fmtBytes(
      r.memory_saved)} (device ${fmtBytes(r.device_total)}${r.fits ? ", fits alone" : ""})\ntime per optimizer `
      + `step ${cost}\nprice: ${r.price}` + (change ? "\nclick to apply" : "\n(not a page control)"));
    if (change) g.addEventListener("click", () => applyChange(change));
  });
  if (!rows.length) el("text", { x: 8, y: 20 }, svg, "no remedy saves memory on this setup");
  $("#remedies").replaceChildren(svg);
  $("#plan-sub").textContent = "saved · time per optimizer step · green bar: fits alone · olive: changes the task";
  const best = P.candidates[0];
  $("#plan-text").textContent = best
    ? `fastest plan that fits: ${best.changes.map((c) => `${c.setting} → ${c.after}`).join("; ") || "your setup"}`
      + ` (${fmtBytes(best.device_total)}, ${best.time.step_s.toFixed(2)} s/step, `
      + `${Math.round(best.time.tokens_per_s).toLocaleString("en")} tokens/s; time model, not yet calibrated)`
    : `no plan that keeps the task fits (${P.combinations} combinations searched)`;
}

function changeFlags(c) {
  switch (c.remedy) {
    case "precision": case "loss": case "optimizer":
      return { [c.remedy]: c.after };
    case "attention": return { attn: c.after };
    case "grad_ckpt": return { grad_ckpt: true };
    case "seq_len": return { seq: Number(c.after) };
    case "micro_batch": { const [b, a] = c.after.split("x").map(Number); return { batch: b, accum: a }; }
    case "model": return { model: c.after };
    case "adapters": {
      if (c.setting === "LoRA rank") return { lora_rank: Number(c.after) };
      if (c.setting === "LoRA targets") return null; // no targets control on the page: --lora-targets
      const out = { method: c.after.split(" ")[0] };
      const r = /r(\d+)/.exec(c.after);
      if (r) out.lora_rank = Number(r[1]);
      return out;
    }
    default: return null; // offload needs a DeepSpeed config: drop one on the page
  }
}

function applyChange(change) {
  for (const [k, v] of Object.entries(change)) {
    if (k === "model") { state.model = v; state.modelConfig = null; $("#model").value = v; state.touched.add(k); }
    else setValue(k, v);
  }
  syncControls();
  refresh();
}

// -- settings, provenance, warnings --------------------------------------------------------------------------------
function renderSetup(s) {
  $("#command").textContent = "$ " + s.command.map((a) => (/[\s"'$]/.test(a) ? JSON.stringify(a) : a)).join(" ")
    + (state.config ? `   # with ${state.config.name} (dropped)` : "");
  $("#provenance").textContent = s.provenance_text || "every setting from the page's controls";
  const ul = $("#warnings");
  ul.replaceChildren();
  for (const w of [...s.warnings, ...((state.last.ledger || {}).warnings || [])]) el("li", {}, ul, w);
  $("#export-config").textContent = `as your config (${s.config_format && ["llamafactory", "trl", "axolotl"].includes(
    s.config_format) ? s.config_format : "llamafactory"})`;
  if (state.config || state.startup) {
    adoptFlags(s);
    const fromFile = new Set(Object.entries(s.provenance).filter(([, src]) => src !== "flag").map(([k]) => k));
    const field = { batch: "micro_batch", seq: "seq_len", accum: "grad_accum", lora_rank: "lora",
      eval_batch: "eval_batch" };
    for (const [flag, f] of Object.entries(field)) {
      const out = document.querySelector(`.slider[data-flag="${flag}"] output`);
      if (out) out.classList.toggle("file", fromFile.has(f) && !state.touched.has(flag));
    }
  }
}

// -- tooltips ------------------------------------------------------------------------------------------------------
function tip(node, text) {
  const t = $("#tip");
  node.addEventListener("mousemove", (e) => {
    t.textContent = text; t.hidden = false;
    t.style.left = `${Math.min(e.clientX + 14, window.innerWidth - 370)}px`;
    t.style.top = `${e.clientY + 14}px`;
  });
  node.addEventListener("mouseleave", () => { t.hidden = true; });
}

// -- controls ------------------------------------------------------------------------------------------------------
function setValue(flag, value) {
  state.values[flag] = value;
  state.touched.add(flag);
  syncControls();
}

function syncControls() {
  const v = state.values;
  for (const [flag, [, toPos, text]] of Object.entries(SLIDERS)) {
    const box = document.querySelector(`.slider[data-flag="${flag}"]`);
    if (v[flag] !== undefined) box.querySelector("input").value = toPos(v[flag] === null ? 0 : v[flag]);
    box.querySelector("output").textContent = text(v[flag]);
  }
  document.querySelector('.slider[data-flag="lora_rank"]').hidden = !["lora", "qlora"].includes(v.method);
  for (const f of SWITCHES) document.querySelector(`input[data-flag="${f}"]`).checked = !!v[f];
  for (const f of SELECTS) document.querySelector(`select[data-flag="${f}"]`).value = v[f];
  for (const b of document.querySelectorAll("#method button")) {
    b.setAttribute("aria-checked", String(b.dataset.value === v.method));
  }
}

function setupControls(meta) {
  const models = $("#models");
  for (const m of meta.models) el("option", { value: m.hub_id, label: m.key }, models);
  const gpu = $("#gpu");
  for (const g of meta.gpus) el("option", { value: g.key }, gpu, `${g.name} (${fmtBytes(g.memory_bytes)})`);
  el("option", { value: "" }, gpu, "another size (e.g. 24GiB)…");
  gpu.value = state.gpu;
  const size = $("#gpu-size");
  gpu.addEventListener("change", () => {
    size.hidden = gpu.value !== "";
    if (gpu.value) { state.gpu = gpu.value; refresh(); } else size.focus();
  });
  size.addEventListener("change", () => { state.gpu = size.value.trim(); refresh(); });
  const model = $("#model");
  model.addEventListener("change", () => {
    state.model = model.value.trim(); state.modelConfig = null; state.touched.add("model");
    $("#model-dropped").hidden = true; refresh();
  });
  const seg = $("#method");
  for (const m of meta.choices.method) {
    const b = el("button", { type: "button", role: "radio", "data-value": m }, seg, m);
    b.addEventListener("click", () => { setValue("method", m); refresh(); });
  }
  for (const f of SELECTS) {
    const s = document.querySelector(`select[data-flag="${f}"]`);
    for (const c of meta.choices[f]) el("option", { value: c }, s, c);
    s.addEventListener("change", () => { setValue(f, s.value); refresh(); });
  }
  for (const f of SWITCHES) {
    const c = document.querySelector(`input[data-flag="${f}"]`);
    c.addEventListener("change", () => { setValue(f, c.checked); refresh(); });
  }
  for (const [flag, [fromPos]] of Object.entries(SLIDERS)) {
    const input = document.querySelector(`.slider[data-flag="${flag}"] input`);
    input.addEventListener("input", () => { setValue(flag, fromPos(Number(input.value))); refresh(); });
  }
  for (const x of meta.extra_flags || []) extraControl(x);
  for (const b of document.querySelectorAll("[data-export]")) {
    b.addEventListener("click", () => exportAs(b.dataset.export));
  }
}

function extraControl(x) {
  // a flag of the CLI the page has no control for (world size, ZeRO, FSDP): shown as the CLI takes it
  const box = $("#extra-flags");
  if (x.switch) {
    const lab = el("label", { class: "switch" }, box);
    const c = el("input", { type: "checkbox" }, lab);
    lab.append(` ${x.flag}`);
    c.addEventListener("change", () => { state.extra[x.flag.slice(2)] = c.checked || null; refresh(); });
  } else {
    const lab = el("label", { class: "field", title: x.help }, box, `${x.flag}`);
    const input = x.choices ? el("select", {}, lab) : el("input", { type: x.integer ? "number" : "text", min: 0 }, lab);
    if (x.choices) for (const c of ["", ...x.choices]) el("option", { value: c }, input, c || "(default)");
    input.addEventListener("change", () => { state.extra[x.flag.slice(2)] = input.value === "" ? null : input.value;
      refresh(); });
  }
}

// -- dropped files: a training config, a model's config.json, a DeepSpeed JSON (sent as content) -------------------
function classify(name, text) {
  if (/\.json$/i.test(name)) {
    try {
      const obj = JSON.parse(text);
      if (obj && (obj.model_type || obj.architectures || obj.hidden_size)) return ["model", obj];
      if (obj && (obj.zero_optimization || obj.train_micro_batch_size_per_gpu)) return ["deepspeed", text];
    } catch (e) { /* the server names the problem */ }
  }
  return ["config", text];
}

async function loadFiles(files) {
  for (const f of files) {
    const text = await f.text();
    const [kind, content] = classify(f.name, text);
    if (kind === "model") {
      state.modelConfig = { name: f.name, obj: content };
      chip("#model-dropped", `model: ${content._name_or_path || f.name} (dropped)`, () => {
        state.modelConfig = null; refresh(); });
    } else if (kind === "deepspeed") {
      state.deepspeed = content;
    } else {
      state.config = { name: f.name, text: content };
      state.startup = false;
      state.touched = new Set();
      chip("#config-loaded", `${f.name}${state.deepspeed ? " + DeepSpeed JSON" : ""}`, clearConfig);
    }
  }
  await adoptConfig();
}

function clearConfig() {
  state.config = null; state.startup = false; state.deepspeed = null; state.touched = new Set();
  $("#config-loaded").hidden = true;
  refresh();
}

async function adoptConfig() {
  // set the controls from what the file resolves to, so the sliders start where the file is
  if (state.config || state.startup) {
    try {
      adoptFlags(await post("setup", requestBody()));
    } catch (err) { showError(err.message); }
  }
  syncControls();
  refresh();
}

function adoptFlags(s) {
  // the controls the user has not moved show what the config resolves to
  for (const [k, v] of Object.entries(s.flags)) {
    if (k === "gpu" || k === "headroom" || v === undefined || state.touched.has(k)) continue;
    if (v !== null || k === "eval_batch") state.values[k] = v;
  }
  if (!state.modelConfig && !state.touched.has("model")) { state.model = s.model_named; $("#model").value = s.model_named; }
  syncControls();
}

function chip(sel, text, onClear) {
  const c = $(sel);
  c.replaceChildren();
  el("span", {}, c, text);
  const x = el("button", { type: "button", title: "remove" }, c, "×");
  x.addEventListener("click", () => { c.hidden = true; onClear(); });
  c.hidden = false;
}

function setupDrop() {
  const drop = $("#drop");
  for (const ev of ["dragenter", "dragover"]) {
    window.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.add("over"); });
  }
  window.addEventListener("dragleave", () => drop.classList.remove("over"));
  window.addEventListener("drop", (e) => {
    e.preventDefault(); drop.classList.remove("over");
    if (e.dataTransfer && e.dataTransfer.files.length) loadFiles([...e.dataTransfer.files]);
  });
  $("#files").addEventListener("change", (e) => loadFiles([...e.target.files]));
}

// -- export: the server answers with the text, the browser saves it -----------------------------------------------
async function exportAs(kind) {
  try {
    const r = await post("export", { ...requestBody(), as: kind });
    const url = URL.createObjectURL(new Blob([r.content], { type: r.media_type }));
    const a = el("a", { href: url, download: r.filename }, document.body);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
    $("#export-status").textContent = `saved ${r.filename}`;
  } catch (err) { $("#export-status").textContent = err.message; } // the page's numbers still stand
}

// -- start -----------------------------------------------------------------------------------------------------------
async function start() {
  const res = await fetch("/api/meta");
  state.meta = await res.json();
  setupControls(state.meta);
  setupDrop();
  const params = new URLSearchParams(location.search);
  if (state.meta.startup_config) {
    state.startup = true;
    chip("#config-loaded", `${state.meta.startup_config.name} (--config)`, clearConfig);
  }
  for (const [k, v] of params) { // ?batch=4&seq=4096&gpu=a100-80gb&model=…: a link to a setup
    if (k === "model") { state.model = v; $("#model").value = v; state.touched.add(k); }
    else if (k === "gpu") { state.gpu = v; $("#gpu").value = v; }
    else if (k in state.values) setValue(k, /^[\d.]+$/.test(v) ? Number(v) : v === "true" ? true : v === "false" ? false : v);
  }
  await adoptConfig();
}

document.addEventListener("DOMContentLoaded", start);
