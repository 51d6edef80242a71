"""Print the Celery queues a worker must consume to run every telemetry task.

    celery -A controlplane worker -Q "$(python manage.py telemetry_queues)"

A real deployment runs one probe worker per region instead: ``-Q probe.<region>`` there, and the
default queue on the control plane's own workers (``--region`` prints just one region's queue).
"""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from controlplane.fleet.models import Region
from telemetry.tasks import probe_queue


class Command(BaseCommand):
    help = "Print the comma-separated Celery queues for telemetry workers (default + probe.<region>)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--region", help="Only this region's probe queue.")

    def handle(self, *args, region: str | None = None, **options) -> None:
        if region is not None:
            if not Region.objects.filter(slug=region).exists():
                raise CommandError(f"No region with slug {region!r}.")
            self.stdout.write(probe_queue(region))
            return
        slugs = Region.objects.order_by("slug").values_list("slug", flat=True)
        self.stdout.write(",".join([settings.CELERY_TASK_DEFAULT_QUEUE, *(probe_queue(s) for s in slugs)]))
