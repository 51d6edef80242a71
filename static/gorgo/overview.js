/* Overview: headline strip, latency map, RTT matrix, TTFT and request-rate series (live). */
(function () {
  "use strict";
  const G = window.Gorgo;
  const { fleet } = G.page;
  const WINDOW_S = 15 * 60;
  const BUCKET_S = 10;
  const RTT_WORST_MS = 300; // the red end of the RTT colour scale
  const TTFT_WORST_MS = 1000; // the red end of the TTFT colour scale (fixed: a colour keeps its meaning)

  const state = {
    rtt: new Map(), // "region|nodeId" -> {rtt_ms, jitter_ms, samples}
    healthy: new Map(), // nodeId -> bool
    overview: null, // /data/overview/
    series: new Map(), // region -> Map(bucket start -> bucket)
    policy: G.page.policy,
  };

  for (const entry of G.page.live.rtt) state.rtt.set(`${entry.region}|${entry.node_id}`, entry);
  for (const node of Object.values(G.page.live.nodes)) {
    if (node.healthy !== undefined) state.healthy.set(String(node.node_id), node.healthy);
  }

  // ------------------------------------------------------------ headline
  function setStat(id, value, tone) {
    const el = document.querySelector(`#stat-${id} .v`);
    el.textContent = value;
    el.classList.remove("good", "warn", "bad", "none");
    if (value === "—") el.classList.add("none");
    else if (tone) el.classList.add(tone);
  }

  function renderHeadline() {
    const h = state.overview ? state.overview.headline : null;
    const none = !h || !h.rate_rps;
    setStat("ttft-p50", none ? "—" : G.fmt.ms(h.ttft_p50_ms));
    setStat("ttft-p99", none ? "—" : G.fmt.ms(h.ttft_p99_ms));
    setStat("rate", h ? G.fmt.rate(h.rate_rps) : "—");
    // The fleet's failures (5xx, no answer); clients' own 4xx are shown apart, never as errors.
    const errorRate = none ? null : h.error_rate;
    setStat("errors", G.fmt.pct(errorRate, 2), errorRate === null ? null : errorRate > 0.05 ? "bad" : errorRate > 0.01 ? "warn" : "good");
    document.querySelector("#stat-errors .stat-sub").textContent =
      none ? "5xx · last 1 min" : `5xx · last 1 min · 4xx ${G.fmt.pct(h.client_error_rate, 2)}%`;
    setStat("hit", h ? G.fmt.pct(h.hit_rate) : "—");
    if (state.overview) {
      const sub = none ? "no traffic in the last minute" : "last 1 min · all gateways";
      document.querySelector("#stat-ttft-p50 .stat-sub").textContent = sub;
      document.querySelector("#stat-ttft-p99 .stat-sub").textContent = sub;
    }
    renderPolicy();
  }

  function renderPolicy() {
    const p = state.policy;
    const name = document.getElementById("policy-name");
    if (!p) return;
    name.textContent = p.name;
    name.href = `/policies/${p.id}/`;
    document.getElementById("policy-version").textContent = `v${p.version}`;
    const ago = p.published_at ? G.fmt.age(Date.now() / 1000 - p.published_at) + " ago" : "";
    document.getElementById("policy-sub").textContent = `${p.algorithm} · by ${p.author} ${ago}`;
  }

  // ------------------------------------------------------------ map
  function nodePositions() {
    // Nodes sit on a small ring around their region's marker, so each link has its own line.
    const positions = new Map();
    for (const region of fleet.regions) {
      const nodes = fleet.nodes.filter((n) => n.region === region.slug);
      nodes.forEach((node, i) => {
        // Fanned out below the region marker, clear of its label above.
        const angle = -Math.PI / 2 + (i - (nodes.length - 1) / 2) * (Math.PI / 3.5);
        const r = 7;
        positions.set(String(node.id), {
          lat: region.lat + r * Math.sin(angle),
          lon: region.lon + (r * Math.cos(angle)) / Math.cos((region.lat * Math.PI) / 180),
        });
      });
    }
    return positions;
  }

  function geoRanges() {
    const lats = fleet.regions.map((r) => r.lat), lons = fleet.regions.map((r) => r.lon);
    if (!lats.length) return { lat: [-50, 75], lon: [-170, 180] };
    const lonPad = Math.max(25, (Math.max(...lons) - Math.min(...lons)) * 0.15);
    return {
      lat: [Math.max(-60, Math.min(...lats) - 22), Math.min(80, Math.max(...lats) + 22)],
      lon: [Math.max(-180, Math.min(...lons) - lonPad), Math.min(180, Math.max(...lons) + lonPad)],
    };
  }

  // d3-geo fills the smaller side of a clockwise ring; a counter-clockwise one would fill the globe.
  function clockwise(points) {
    let sum = 0;
    for (let i = 0; i < points.length - 1; i++) sum += (points[i + 1][0] - points[i][0]) * (points[i + 1][1] + points[i][1]);
    return sum > 0 ? points : points.slice().reverse();
  }

  function landTraces() {
    const world = window.GORGO_WORLD || { land: [], water: [] };
    const ring = (raw, fill, line) => {
      const points = clockwise(raw);
      return {
      type: "scattergeo", mode: "lines", lon: points.map((p) => p[0]), lat: points.map((p) => p[1]),
      fill: "toself", fillcolor: fill, line: { color: line, width: 0.6 }, hoverinfo: "skip", showlegend: false,
      };
    };
    return [...world.land.map((p) => ring(p, "#23272e", "#30353d")), ...world.water.map((p) => ring(p, "#14161b", "#30353d"))];
  }

  // Links are drawn as great circles: put each link's hover point on its arc, not on the chord.
  function greatCircleMidpoint(lon1, lat1, lon2, lat2) {
    const rad = Math.PI / 180;
    const v = (lon, lat) => [Math.cos(lat * rad) * Math.cos(lon * rad), Math.cos(lat * rad) * Math.sin(lon * rad), Math.sin(lat * rad)];
    const a = v(lon1, lat1), b = v(lon2, lat2);
    const m = [a[0] + b[0], a[1] + b[1], a[2] + b[2]];
    return [Math.atan2(m[1], m[0]) / rad, Math.atan2(m[2], Math.hypot(m[0], m[1])) / rad];
  }

  function renderMap() {
    const positions = nodePositions();
    const regionFigures = (state.overview && state.overview.regions) || {};
    const traces = landTraces();
    const mid = { lon: [], lat: [], text: [], color: [] };
    // Links region -> node, coloured by the live RTT.
    for (const region of fleet.regions) {
      for (const node of fleet.nodes) {
        const pos = positions.get(String(node.id));
        const entry = state.rtt.get(`${region.slug}|${node.id}`);
        const rtt = entry ? entry.rtt_ms : null;
        const color = G.latencyColor(rtt, RTT_WORST_MS);
        traces.push({
          type: "scattergeo", mode: "lines", lon: [region.lon, pos.lon], lat: [region.lat, pos.lat],
          line: { color, width: region.slug === node.region ? 2.5 : 1.4 }, opacity: entry ? 0.85 : 0.25,
          hoverinfo: "skip", showlegend: false,
        });
        const [midLon, midLat] = greatCircleMidpoint(region.lon, region.lat, pos.lon, pos.lat);
        mid.lon.push(midLon);
        mid.lat.push(midLat);
        mid.color.push(color);
        mid.text.push(entry
          ? `${region.slug} → ${node.name}: <b>${G.fmt.ms(rtt)} ms</b> ± ${G.fmt.ms(entry.jitter_ms)}`
          : `${region.slug} → ${node.name}: not measured yet`);
      }
    }
    traces.push({
      type: "scattergeo", mode: "markers", lon: mid.lon, lat: mid.lat, text: mid.text, hoverinfo: "text",
      marker: { size: 5, color: mid.color, opacity: 0.9 }, showlegend: false, name: "rtt",
    });
    // Nodes: region colour; a red cross when unhealthy.
    const nodes = fleet.nodes.map((n) => ({ n, pos: positions.get(String(n.id)), healthy: state.healthy.get(String(n.id)) }));
    traces.push({
      type: "scattergeo", mode: "markers", name: "nodes", showlegend: false,
      lon: nodes.map((x) => x.pos.lon), lat: nodes.map((x) => x.pos.lat),
      text: nodes.map((x) => `${x.n.name} (${x.n.region}) · ${x.n.state} · ${x.healthy === false ? "unhealthy" : x.healthy ? "healthy" : "health unknown"}`),
      hoverinfo: "text",
      marker: {
        size: 9,
        symbol: nodes.map((x) => (x.healthy === false ? "x" : "square")),
        color: nodes.map((x) => (x.healthy === false ? "#F2495C" : G.nodeStyle(x.n.id).color)),
        line: { color: "#111217", width: 1 },
      },
    });
    // Regions (gateways): size by request rate, colour by TTFT p50.
    const rates = fleet.regions.map((r) => (regionFigures[r.slug] || {}).rate_rps || 0);
    const p50s = fleet.regions.map((r) => (regionFigures[r.slug] || {}).ttft_p50_ms ?? null);
    const maxRate = Math.max(1, ...rates);
    traces.push({
      type: "scattergeo", mode: "markers+text", name: "regions", showlegend: false,
      lon: fleet.regions.map((r) => r.lon), lat: fleet.regions.map((r) => r.lat),
      text: fleet.regions.map((r, i) => (p50s[i] === null ? r.slug : `${r.slug} · ${G.fmt.ms(p50s[i])} ms`)),
      textposition: "top center", textfont: { color: "#e8e8e8", size: 12 },
      hovertext: fleet.regions.map((r, i) => `<b>${r.name}</b><br>${G.fmt.rate(rates[i])} req/s · TTFT p50 ${p50s[i] === null ? "—" : G.fmt.ms(p50s[i]) + " ms"}`),
      hoverinfo: "text",
      marker: {
        size: rates.map((rate) => 16 + 26 * Math.sqrt(rate / maxRate)),
        color: p50s.map((v) => (v === null ? 0 : v)),
        cmin: 0, cmax: TTFT_WORST_MS, colorscale: [[0, "#73BF69"], [0.5, "#FADE2A"], [1, "#F2495C"]],
        showscale: true,
        colorbar: { title: { text: "TTFT p50<br>(ms)", font: { size: 10.5 } }, thickness: 8, len: 0.5, y: 0.72, x: 1.0, tickfont: { size: 10 }, outlinewidth: 0 },
        line: { color: fleet.regions.map((r) => G.regionColor(r.slug)), width: 3 },
        opacity: p50s.map((v) => (v === null ? 0.55 : 0.95)),
      },
    });
    // An invisible trace carrying the RTT colour bar.
    traces.push({
      type: "scattergeo", mode: "markers", lon: [fleet.regions[0] ? fleet.regions[0].lon : 0], lat: [fleet.regions[0] ? fleet.regions[0].lat : 0],
      hoverinfo: "skip", showlegend: false,
      marker: {
        size: 0.1, opacity: 0, color: [0], cmin: 0, cmax: RTT_WORST_MS, colorscale: [[0, "#73BF69"], [0.5, "#FADE2A"], [1, "#F2495C"]],
        showscale: true,
        colorbar: { title: { text: "RTT<br>(ms)", font: { size: 10.5 } }, thickness: 8, len: 0.4, y: 0.2, x: 1.0, tickfont: { size: 10 }, outlinewidth: 0 },
      },
    });
    const ranges = geoRanges();
    G.plot("map", traces, G.layout({
      margin: { l: 0, r: 0, t: 0, b: 0 },
      hovermode: "closest",
      geo: {
        projection: { type: "natural earth" },
        lataxis: { range: ranges.lat, showgrid: true, gridcolor: "#1d2026", dtick: 15 },
        lonaxis: { range: ranges.lon, showgrid: true, gridcolor: "#1d2026", dtick: 15 },
        showland: false, showocean: false, showcoastlines: false, showcountries: false, showlakes: false,
        showrivers: false, showsubunits: false, showframe: false, bgcolor: "rgba(0,0,0,0)",
      },
    }), fleet.regions.length ? null : "No regions configured yet.");
  }

  // ------------------------------------------------------------ RTT matrix
  function renderMatrix() {
    const x = fleet.nodes.map((n) => n.name);
    const y = fleet.regions.map((r) => r.slug);
    const z = [], text = [], custom = [];
    let any = false;
    for (const region of fleet.regions) {
      const row = [], rowText = [], rowCustom = [];
      for (const node of fleet.nodes) {
        const e = state.rtt.get(`${region.slug}|${node.id}`);
        any = any || !!e;
        row.push(e ? e.rtt_ms : null);
        rowText.push(e ? G.fmt.ms(e.rtt_ms) : "");
        rowCustom.push(e ? `± ${G.fmt.ms(e.jitter_ms)} ms jitter, ${e.samples} samples` : "not measured");
      }
      z.push(row); text.push(rowText); custom.push(rowCustom);
    }
    G.plot("rtt-matrix", [{
      type: "heatmap", x, y, z, text, customdata: custom, texttemplate: "%{text}", textfont: { size: 11, color: "#111217" },
      zmin: 0, zmax: RTT_WORST_MS, colorscale: [[0, "#73BF69"], [0.5, "#FADE2A"], [1, "#F2495C"]], showscale: false,
      xgap: 2, ygap: 2, hovertemplate: "%{y} → %{x}<br><b>%{z:.1f} ms</b> %{customdata}<extra></extra>",
    }], G.layout({
      margin: { l: 80, r: 8, t: 8, b: 70 },
      hovermode: "closest",
      xaxis: { tickangle: -35, side: "bottom", title: { text: "node", font: { size: 11 } }, showgrid: false },
      yaxis: { autorange: "reversed", title: { text: "from region", font: { size: 11 } }, showgrid: false },
    }), any ? null : "No RTT probes yet: is the telemetry worker running?");
  }

  // ------------------------------------------------------------ series
  function loadSeries(series) {
    state.series = new Map();
    for (const [region, buckets] of Object.entries(series || {})) {
      state.series.set(region, new Map(buckets.map((b) => [b.t, b])));
    }
  }

  function renderSeries() {
    const now = Date.now() / 1000;
    const since = now - WINDOW_S;
    const xRange = [G.toDate(since), G.toDate(now)];
    const ttft = [], rate = [];
    let any = false;
    for (const region of fleet.regions) {
      const buckets = [...(state.series.get(region.slug) || new Map()).values()].filter((b) => b.t >= since - BUCKET_S).sort((a, b) => a.t - b.t);
      if (buckets.some((b) => b.count > 0)) any = true;
      const color = G.regionColor(region.slug);
      const x = buckets.map((b) => G.toDate(b.t + BUCKET_S / 2));
      ttft.push({ type: "scatter", mode: "lines", name: region.slug, legendgroup: region.slug, x, y: buckets.map((b) => b.ttft_p50_ms),
        line: { color, width: 2 }, connectgaps: false, hovertemplate: `${region.slug} p50 %{y:.0f} ms<extra></extra>` });
      ttft.push({ type: "scatter", mode: "lines", name: `${region.slug} p99`, legendgroup: region.slug, showlegend: false, x,
        y: buckets.map((b) => b.ttft_p99_ms), line: { color, width: 1, dash: "dot" }, opacity: 0.5, connectgaps: false,
        hovertemplate: `${region.slug} p99 %{y:.0f} ms<extra></extra>` });
      rate.push({ type: "scatter", mode: "lines", name: region.slug, x, y: buckets.map((b) => b.count / BUCKET_S), stackgroup: "rate",
        line: { color, width: 1.5 }, fillcolor: color + "40", hovertemplate: `${region.slug} %{y:.2f} req/s<extra></extra>` });
    }
    const empty = any ? null : "No traffic in the last 15 minutes";
    G.plot("ttft-series", ttft, G.layout({ xaxis: G.timeAxis(xRange), yaxis: G.valueAxis("TTFT (ms)") }), empty);
    G.plot("rate-series", rate, G.layout({ xaxis: G.timeAxis(xRange), yaxis: G.valueAxis("requests/s"), legend: { traceorder: "normal" } }), empty);
  }

  // ------------------------------------------------------------ data
  async function refresh() {
    try {
      state.overview = await G.getJSON(G.page.urls.overview);
      loadSeries(state.overview.series);
    } catch (e) {
      console.warn("gorgo: overview data unavailable", e);
      return;
    }
    renderHeadline();
    renderMap();
    renderSeries();
  }
  const refreshSoon = G.throttle(refresh, 5000);

  function render() {
    renderHeadline();
    renderMap();
    renderMatrix();
    renderSeries();
  }
  render();
  refresh();
  setInterval(refresh, 30000); // slide the windows even when nothing is pushed

  G.live({
    "telemetry.rtt"(message) {
      for (const cell of message.cells) {
        if (cell.rtt_ms === null || cell.rtt_ms === undefined) continue;
        const key = `${message.region}|${cell.node_id}`;
        const previous = state.rtt.get(key);
        state.rtt.set(key, { region: message.region, node_id: cell.node_id, rtt_ms: cell.rtt_ms, jitter_ms: cell.jitter_ms,
          samples: previous ? previous.samples + 1 : 1 });
      }
      renderMatrix();
      renderMap();
    },
    "telemetry.nodes"(message) {
      let changed = false;
      for (const cell of message.nodes) {
        const id = String(cell.node_id);
        if (state.healthy.get(id) !== cell.healthy) { state.healthy.set(id, cell.healthy); changed = true; }
      }
      if (changed) renderMap();
    },
    "telemetry.health"(message) {
      state.healthy.set(String(message.node_id), message.current === "healthy");
      renderMap();
    },
    "telemetry.aggregates"(message) {
      if (message.resolution !== "10s") return;
      for (const cell of message.buckets) {
        if (cell.scope !== "region") continue;
        if (!state.series.has(cell.key)) state.series.set(cell.key, new Map());
        state.series.get(cell.key).set(cell.bucket_start, {
          t: cell.bucket_start, count: cell.count, errors: cell.errors, ttft_p50_ms: cell.ttft_p50_ms, ttft_p99_ms: cell.ttft_p99_ms,
        });
      }
      renderSeries();
      refreshSoon(); // the headline and map need percentiles over merged buckets: the server has them
    },
    "policy.published"(message) {
      state.policy = message;
      renderPolicy();
    },
    reconnected: refresh,
  });
})();
