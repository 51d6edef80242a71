"""``python benchmarks/whatif_gateway.py``: the gateway (``python -m routing``) with prefix hashes in
its request records.

``RequestRecord.prefix_hashes`` is in the contract, but the gateway's proxy does not fill it yet
(``routing/`` is being re-laid out; the change is to pass the prompt's chunk hashes, which
``Proxy._route`` computes anyway, into the record). Until then this launcher adds them the same way
for the what-if accuracy benchmark: the hashes of the prompt a request routed on are kept in a
context variable of the request's task and put into its record. One worker process only (the
patch lives in this process).
"""

from __future__ import annotations

import runpy
from contextvars import ContextVar
from typing import Any

import routing.proxy
from routing.contract import PREFIX_HASHES_MAX, RequestRecord
from routing.prefix_index import chunk_hashes

_PREFIX_HASHES: ContextVar[tuple[int, ...]] = ContextVar("prefix_hashes", default=())
_route = routing.proxy.Proxy._route


def _route_keeping_hashes(
    self: Any, table: Any, candidates: Any, request: Any, prompt_text: str, *rest: Any
) -> Any:
    _PREFIX_HASHES.set(tuple(chunk_hashes(prompt_text)[:PREFIX_HASHES_MAX]))
    return _route(self, table, candidates, request, prompt_text, *rest)


def _record(**fields: Any) -> RequestRecord:
    return RequestRecord(**fields, prefix_hashes=_PREFIX_HASHES.get())


routing.proxy.Proxy._route = _route_keeping_hashes  # type: ignore[method-assign]
routing.proxy.RequestRecord = _record  # type: ignore[misc,assignment]

if __name__ == "__main__":
    runpy.run_module("routing", run_name="__main__")
