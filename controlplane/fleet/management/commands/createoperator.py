"""``manage.py createoperator``: create or update an operator (or viewer) and print their API token."""

from __future__ import annotations

import os

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts import OPERATORS, VIEWERS, Account, ensure_account


class Command(BaseCommand):
    help = (
        "Create or update an operator account (or a viewer with --viewer) and print its API token. "
        "The password comes from --password or GORGO_OPERATOR_PASSWORD; a new account without one "
        "gets a generated password, printed once. With -v 0 only the token is printed."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="operator", help="default: operator")
        parser.add_argument("--password", help="default: env GORGO_OPERATOR_PASSWORD, else keep/generate")
        parser.add_argument("--viewer", action="store_true", help="read-only account (group viewers)")

    def handle(
        self, *args, username: str, password: str | None, viewer: bool, verbosity: int, **options
    ) -> None:
        password = password or os.environ.get("GORGO_OPERATOR_PASSWORD") or None
        try:
            account = ensure_account(username, password=password, viewer=viewer)
        except ValidationError as exc:
            raise CommandError(f"Password rejected: {' '.join(exc.messages)}") from None
        if verbosity == 0:
            self.stdout.write(account.token)
            return
        write_account(self, account, group=VIEWERS if viewer else OPERATORS)


def write_account(command: BaseCommand, account: Account, *, group: str) -> None:
    """Print what an operator needs to log in and to call the API."""
    username = account.user.get_username()
    verb = "Created" if account.created else "Found existing"
    command.stdout.write(command.style.SUCCESS(f"{verb} account {username!r} (group {group})."))
    if account.generated_password:
        command.stdout.write(
            f"Password: {account.generated_password}   (shown once; set GORGO_OPERATOR_PASSWORD to choose)"
        )
    command.stdout.write(f"API token: {account.token}")
    command.stdout.write(
        f'Try: curl -H "Authorization: Token {account.token}" http://127.0.0.1:8000/api/v1/nodes/'
    )
