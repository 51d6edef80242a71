"""Client-key API: create (the secret is in that answer only), list, change limits, revoke, rotate."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane import audit
from controlplane.api import BaseModelViewSet
from controlplane.keys.api.serializers import ClientKeySerializer, ClientKeyWithSecretSerializer
from controlplane.keys.filtersets import ClientKeyFilterSet
from controlplane.keys.models import ClientKey, hash_secret, new_key_id, new_secret
from controlplane.keys.publishing import sync_last_used
from controlplane.permissions import required_perms


class ClientKeyViewSet(BaseModelViewSet):
    queryset = ClientKey.objects.prefetch_related("allowed_models", "allowed_regions")
    serializer_class = ClientKeySerializer
    filterset_class = ClientKeyFilterSet

    def list(self, request: Request, *args, **kwargs) -> Response:
        sync_last_used()
        return super().list(request, *args, **kwargs)

    def retrieve(self, request: Request, *args, **kwargs) -> Response:
        sync_last_used()
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(
        responses={201: ClientKeyWithSecretSerializer}, summary="Create a key (its secret: now only)"
    )
    def create(self, request: Request, *args, **kwargs) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key_id = new_key_id()
        secret = new_secret(key_id)
        serializer.save(key_id=key_id, secret_sha256=hash_secret(secret))
        audit.record(request.user, serializer.instance, "Created through the API.", added=True)
        data = ClientKeyWithSecretSerializer(serializer.instance, context=self.get_serializer_context()).data
        return Response({**data, "secret": secret}, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None,
        responses=ClientKeySerializer,
        summary="Revoke: every gateway refuses it within a second",
    )
    @action(detail=True, methods=["post"])
    @required_perms("keys.change_clientkey")
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = self.get_object()
        if not key.revoked:
            key.revoke()
            audit.record(request.user, key, "Revoked through the API.")
        return Response(self.get_serializer(key).data)

    @extend_schema(
        request=None,
        responses=ClientKeyWithSecretSerializer,
        summary="Rotate: a new secret, the old one stops working",
    )
    @action(detail=True, methods=["post"])
    @required_perms("keys.change_clientkey")
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        key = self.get_object()
        secret = key.set_new_secret()
        key.save(update_fields=["secret_sha256", "last_updated"])
        audit.record(request.user, key, "Secret rotated through the API.")
        data = ClientKeyWithSecretSerializer(key, context=self.get_serializer_context()).data
        return Response({**data, "secret": secret})
