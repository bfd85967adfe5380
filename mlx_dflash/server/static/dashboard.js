// mlx-dflash dashboard: polls /v1/stats, draws its charts, streams a chat. Every piece of
// model or request text goes in with textContent, never as HTML.
"use strict";

const ORIGINS = ["target", "drafter", "copy", "ngram", "tree", "forced"];
const WINDOW_S = 600;
let apiKey = sessionStorage.getItem("mlx-dflash-key") || "";
let polling = null;

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

class KeyNeeded extends Error {}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const response = await fetch(path, opts);
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("key-error").textContent = apiKey ? "that key was refused" : "";
    throw new KeyNeeded();
  }
  return response;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = el("tr");
    for (const cell of cells) tr.appendChild(el("td", cell));
    return tr;
  }));
}

function renderModels(stats) {
  const names = Object.keys(stats.models);
  fillRows($("models").tBodies[0], names.map((name) => {
    const m = stats.models[name];
    const cache = Object.entries(m.prefix_cache || {}).map(([k, v]) => k + " " + bytes(v)).join(", ");
    let now = m.decoding ? "decoding" : "";
    if (m.decoding && m.last_pass) now += ` (${m.last_pass[0]} rows x ${m.last_pass[1]} tokens)`;
    return [name, m.loaded ? (m.pinned ? "yes, pinned" : "yes") : "no", m.drafter || "none (target alone)",
            m.block_size || "auto", m.context, bytes(m.weights_bytes), cache || "-", now];
  }));
  const select = $("chat-model");
  if (select.options.length !== names.length) {
    select.replaceChildren(...names.map((n) => { const o = el("option", n); o.value = n; return o; }));
  }
  const mem = stats.memory || {};
  $("machine").textContent = `memory: active ${bytes(mem.active)}, peak ${bytes(mem.peak)}, ` +
    `buffer cache ${bytes(mem.cache)}` + (mem.limit ? `, limit ${bytes(mem.limit)}` : "") +
    ` · kernels: ${stats.kernels}`;
  $("server").textContent = `v${stats.version} · up ${Math.round(stats.uptime_s)} s`;
}

function renderRequests(stats) {
  const rows = stats.requests.map((r) => [
    r.id, r.model || "(default)", r.endpoint, r.state, r.prompt_tokens, r.cached_tokens ?? "",
    r.generated ?? "", r.tokens_per_second ?? "", r.mean_acceptance ?? "", r.last_drafts ?? "",
    Object.entries(r.by_source || {}).map(([k, v]) => k + " " + v).join(", "),
  ]);
  fillRows($("requests").tBodies[0], rows);
  $("counts").textContent = `${stats.running} running, ${stats.waiting} waiting`;
  const t = stats.totals || {};
  const sum = (m) => Object.values(t[m] || {}).reduce((a, b) => a + b, 0);
  const accepted = Object.entries(t.accepted_tokens || {}).map(([k, v]) => `${k.split("source=")[1]} ${v}`);
  $("totals").textContent = `since start: ${sum("requests")} requests, ${sum("generated_tokens")} ` +
    `tokens generated, ${sum("prompt_tokens")} prompt tokens (${sum("cached_tokens")} from the ` +
    `prefix cache)` + (accepted.length ? `; accepted drafts: ${accepted.join(", ")}` : "");
}

function series(history) {
  // Per interval between samples: tokens/s, and tokens per target pass where passes ran.
  const rate = [], perPass = [];
  for (let i = 1; i < history.length; i++) {
    const [t0, tok0, pass0] = history[i - 1], [t1, tok1, pass1] = history[i];
    const dt = t1 - t0;
    if (dt <= 0) continue;
    rate.push([t1, (tok1 - tok0) / dt]);
    if (pass1 > pass0) perPass.push([t1, (tok1 - tok0) / (pass1 - pass0)]);
  }
  return [rate, perPass];
}

function draw(svg, points, now, label) {
  const W = 600, H = 140, pad = 4;
  const ymax = Math.max(1, ...points.map((p) => p[1])) * 1.1;
  const x = (t) => W - (now - t) / WINDOW_S * W;
  const y = (v) => H - pad - v / ymax * (H - 2 * pad);
  const NS = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(NS, "polyline");
  line.setAttribute("points", points.filter((p) => now - p[0] <= WINDOW_S)
    .map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "));
  const axis = document.createElementNS(NS, "text");
  axis.setAttribute("x", "4"); axis.setAttribute("y", "14");
  axis.textContent = (ymax / 1.1).toFixed(1);
  svg.replaceChildren(line, axis);
  svg.dataset.points = String(points.length);
  $(label).textContent = points.length ? points[points.length - 1][1].toFixed(1) : "";
}

function renderCharts(stats) {
  const history = stats.history || [];
  const now = history.length ? history[history.length - 1][0] : Date.now() / 1000;
  const [rate, perPass] = series(history);
  draw($("chart-rate"), rate, now, "rate-now");
  draw($("chart-per-pass"), perPass, now, "per-pass-now");
}

async function poll() {
  try {
    const stats = await (await api("/v1/stats")).json();
    $("key-form").hidden = true;
    renderModels(stats);
    renderRequests(stats);
    renderCharts(stats);
  } catch (e) {
    if (!(e instanceof KeyNeeded)) $("server").textContent = "server unreachable: " + e.message;
  }
}

function appendPiece(origin, text) {
  const reply = $("chat-reply");
  const cls = "o-" + (ORIGINS.includes(origin) ? origin : "target");
  const last = reply.lastElementChild;
  if (last && last.className === cls) last.textContent += text;
  else reply.appendChild(el("span", text, cls));
}

async function sendChat(event) {
  event.preventDefault();
  const prompt = $("chat-input").value;
  if (!prompt.trim()) return;
  if (!$("chat-model").value) {
    $("chat-stats").textContent = "no model known yet: waiting for the server";
    return;
  }
  $("chat-send").disabled = true;
  $("chat-reply").replaceChildren();
  $("chat-reply").dataset.done = "false";
  $("chat-stats").textContent = "";
  const body = {
    model: $("chat-model").value,
    messages: [{ role: "user", content: prompt }],
    max_tokens: Number($("chat-max").value) || 256,
    temperature: Number($("chat-temp").value) || 0,
    stream: true,
    token_origins: true,
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" },
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      $("chat-stats").textContent = "error: " + ((err.error && err.error.message) || response.status);
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          for (const [origin, text] of chunk.origins || []) appendPiece(origin, text);
          if (chunk.error) $("chat-stats").textContent = "error: " + chunk.error.message;
          if (chunk.dflash) {
            const d = chunk.dflash;
            $("chat-stats").textContent = `${d.tokens_per_second} tokens/s · ` +
              `${d.mean_acceptance_length} tokens per target pass · ${d.cycles} passes`;
          }
        }
      }
    }
  } catch (e) {
    if (!(e instanceof KeyNeeded)) $("chat-stats").textContent = "error: " + e.message;
  } finally {
    $("chat-send").disabled = false;
    $("chat-reply").dataset.done = "true";
  }
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = $("key").value.trim();
    sessionStorage.setItem("mlx-dflash-key", apiKey);
    poll();
  });
  $("chat-form").addEventListener("submit", sendChat);
  poll();
  polling = setInterval(poll, 1000);
}

document.addEventListener("DOMContentLoaded", start);
