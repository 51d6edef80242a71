"""Project-wide API helpers: the exception handler that keeps every error in one shape."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    """DRF's handler, plus Django ValidationErrors from Model.clean() as 400 field errors."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(detail, status=status.HTTP_400_BAD_REQUEST)
    from controlplane.policies.publishing import PublishError

    if isinstance(exc, PublishError):
        return Response(
            {"detail": str(exc), "code": "publish_failed"}, status=status.HTTP_503_SERVICE_UNAVAILABLE
        )
    if isinstance(exc, exceptions.APIException) or exc is not None:
        return drf_exception_handler(exc, context)
    return None
