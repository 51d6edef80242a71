"""gorgo's emulated vLLM fleet: OpenAI-compatible nodes with vLLM's metrics, batching, prefix cache
and emulated WAN delay, plus a traffic generator. See docs/simulator.md.

Modules: ``topology`` (fleet description, TOML), ``tokenizer`` and ``text`` (deterministic
tokens), ``kv_cache`` and ``engine`` (scheduler), ``metrics``, ``protocol`` and ``server`` (HTTP),
``wan`` (delay emulation), ``fleet`` (in-process API), ``traffic`` (load generator), ``harness``
(ports, waiting and process groups for the tests and benchmarks).
Importing the package has no side effects.
"""
