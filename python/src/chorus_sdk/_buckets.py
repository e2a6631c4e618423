"""Key-value buckets the Rust SDK shares, made as the Rust SDK makes them.

nats-py's ``create_key_value`` turns on per-message TTLs, which a stream cannot turn off: a
bucket a Python agent made first could then not be opened by a Rust agent (its
``create_or_update`` refuses that change). So the bucket's stream is made here with exactly
the settings the Rust SDK gives it, and opened as a key-value bucket."""

from __future__ import annotations

from typing import Any

from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError


async def ensure_bucket(js: Any, bucket: str, ttl: float, description: str, per_key_ttl: bool = False) -> Any:
    """The key-value bucket ``bucket``: opened if it exists, else made as the Rust SDK makes
    it (one value per key, entries expiring after ``ttl`` seconds, file storage; with
    ``per_key_ttl``, each key may carry a ``Nats-TTL`` of its own, its removal marked for a
    second, as ``KvSpec::per_key_ttl``)."""
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        pass
    await js.add_stream(
        StreamConfig(
            name=f"KV_{bucket}",
            description=description,
            subjects=[f"$KV.{bucket}.>"],
            max_msgs_per_subject=1,
            max_age=ttl,
            storage=StorageType.FILE,
            num_replicas=1,
            allow_rollup_hdrs=True,
            deny_delete=True,
            deny_purge=False,
            allow_direct=True,
            discard=DiscardPolicy.NEW,
            allow_msg_ttl=True if per_key_ttl else None,
            subject_delete_marker_ttl=1.0 if per_key_ttl else None,
        )
    )
    return await js.key_value(bucket)
