"""The front door: who may call (keys, auth), how much (rate and concurrency limits), and when
(admission to a node with room). ``front_door.FrontDoor`` is the one face the proxy calls."""
