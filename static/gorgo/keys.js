/* Client keys page: a copy button for the secret shown once. Works without it (select and copy). */
(function () {
  "use strict";
  const button = document.getElementById("copy-secret");
  const secret = document.getElementById("new-secret");
  if (button && secret && navigator.clipboard) {
    button.addEventListener("click", () => {
      navigator.clipboard.writeText(secret.textContent.trim()).then(() => { button.textContent = "Copied"; });
    });
  } else if (button) {
    button.hidden = true;
  }
})();
