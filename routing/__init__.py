"""gorgo's routing gateway (no Django). See ARCHITECTURE.md."""

from routing import native

# Before any other routing module is imported: the compiled hot modules, when built (routing.native).
native.install()
