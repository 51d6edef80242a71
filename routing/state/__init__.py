"""What the gateway knows of the fleet: the policy snapshot and live state from Redis
(``policy_store``), the routing table built from them (``table``, ``eligibility``), its own
outstanding work (``inflight``) and what its peer gateways share (``sharing``)."""
