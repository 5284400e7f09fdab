"""Credentials out of text: a URI's user:password@ and the query parameters that carry secrets
(S3 presigned URLs, Azure SAS tokens, ...) replaced by ***, in every text the job prints or
records."""

from __future__ import annotations

import re

# user:password@ of a URI anywhere in a text, and the values of query parameters that carry
# secrets (S3 presigned URLs, Azure SAS tokens, ...)
_USERINFO = re.compile(  # key:secret (the secret may hold a raw "/") or a lone token, then @
    r"\b([a-zA-Z][a-zA-Z0-9+.-]*)://([^\s@'\"/:]+:[^\s@'\"]*|[^\s@'\"/:]+)@")
_CONTAINER_AT_ACCOUNT = ("abfs", "abfss", "az", "wasb", "wasbs")  # container@account: no secret
_SECRET_QUERY = re.compile(
    r"([?&](?:x-amz-[a-z-]*|x-goog-[a-z-]*|sig|signature|token|access_token|secret|password|"
    r"key|credential|sv|se|sp|st|skoid|sktid|skt|ske|sks|skv)=)[^&\s'\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it replaced by ***
    (s3://key:secret@bucket/x -> s3://***@bucket/x; ?X-Amz-Signature=... -> =***)."""
    if "://" not in text:
        return text

    def userinfo(m: re.Match) -> str:
        if m.group(1).lower() in _CONTAINER_AT_ACCOUNT and ":" not in m.group(2):
            return m.group(0)
        return f"{m.group(1)}://***@"

    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(userinfo, text))


__all__ = ["redact"]
