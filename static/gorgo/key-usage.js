/* Key usage: requests per team over time, tokens per key, and per-team / per-key tables. */
(function () {
  "use strict";
  const G = window.Gorgo;
  const state = { window: G.page.window, data: G.page.usage || null };

  // Teams exist only on this page: a palette of their own, so they are not read as regions.
  const TEAM_PALETTE = ["#8AB8FF", "#FFB357", "#96D98D", "#CA95E5", "#FFEE52", "#FF7383", "#5794F2", "#C0D8FF"];
  const TOKENS = { prompt: "#5A6270", completion: "#E6E7E9" };
  const MAX_KEYS_CHARTED = 15;
  const windowLabel = () => G.page.windows[state.window].label;
  const teamLabel = (team) => team || "(no team)";
  // Key names are typed by operators and Plotly renders tick labels as (limited) HTML.
  const escapeHTML = G.escapeHTML;
  const teamHTML = (team) => escapeHTML(teamLabel(team));

  function teamColors() {
    const teams = ((state.data && state.data.teams) || []).map((t) => t.team).sort();
    return new Map(teams.map((team, i) => [team, TEAM_PALETTE[i % TEAM_PALETTE.length]]));
  }

  function renderRequests(colors) {
    const now = Date.now() / 1000;
    const seconds = G.page.windows[state.window].seconds;
    const series = (state.data && state.data.series) || {};
    const traces = [];
    for (const [team, color] of colors) {
      const points = series[team] || [];
      const x = points.map((p) => G.toDate(p.t));
      traces.push({
        type: "scatter", mode: "lines", name: teamHTML(team), x, y: points.map((p) => p.count),
        line: { color, width: 1.8 }, hovertemplate: `${teamHTML(team)} %{y:,} requests<extra></extra>`,
      });
      if (points.some((p) => p.errors > 0)) {
        traces.push({
          type: "scatter", mode: "lines", name: `${teamHTML(team)} errors`, x, y: points.map((p) => p.errors),
          line: { color, width: 1.2, dash: "dot" }, showlegend: false,
          hovertemplate: `${teamHTML(team)} %{y:,} errors<extra></extra>`,
        });
      }
    }
    const step = state.data ? state.data.step_s : 10;
    G.plot("team-requests", traces, G.layout({
      xaxis: G.timeAxis([G.toDate(now - seconds), G.toDate(now)]),
      yaxis: G.valueAxis(`requests per ${step >= 60 ? step / 60 + " min" : step + " s"}`),
    }), traces.length ? null : `No keyed traffic in the last ${windowLabel()}`);
  }

  function renderTokens(colors) {
    const keys = ((state.data && state.data.keys) || [])
      .filter((k) => k.prompt_tokens + k.completion_tokens > 0)
      .sort((a, b) => b.prompt_tokens + b.completion_tokens - (a.prompt_tokens + a.completion_tokens))
      .slice(0, MAX_KEYS_CHARTED);
    const x = keys.map((k) => k.key_id);
    const ticktext = keys.map((k) => `<span style="color:${colors.get(k.team) || "#b7b9bd"}">${escapeHTML(k.name || k.key_id)}</span>`);
    const traces = [
      { type: "bar", name: "prompt", x, y: keys.map((k) => k.prompt_tokens), marker: { color: TOKENS.prompt },
        hovertemplate: "prompt %{y:,} tokens<extra></extra>" },
      { type: "bar", name: "completion", x, y: keys.map((k) => k.completion_tokens), marker: { color: TOKENS.completion },
        hovertemplate: "completion %{y:,} tokens<extra></extra>" },
    ];
    G.plot("key-tokens", traces, G.layout({
      barmode: "stack", bargap: 0.35, hovermode: "closest",
      xaxis: { type: "category", tickmode: "array", tickvals: x, ticktext, categoryorder: "array", categoryarray: x },
      yaxis: G.valueAxis("tokens", { tickformat: "~s" }),
    }), keys.length ? null : `No keyed traffic in the last ${windowLabel()}`);
  }

  function cell(row, text, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.textContent = text;
    row.appendChild(td);
    return td;
  }

  function usageCells(row, u) {
    for (const value of [u.count, u.errors_4xx, u.errors_5xx, u.limited, u.refused]) cell(row, value.toLocaleString("en-US"), "num");
    for (const value of [u.prompt_tokens, u.completion_tokens, u.cached_tokens]) cell(row, G.fmt.tokens(value), "num");
    cell(row, G.fmt.ms(u.ttft_p50_ms), "num");
    cell(row, G.fmt.ms(u.ttft_p99_ms), "num");
  }

  function fillTable(id, items, columns, addRow) {
    const body = document.querySelector(`#${id} tbody`);
    body.replaceChildren();
    if (!items.length) {
      const row = body.insertRow();
      const td = cell(row, `No keyed traffic in the last ${windowLabel()}.`, "empty-row");
      td.colSpan = columns;
      return;
    }
    items.forEach((item) => addRow(body.insertRow(), item));
  }

  function renderTables(colors) {
    const data = state.data || { teams: [], keys: [] };
    fillTable("team-table", data.teams, 12, (row, t) => {
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = teamLabel(t.team);
      th.style.color = colors.get(t.team) || "";
      row.appendChild(th);
      cell(row, String(t.keys), "num");
      usageCells(row, t);
    });
    fillTable("key-usage-table", data.keys, 14, (row, k) => {
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = k.name || "(deleted key)";
      row.appendChild(th);
      const code = document.createElement("code");
      code.textContent = k.key_id;
      cell(row, "").appendChild(code);
      cell(row, teamLabel(k.team));
      cell(row, k.priorities.join(", ") || "—");
      usageCells(row, k);
    });
  }

  function render() {
    const colors = teamColors();
    renderRequests(colors);
    renderTokens(colors);
    renderTables(colors);
  }

  async function refresh() {
    const requested = state.window;
    try {
      const data = await G.getJSON(G.page.urls.key_usage, { window: requested });
      if (requested !== state.window) return;
      state.data = data;
    } catch (e) {
      console.warn("gorgo: key usage unavailable", e);
      return;
    }
    render();
  }
  const throttled = G.throttle(refresh, 10000);
  const refreshSoon = () => { if (state.window !== "24h") throttled(); };

  G.windowPicker((key) => { state.window = key; state.data = null; render(); refresh(); });
  render();
  setInterval(refresh, 60000);
  G.live({ "telemetry.aggregates": refreshSoon, reconnected: refresh });
})();
