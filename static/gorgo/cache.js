/* Cache: prefix-cache hit rate and KV usage per node over time; routed vs hit tokens per node. */
(function () {
  "use strict";
  const G = window.Gorgo;
  const { fleet } = G.page;
  const state = { window: G.page.window, data: null, live: new Map() }; // live: nodeId -> [{t, hit_rate, kv}]

  // Not regions, not TTFT parts: neutral tones so they are not mistaken for either.
  const ROUTED = { routed: "#5A6270", expected: "#9FA7B3", hit: "#E6E7E9" };
  const windowLabel = () => G.page.windows[state.window].label;

  function pointsOf(nodeId) {
    const base = (state.data && state.data.series[String(nodeId)]) || [];
    const extra = state.live.get(String(nodeId)) || [];
    const last = base.length ? base[base.length - 1].t : 0;
    return base.concat(extra.filter((p) => p.t > last));
  }

  function renderLines(id, field, title) {
    const now = Date.now() / 1000;
    const seconds = G.page.windows[state.window].seconds;
    let any = false;
    const traces = fleet.nodes.map((node) => {
      const style = G.nodeStyle(node.id);
      const points = pointsOf(node.id).filter((p) => p.t >= now - seconds);
      if (points.some((p) => p[field] !== null && p[field] !== undefined)) any = true;
      return {
        type: "scatter", mode: "lines", name: node.name, x: points.map((p) => G.toDate(p.t)),
        y: points.map((p) => (p[field] === null || p[field] === undefined ? null : p[field] * 100)),
        line: { color: style.color, dash: style.dash, width: 1.8 }, connectgaps: false,
        hovertemplate: `${node.name} %{y:.1f} %<extra></extra>`,
      };
    });
    G.plot(id, traces, G.layout({
      xaxis: G.timeAxis([G.toDate(now - seconds), G.toDate(now)]),
      yaxis: G.valueAxis(title, { range: [0, 100], rangemode: "normal", ticksuffix: "" }),
    }), any ? null : `No metrics scraped in the last ${windowLabel()}`);
  }

  function renderRouted() {
    const routed = (state.data && state.data.routed) || {};
    const nodes = fleet.nodes.filter((n) => routed[String(n.id)] && routed[String(n.id)].prompt_tokens > 0);
    const x = nodes.map((n) => n.name);
    const ticktext = nodes.map((n) => `<span style="color:${G.nodeStyle(n.id).color}">${n.name}</span>`);
    const pick = (field) => nodes.map((n) => routed[String(n.id)][field]);
    const prompt = pick("prompt_tokens");
    const expected = pick("predicted_cached_tokens");
    // null: the node reported no cached_tokens and no prefix-cache counters either: no bar, not 0 %.
    const hitShare = pick("cached_tokens").map((v, i) => (v === null || !prompt[i] ? null : v / prompt[i]));
    const sources = pick("cached_source").map((s) => (s && s !== "usage" ? " (from vLLM's prefix-cache counters)" : ""));
    const traces = [
      { type: "bar", name: "routed prompt tokens", x, y: prompt, marker: { color: ROUTED.routed },
        hovertemplate: "routed %{y:,} tokens<extra></extra>" },
      { type: "bar", x, y: expected,
        // Only cache-aware algorithms predict hits; say so instead of drawing an unexplained gap.
        name: expected.some((v) => v > 0) ? "expected cached (router)" : "expected cached (router): none predicted",
        marker: { color: "#2a2e34", pattern: { shape: "/", fgcolor: ROUTED.expected, bgcolor: "#2a2e34", size: 6, solidity: 0.45 } },
        hovertemplate: "router expected %{y:,} cached<extra></extra>" },
      { type: "bar", name: "cached on the node (hit)", x, y: pick("cached_tokens"), marker: { color: ROUTED.hit },
        text: hitShare.map((s) => (s === null ? "not reported" : `${(s * 100).toFixed(0)} %`)), textposition: "outside", textfont: { size: 10.5, color: "#d8d9da" },
        customdata: sources,
        cliponaxis: false, hovertemplate: "cached on node %{y:,} tokens (%{text} of routed)%{customdata}<extra></extra>" },
    ];
    G.plot("routed-vs-hit", traces, G.layout({
      barmode: "group", bargap: 0.3, bargroupgap: 0.06,
      xaxis: { type: "category", tickmode: "array", tickvals: x, ticktext },
      yaxis: G.valueAxis("prompt tokens", { tickformat: "~s" }),
    }), nodes.length ? null : `No traffic in the last ${windowLabel()}`);
  }

  function render() {
    renderLines("hit-rate", "hit_rate", "hit rate (%)");
    renderLines("kv-usage", "kv_cache_usage", "KV-cache usage (%)");
    renderRouted();
  }

  async function refresh() {
    const requested = state.window;
    try {
      const data = await G.getJSON(G.page.urls.cache, { window: requested });
      if (requested !== state.window) return;
      state.data = data;
      state.live = new Map();
    } catch (e) {
      console.warn("gorgo: cache data unavailable", e);
      return;
    }
    render();
  }
  const throttled = G.throttle(refresh, 10000);
  // A day merges ~13k buckets (~0.7 s of server time): the minute timer is enough there.
  const refreshSoon = () => { if (state.window !== "24h") throttled(); };

  G.windowPicker((key) => { state.window = key; state.data = null; state.live = new Map(); render(); refresh(); });
  render();
  refresh();
  setInterval(refresh, 60000);
  G.live({
    "telemetry.nodes"(message) {
      for (const cell of message.nodes) {
        if (!cell.scrape_ok) continue;
        const id = String(cell.node_id);
        if (!state.live.has(id)) state.live.set(id, []);
        state.live.get(id).push({ t: message.ts, hit_rate: cell.prefix_hit_rate, kv_cache_usage: cell.kv_cache_usage });
      }
      renderLines("hit-rate", "hit_rate", "hit rate (%)");
      renderLines("kv-usage", "kv_cache_usage", "KV-cache usage (%)");
    },
    "telemetry.aggregates": refreshSoon,
    reconnected: refresh,
  });
})();
