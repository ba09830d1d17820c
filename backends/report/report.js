(function () {
'use strict';
const D = JSON.parse(document.getElementById('attnplan-data').textContent);
const PAL = D.palette, SPAL = D.stage_palette, COL = D.colours, KINDS = D.kinds;
const tip = document.getElementById('tip');
const renders = [];
const fmtInt = x => Math.round(x).toLocaleString('en-US');
function fmtBytes(b) { return b >= 1e9 ? (b / 1e9).toFixed(2) + ' GB' : b >= 1e6 ? (b / 1e6).toFixed(2) + ' MB'
  : b >= 1e3 ? (b / 1e3).toFixed(1) + ' kB' : Math.round(b) + ' B'; }
function fmtTime(us) { return us >= 1000 ? (us / 1000).toFixed(3) + ' ms' : us >= 1 ? us.toFixed(2) + ' µs'
  : (us * 1000).toFixed(1) + ' ns'; }
function fmtTok(t) { return t >= 1048576 ? (t / 1048576).toFixed(2) + 'M' : t >= 1024 ? (t / 1024).toFixed(t % 1024 ? 1 : 0) + 'k' : String(Math.round(t)); }
function fmtVal(v, unit) { if (unit === 'B') return fmtBytes(v); if (unit === 'flop') return v.toExponential(2);
  return fmtInt(v); }
function fmtTick(v, unit) { // short axis labels: 1.5T, 20k, 400 MB
  if (v === 0) return '0';
  const si = [[1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']].find(([f]) => Math.abs(v) >= f) || [1, ''];
  const x = v / si[0], s = (Math.abs(x) >= 10 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(1)) + si[1];
  return unit === 'B' ? s + 'B' : s; }
// last index i with a[i] <= x, or -1
function bsearch(a, x) { let lo = 0, hi = a.length - 1; if (hi < 0 || x < a[0]) return -1;
  while (lo < hi) { const m = (lo + hi + 1) >> 1; if (a[m] <= x) lo = m; else hi = m - 1; } return lo; }
function showTip(text, e) {
  if (!text) { tip.style.display = 'none'; return; }
  tip.textContent = text; tip.style.display = 'block';
  const w = tip.offsetWidth, h = tip.offsetHeight;
  let x = e.clientX + 14, y = e.clientY + 14;
  if (x + w > window.innerWidth - 4) x = Math.max(4, e.clientX - w - 14);
  if (y + h > window.innerHeight - 4) y = Math.max(4, e.clientY - h - 14);
  tip.style.left = x + 'px'; tip.style.top = y + 'px';
}
function setup(canvas, heightOf, draw, hit) {
  let geom = null;
  function render() {
    const w = Math.max(120, canvas.clientWidth || canvas.parentElement.clientWidth), h = Math.round(heightOf(w));
    const r = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
    canvas.style.height = h + 'px';
    const ctx = canvas.getContext('2d');
    ctx.setTransform(r, 0, 0, r, 0, 0); ctx.clearRect(0, 0, w, h);
    ctx.font = '11px system-ui, sans-serif'; ctx.textBaseline = 'middle';
    geom = draw(ctx, w, h); canvas._geom = geom;
  }
  renders.push(render); render();
  canvas.addEventListener('mousemove', e => {
    const b = canvas.getBoundingClientRect();
    showTip(geom ? hit(e.clientX - b.left, e.clientY - b.top, geom) : null, e);
  });
  canvas.addEventListener('mouseleave', () => showTip(null));
}
function ticks(max, count) { // nice tick values in [0, max]
  if (!(max > 0)) return [0];
  const raw = max / count, p = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(s => s * p).find(s => s >= raw);
  const out = []; for (let v = 0; v <= max * 1.0001; v += step) out.push(v); return out;
}

// ---- mask ---------------------------------------------------------------------------------
function maskPanel(canvas, P) {
  const m = P.mask, c = m.cells, E = m.edges, nb = m.bins, T = m.tokens, docs = m.docs;
  const index = new Map(); for (let i = 0; i < c.q.length; i++) index.set(c.q[i] * nb + c.k[i], i);
  function draw(ctx, w) {
    const ox = 46, oy = 6, S = Math.max(40, Math.min(w - ox - 8, 760 - ox)), sc = S / T;
    ctx.fillStyle = '#fff'; ctx.fillRect(ox, oy, S, S);
    ctx.fillStyle = '#eef0f3';
    for (let i = 0; i + 1 < docs.length; i++) { const a = docs[i] * sc, s = Math.max(0.5, (docs[i + 1] - docs[i]) * sc);
      ctx.fillRect(ox + a, oy + a, s, s); }
    for (let i = 0; i < c.q.length; i++) {
      const q0 = E[c.q[i]] * sc, q1 = E[c.q[i] + 1] * sc, k0 = E[c.k[i]] * sc, k1 = E[c.k[i] + 1] * sc;
      ctx.globalAlpha = 0.3 + 0.7 * c.density[i] / 1000; ctx.fillStyle = PAL[c.device[i]];
      ctx.fillRect(ox + k0, oy + q0, Math.max(1, k1 - k0), Math.max(1, q1 - q0));
    }
    ctx.globalAlpha = 1; ctx.strokeStyle = '#333'; ctx.lineWidth = 0.7;
    for (let i = 0; i + 1 < docs.length; i++) { const s = (docs[i + 1] - docs[i]) * sc;
      if (s >= 3) ctx.strokeRect(ox + docs[i] * sc, oy + docs[i] * sc, s, s); }
    ctx.strokeStyle = '#999'; ctx.strokeRect(ox, oy, S, S);
    ctx.fillStyle = '#555'; ctx.textAlign = 'right';
    const unit = T >= 4096 ? 1024 : 1, tv = ticks(T / unit, 4).map(v => v * unit);
    for (const v of tv) { ctx.fillText(fmtTok(v), ox - 4, oy + v * sc); }
    ctx.textAlign = 'center';
    for (const v of tv) { ctx.fillText(fmtTok(v), ox + v * sc, oy + S + 10); }
    ctx.fillText('key tokens →   (query tokens ↓)', ox + S / 2, oy + S + 24);
    return {ox, oy, S, sc};
  }
  const TB = m.spans ? 'span ' : 'tb';  // a grouped plan is drawn span by span (its varlen groups' pieces)
  function docOf(t) { return Math.max(0, bsearch(docs, t)); }
  function cellText(i) {
    const qa = m.bin_tb0[c.q[i]], qb = m.bin_tb0[c.q[i] + 1] - 1, ka = m.bin_tb0[c.k[i]], kb = m.bin_tb0[c.k[i] + 1] - 1;
    const q0 = E[c.q[i]], q1 = E[c.q[i] + 1], k0 = E[c.k[i]], k1 = E[c.k[i] + 1];
    const d0 = docOf(q0), d1 = docOf(q1 - 1);
    const st = c.s0[i] === c.s1[i] ? 'stage ' + c.s0[i] : 'stages ' + c.s0[i] + '–' + c.s1[i];
    const docTxt = d0 === d1 ? 'document #' + d0 + ' (' + fmtInt(docs[d0 + 1] - docs[d0]) + ' tokens)'
      : 'documents #' + d0 + '–#' + d1;
    const pairs = 'pairs ' + fmtInt(c.pairs[i]) + ' (allowed q,k × ' + m.heads + ' q heads), ' + (c.density[i] / 10).toFixed(1) + '% of the cell';
    const node = Math.floor(c.device[i] / P.dpn);
    if (c.blocks[i] === 1) {
      return 'compute block c' + c.c0[i] + ' · device d' + c.device[i] + ' (node ' + node + ') · ' + st +
        '\nq ' + TB + qa + ' [' + fmtInt(q0) + ', ' + fmtInt(q1) + ') × kv ' + TB + ka + ' [' + fmtInt(k0) + ', ' + fmtInt(k1) + ')' +
        '\n' + pairs + '\n' + docTxt;
    }
    const devs = c.ndev[i] === 1 ? 'device d' + c.device[i] + ' (node ' + node + ')'
      : 'devices: d' + c.device[i] + ' ' + (c.share[i] / 10).toFixed(1) + '% of pairs, ' + (c.ndev[i] - 1) + ' other device(s)';
    const span = (qa === qb && ka === kb) ? 'tile q ' + TB + qa + ' × kv ' + TB + ka + ' (one per head group)'
      : 'q ' + TB + qa + '–' + TB + qb + ' [' + fmtInt(q0) + ', ' + fmtInt(q1) + ') × kv ' + TB + ka + '–' + TB + kb + ' [' + fmtInt(k0) + ', ' + fmtInt(k1) + ')';
    return 'cell aggregating ' + c.blocks[i] + ' compute blocks (c' + c.c0[i] + '…c' + c.c1[i] + ')\n' + span +
      '\n' + devs + ' · ' + st + '\n' + pairs + '\n' + docTxt;
  }
  function hit(x, y, g) {
    const k = (x - g.ox) / g.sc, q = (y - g.oy) / g.sc;
    if (q < 0 || k < 0 || q >= T || k >= T) return null;
    const r = 2 / g.sc; let best = -1;
    const qa = Math.max(0, bsearch(E, q - r)), qb = Math.max(0, bsearch(E, q + r));
    const ka = Math.max(0, bsearch(E, k - r)), kb = Math.max(0, bsearch(E, k + r));
    for (let qi = qa; qi <= Math.min(qb, nb - 1); qi++) for (let ki = ka; ki <= Math.min(kb, nb - 1); ki++) {
      const i = index.get(qi * nb + ki);
      if (i !== undefined && (best < 0 || c.pairs[i] > c.pairs[best])) best = i;
    }
    if (best >= 0) return cellText(best);
    const dq = docOf(q), dk = docOf(k);
    return 'q ' + fmtInt(q) + ', k ' + fmtInt(k) + ': masked, no compute block\n' +
      (dq === dk ? 'inside document #' + dq : 'q in document #' + dq + ', k in document #' + dk);
  }
  setup(canvas, w => Math.min(w - 54, 760 - 54) + 40, draw, hit);
}

// ---- bars ---------------------------------------------------------------------------------
function barPanel(canvas, P, j, ymax) {
  const B = P.bars[j], v = B.values, n = v.length;
  const cap = document.querySelector('figcaption[data-bar="' + canvas.dataset.plan + '-' + j + '"]');
  const mx = Math.max(...v);
  cap.textContent = B.label + ' · max/mean ' + (B.mean > 0 ? (mx / B.mean).toFixed(2) : '—') + ' · mean ' + fmtVal(B.mean, B.unit);
  function draw(ctx, w, h) {
    const ox = 40, oy = 6, W = w - ox - 6, H = h - oy - 16, bw = W / n, top = ymax > 0 ? ymax : 1;
    ctx.fillStyle = '#555'; ctx.textAlign = 'right';
    for (const t of ticks(top, 3)) { const y = oy + H - t / top * H; ctx.fillText(fmtTick(t, B.unit), ox - 4, y);
      ctx.fillStyle = '#eee'; ctx.fillRect(ox, y, W, 1); ctx.fillStyle = '#555'; }
    for (let d = 0; d < n; d++) { const bh = v[d] / top * H; ctx.fillStyle = PAL[d];
      ctx.fillRect(ox + d * bw + (bw > 4 ? 0.5 : 0), oy + H - bh, Math.max(1, bw - (bw > 4 ? 1 : 0)), bh); }
    const my = oy + H - B.mean / top * H; ctx.strokeStyle = '#000'; ctx.setLineDash([4, 3]); ctx.beginPath();
    ctx.moveTo(ox, my); ctx.lineTo(ox + W, my); ctx.stroke(); ctx.setLineDash([]);
    ctx.textAlign = 'center'; ctx.fillStyle = '#555';
    const every = Math.max(1, Math.ceil(n / Math.max(1, W / 26)));
    for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox + (d + 0.5) * bw, oy + H + 9);
    return {ox, bw};
  }
  function hit(x, y, g) { const d = Math.floor((x - g.ox) / g.bw); if (d < 0 || d >= n) return null;
    return 'd' + d + ' (node ' + Math.floor(d / P.dpn) + '): ' + fmtVal(v[d], B.unit) + '\n' +
      (B.mean > 0 ? (v[d] / B.mean).toFixed(3) + ' × mean (' + fmtVal(B.mean, B.unit) + ')' : 'mean 0'); }
  setup(canvas, () => 120, draw, hit);
}

// ---- heatmap ------------------------------------------------------------------------------
function heatPanel(canvas, P) {
  const C = P.comm, n = P.devices, tot = C.fwd.map((f, i) => f + C.bwd[i]);
  const mx = Math.max(1, ...tot), index = new Map();
  for (let i = 0; i < tot.length; i++) index.set(C.src[i] * n + C.dst[i], i);
  function colour(t) { const s = Math.sqrt(t / mx); // white → deep blue
    const r = Math.round(255 - s * (255 - 8)), g = Math.round(255 - s * (255 - 48)), b = Math.round(255 - s * (255 - 107));
    return 'rgb(' + r + ',' + g + ',' + b + ')'; }
  function draw(ctx, w) {
    const ox = 40, oy = 16, S = Math.max(40, Math.min(w - ox - 90, 480)), cs = S / n;
    ctx.fillStyle = '#fff'; ctx.fillRect(ox, oy, S, S);
    for (let i = 0; i < tot.length; i++) { if (!tot[i]) continue; ctx.fillStyle = colour(tot[i]);
      ctx.fillRect(ox + C.dst[i] * cs, oy + C.src[i] * cs, Math.max(1, cs), Math.max(1, cs)); }
    ctx.strokeStyle = '#888'; ctx.lineWidth = 1; ctx.strokeRect(ox, oy, S, S);
    if (P.nodes > 1) { ctx.strokeStyle = '#c62828'; ctx.beginPath();
      for (let k = 1; k < P.nodes; k++) { const p = k * P.dpn * cs; ctx.moveTo(ox + p, oy); ctx.lineTo(ox + p, oy + S);
        ctx.moveTo(ox, oy + p); ctx.lineTo(ox + S, oy + p); } ctx.stroke(); }
    ctx.fillStyle = '#555'; const every = Math.max(1, Math.ceil(n / (S / 22)));
    ctx.textAlign = 'right'; for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox - 4, oy + (d + 0.5) * cs);
    ctx.textAlign = 'center'; for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox + (d + 0.5) * cs, oy - 8);
    const lx = ox + S + 14; // colour scale
    for (let i = 0; i < 100; i++) { ctx.fillStyle = colour(mx * (1 - i / 99) ** 2); ctx.fillRect(lx, oy + i * S / 100, 12, S / 100 + 1); }
    ctx.textAlign = 'left'; ctx.fillStyle = '#555'; ctx.fillText(fmtBytes(mx), lx + 15, oy + 4); ctx.fillText('0', lx + 15, oy + S - 4);
    return {ox, oy, S, cs};
  }
  function hit(x, y, g) { const s = Math.floor((y - g.oy) / g.cs), d = Math.floor((x - g.ox) / g.cs);
    if (s < 0 || d < 0 || s >= n || d >= n) return null; const i = index.get(s * n + d);
    const link = Math.floor(s / P.dpn) === Math.floor(d / P.dpn) ? 'intra-node' : 'inter-node';
    if (i === undefined) return 'd' + s + ' → d' + d + ': nothing moves';
    return 'd' + s + ' → d' + d + ' (' + link + '): ' + fmtBytes(tot[i]) + ' in ' + C.count[i] + ' messages\nforward ' +
      fmtBytes(C.fwd[i]) + ', backward ' + fmtBytes(C.bwd[i]); }
  setup(canvas, w => Math.max(40, Math.min(w - 130, 480)) + 30, draw, hit);
}

// ---- timeline -----------------------------------------------------------------------------
function timelinePanel(canvas, P, phase, tmax) {
  const L = P.timeline[phase], S = L.spans, n = P.devices, rowH = Math.max(7, Math.min(18, Math.floor(640 / n)));
  const lanes = new Map(); // dev*4+lane -> span indices in time order
  for (let i = 0; i < S.dev.length; i++) { const k = S.dev[i] * 4 + S.lane[i]; if (!lanes.has(k)) lanes.set(k, []); lanes.get(k).push(i); }
  for (const a of lanes.values()) a.sort((x, y) => S.t0[x] - S.t0[y]);
  const LANE_Y = [[0, 0.62], [0, 0.62], [0.64, 0.8], [0.8, 0.96]];
  function colourOf(i) { const l = S.lane[i]; if (l === 1) return COL.wait; if (l === 2) return COL.send; if (l === 3) return COL.recv;
    return S.key[i] < 0 ? COL.merge : SPAL[S.key[i] % SPAL.length]; }
  function draw(ctx, w, h) {
    const ox = 44, oy = 4, W = w - ox - 10, sx = W / (tmax > 0 ? tmax : 1);
    for (let d = 0; d < n; d++) { if (d % 2) { ctx.fillStyle = '#f6f7f9'; ctx.fillRect(ox, oy + d * rowH, W, rowH); }
      ctx.fillStyle = PAL[d]; ctx.fillRect(ox - 8, oy + d * rowH + 1, 5, rowH - 2); }
    for (const lane of [0, 1, 2, 3]) for (let i = 0; i < S.dev.length; i++) { if (S.lane[i] !== lane) continue;
      const y = oy + S.dev[i] * rowH, [a, b] = LANE_Y[lane]; ctx.fillStyle = colourOf(i);
      ctx.fillRect(ox + S.t0[i] * sx, y + a * rowH, Math.max(1, (S.t1[i] - S.t0[i]) * sx), Math.max(1, (b - a) * rowH)); }
    if (P.nodes > 1) { ctx.fillStyle = '#c62828'; for (let k = 1; k < P.nodes; k++) ctx.fillRect(ox - 10, oy + k * P.dpn * rowH - 0.5, W + 10, 1); }
    ctx.fillStyle = '#000'; ctx.fillRect(ox + L.makespan * sx, oy, 1, n * rowH);
    ctx.fillStyle = '#555'; ctx.textAlign = 'right'; const every = Math.max(1, Math.ceil(12 / rowH));
    for (let d = 0; d < n; d += every) ctx.fillText('d' + d, ox - 10, oy + (d + 0.5) * rowH);
    ctx.textAlign = 'center'; const yT = oy + n * rowH;
    for (const t of ticks(tmax, 6)) { ctx.fillRect(ox + t * sx, yT, 1, 4); ctx.fillText(fmtTime(t), ox + t * sx, yT + 11); }
    ctx.textAlign = 'left'; ctx.fillText('makespan ' + fmtTime(L.makespan), Math.min(ox + L.makespan * sx + 4, ox + W - 110), yT + 24);
    return {ox, oy, sx};
  }
  function spanText(i) {
    const l = S.lane[i], d = S.dev[i], many = S.n[i] > 1, when = fmtTime(S.t0[i]) + ' – ' + fmtTime(S.t1[i]);
    const agg = many ? '\n(aggregated: events less than ' + fmtTime(L.eps) + ' apart are merged)' : '';
    if (l === 0 && S.key[i] < 0) return (many ? S.n[i] + ' merges/adds' : 'merge/add') + ' of incoming partials on d' + d +
      '\n' + when + ', busy ' + fmtTime(S.busy[i]) + agg;
    if (l === 0) return (many ? S.n[i] + ' compute blocks c' + S.a[i] + '…c' + S.b[i] : 'compute block c' + S.a[i]) +
      ' on d' + d + ' · stage ' + S.key[i] + '\n' + when + ', busy ' + fmtTime(S.busy[i]) + agg;
    const kind = S.kind[i] >= 0 ? KINDS[S.kind[i]] : 'mixed', blk = S.tb[i] >= 0 ? ' tb' + S.tb[i] : ' blocks';
    if (l === 1) return many ? 'd' + d + ' waits ' + S.n[i] + ' times, ' + fmtTime(S.busy[i]) + ' idle (messages m' + S.a[i] + '…m' + S.b[i] + ')\n' + when + agg
      : 'd' + d + ' waits ' + fmtTime(S.busy[i]) + ' on m' + S.a[i] + ' (' + kind + blk + ', peer d' + S.peer[i] + ')\n' + when;
    const dir = l === 2 ? 'out' : 'in', arrow = (p) => l === 2 ? 'd' + d + ' → ' + p : p + ' → d' + d;
    const peer = S.peer[i] >= 0 ? 'd' + S.peer[i] : 'several devices';
    if (!many) return 'm' + S.a[i] + ' ' + kind + blk + ' ' + arrow(peer) + ', ' + fmtBytes(S.bytes[i]) + '\n' + when;
    return S.n[i] + ' messages ' + dir + ' (' + arrow(peer) + '), ' + fmtBytes(S.bytes[i]) + ', kinds ' + kind + '\n' + when + agg;
  }
  function hit(x, y, g) {
    const d = Math.floor((y - g.oy) / rowH); if (d < 0 || d >= n) return null;
    const f = (y - g.oy) / rowH - d, t = (x - g.ox) / g.sx, tol = 2 / g.sx;
    const order = f < 0.63 ? [1, 0] : f < 0.8 ? [2] : [3];
    for (const lane of order) { const a = lanes.get(d * 4 + lane); if (!a) continue;
      let lo = 0, hi = a.length - 1, j = -1; while (lo <= hi) { const m = (lo + hi) >> 1; if (S.t0[a[m]] <= t + tol) { j = m; lo = m + 1; } else hi = m - 1; }
      for (let k = j; k >= 0 && k > j - 4; k--) if (S.t1[a[k]] >= t - tol) return spanText(a[k]); }
    return 'd' + d + ' at ' + fmtTime(Math.max(0, t)) + ': idle' + (t > L.finish[d] ? ' (finished at ' + fmtTime(L.finish[d]) + ')' : '') +
      '\ncompute ' + fmtTime(L.compute[d]) + ', waiting ' + fmtTime(L.wait[d]) + ' in ' + phase;
  }
  setup(canvas, () => n * rowH + 34, draw, hit);
}

// shared scales across plans (compare mode)
const barMax = D.plans[0].bars.map((_, j) => Math.max(...D.plans.map(p => Math.max(...p.bars[j].values, p.bars[j].mean))));
const tMax = {fwd: Math.max(...D.plans.map(p => p.timeline.fwd.makespan)), bwd: Math.max(...D.plans.map(p => p.timeline.bwd.makespan))};
document.querySelectorAll('canvas.mask').forEach(c => maskPanel(c, D.plans[+c.dataset.plan]));
document.querySelectorAll('canvas.bar').forEach(c => barPanel(c, D.plans[+c.dataset.plan], +c.dataset.metric, barMax[+c.dataset.metric]));
document.querySelectorAll('canvas.heat').forEach(c => heatPanel(c, D.plans[+c.dataset.plan]));
document.querySelectorAll('canvas.timeline').forEach(c => timelinePanel(c, D.plans[+c.dataset.plan], c.dataset.phase, tMax[c.dataset.phase]));
let pending = 0;
window.addEventListener('resize', () => { cancelAnimationFrame(pending); pending = requestAnimationFrame(() => renders.forEach(r => r())); });
// for tests and scripts: client coordinates of token (q, k) on a plan's mask canvas
window.attnplan = {data: D, rendered: renders.length, maskPoint(plan, q, k) {
  const c = document.querySelectorAll('canvas.mask')[plan], g = c._geom, b = c.getBoundingClientRect();
  return {x: b.left + g.ox + (k + 0.5) * g.sc, y: b.top + g.oy + (q + 0.5) * g.sc}; }};
})();
