"""The OpenAPI schema class: drf-spectacular's, with every error answer documented."""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from controlplane.api import ExactSerializerMixin


class ErrorSerializer(serializers.Serializer):
    """The body of every error that is not a list of field errors."""

    detail = serializers.CharField()
    code = serializers.CharField(required=False)


_FIELD_ERRORS = OpenApiResponse(
    OpenApiTypes.OBJECT,
    description="Invalid input: field or query parameter name -> list of messages (an unknown "
    "field or query parameter is refused by name).",
)
_ERRORS = {
    "400": _FIELD_ERRORS,
    "401": OpenApiResponse(ErrorSerializer, description="Not signed in (no or an invalid token)."),
    "403": OpenApiResponse(ErrorSerializer, description="Signed in, but without the permission."),
    "404": OpenApiResponse(ErrorSerializer, description="No such object."),
    "409": OpenApiResponse(
        OpenApiTypes.OBJECT,
        description="Conflicts with the current state: the name is taken, or the object is in use "
        "(``detail`` says what to do first).",
    ),
    "429": OpenApiResponse(ErrorSerializer, description="Too many failed sign-ins; wait and try again."),
}


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's schema, with the error answers every operation can give documented, and
    request bodies closed (``additionalProperties: false``): the API refuses unknown fields
    (``controlplane.api.ExactSerializerMixin``)."""

    def _map_basic_serializer(self, serializer, direction):
        mapped = super()._map_basic_serializer(serializer, direction)
        if direction == "request" and isinstance(serializer, ExactSerializerMixin):
            mapped["additionalProperties"] = False
        return mapped

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        # 400 everywhere: malformed bodies, unknown fields and unknown query parameters.
        codes = ["400", "401", "403", "429"]
        if "{" in self.path:
            codes.append("404")
        if self.method in {"POST", "PUT", "PATCH", "DELETE"}:
            codes.append("409")
        for code in codes:
            if code not in responses:
                responses[code] = self._get_response_for_code(_ERRORS[code], code, direction=direction)
        return dict(sorted(responses.items()))
