"""The API's one pagination: bounded ``limit``/``offset``, malformed values answered with 400."""

from __future__ import annotations

from rest_framework import exceptions, pagination

MAX_PAGE_SIZE = 1000
MAX_OFFSET = 1_000_000_000


class BoundedLimitOffsetPagination(pagination.LimitOffsetPagination):
    """``limit`` 1..1000 and ``offset`` 0..10^9, or a 400 naming the parameter.

    DRF's own silently ignores a malformed value and passes any number to the database, where
    ``?limit=9223372036854775808`` overflowed SQLite into a 500.
    """

    max_limit = MAX_PAGE_SIZE

    def get_limit(self, request) -> int | None:
        raw = request.query_params.get(self.limit_query_param)
        if raw is None:
            return self.default_limit
        return _bounded_int(self.limit_query_param, raw, 1, self.max_limit)

    def get_offset(self, request) -> int:
        raw = request.query_params.get(self.offset_query_param)
        if raw is None:
            return 0
        return _bounded_int(self.offset_query_param, raw, 0, MAX_OFFSET)

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"] = {**parameter["schema"], "minimum": low, "maximum": high}
        return parameters


def _bounded_int(name: str, raw: str, low: int, high: int) -> int:
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise exceptions.ValidationError({name: [f"Must be a whole number from {low} to {high}."]})
    return int(raw)
