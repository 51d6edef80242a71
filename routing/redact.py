"""Mask the credentials of URLs before they reach a log: ``redis://user:***@host/0?password=***``.

Used by the gateway and by the control plane's logging configuration (``MaskingFilter``), so every
log line of every process hides passwords the same way. No Django here: ``routing`` imports none.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query parameters whose values are secrets (compared lower-case).
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "key", "api_key"})
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def mask_url(url: str) -> str:
    """``url`` with the userinfo password and secret query values replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
        hostname = parts.hostname
        port = parts.port
    except ValueError:
        return url
    netloc = parts.netloc
    if password is not None or (parts.username is not None and "@" in netloc):
        host = hostname or ""
        if ":" in host:
            host = f"[{host}]"
        userinfo = f"{parts.username or ''}:{MASK}" if password is not None else (parts.username or "")
        netloc = f"{userinfo}@{host}" + (f":{port}" if port is not None else "")
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() in SECRET_QUERY_KEYS for key, _ in pairs):
            query = urlencode(
                [(key, MASK if key.lower() in SECRET_QUERY_KEYS else value) for key, value in pairs], safe="*"
            )
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def mask_urls(text: str) -> str:
    """Every URL inside ``text`` masked with ``mask_url``."""
    if "://" not in text:
        return text
    return _URL.sub(lambda match: mask_url(match.group(0)), text)


class MaskingFilter(logging.Filter):
    """A logging filter (attach it to handlers) that masks credentials in URLs of each message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_urls(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = mask_urls(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = mask_urls(record.exc_text)
        return True
