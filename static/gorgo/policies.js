/* Policy pages: show the selected algorithm's parameters only; keep the residency grid readable.
 * Everything works without this script (all parameter sets are shown; the server validates). */
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
      box.appendChild(e.kind === "shadow" ? shadowTable(e) : canaryTable(e));
      list.appendChild(box);
    });
  }

  render();
  Gorgo.live({
    "policy.experiment"(message) { experiments.set(message.id, message); render(); },
  });
})();
