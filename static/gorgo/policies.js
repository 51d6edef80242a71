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
