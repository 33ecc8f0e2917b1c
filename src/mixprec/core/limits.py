"""Size limits every layer shares: protobuf's, and what a model held inline keeps under it.

One home for each: a model, a report's copy of it, a probe's variant and a streamed run
all ask here whether their bytes fit in one protobuf message.
"""

from __future__ import annotations

__all__ = ["INLINE_LIMIT", "PROTO_LIMIT"]

#: The largest protobuf message (2 GiB - 1 byte): no ``ModelProto`` serializes past it.
PROTO_LIMIT = 2**31 - 1
#: A model is held or written inline only up to this many bytes (its weights included);
#: beyond, its weights go to external data. 64 MiB under protobuf's limit leave room for
#: the graph and what a pass adds to it.
INLINE_LIMIT = PROTO_LIMIT - 2**26
