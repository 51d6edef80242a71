/* Nodes: fill the live columns of the server-rendered table and keep them current. */
(function () {
  "use strict";
  const G = window.Gorgo;
  const RTT_WORST_MS = 300;
  const STALE_SCRAPE_S = 30; // several scrape intervals without a scrape: say so
  const nodes = new Map(Object.entries(G.page.live.nodes)); // id -> live doc
  const rtt = new Map(G.page.live.rtt.map((e) => [`${e.region}|${e.node_id}`, e]));

  function row(nodeId) { return document.querySelector(`tr[data-node-id="${nodeId}"]`); }

  function setHealth(tr, health) {
    const badge = tr.querySelector('[data-field="health"]');
    badge.className = `badge health-${health}`;
    badge.textContent = health;
  }

  function renderNode(nodeId) {
    const tr = row(nodeId);
    const live = nodes.get(String(nodeId));
    if (!tr || !live) return;
    const cell = (field) => tr.querySelector(`[data-field="${field}"]`);
    cell("num_running").textContent = G.fmt.num(live.num_running);
    cell("num_waiting").textContent = G.fmt.num(live.num_waiting);
    const kv = live.kv_cache_usage;
    cell("kv_cache_usage").querySelector(".bar-fill").style.width = kv === null || kv === undefined ? "0" : `${Math.min(100, kv * 100)}%`;
    cell("kv_cache_usage").querySelector(".bar-fill").style.background = kv > 0.9 ? "#F2495C" : kv > 0.75 ? "#FF9830" : "#5794F2";
    cell("kv_cache_usage").querySelector(".bar-text").textContent = kv === null || kv === undefined ? "—" : `${G.fmt.pct(kv)} %`;
    const hit = live.prefix_hit_rate;
    cell("prefix_hit_rate").textContent = hit === null || hit === undefined ? "—" : `${G.fmt.pct(hit)} %`;
    if (live.health) setHealth(tr, live.health);
  }

  function renderRTT(region, nodeId) {
    const tr = row(nodeId);
    const entry = rtt.get(`${region}|${nodeId}`);
    if (!tr || !entry) return;
    const td = tr.querySelector(`[data-rtt-region="${region}"]`);
    if (!td) return;
    td.textContent = `${G.fmt.ms(entry.rtt_ms)} ms`;
    td.style.color = G.latencyColor(entry.rtt_ms, RTT_WORST_MS);
    td.title = `EWMA ${G.fmt.ms(entry.rtt_ms)} ms ± ${G.fmt.ms(entry.jitter_ms)} ms jitter`;
  }

  function renderAges() {
    const now = Date.now() / 1000;
    for (const [id, live] of nodes) {
      const tr = row(id);
      if (!tr) continue;
      const td = tr.querySelector('[data-field="scrape_age"]');
      const age = live.last_scrape_at ? now - live.last_scrape_at : null;
      td.textContent = age === null ? "never" : G.fmt.age(age);
      td.classList.toggle("cell-stale", age === null || age > STALE_SCRAPE_S || !!live.scrape_error);
      td.title = live.scrape_error ? `last scrape failed: ${live.scrape_error}` : "since the last successful /metrics scrape";
    }
  }

  for (const id of nodes.keys()) renderNode(id);
  for (const e of rtt.values()) renderRTT(e.region, e.node_id);
  renderAges();
  setInterval(renderAges, 1000);

  G.live({
    "telemetry.nodes"(message) {
      for (const c of message.nodes) {
        const id = String(c.node_id);
        const live = Object.assign(nodes.get(id) || { node_id: c.node_id }, {
          healthy: c.healthy, num_running: c.num_running, num_waiting: c.num_waiting,
          kv_cache_usage: c.kv_cache_usage, prefix_hit_rate: c.prefix_hit_rate,
        });
        if (c.scrape_ok) live.last_scrape_at = message.ts;
        live.scrape_error = c.scrape_ok ? "" : c.error || "scrape failed";
        nodes.set(id, live);
        renderNode(id);
      }
      renderAges();
    },
    "telemetry.rtt"(message) {
      for (const c of message.cells) {
        if (c.rtt_ms === null || c.rtt_ms === undefined) continue;
        rtt.set(`${message.region}|${c.node_id}`, { region: message.region, node_id: c.node_id, rtt_ms: c.rtt_ms, jitter_ms: c.jitter_ms });
        renderRTT(message.region, c.node_id);
      }
    },
    "telemetry.health"(message) {
      const id = String(message.node_id);
      const live = nodes.get(id) || { node_id: message.node_id };
      live.health = message.current;
      nodes.set(id, live);
      const tr = row(id);
      if (tr) setHealth(tr, message.current);
    },
  });
})();
