/* TTFT breakdown: stacked parts per gateway region and per node, TTFT p50/p99 over time, and how
 * well the router's cost model predicted each node's TTFT. */
(function () {
  "use strict";
  const G = window.Gorgo;
  const { fleet } = G.page;
  const state = { window: G.page.window, stat: "p50", data: null };

  const windowLabel = () => G.page.windows[state.window].label;
  const colored = (text, color) => `<span style="color:${color}">${text}</span>`;

  function stackedBars(id, entries, emptyMessage) {
    // entries: [{key, label, color, summary}] in display order
    const withData = entries.filter((e) => e.summary && e.summary[state.stat]);
    const x = withData.map((e) => e.key);
    const ticktext = withData.map((e) => colored(e.label, e.color));
    const traces = G.COMPONENTS.map((c) => ({
      type: "bar", name: c.label, x, y: withData.map((e) => e.summary[state.stat][c.key]),
      marker: { color: c.color, line: { width: 0 } },
      hovertemplate: `${c.label} %{y:.1f} ms<extra></extra>`,
    }));
    // The marker is the TTFT the parts add up to: the same statistic as the bars. The measured
    // percentiles (a different statistic) are in its hover text, labelled as such.
    const bucket = G.page.windows[state.window].resolution === "10s" ? "10 s" : "1 min";
    const markerName = state.stat === "mean" ? "mean TTFT" : `TTFT of the median ${bucket} bucket`;
    traces.push({
      type: "scatter", mode: "markers", name: markerName, x, y: withData.map((e) => e.summary[state.stat].ttft),
      customdata: withData.map((e) => [e.summary.count, e.summary.ttft_p50_ms, e.summary.ttft_p99_ms]),
      marker: { symbol: "diamond", size: 9, color: "#f0f1f2", line: { color: "#111217", width: 1 } },
      hovertemplate: `${markerName} %{y:.0f} ms · measured p50 %{customdata[1]:.0f} ms, p99 %{customdata[2]:.0f} ms · %{customdata[0]:,} requests<extra></extra>`,
    });
    // The axis title stays short (a long one was cut off at the chart's edges); the panel's hint
    // says what the statistic is, and why it is not the requests' p50 shown on other pages.
    const hint = document.getElementById(id).closest(".panel").querySelector(".panel-hint");
    if (hint) {
      hint.textContent = state.stat === "mean"
        ? "ms, stacked · mean: the parts add up to the mean TTFT ◆"
        : `ms, stacked · median bucket: the ${bucket} bucket whose mean TTFT is the median of buckets, ` +
          "its parts adding up to its TTFT ◆ (not the requests' p50 shown elsewhere: that is in the hover)";
    }
    G.plot(id, traces, G.layout({
      barmode: "relative",
      bargap: 0.35,
      xaxis: { type: "category", tickmode: "array", tickvals: x, ticktext, categoryorder: "array", categoryarray: x },
      yaxis: G.valueAxis(state.stat === "mean" ? "ms · mean" : "ms · median bucket"),
    }), withData.length ? null : emptyMessage);
  }

  function renderBars() {
    const d = state.data || { regions: {}, nodes: {} };
    const empty = `No traffic in the last ${windowLabel()}`;
    // A region served both in the region and from elsewhere gets two bars: local, cross-region.
    const split = d.split || {};
    stackedBars("by-region", fleet.regions.flatMap((r) => split[r.slug] ? [
      { key: `${r.slug} local`, label: `${r.slug} · local`, color: G.regionColor(r.slug), summary: split[r.slug].local },
      { key: `${r.slug} cross`, label: `${r.slug} · cross-region`, color: G.regionColor(r.slug), summary: split[r.slug].cross },
    ] : [{ key: r.slug, label: r.slug, color: G.regionColor(r.slug), summary: d.regions[r.slug] }]), empty);
    stackedBars("by-node", fleet.nodes.map((n) => ({
      key: n.name, label: n.name, color: G.nodeStyle(n.id).color, summary: d.nodes[String(n.id)],
    })), empty);
  }

  function renderPrediction() {
    // Per node: median |measured - predicted| and the bias (mean error), with the signed error's
    // p10..p90 as the bias bar's whiskers. Error > 0: the node was slower than the model said.
    const d = state.data || { nodes: {} };
    const rows = fleet.nodes
      .map((n) => ({ node: n, q: d.nodes[String(n.id)] && d.nodes[String(n.id)].prediction }))
      .filter((r) => r.q);
    const x = rows.map((r) => r.node.name);
    const ticktext = rows.map((r) => colored(r.node.name, G.nodeStyle(r.node.id).color));
    const custom = rows.map((r) => [r.q.count, r.q.error_p10_ms, r.q.error_p90_ms, r.q.p90_abs_error_ms]);
    const traces = [
      { type: "bar", name: "median |error|", x, y: rows.map((r) => r.q.median_abs_error_ms), customdata: custom,
        marker: { color: "#B877D9" },
        hovertemplate: "median |error| %{y:.0f} ms · p90 |error| %{customdata[3]:.0f} ms · %{customdata[0]:,} requests<extra></extra>" },
      { type: "bar", name: "bias (mean error)", x, y: rows.map((r) => r.q.bias_ms), customdata: custom,
        marker: { color: "#FADE2A" },
        error_y: { type: "data", symmetric: false, color: "#8e9299",
          array: rows.map((r) => Math.max(0, (r.q.error_p90_ms ?? r.q.bias_ms) - r.q.bias_ms)),
          arrayminus: rows.map((r) => Math.max(0, r.q.bias_ms - (r.q.error_p10_ms ?? r.q.bias_ms))) },
        hovertemplate: "bias %{y:.0f} ms · error p10 %{customdata[1]:.0f} to p90 %{customdata[2]:.0f} ms<extra></extra>" },
    ];
    G.plot("prediction-quality", traces, G.layout({
      barmode: "group",
      bargap: 0.35,
      xaxis: { type: "category", tickmode: "array", tickvals: x, ticktext, categoryorder: "array", categoryarray: x },
      yaxis: G.valueAxis("ms · measured − predicted TTFT", { rangemode: "normal" }),
    }), rows.length ? null : `No decision priced its node in the last ${windowLabel()} (round robin and least load predict nothing)`);
  }

  function renderSeries() {
    const d = state.data;
    const now = Date.now() / 1000;
    const seconds = G.page.windows[state.window].seconds;
    const traces = [];
    let any = false;
    for (const region of fleet.regions) {
      const points = (d && d.series[region.slug]) || [];
      if (points.some((p) => p.count > 0)) any = true;
      const color = G.regionColor(region.slug);
      const x = points.map((p) => G.toDate(p.t + d.step_s / 2));
      traces.push({ type: "scatter", mode: "lines", name: region.slug, legendgroup: region.slug, x, y: points.map((p) => p.ttft_p50_ms),
        line: { color, width: 2 }, hovertemplate: `${region.slug} p50 %{y:.0f} ms<extra></extra>` });
      traces.push({ type: "scatter", mode: "lines", name: `${region.slug} p99`, legendgroup: region.slug, showlegend: false, x,
        y: points.map((p) => p.ttft_p99_ms), line: { color, width: 1, dash: "dot" }, opacity: 0.55, hovertemplate: `${region.slug} p99 %{y:.0f} ms<extra></extra>` });
    }
    G.plot("ttft-over-time", traces, G.layout({
      xaxis: G.timeAxis([G.toDate(now - seconds), G.toDate(now)]),
      yaxis: G.valueAxis("TTFT (ms)"),
    }), any ? null : `No traffic in the last ${windowLabel()}`);
  }

  async function refresh() {
    const requested = state.window;
    try {
      const data = await G.getJSON(G.page.urls.breakdown, { window: requested });
      if (requested !== state.window) return; // the user switched windows meanwhile
      state.data = data;
    } catch (e) {
      console.warn("gorgo: breakdown data unavailable", e);
      return;
    }
    renderBars();
    renderSeries();
    renderPrediction();
  }
  const throttled = G.throttle(refresh, 10000);
  // A day merges ~13k buckets (~0.7 s of server time): the minute timer is enough there.
  const refreshSoon = () => { if (state.window !== "24h") throttled(); };

  document.querySelectorAll("[data-stat]").forEach((button) => button.addEventListener("click", () => {
    state.stat = button.dataset.stat;
    document.querySelectorAll("[data-stat]").forEach((b) => {
      b.classList.toggle("active", b === button);
      b.setAttribute("aria-pressed", String(b === button));
    });
    renderBars();
  }));
  G.windowPicker((key) => { state.window = key; state.data = null; renderBars(); renderSeries(); renderPrediction(); refresh(); });

  renderBars();
  renderSeries();
  renderPrediction();
  refresh();
  setInterval(refresh, 60000);
  G.live({ "telemetry.aggregates": refreshSoon, reconnected: refresh });
})();
