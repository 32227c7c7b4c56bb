// The job dashboard's page (dashboard.h): HTML, CSS and script in one document, nothing
// fetched from elsewhere. It reads api/metrics (every 2 s while the job runs) and api/files,
// and draws with plain SVG. Marked for tests: body[data-ready] once drawn; each chart an
// <svg class="chart" id=...> with one <polyline class="series" data-series data-points> per
// rank and one <line class="restart" data-generation> per restart; #stragglers rows
// tr[data-rank]; #ranks rows tr[data-rank]; #breakdown bars div[data-rank][data-phase].
#include "control/dashboard.h"

namespace loom::control {

const char* dashboard_page() {
  return R"PAGE(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Loom job</title>
<style>
  :root { --fg: #1d2330; --muted: #6b7385; --line: #e3e6ec; --bad: #c0392b; --warn: #b9770e; }
  body { font: 14px/1.4 system-ui, sans-serif; color: var(--fg); margin: 0; background: #f6f7f9; }
  header { background: #1d2330; color: #fff; padding: 12px 20px; display: flex; gap: 24px;
           align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  header .state { font-weight: 600; }
  main { padding: 16px 20px; display: grid; gap: 16px;
         grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); }
  section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px; }
  section h2 { font-size: 14px; margin: 0 0 8px; }
  .cards { display: flex; gap: 12px; flex-wrap: wrap; grid-column: 1 / -1; }
  .card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px;
          min-width: 130px; }
  .card .v { font-size: 22px; font-weight: 600; }
  .card .k { color: var(--muted); font-size: 12px; }
  .banner { grid-column: 1 / -1; background: #fdecea; color: var(--bad); border: 1px solid #f5c6c0;
            border-radius: 6px; padding: 10px 14px; font-weight: 600; }
  .banner.warn { background: #fef5e7; color: var(--warn); border-color: #f8e1b5; }
  svg.chart { width: 100%; height: 200px; }
  svg.chart .axis { stroke: #c8ccd4; stroke-width: 1; }
  svg.chart .label { fill: var(--muted); font-size: 11px; }
  svg.chart .series { fill: none; stroke-width: 1.8; }
  svg.chart .restart { stroke: var(--bad); stroke-dasharray: 4 3; stroke-width: 1.5; }
  svg.chart .restart-label { fill: var(--bad); font-size: 11px; }
  .legend { display: flex; gap: 12px; flex-wrap: wrap; font-size: 12px; color: var(--muted); }
  .legend span::before { content: ""; display: inline-block; width: 10px; height: 10px;
                         margin-right: 4px; background: var(--c); border-radius: 2px; }
  table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
  th, td { text-align: right; padding: 3px 8px; border-bottom: 1px solid var(--line); }
  th:first-child, td:first-child { text-align: left; }
  th, td { white-space: nowrap; }
  #ranks td:last-child, #ranks th:last-child { text-align: left; white-space: normal;
                                               font-size: 12px; color: var(--muted); }
  tr.straggler td { color: var(--bad); font-weight: 600; }
  .bars .row { display: flex; align-items: center; gap: 8px; margin: 4px 0; }
  .bars .name { width: 60px; }
  .bars .track { flex: 1; display: flex; height: 18px; background: #f0f1f4; border-radius: 3px;
                 overflow: hidden; }
  .bars .seg { height: 100%; }
  .muted { color: var(--muted); }
  a { color: #2563c9; }
</style>
</head>
<body>
<header>
  <h1>Loom job</h1>
  <span id="job-state" class="state">loading…</span>
  <span id="job-detail" class="muted"></span>
  <span id="updated" class="muted"></span>
</header>
<main>
  <div id="banners" style="display:contents"></div>
  <div class="cards" id="cards"></div>
  <section><h2>Tokens per second, per rank</h2><svg class="chart" id="chart-tokens"></svg>
    <div class="legend" id="legend-tokens"></div></section>
  <section><h2>MFU, per rank</h2><svg class="chart" id="chart-mfu"></svg>
    <div class="legend" id="legend-mfu"></div></section>
  <section><h2>Step time (s), per rank</h2><svg class="chart" id="chart-step"></svg>
    <div class="legend" id="legend-step"></div></section>
  <section><h2>Where each rank's step goes (newest report)</h2>
    <div class="bars" id="breakdown"></div><div class="legend" id="legend-phases"></div></section>
  <section><h2>Resident memory (MiB), per rank</h2><svg class="chart" id="chart-memory"></svg>
    <div class="legend" id="legend-memory"></div></section>
  <section><h2>Goodput and restarts</h2><svg class="chart" id="chart-goodput"></svg>
    <div class="muted" id="uptime"></div></section>
  <section><h2>Stragglers</h2><table id="stragglers"><thead><tr><th>rank</th><th>busy (s)</th>
    <th>others (s)</th><th>ratio</th><th>where</th><th>excess (s)</th></tr></thead>
    <tbody></tbody></table><div class="muted" id="straggler-rule"></div></section>
  <section><h2>Ranks</h2><table id="ranks"><thead><tr><th>rank</th><th>step</th><th>step s</th>
    <th>tokens/s</th><th>MFU</th><th>RSS MiB</th><th>now</th></tr></thead><tbody></tbody></table>
  </section>
  <section><h2>Traces, flight dumps and stacks</h2><div id="files" class="muted">none</div></section>
</main>
<script>
"use strict";
const COLORS = ["#2563c9", "#d9480f", "#2f9e44", "#9c36b5", "#c2255c", "#0c8599", "#e67700",
                "#5c7cfa", "#495057", "#74b816"];
const PHASES = ["data_wait", "forward_backward", "comm_wait", "optimizer", "checkpoint_stall",
                "other"];
const PHASE_COLORS = ["#f59f00", "#2563c9", "#e03131", "#2f9e44", "#9c36b5", "#adb5bd"];
const SVG = "http://www.w3.org/2000/svg";
const color = i => COLORS[i % COLORS.length];
const el = (tag, attrs, text) => {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
                                   : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const fmt = (v, digits) => v === null || v === undefined || !isFinite(v) ? "–"
                                                                         : Number(v).toFixed(digits);
const human = v => v >= 1e6 ? fmt(v / 1e6, 2) + "M" : v >= 1e3 ? fmt(v / 1e3, 1) + "k" : fmt(v, 0);

// A line chart: one polyline per series on a shared time axis, restarts as dashed lines.
function lineChart(svg, series, restarts, t0, t1, format) {
  svg.replaceChildren();
  const W = svg.clientWidth || 560, H = svg.clientHeight || 200;
  const L = 52, R = 10, T = 10, B = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  let lo = Infinity, hi = -Infinity;
  for (const s of series) for (const [, v] of s.points) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (!isFinite(lo)) { lo = 0; hi = 1; }
  lo = Math.min(0, lo);
  if (hi <= lo) hi = lo + 1;
  const span = Math.max(t1 - t0, 1);
  const x = t => L + (t - t0) / span * (W - L - R);
  const y = v => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  svg.append(el("svg:line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}));
  svg.append(el("svg:line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}));
  svg.append(el("svg:text", {class: "label", x: L - 4, y: T + 10, "text-anchor": "end"}, format(hi)));
  svg.append(el("svg:text", {class: "label", x: L - 4, y: H - B, "text-anchor": "end"}, format(lo)));
  svg.append(el("svg:text", {class: "label", x: L, y: H - 6}, "0 s"));
  svg.append(el("svg:text", {class: "label", x: W - R, y: H - 6, "text-anchor": "end"},
                `${fmt(span, 0)} s`));
  for (const r of restarts) {
    svg.append(el("svg:line", {class: "restart", "data-generation": r.generation,
                               x1: x(r.t), y1: T, x2: x(r.t), y2: H - B}));
    svg.append(el("svg:text", {class: "restart-label", x: x(r.t) + 3, y: T + 10},
                  `restart: generation ${r.generation}`));
  }
  if (!series.some(s => s.points.length)) {
    svg.append(el("svg:text", {class: "label", x: (L + W - R) / 2, y: (T + H - B) / 2,
                               "text-anchor": "middle"}, "no data reported"));
  }
  for (const s of series) {
    const pts = s.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg.append(el("svg:polyline", {class: "series", "data-series": s.name,
                                   "data-points": s.points.length, points: pts,
                                   stroke: s.color}));
  }
}

function legend(div, series) {
  div.replaceChildren(...series.map(s => {
    const e = el("span", {}, s.name);
    e.style.setProperty("--c", s.color);
    return e;
  }));
}

function render(m, files) {
  const job = m.job, ranks = m.ranks || [];
  document.getElementById("job-state").textContent =
      `generation ${job.generation} ${job.state}`;
  document.getElementById("job-detail").textContent =
      `world ${job.world_size} · restarts ${job.restarts}` +
      (job.last_failure ? ` · last failure: ${job.last_failure}` : "");
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;

  const banners = document.getElementById("banners");
  banners.replaceChildren();
  if (job.hang) banners.append(el("div", {class: "banner", id: "hang"}, `Hang: ${job.hang}`));
  for (const s of m.stragglers || []) {
    banners.append(el("div", {class: "banner warn"},
        `Straggler: rank ${s.rank}, ${fmt(s.ratio, 2)}× the other ranks' busy time, most in ` +
        `${s.phase} (+${fmt(s.phase_excess_seconds, 3)} s)`));
  }

  const sum = m.summary || {};
  const cards = [["tokens/s", human(sum.tokens_per_second)],
                 ["step (median)", fmt(sum.step_seconds, 3) + " s"],
                 ["MFU", sum.mfu === null ? "–" : fmt(100 * sum.mfu, 1) + "%"],
                 ["goodput", sum.goodput === null ? "–" : fmt(100 * sum.goodput, 1) + "%"],
                 ["loss", fmt(sum.loss, 4)],
                 ["ranks reporting", `${sum.ranks} / ${job.world_size}`]];
  document.getElementById("cards").replaceChildren(...cards.map(([k, v]) => {
    const c = el("div", {class: "card"});
    c.append(el("div", {class: "v"}, v), el("div", {class: "k"}, k));
    return c;
  }));

  let t0 = Infinity, t1 = -Infinity;
  for (const r of ranks) for (const p of r.series) {
    t0 = Math.min(t0, p.unix_time); t1 = Math.max(t1, p.unix_time);
  }
  const gens = m.generations || [];
  for (const g of gens) { t0 = Math.min(t0, g.start_unix_time); t1 = Math.max(t1, g.start_unix_time); }
  if (!isFinite(t0)) { t0 = 0; t1 = 1; }
  const restarts = gens.filter(g => g.generation > 1)
                       .map(g => ({generation: g.generation, t: g.start_unix_time}));
  const chart = (id, field, format) => {
    const series = ranks.map(r => ({
      name: `rank ${r.rank}`, color: color(r.rank),
      points: r.series.filter(p => field(p) !== null && field(p) !== undefined)
                      .map(p => [p.unix_time, field(p)])}));
    lineChart(document.getElementById("chart-" + id), series, restarts, t0, t1, format);
    legend(document.getElementById("legend-" + id), series);
  };
  chart("tokens", p => p.tokens_per_second, human);
  chart("mfu", p => p.mfu === null ? null : 100 * p.mfu, v => fmt(v, 1) + "%");
  chart("step", p => p.step_seconds, v => fmt(v, 3));
  chart("memory", p => p.rss_bytes / 1048576, v => fmt(v, 0));
  const rank0 = ranks.find(r => r.rank === 0);
  lineChart(document.getElementById("chart-goodput"),
            rank0 ? [{name: "goodput (rank 0)", color: color(0),
                      points: rank0.series.filter(p => p.goodput !== null)
                                          .map(p => [p.unix_time, 100 * p.goodput])}] : [],
            restarts, t0, t1, v => fmt(v, 0) + "%");
  document.getElementById("uptime").textContent =
      `${gens.length} generation(s) over ${fmt(t1 - t0, 0)} s; ` +
      (restarts.length ? `restarts at ${restarts.map(r => fmt(r.t - t0, 0) + " s").join(", ")}`
                       : "no restarts");

  const breakdown = document.getElementById("breakdown");
  breakdown.replaceChildren(...ranks.filter(r => r.series.length).map(r => {
    const p = r.series[r.series.length - 1];
    const row = el("div", {class: "row"});
    const track = el("div", {class: "track"});
    PHASES.forEach((phase, i) => {
      const s = (p.phase_seconds || {})[phase] || 0;
      const seg = el("div", {class: "seg", "data-rank": r.rank, "data-phase": phase,
                             title: `${phase}: ${fmt(s, 3)} s`});
      seg.style.width = `${100 * s / Math.max(p.step_seconds, 1e-9)}%`;
      seg.style.background = PHASE_COLORS[i];
      track.append(seg);
    });
    row.append(el("span", {class: "name"}, `rank ${r.rank}`), track,
               el("span", {class: "muted"}, `${fmt(p.step_seconds, 3)} s`));
    return row;
  }));
  legend(document.getElementById("legend-phases"),
         PHASES.map((name, i) => ({name, color: PHASE_COLORS[i]})));

  const flagged = new Set((m.stragglers || []).map(s => s.rank));
  document.querySelector("#stragglers tbody").replaceChildren(...(m.stragglers || []).map(s => {
    const tr = el("tr", {"data-rank": s.rank, class: "straggler"});
    for (const v of [`rank ${s.rank}`, fmt(s.busy_seconds, 3), fmt(s.others_seconds, 3),
                     fmt(s.ratio, 2) + "×", s.phase, "+" + fmt(s.phase_excess_seconds, 3)]) {
      tr.append(el("td", {}, v));
    }
    return tr;
  }));
  document.getElementById("straggler-rule").textContent =
      (m.stragglers || []).length ? "" : "none flagged; " +
      `a rank is flagged when its median busy time over ${m.straggler_window} reports exceeds ` +
      `${m.straggler_threshold}× the others'`;
  document.querySelector("#ranks tbody").replaceChildren(...ranks.map(r => {
    const p = r.series.length ? r.series[r.series.length - 1] : null;
    const a = r.activity || {};
    const tr = el("tr", {"data-rank": r.rank, class: flagged.has(r.rank) ? "straggler" : ""});
    const now = a.phase ? a.phase + (a.collective ? ` · ${a.collective}` : "") : "";
    for (const v of [`rank ${r.rank}`, p ? p.last_step : "–", p ? fmt(p.step_seconds, 3) : "–",
                     p ? human(p.tokens_per_second) : "–",
                     p && p.mfu !== null ? fmt(100 * p.mfu, 1) + "%" : "–",
                     p ? fmt(p.rss_bytes / 1048576, 0) : "–", now]) {
      tr.append(el("td", {}, v));
    }
    return tr;
  }));

  const list = [...(files.traces || []), ...(files.flight || []), ...(files.stacks || [])];
  const filesDiv = document.getElementById("files");
  if (list.length) {
    const ul = el("ul");
    for (const f of list) {
      const li = el("li");
      li.append(el("a", {href: "files/" + f.path, "data-path": f.path}, f.path),
                el("span", {class: "muted"}, ` (${human(f.bytes)}B)`));
      ul.append(li);
    }
    filesDiv.replaceChildren(ul,
        el("div", {}, "Open a trace at ui.perfetto.dev; compare flight dumps with " +
                      "`loom flight diff`; stacks are each thread's at the watchdog's dump."));
  }
  document.body.dataset.ready = "1";
  return job.state === "gathering" || job.state === "running";
}

async function refresh() {
  let live = true;
  try {
    const [m, f] = await Promise.all([fetch("api/metrics").then(r => {
      if (!r.ok) throw new Error(`api/metrics: HTTP ${r.status}`);
      return r.json();
    }), fetch("api/files").then(r => r.ok ? r.json() : {})]);
    live = render(m, f);
  } catch (e) {
    document.getElementById("job-state").textContent = `cannot read the metrics: ${e.message}`;
  }
  if (live) setTimeout(refresh, 2000);
}
refresh();
</script>
</body>
</html>
)PAGE";
}

}  // namespace loom::control
