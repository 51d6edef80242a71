"""The demo, for development: ``manage.py seed_demo`` loads the simulator's topology as the fleet.

The one part of the control plane that imports the simulator (``simulator.topology``), at the top
of the layers beside the project wiring; nothing imports it. See docs/controlplane.md, "Layers".
"""
