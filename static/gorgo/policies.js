/* Policy pages: show the selected algorithm's parameters only; keep the residency grid readable;
 * the review page's what-if panel (which needs this script and Plotly: it runs through the API).
 * The editor works without this script (all parameter sets are shown; the server validates). */
(function () {
  "use strict";
  const algorithm = document.getElementById("id_algorithm");
  if (algorithm) {
    const sync = () => {
      document.querySelectorAll("fieldset.params").forEach((fieldset) => {
        fieldset.hidden = fieldset.dataset.algorithm !== algorithm.value;
      });
    };
    algorithm.addEventListener("change", sync);
    sync();
  }

  const grid = document.querySelector(".residency-grid");
  if (grid) {
    const sync = () => {
      grid.querySelectorAll("tbody tr").forEach((tr) => {
        const ticked = tr.querySelectorAll("input:checked").length;
        tr.querySelector("td.muted").textContent = ticked ? "only ticked regions" : "any region";
      });
    };
    grid.addEventListener("change", sync);
    sync();
  }

  // What if: queue a replay through the API, poll the run, draw the distributions side by side.
  const panel = document.getElementById("what-if");
  if (panel && window.Gorgo) {
    const G = window.Gorgo;
    const form = document.getElementById("what-if-form");
    const status = document.getElementById("what-if-status");
    const button = document.getElementById("what-if-run");
    const table = document.getElementById("what-if-table");
    const SERIES = [
      { key: "measured", label: "measured (recorded)", color: "#8e9299", dash: "dot" },
      { key: "live", label: "live policy (replayed)", color: "#5794F2", dash: "solid" },
      { key: "draft", label: "this policy (replayed)", color: "#FF9830", dash: "solid" },
    ];
    const POLL_MS = 1000;
    const POLL_LIMIT = 180; // the task's hard limit is 120 s, plus queueing

    const say = (text, failed) => {
      status.textContent = text;
      status.classList.toggle("bad", Boolean(failed));
    };
    const fail = (message) => {
      say(message, true);
      G.setEmpty("what-if-cdf", message);
      G.setEmpty("what-if-histogram", message);
      table.hidden = true;
    };
    const detail = (body) => {
      if (!body) return "The replay could not be started.";
      if (body.detail) return body.detail;
      return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
    };

    function render(result) {
      // The live policy's name is typed by an operator: text in the table, escaped for Plotly.
      const text = (s) => s.key === "live" ? `live v${result.live_version} ${result.live_policy} (replayed)` : s.label;
      const label = (s) => G.escapeHTML(text(s));
      const rows = SERIES.map((s) => {
        const d = result[s.key];
        const row = document.createElement("tr");
        row.dataset.series = s.key;
        const name = row.insertCell();
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = s.color;
        name.append(swatch, text(s));
        const cells = [
          [G.fmt.ms(d.p50_ms), "num mono"], [G.fmt.ms(d.p90_ms), "num mono"], [G.fmt.ms(d.p99_ms), "num mono"],
          [String(d.count), "num"], [d.cross_region_share === null ? "—" : G.fmt.pct(d.cross_region_share, 0) + " %", "num"],
        ];
        for (const [value, className] of cells) {
          const td = row.insertCell();
          td.className = className;
          td.textContent = value;
        }
        return row;
      });
      table.querySelector("tbody").replaceChildren(...rows);
      table.hidden = false;
      const cdf = SERIES.map((s) => ({
        type: "scatter", mode: "lines", name: label(s),
        x: result[s.key].cdf.map((p) => p[0]), y: result[s.key].cdf.map((p) => p[1] * 100),
        line: { color: s.color, dash: s.dash, width: 2 },
        hovertemplate: "%{y:.0f} % at or below %{x:.0f} ms<extra>" + label(s) + "</extra>",
      }));
      G.plot("what-if-cdf", cdf, G.layout({
        hovermode: "closest",
        xaxis: G.valueAxis("TTFT (ms, log)", { type: "log", rangemode: "normal" }),
        yaxis: G.valueAxis("requests at or below (%)", { range: [0, 100] }),
      }));
      const edges = result.histogram_edges_ms;
      const centres = edges.slice(0, -1).map((low, i) => Math.sqrt(Math.max(low, 0.1) * edges[i + 1]));
      // Steps, not bars: three bar series on a log axis draw as slivers.
      const steps = SERIES.map((s) => ({
        type: "scatter", mode: "lines", name: label(s), x: centres, y: result[s.key].histogram,
        line: { color: s.color, dash: s.dash, width: 2, shape: "hvh" },
        hovertemplate: "%{y} requests near %{x:.0f} ms<extra>" + label(s) + "</extra>",
      }));
      G.plot("what-if-histogram", steps, G.layout({
        hovermode: "closest",
        xaxis: G.valueAxis("TTFT (ms, log)", { type: "log", rangemode: "normal" }),
        yaxis: G.valueAxis("requests"),
      }));
      const notes = [`${result.requests.toLocaleString("en-US")} requests replayed in ${result.replay_s.toFixed(1)} s`];
      if (result.truncated) notes.push("the window held more: the newest were replayed");
      if (result.with_prefix_hashes < 1) notes.push(`${G.fmt.pct(1 - result.with_prefix_hashes, 0)} % of the records had no prefix hashes (replayed as unique prompts)`);
      const lost = result.draft.unroutable + result.draft.unfinished;
      if (lost) notes.push(`this policy left ${lost} request(s) unserved`);
      say(notes.join(" · "));
    }

    async function poll(url) {
      for (let i = 0; i < POLL_LIMIT; i += 1) {
        const run = await G.getJSON(url);
        if (run.status === "done") return render(run.result);
        if (run.status === "failed") return fail(run.error);
        say(`Replaying the last ${run.minutes} minutes…`);
        await new Promise((resolve) => setTimeout(resolve, POLL_MS));
      }
      fail("The replay did not finish; is a Celery worker running?");
    }

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      button.disabled = true;
      say("Queueing the replay…");
      try {
        const response = await fetch(panel.dataset.url, {
          method: "POST",
          credentials: "same-origin",
          headers: {
            "Content-Type": "application/json",
            Accept: "application/json",
            "X-CSRFToken": form.querySelector("[name=csrfmiddlewaretoken]").value,
          },
          body: JSON.stringify({ minutes: Number(form.elements.minutes.value) }),
        });
        const body = await response.json().catch(() => null);
        if (response.status !== 202) fail(detail(body));
        else await poll(body.url);
      } catch (error) {
        fail(`The replay could not be fetched: ${error.message}`);
      } finally {
        button.disabled = false;
      }
    });
  }
})();

/* The policy page's shadow and canary panel: drawn from the page's data, then kept live by the
 * policy.experiment pushes (controlplane/dashboard/signals.py; shapes in docs/dashboard.md). */
(function () {
  "use strict";
  const list = document.getElementById("experiment-list");
  const data = document.getElementById("gorgo-experiments");
  if (!list || !data || !window.Gorgo) return;
  const experiments = new Map();
  JSON.parse(data.textContent).forEach((e) => experiments.set(e.id, e));
  // Stop and promote go through the API (the same permission check, audit and version history
  // as a script's call); only an operator who may publish gets the buttons.
  const panel = document.getElementById("experiments");
  const canAct = panel && panel.hasAttribute("data-can-publish");
  const errors = new Map(); // experiment id -> the last failed step's message, kept across redraws
  const ACTIONS = {
    stop: {
      label: "Stop",
      css: "btn btn-small btn-warn",
      confirm: (e) => (e.kind === "shadow"
        ? `Stop shadow #${e.id}? The gateways stop computing its decisions; the live policy is unchanged.`
        : `Stop canary #${e.id}? Its share of sessions goes back to the live policy.`),
    },
    promote: {
      label: "Promote to live",
      css: "btn btn-small btn-primary",
      confirm: (e) => `Promote ${e.kind} #${e.id}? Its policy is published as the live policy on every gateway, for all traffic.`,
    },
  };

  const ms = (v) => (v === null || v === undefined ? "–" : `${Math.round(v)} ms`);
  const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`);
  const signed = (v, unit) => (v >= 0 ? "+" : "") + (unit === "%" ? `${(100 * v).toFixed(1)} %` : `${v.toFixed(1)} ms`);
  const interval = (i, unit) => (i ? `${signed(i.estimate, unit)} [${signed(i.low, unit)} … ${signed(i.high, unit)}]` : "–");
  const cell = (text, cls) => { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; return td; };

  function table(head, rows, testid) {
    const t = document.createElement("table");
    t.className = "table compact";
    t.dataset.testid = testid;
    const tr = document.createElement("tr");
    head.forEach((h) => { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); });
    t.createTHead().appendChild(tr);
    const body = t.createTBody();
    rows.forEach((cells) => { const row = document.createElement("tr"); cells.forEach((c) => row.appendChild(c)); body.appendChild(row); });
    return t;
  }

  function shadowTable(e) {
    const rows = Object.entries(e.regions).filter(([, sides]) => sides.shadow).map(([region, { shadow }]) => [
      cell(region), cell(String(shadow.requests || 0), "num"), cell(pct(shadow.moved_share), "num"),
      cell(`${pct(shadow.cross_region_share_live)} → ${pct(shadow.cross_region_share_shadow)}`, "num"),
      cell(`${ms(shadow.live_predicted_p50_ms)} / ${ms(shadow.shadow_predicted_p50_ms)}`, "num"),
      cell(`${ms(shadow.live_predicted_p99_ms)} / ${ms(shadow.shadow_predicted_p99_ms)}`, "num"),
    ]);
    return table(["region", "requests", "would move", "cross-region live → shadow", "predicted p50 live / shadow", "predicted p99 live / shadow"], rows, "shadow-figures");
  }

  function verdict(c) {
    const td = cell(c.worse ? "worse by more than the margin" : (c.enough_samples ? "not worse (so far)" : "collecting samples"), c.worse ? "diff-old" : "");
    if (c.worse) td.title = c.worse;
    return td;
  }

  function canaryTable(e) {
    const rows = e.comparison.map((c) => [
      cell(c.region), cell(`${c.canary.requests} / ${c.rest.requests}`, "num"),
      cell(`${ms(c.canary.ttft_mean_ms)} / ${ms(c.rest.ttft_mean_ms)}`, "num"),
      cell(interval(c.ttft_diff_ms, "ms"), "num mono"),
      cell(`${pct(c.canary.error_rate)} / ${pct(c.rest.error_rate)}`, "num"),
      cell(interval(c.error_rate_diff, "%"), "num mono"),
      verdict(c),
    ]);
    return table(["region", "requests canary / rest", "mean TTFT canary / rest", "Δ TTFT (always-valid interval)", "error rate canary / rest", "Δ error rate", "verdict"], rows, "canary-comparison");
  }

  function render() {
    list.replaceChildren();
    if (!experiments.size) { const p = document.createElement("p"); p.className = "muted small"; p.textContent = "No shadow or canary has run yet."; list.appendChild(p); return; }
    [...experiments.values()].sort((a, b) => b.id - a.id).forEach((e) => {
      const box = document.createElement("div");
      box.className = "experiment";
      box.dataset.experimentId = e.id;
      box.dataset.status = e.status;
      const title = document.createElement("h3");
      title.className = "small";
      title.textContent = `${e.kind} #${e.id}${e.share_percent ? ` on ${e.share_percent} % of sessions` : ""}: ${e.status.replace("_", " ")}`;
      box.appendChild(title);
      if (e.end_note) { const note = document.createElement("p"); note.className = "small muted"; note.textContent = e.end_note; box.appendChild(note); }
      if (canAct && e.status === "running") box.appendChild(actions(e));
      if (errors.has(e.id)) {
        const error = document.createElement("p");
        error.className = "small bad experiment-error";
        error.setAttribute("role", "alert");
        error.dataset.testid = "experiment-error";
        error.textContent = errors.get(e.id);
        box.appendChild(error);
      }
      box.appendChild(e.kind === "shadow" ? shadowTable(e) : canaryTable(e));
      list.appendChild(box);
    });
  }

  function actions(e) {
    const bar = document.createElement("div");
    bar.className = "experiment-actions";
    Object.entries(ACTIONS).forEach(([name, action]) => {
      const button = document.createElement("button");
      button.type = "button";
      button.className = action.css;
      button.textContent = action.label;
      button.dataset.testid = `experiment-${name}`;
      button.addEventListener("click", () => act(e, name, bar));
      bar.appendChild(button);
    });
    return bar;
  }

  function failure(body, status) {
    if (body && body.detail) return body.detail;
    if (body && typeof body === "object") return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
    return `the server answered ${status}`;
  }

  async function act(e, name, bar) {
    if (!window.confirm(ACTIONS[name].confirm(e))) return;
    // A new attempt: the last one's message goes now, not when this answer comes (the push of
    // the outcome may redraw the experiment first, and must not show it beside the new status).
    errors.delete(e.id);
    bar.querySelectorAll("button").forEach((b) => { b.disabled = true; });
    try {
      const response = await fetch(`${panel.dataset.api}${e.id}/${name}/`, {
        method: "POST",
        credentials: "same-origin",
        headers: {
          "Content-Type": "application/json",
          Accept: "application/json",
          "X-CSRFToken": panel.querySelector("[name=csrfmiddlewaretoken]").value,
        },
        body: "{}",
      });
      const body = await response.json().catch(() => null);
      if (response.ok) {
        errors.delete(e.id);
        // The push (policy.experiment) brings the same; this shows it without waiting for it.
        experiments.set(e.id, { ...experiments.get(e.id), status: body.status, end_note: body.end_note || "" });
      } else {
        errors.set(e.id, `Could not ${name} ${e.kind} #${e.id}: ${failure(body, response.status)}`);
      }
    } catch (error) {
      errors.set(e.id, `Could not ${name} ${e.kind} #${e.id}: ${error.message}`);
    }
    render();
  }

  render();
  Gorgo.live({
    "policy.experiment"(message) { experiments.set(message.id, message); render(); },
  });
})();
