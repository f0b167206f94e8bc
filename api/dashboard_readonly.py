"""The read-only dashboard shows no control that would only answer 403 (issue 33, smaller).

Through spectune the dashboard takes GET and HEAD only (api.dashboard.DashboardGate), yet
optuna-dashboard draws its Create study button and its Delete buttons (study, artifact) for
everyone, and each answers 403 when pressed.  Its page is one HTML file whose policy allows
scripts from this origin only (`script-src 'self'`), so the gate adds to that page, on its way
out, a style and a script that hide them, as the page is redrawn too.  The gate serves the
script (`SCRIPT_PATH`) behind the dashboard's own authentication, like every page of it.
"""

from __future__ import annotations

SCRIPT_PATH = "/spectune/dashboard-readonly.js"

# Icon buttons optuna-dashboard labels (its bundle: "delete study", "delete artifact").
_STYLE = (
    '<style id="spectune-readonly">button[aria-label="delete study"],'
    'button[aria-label="delete artifact"]{display:none!important}</style>'
)
# Text buttons: "Create" opens the new-study dialog, "Delete" confirms a deletion.
SCRIPT = """(() => {
  const hidden = new Set(["Create", "Delete"]);
  const hide = () => {
    for (const b of document.querySelectorAll("button")) {
      if (hidden.has(b.textContent.trim()) && b.style.display !== "none") {
        b.style.display = "none";
        b.dataset.spectuneReadonly = "hidden";
      }
    }
  };
  new MutationObserver(hide).observe(document.documentElement, {childList: true, subtree: true});
  hide();
})();
"""
_INJECTED = (_STYLE + f'<script defer src="{SCRIPT_PATH}"></script>').encode()


def inject(page: bytes) -> bytes:
    """The dashboard's HTML page with the read-only style and script before `</head>`."""
    at = page.find(b"</head>")
    return page if at < 0 else page[:at] + _INJECTED + page[at:]
