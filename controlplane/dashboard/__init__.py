"""The browser UI: live dashboard pages and the policy editor (server-rendered, Plotly.js, Channels)."""
