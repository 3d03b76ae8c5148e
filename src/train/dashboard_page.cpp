// The dashboard page (served at / by train/monitor_server.cpp): polls /api/records and /api/alerts every two
// seconds and draws the run with chart.js (served at /chart.js). #state holds what the charts hold (counts of
// points per chart) for tests in a headless browser (tests/e2e/test_monitor.cpp).
#include "train/monitor_server.h"

namespace tessera::train {

const char* const kDashboardHtml = R"html(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tessera</title>
<script src="/chart.js"></script>
<style>
body { font: 14px system-ui, sans-serif; margin: 16px; background: #fafafa; color: #222; }
h1 { font-size: 18px; margin: 0 0 4px; } #run { color: #666; margin-bottom: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
.card h2 { font-size: 14px; margin: 0 0 6px; } canvas { width: 100%; }
#heat { height: 220px; image-rendering: pixelated; } table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #eee; padding: 2px 6px; text-align: left; font-size: 12px; }
.stop { color: #b00; } .checkpoint { color: #a60; } .warn, .skip { color: #750; }
#state { display: none; }
</style></head><body>
<h1>tessera</h1><div id="run">connecting...</div>
<div class="grid">
<div class="card"><h2>Loss (nats/token)</h2><canvas id="c_loss"></canvas></div>
<div class="card"><h2>Throughput</h2><canvas id="c_speed"></canvas></div>
<div class="card"><h2>Step time by phase (ms)</h2><canvas id="c_phase"></canvas></div>
<div class="card"><h2>Memory (MiB)</h2><canvas id="c_mem"></canvas></div>
<div class="card"><h2>Expert overload (max / mean load, per MoE layer)</h2><canvas id="c_moe"></canvas></div>
<div class="card"><h2>Expert load over time (rows: layers &times; experts; columns: steps; dark = busy)</h2>
  <canvas id="heat"></canvas><div id="heat_note"></div></div>
<div class="card"><h2>Alerts</h2><table><thead><tr><th>time</th><th>step</th><th>rule</th><th>action</th>
  <th>message</th></tr></thead><tbody id="alerts"></tbody></table></div>
</div>
<pre id="state">{}</pre>
<script>
"use strict";
const colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
function chart(id, datasets, y2) {  // y2: the title of a second y axis on the right (datasets with yAxisID "y2")
  const scales = { x: { type: "linear", title: { display: true, text: "step" } }, y: { position: "left" } };
  if (y2) {
    scales.y.title = { display: true, text: datasets[0].label };
    scales.y2 = { position: "right", grid: { drawOnChartArea: false }, title: { display: true, text: y2 } };
  }
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { datasets: datasets.map((d, i) => Object.assign({ data: [], borderColor: colors[i % 8],
      backgroundColor: colors[i % 8] + "55", pointRadius: 0, borderWidth: 1.5 }, d)) },
    options: { animation: false, parsing: false, normalized: true, responsive: true, scales,
      plugins: { legend: { labels: { boxWidth: 12 } }, decimation: { enabled: true, algorithm: "lttb", samples: 800 } } } });
}
const charts = {
  loss: chart("c_loss", [{ label: "train" }, { label: "eval", pointRadius: 3 }]),
  speed: chart("c_speed", [{ label: "tokens/s" }, { label: "MFU %", yAxisID: "y2" }], "MFU %"),
  phase: chart("c_phase", ["compute", "communication", "data", "optimizer"].map(p => ({ label: p, fill: true }))),
  mem: chart("c_mem", [{ label: "arena in use" }, { label: "arena peak" }, { label: "resident" }]),
  moe: chart("c_moe", []),
};
charts.phase.options.scales.y = { stacked: true };
let offsets = { records: 0, alerts: 0 }, loads = [], stride = 1, seen = 0, alerts = 0, records = 0;
const MiB = 1 / 1048576;
function add(c, i, x, y) { if (y !== undefined && y !== null && isFinite(y)) c.data.datasets[i].data.push({ x, y }); }
function take(r) {
  records++;
  if (r.eval_loss !== undefined) { add(charts.loss, 1, r.step, r.eval_loss); return; }
  if (r.loss === undefined) return;
  add(charts.loss, 0, r.step, r.loss);
  add(charts.speed, 0, r.step, r.tokens_per_s); add(charts.speed, 1, r.step, 100 * r.mfu);
  if (r.phase_ms) ["compute", "communication", "data", "optimizer"].forEach((p, i) =>
    add(charts.phase, i, r.step, r.phase_ms[p]));
  if (r.memory) { add(charts.mem, 0, r.step, r.memory.arena_bytes_in_use * MiB);
    add(charts.mem, 1, r.step, r.memory.arena_peak_bytes * MiB); add(charts.mem, 2, r.step, r.memory.resident_bytes * MiB); }
  if (r.moe) {
    r.moe.forEach((l, i) => {
      if (!charts.moe.data.datasets[i]) charts.moe.data.datasets.push({ label: "layer " + l.layer, data: [],
        borderColor: colors[i % 8], pointRadius: 0, borderWidth: 1.5 });
      add(charts.moe, i, r.step, l.overload);
    });
    // the heatmap keeps at most 600 columns: every stride-th step, the stride doubling as the run grows
    if (seen++ % stride === 0) loads.push({ step: r.step, layers: r.moe });
    if (loads.length > 600) { loads = loads.filter((_, i) => i % 2 === 0); stride *= 2; }
  }
}
function heat() {
  const c = document.getElementById("heat"), note = document.getElementById("heat_note");
  if (!loads.length) { note.textContent = "no MoE layers in this model"; return; }
  const layers = loads[loads.length - 1].layers, E = layers.map(l => l.load.length);
  const rows = E.reduce((a, b) => a + b, 0);
  c.width = loads.length; c.height = rows;
  const g = c.getContext("2d"), img = g.createImageData(loads.length, rows);
  loads.forEach((s, x) => {
    let y = 0;
    s.layers.forEach(l => {
      const mean = l.load.reduce((a, b) => a + b, 0) / l.load.length || 1;
      l.load.forEach(v => {
        const t = Math.min(1, v / mean / 2), o = 4 * (y++ * loads.length + x);  // 0 idle, 0.5 mean, 1 twice it
        img.data[o] = 255 - 200 * t; img.data[o + 1] = 255 - 140 * t; img.data[o + 2] = 255 - 60 * t; img.data[o + 3] = 255;
      });
    });
  });
  g.putImageData(img, 0, 0);
  note.textContent = `steps ${loads[0].step}-${loads[loads.length - 1].step} (every ${stride}): ` +
    `${layers.length} MoE layers (${layers.map(l => l.layer).join(", ")}) of ${E[0]} experts, top to bottom`;
}
function alert(a) {
  alerts++;
  const tr = document.createElement("tr");
  tr.className = a.action;
  for (const k of ["time", "step", "rule", "action", "message"]) {
    const td = document.createElement("td"); td.textContent = a[k]; tr.appendChild(td); }
  document.getElementById("alerts").prepend(tr);
}
async function poll() {
  try {
    const run = await (await fetch("/api/run")).json();
    for (const what of ["records", "alerts"]) {
      const r = await (await fetch(`/api/${what}?offset=${offsets[what]}`)).json();
      if (r.offset < offsets[what]) location.reload();  // the log was rewritten (a resumed run)
      offsets[what] = r.offset;
      r.records.forEach(what === "records" ? take : alert);
    }
    Object.values(charts).forEach(c => c.update());
    heat();
    const last = charts.loss.data.datasets[0].data.slice(-1)[0];
    document.getElementById("run").textContent = `${run.run_dir} (${run.live ? "live" : "finished run"}): ` +
      (last ? `step ${last.x}, loss ${last.y.toFixed(4)}` : "no step yet") + `, ${alerts} alerts`;
    const points = {};
    for (const [k, c] of Object.entries(charts)) points[k] = c.data.datasets.map(d => d.data.length);
    document.getElementById("state").textContent = JSON.stringify({ records, alerts, points,
      heat: loads.length ? [loads.length, document.getElementById("heat").height] : null });
  } catch (e) { document.getElementById("run").textContent = "disconnected: " + e; }
  setTimeout(poll, 2000);
}
poll();
</script></body></html>
)html";

}  // namespace tessera::train
