/* gorgo dashboard, shared by every page: colours, the live socket, Plotly defaults, formatting.
 *
 * One global, `Gorgo`. Colours are defined here once so a region, a node or a TTFT component has
 * the same colour on every chart and table. Pages read their embedded data with Gorgo.page, draw
 * with Gorgo.plot and subscribe to live updates with Gorgo.live({type: handler}).
 */
(function () {
  "use strict";

  const pageEl = document.getElementById("gorgo-page");
  const page = pageEl ? JSON.parse(pageEl.textContent) : { fleet: { regions: [], nodes: [] } };

  // ---------------------------------------------------------------- colours
  // Regions take palette slots in slug order (the order the server sends them in).
  const REGION_PALETTE = ["#5794F2", "#FF9830", "#73BF69", "#B877D9", "#F2CC0C", "#8AB8FF", "#FF7383", "#37872D"];
  // TTFT components: hues no region uses, ordered from the client outwards.
  const COMPONENTS = [
    { key: "gateway", label: "gateway", color: "#CA95E5" },
    { key: "network", label: "network (RTT)", color: "#FADE2A" },
    { key: "queue", label: "queue", color: "#F2495C" },
    { key: "prefill", label: "prefill", color: "#1F9E89" },
    { key: "other", label: "other", color: "#6E7079" },
  ];
  // Latency scale (good -> bad) for TTFT and RTT colouring.
  const LATENCY_SCALE = [[0, "#73BF69"], [0.5, "#FADE2A"], [1, "#F2495C"]];

  const regionIndex = new Map(page.fleet.regions.map((r, i) => [r.slug, i]));
  const nodesById = new Map(page.fleet.nodes.map((n) => [String(n.id), n]));

  function regionColor(slug) {
    const i = regionIndex.has(slug) ? regionIndex.get(slug) : regionIndex.size;
    return REGION_PALETTE[i % REGION_PALETTE.length];
  }

  function mix(hex, target, amount) {
    const a = parseInt(hex.slice(1), 16), b = parseInt(target.slice(1), 16);
    const ch = (v, s) => (v >> s) & 255;
    const out = [16, 8, 0].map((s) => Math.round(ch(a, s) + (ch(b, s) - ch(a, s)) * amount));
    return "#" + out.map((v) => v.toString(16).padStart(2, "0")).join("");
  }

  // A node is drawn in its region's colour; its siblings differ by shade and dash.
  const DASHES = ["solid", "dot", "dash", "dashdot"];
  function nodeStyle(nodeId) {
    const node = nodesById.get(String(nodeId));
    if (!node) return { color: "#999999", dash: "solid", name: `node ${nodeId}` };
    const siblings = page.fleet.nodes.filter((n) => n.region === node.region);
    const k = siblings.findIndex((n) => n.id === node.id);
    const base = regionColor(node.region);
    const color = k === 0 ? base : mix(base, k % 2 ? "#ffffff" : "#000000", 0.3 + 0.1 * Math.floor(k / 2));
    return { color, dash: DASHES[k % DASHES.length], name: node.name };
  }

  function latencyColor(ms, worstMs) {
    if (ms === null || ms === undefined) return "#555a63";
    const x = Math.max(0, Math.min(1, ms / worstMs));
    const [c0, c1] = x < 0.5 ? [LATENCY_SCALE[0][1], LATENCY_SCALE[1][1]] : [LATENCY_SCALE[1][1], LATENCY_SCALE[2][1]];
    return mix(c0, c1, x < 0.5 ? x * 2 : (x - 0.5) * 2);
  }

  function paintRegionDots(root) {
    (root || document).querySelectorAll(".region-dot[data-region]").forEach((el) => {
      el.style.background = regionColor(el.dataset.region);
    });
  }

  // ---------------------------------------------------------------- formatting
  const fmt = {
    ms(v) { return v === null || v === undefined || Number.isNaN(v) ? "—" : v < 10 ? v.toFixed(1) : Math.round(v).toLocaleString("en-US"); },
    pct(v, digits = 1) { return v === null || v === undefined || Number.isNaN(v) ? "—" : (v * 100).toFixed(digits); },
    rate(v) { return v === null || v === undefined ? "—" : v < 10 ? v.toFixed(2) : v.toFixed(1); },
    num(v, digits = 0) { return v === null || v === undefined ? "—" : Number(v).toFixed(digits); },
    tokens(v) { return v >= 1e6 ? (v / 1e6).toFixed(1) + " M" : v >= 1e3 ? (v / 1e3).toFixed(1) + " k" : String(v); },
    age(seconds) {
      if (seconds === null || seconds === undefined || seconds < 0) return "—";
      if (seconds < 90) return `${Math.round(seconds)} s`;
      if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
      return `${(seconds / 3600).toFixed(1)} h`;
    },
  };

  // ---------------------------------------------------------------- Plotly
  const FONT = 'Inter, "Segoe UI", Roboto, "Helvetica Neue", "Liberation Sans", Arial, sans-serif';
  const AXIS = { gridcolor: "#262a30", linecolor: "#3a3f47", zeroline: false, tickfont: { size: 10.5 }, automargin: true };

  function merge(base, extra) {
    const out = Array.isArray(base) ? base.slice() : Object.assign({}, base);
    for (const [k, v] of Object.entries(extra || {})) {
      out[k] = v && typeof v === "object" && !Array.isArray(v) && base[k] && typeof base[k] === "object" ? merge(base[k], v) : v;
    }
    return out;
  }

  function layout(extra) {
    return merge({
      paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)",
      font: { family: FONT, size: 11, color: "#b7b9bd" },
      margin: { l: 56, r: 14, t: 8, b: 34 },
      xaxis: AXIS,
      yaxis: AXIS,
      legend: { orientation: "h", x: 0, y: 1.0, yanchor: "bottom", font: { size: 11 }, bgcolor: "rgba(0,0,0,0)" },
      hoverlabel: { bgcolor: "#202328", bordercolor: "#3a3f47", font: { color: "#e6e6e6", family: FONT, size: 12 } },
      hovermode: "x unified",
      // Keep the user's zoom and legend toggles when live data redraws the chart.
      uirevision: "keep",
    }, extra);
  }
  const timeAxis = (range) => merge(AXIS, { type: "date", hoverformat: "%H:%M:%S", range: range || undefined });
  const valueAxis = (title, extra) => merge(AXIS, merge({ title: { text: title, font: { size: 11 } }, rangemode: "tozero" }, extra || {}));

  const CONFIG = {
    displaylogo: false,
    responsive: true,
    displayModeBar: "hover",
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines", "hoverCompareCartesian", "hoverClosestCartesian"],
  };

  /** Draw (or redraw in place) a chart; `empty` is a message shown instead of an empty chart. */
  function plot(id, traces, plotLayout, empty) {
    const el = document.getElementById(id);
    if (!el || !window.Plotly) return;
    window.Plotly.react(el, traces, plotLayout, CONFIG);
    setEmpty(id, empty || null);
  }

  function setEmpty(id, message) {
    const overlay = document.getElementById(`${id}-empty`);
    if (!overlay) return;
    overlay.hidden = !message;
    if (message) overlay.textContent = message;
  }

  const toDate = (seconds) => new Date(seconds * 1000);
  // Plotly renders trace names, tick labels and hover text as (limited) HTML and fills in %{...}:
  // text typed by operators (policy, key and team names) goes through this first.
  const escapeHTML = (text) => String(text).replace(/[&<>"'%]/g, (c) => `&#${c.charCodeAt(0)};`);

  // ---------------------------------------------------------------- data
  async function getJSON(url, params) {
    const u = new URL(url, location.href);
    Object.entries(params || {}).forEach(([k, v]) => u.searchParams.set(k, v));
    const response = await fetch(u, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${u.pathname}: HTTP ${response.status}`);
    return response.json();
  }

  /** Run `fn` at most once per `ms`, trailing call included (for reloads triggered by updates). */
  function throttle(fn, ms) {
    let last = 0, timer = null;
    return function () {
      const wait = last + ms - Date.now();
      if (wait <= 0) { last = Date.now(); fn(); return; }
      if (!timer) timer = setTimeout(() => { timer = null; last = Date.now(); fn(); }, wait);
    };
  }

  // ---------------------------------------------------------------- live socket
  const CLOSE_UNAUTHENTICATED = 4401;
  const CLOSE_TRY_AGAIN_LATER = 1013;
  const conn = document.getElementById("conn");
  const socketState = { state: "connecting", messages: 0, lastMessageAt: null };

  function showConn(state, text) {
    socketState.state = state;
    if (!conn) return;
    conn.dataset.state = state;
    conn.querySelector(".conn-text").textContent = text;
  }

  /**
   * Subscribe to /ws/dashboard/: handlers maps a message type ("telemetry.rtt", ...) to a
   * function. Reconnects with exponential backoff (1 s .. 30 s, jittered) and calls
   * handlers.reconnected() after a reconnect so the page can reload what it missed.
   */
  function live(handlers) {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/dashboard/`;
    let attempt = 0, retryTimer = null, countdown = null, everOpen = false;

    function open() {
      clearInterval(countdown);
      showConn("connecting", "connecting…");
      const ws = new WebSocket(url);
      ws.onopen = () => {
        const reconnect = everOpen;
        everOpen = true;
        attempt = 0;
        showConn("live", "live");
        if (reconnect && handlers.reconnected) handlers.reconnected();
      };
      ws.onmessage = (event) => {
        let message;
        try { message = JSON.parse(event.data); } catch (e) { return; }
        socketState.messages += 1;
        socketState.lastMessageAt = Date.now();
        const handler = handlers[message.type];
        if (handler) {
          try { handler(message); } catch (e) { console.error("gorgo: update failed", message.type, e); }
        }
      };
      ws.onclose = (event) => {
        if (event.code === CLOSE_UNAUTHENTICATED) { showConn("signed-out", "signed out: reload to sign in"); return; }
        attempt += 1;
        const delayMs = Math.min(30000, 1000 * 2 ** Math.min(attempt - 1, 5)) * (0.8 + Math.random() * 0.4);
        const due = Date.now() + delayMs;
        // 1013: the server is up but its live updates (Redis) are not.
        const why = event.code === CLOSE_TRY_AGAIN_LATER ? "live updates unavailable" : "disconnected";
        const tick = () => showConn("retrying", `${why}, reconnecting in ${Math.max(1, Math.ceil((due - Date.now()) / 1000))} s`);
        tick();
        countdown = setInterval(tick, 1000);
        retryTimer = setTimeout(open, delayMs);
      };
    }
    // Back online or back to the tab: retry now instead of waiting out the backoff.
    const retryNow = () => {
      if (socketState.state === "retrying") { clearTimeout(retryTimer); open(); }
    };
    window.addEventListener("online", retryNow);
    document.addEventListener("visibilitychange", () => { if (!document.hidden) retryNow(); });
    open();
  }

  // ---------------------------------------------------------------- page chrome
  function wireConfirms(root) {
    (root || document).querySelectorAll("form[data-confirm]").forEach((form) => {
      form.addEventListener("submit", (event) => {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    });
  }

  /** The window picker (15 min / 1 h / 24 h): switch without a reload, keep it in the URL. */
  function windowPicker(onChange) {
    const buttons = document.querySelectorAll(".window-picker [data-window]");
    buttons.forEach((button) => button.addEventListener("click", (event) => {
      event.preventDefault();
      buttons.forEach((b) => { b.classList.toggle("active", b === button); b.setAttribute("aria-pressed", String(b === button)); });
      const url = new URL(location.href);
      url.searchParams.set("window", button.dataset.window);
      history.replaceState(null, "", url);
      onChange(button.dataset.window);
    }));
  }

  document.addEventListener("DOMContentLoaded", () => { paintRegionDots(); wireConfirms(); });

  window.Gorgo = {
    page, COMPONENTS, REGION_PALETTE, regionColor, nodeStyle, latencyColor, nodesById, paintRegionDots,
    fmt, layout, timeAxis, valueAxis, plot, setEmpty, toDate, escapeHTML, getJSON, throttle, live, socketState,
    windowPicker,
  };
})();
